"""Vector-Jacobian products of many vectors through one graph, batched by ``torch.func.vmap``.

``torch.autograd.grad(..., is_grads_batched=True)`` batches with the legacy vmap prototype,
which has no batching rule for, e.g., ``max_pool2d_with_indices_backward``,
``constant_pad_nd`` or ``convolution_backward``: it runs them once per vector (a select per
vector and argument, the op, a stack), which on an accelerator costs a launch each. The
vmap of ``torch.func`` batches them as one call on the vectors' stacked batch; the values
are the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def batched_grad(outputs: Sequence[Tensor], inputs: Sequence[Tensor],
                 grad_outputs: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
    """(∂outputs/∂inputs)ᵀ v_k for every k at once: ``grad_outputs`` has one tensor
    [K, *output.shape] per output, the result one [K, *input.shape] per input, None for an
    input the outputs do not depend on. The graph is retained."""
    unused: list[bool] = []

    def one(*vectors: Tensor) -> tuple[Tensor, ...]:
        grads = torch.autograd.grad(list(outputs), list(inputs), list(vectors),
                                    retain_graph=True, allow_unused=True)
        unused[:] = [g is None for g in grads]
        # vmap returns tensors only: a scalar stands in for an unused input
        return tuple(vectors[0].new_zeros(()) if g is None else g for g in grads)

    grads = torch.func.vmap(one)(*grad_outputs)
    return tuple(None if none else g for g, none in zip(grads, unused, strict=True))
