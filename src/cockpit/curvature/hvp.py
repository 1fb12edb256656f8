"""Hessian-vector products on the user's own forward graph (paper B.7, eq. 26).

For a scalar loss L(θ) with gradient g(θ) = ∇_θ L, Pearlmutter's trick gives

    H v = ∇_θ (g(θ)ᵀ v),

i.e. one extra backward pass through the graph of g per product. The gradient g is
computed once with ``torch.autograd.grad(..., create_graph=True, retain_graph=True)``;
every product is then ``torch.autograd.grad(g, θ, grad_outputs=v, retain_graph=True)``.

Design constraints (why this is not ``loss.backward(create_graph=True)``):

* ``p.grad`` is never read or written, so no reference to the double-backward graph
  leaks through ``.grad`` and the user's later ``loss.backward()`` produces bit-identical
  gradients.
* The forward graph is retained, so the user's own backward still works afterwards.
* :meth:`HessianVectorProduct.release` drops every reference to the double-backward graph.

Parameters that do not influence the loss get a zero block (never an error); frozen
parameters (``requires_grad=False``) are simply not passed in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cockpit.curvature.batched_grad import batched_grad
from cockpit.engine.chunk_cat import chunk_cat_takes

__all__ = ["HessianVectorProduct", "flatten_tensors", "unflatten_like"]


def flatten_tensors(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate the flattened tensors into one vector: one ``_chunk_cat`` (FSDP2's
    copy-in, where this torch has it) for non-empty plain tensors of at least one
    dimension, of one dtype and device, outside autograd; not a view or copy per tensor."""
    tensors = list(tensors)
    if tensors and all(
            type(t) is Tensor and t.dim() >= 1 and t.numel() and not t.requires_grad
            and t.dtype == tensors[0].dtype and t.device == tensors[0].device
            for t in tensors) and chunk_cat_takes(tensors):
        return torch._chunk_cat(tensors, 0, 1).view(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_like(vector: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Split a flat vector into tensors shaped like ``like`` (inverse of flatten_tensors)."""
    sizes = [t.numel() for t in like]
    if vector.numel() != sum(sizes):
        raise ValueError(f"Vector has {vector.numel()} entries, expected {sum(sizes)}.")
    return [chunk.view_as(t) for chunk, t in zip(vector.split(sizes), like, strict=True)]


class HessianVectorProduct:
    """The linear operator v ↦ H v with H = ∇²_θ loss, evaluated on an existing graph.

    Args:
        loss: Scalar loss whose graph is still alive (not yet backpropagated through, or
            built with ``retain_graph``).
        params: Parameters θ to differentiate with respect to, all with
            ``requires_grad=True``.

    Attributes:
        num_calls: Number of Hessian-vector products evaluated so far.
        dim: Total number of parameters D.
    """

    def __init__(self, loss: Tensor, params: Sequence[Tensor]) -> None:
        params = list(params)
        if loss.numel() != 1:
            raise ValueError(f"Expected a scalar loss, got shape {tuple(loss.shape)}.")
        if not params:
            raise ValueError("No parameters given.")
        frozen = [i for i, p in enumerate(params) if not p.requires_grad]
        if frozen:
            raise ValueError(
                f"Parameters at positions {frozen} have requires_grad=False; "
                "leave frozen parameters out of `params`."
            )
        if not loss.requires_grad:
            raise ValueError("The loss does not require grad; its graph is not available.")
        grads = torch.autograd.grad(
            loss.reshape(()), params, create_graph=True, retain_graph=True, allow_unused=True
        )
        self._params: list[Tensor] | None = params
        # Only gradients that still depend on θ contribute to H v; the others are constant
        # (loss linear in that block, or block unused), so their Hessian rows are zero.
        self._grads: list[Tensor | None] | None = [
            g if g is not None and g.requires_grad else None for g in grads
        ]
        self.num_calls = 0
        self.dim = sum(p.numel() for p in params)

    @property
    def params(self) -> list[Tensor]:
        """The parameters θ (raises after :meth:`release`)."""
        self._check_alive()
        assert self._params is not None
        return self._params

    def _check_alive(self) -> None:
        if self._grads is None:
            raise RuntimeError("HessianVectorProduct was released; create a new one.")

    def __call__(self, v: Sequence[Tensor]) -> list[Tensor]:
        """Return H v blockwise; ``v`` has one tensor per parameter, shaped like it."""
        self._check_alive()
        assert self._grads is not None and self._params is not None
        v = list(v)
        if len(v) != len(self._params):
            raise ValueError(f"Expected {len(self._params)} blocks, got {len(v)}.")
        for vi, p in zip(v, self._params, strict=True):
            if vi.shape != p.shape:
                raise ValueError(f"Block shape {tuple(vi.shape)} != parameter {tuple(p.shape)}.")
        self.num_calls += 1
        active = [i for i, g in enumerate(self._grads) if g is not None]
        if not active:
            return [torch.zeros_like(p) for p in self._params]
        products = torch.autograd.grad(
            [self._grads[i] for i in active],
            self._params,
            grad_outputs=[v[i].to(self._grads[i]) for i in active],
            retain_graph=True,
            allow_unused=True,
        )
        # (without create_graph the products are outside autograd: no detach needed)
        return [
            torch.zeros_like(p) if hv is None else hv.detach() if hv.requires_grad else hv
            for hv, p in zip(products, self._params, strict=True)
        ]

    def batched(self, vs: Sequence[Tensor]) -> list[Tensor]:
        """H v_m for M vectors at once, one backward pass vmap'd over m: ``vs`` has one
        tensor [M, *shape] per parameter, the result too. Counts M products."""
        self._check_alive()
        assert self._grads is not None and self._params is not None
        vs = list(vs)
        if len(vs) != len(self._params):
            raise ValueError(f"Expected {len(self._params)} blocks, got {len(vs)}.")
        m = vs[0].shape[0]
        for vi, p in zip(vs, self._params, strict=True):
            if vi.shape[1:] != p.shape or vi.shape[0] != m:
                raise ValueError(f"Block shape {tuple(vi.shape)} != [{m}, *{tuple(p.shape)}].")
        active = [i for i, g in enumerate(self._grads) if g is not None]
        if not active:
            self.num_calls += m
            return [p.new_zeros(m, *p.shape) for p in self._params]
        products = batched_grad(
            [self._grads[i] for i in active],
            self._params,
            [vs[i].to(self._grads[i]) for i in active],
        )
        self.num_calls += m
        return [
            p.new_zeros(m, *p.shape) if hv is None else hv.detach() if hv.requires_grad else hv
            for hv, p in zip(products, self._params, strict=True)
        ]

    def matvec(self, v: Tensor) -> Tensor:
        """Return H v for a flat vector ``v`` of length D (parameter order as given)."""
        self._check_alive()
        return flatten_tensors(self(unflatten_like(v, self.params)))

    def release(self) -> None:
        """Drop all references to the double-backward graph (idempotent)."""
        self._grads = None
        self._params = None

    def __enter__(self) -> HessianVectorProduct:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
