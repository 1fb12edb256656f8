"""Hutchinson estimators of the Hessian diagonal and trace (paper B.8, B.9).

For v with i.i.d. Rademacher entries (±1 with probability ½), E[v vᵀ] = I, hence

    diag(H) = E[v ⊙ H v],        Tr(H) = E[vᵀ H v] = Σ_j E[v ⊙ H v]_j.

Both are estimated by the average over ``num_samples`` independent draws. They need only
Hessian-vector products, so they work for any model and loss (the fallback when no
Gauss-Newton factorization of the loss is available).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["hutchinson_diagonal", "hutchinson_replicates", "hutchinson_trace", "rademacher_like"]

BlockHVP = Callable[[list[Tensor]], list[Tensor]]


def rademacher_like(tensor: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Tensor of i.i.d. ±1 entries with the shape, dtype and device of ``tensor``."""
    gen_device = tensor.device if generator is None else generator.device
    bits = torch.randint(0, 2, tensor.shape, generator=generator, device=gen_device)
    return (2 * bits - 1).to(dtype=tensor.dtype, device=tensor.device)


def hutchinson_diagonal(
    hvp: BlockHVP,
    params: Sequence[Tensor],
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    batched: bool | None = None,
) -> list[Tensor]:
    """Estimate diag(H) = E[v ⊙ H v] blockwise, averaging ``num_samples`` Rademacher draws.

    Args:
        hvp: Blockwise Hessian-vector product, e.g. a ``HessianVectorProduct``.
        params: Tensors giving shape, dtype and device of each block.
        num_samples: Number of Hessian-vector products spent.
        generator: Random generator for the Rademacher vectors.
        batched: Spend the products in one vmap'd backward pass (``hvp.batched``) instead
            of one pass each; None: on CUDA only (on a CPU the loop is as fast). Where the
            graph has an operator without a batching rule, the loop runs. Same draws, same
            result either way.

    Returns:
        One tensor per parameter, shaped like it.
    """
    if num_samples < 1:
        raise ValueError("num_samples must be at least 1.")
    params = list(params)
    if _use_batched(params, batched) and num_samples > 1:
        replicates = hutchinson_replicates(hvp, params, num_samples, generator, batched)
        return [torch.stack(block).mean(0) for block in zip(*replicates, strict=True)]
    estimate = [torch.zeros_like(p) for p in params]
    for _ in range(num_samples):
        v = [rademacher_like(p, generator) for p in params]
        for est, vi, hvi in zip(estimate, v, hvp(v), strict=True):
            est.add_(vi * hvi)
    return [est.div_(num_samples) for est in estimate]


def _use_batched(params: list[Tensor], batched: bool | None) -> bool:
    return (params[0].device.type == "cuda") if batched is None else batched


def hutchinson_replicates(
    hvp: BlockHVP,
    params: Sequence[Tensor],
    num_samples: int,
    generator: torch.Generator | None = None,
    batched: bool | None = None,
) -> list[list[Tensor]]:
    """The ``num_samples`` independent unbiased estimates v_m ⊙ H v_m of diag(H) (blockwise),
    in the order of the draws; their mean is :func:`hutchinson_diagonal`'s estimate.
    ``batched`` as there."""
    if num_samples < 1:
        raise ValueError("num_samples must be at least 1.")
    params = list(params)
    draws = [[rademacher_like(p, generator) for p in params] for _ in range(num_samples)]
    if _use_batched(params, batched) and num_samples > 1 and hasattr(hvp, "batched"):
        stacked = [torch.stack(block) for block in zip(*draws, strict=True)]
        try:
            products = hvp.batched(stacked)
        except RuntimeError:  # an operator without a batching rule for double backward
            products = None
        if products is not None:
            return [[v[m] * hv[m] for v, hv in zip(stacked, products, strict=True)]
                    for m in range(num_samples)]
    return [[vi * hvi for vi, hvi in zip(v, hvp(v), strict=True)] for v in draws]


def hutchinson_trace(
    hvp: BlockHVP,
    params: Sequence[Tensor],
    num_samples: int = 1,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Estimate Tr(H) = E[vᵀ H v] (0-dim tensor), averaging ``num_samples`` draws."""
    diagonal = hutchinson_diagonal(hvp, params, num_samples, generator)
    return sum((d.sum() for d in diagonal[1:]), diagonal[0].sum())
