"""Sums of many float32 products that keep their digits on a CPU: ⟨a, b⟩ and ‖x‖²; and
sums of squares over the samples without a float64 copy (:func:`sample_sum_sq`).

A CPU's BLAS accumulates ``torch.dot`` of float32 vectors in a few float32 partial sums, and
``torch.linalg.vector_norm`` without a dtype likewise: over millions of terms of one sign
(a squared norm; Adam's first update, ±lr in every element) they drift — ‖x‖² of 12.9 M
equal-sized numbers comes out 1 % low, enough to report a wrong norm and to fail Alpha's
check that the real update is the predicted one. Here the vector is cut into rows of
:data:`ROW` numbers: each row's sum is short enough to be exact to a few units of float32
(the norms of rows by one ``vector_norm`` over dim 1 in float32; dot products of rows by
one batched product, half precision widened to float32 first), and the rows' sums are added
in float64. As fast as one ``dot`` on a CPU; float64 vectors and other devices (whose
reductions are trees) keep one ``dot``, and so do short vectors on a CPU, half precision
widened to float32 first (summed in its own dtype bfloat16 ‖x‖² is 2e-3 off, and float16
overflows beyond ‖x‖ = 256). A CPU's float32 sum that overflows (a diverging run's
parameters beyond about 1e18, whose norms the debugger must still show) is summed again in
float64; the check reads the CPU's memory, not a device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ROW = 256
"""Numbers summed in the vector's dtype before the float64 sum."""

_LONG = 2**16  # shorter vectors: one dot product (its error stays near float32's ε)


def _blocked(x: Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and x.numel() > _LONG)


def sq_norm(x: Tensor) -> Tensor:
    """‖x‖² as a 0-dim tensor on x's device: float64 where summed by rows, else one dot
    product in x's dtype (integers: Σ x², exact); callers widen, after stacking several."""
    flat = x.detach().reshape(-1)
    if not flat.is_floating_point():
        return flat.pow(2).sum()
    if not _blocked(flat):
        return _short_dot(flat, flat)
    head, tail = _rows(flat)
    total = torch.linalg.vector_norm(head, dim=1, dtype=torch.float32).double().square().sum()
    if tail is not None:
        tail = tail.float()  # (a few hundred numbers: half precision widened, no copy of the rest)
        total = total + torch.dot(tail, tail).double()
    return total if _finite(total) else _dot64(flat, flat)


def dot(a: Tensor, b: Tensor) -> Tensor:
    """⟨a, b⟩ as a 0-dim tensor on a's device (b in a's dtype, both flattened): float64
    where summed by rows, else one dot product in a's dtype."""
    a = a.detach().reshape(-1)
    b = b.detach().reshape(-1).to(a.dtype)
    if not _blocked(a):
        return _short_dot(a, b)
    flat_a, flat_b = a, b
    if a.dtype != torch.float32:  # (half precision: each row's sum in float32)
        a, b = a.float(), b.float()
    a_head, a_tail = _rows(a)
    b_head, b_tail = _rows(b)
    total = torch.bmm(a_head.unsqueeze(1), b_head.unsqueeze(2)).double().sum()
    if a_tail is not None:
        total = total + torch.dot(a_tail, b_tail).double()
    return total if _finite(total) else _dot64(flat_a, flat_b)


def _short_dot(a: Tensor, b: Tensor) -> Tensor:
    """⟨a, b⟩ of a short vector (or one on a device) by one ``dot``: on a CPU half
    precision in float32 and a float32 sum that overflows again in float64."""
    if a.device.type != "cpu" or not a.is_floating_point():
        return torch.dot(a, b)
    if a.dtype in (torch.float16, torch.bfloat16):
        a, b = a.float(), b.float()
    total = torch.dot(a, b)
    return total if a.dtype == torch.float64 or _finite(total) else _dot64(a, b)


def _dot64(a: Tensor, b: Tensor) -> Tensor:
    """⟨a, b⟩ summed in float64 (a float64 copy of rare vectors)."""
    return torch.dot(a.double(), b.double())


def _finite(total: Tensor) -> bool:
    """Whether a 0-dim CPU tensor is finite (read from its memory: no device, no op)."""
    return math.isfinite(total.numpy().item())


_WIDE_COPY = 2**20
"""Squares up to this many are summed in float64 directly (their float64 copy is small)."""


def sample_sum_sq(c: Tensor, dim: int = 0, owned: bool = False, widen: bool = True) -> Tensor:
    """Σ over ``dim`` (the samples) of c ⊙ c, float64, without a float64 copy of a large c.

    ``c.square().sum(dim, dtype=torch.float64)`` costs three times c's memory: PyTorch
    widens a reduction's input to the output's dtype first (on a GPU too; only half
    precision to float32 is reduced without a copy). Beyond :data:`_WIDE_COPY` numbers the
    squares are summed in float32 (half precision accumulated in float32: on a GPU without
    a copy, a CPU widens it first) and widened after the reduction: a sum of |B|
    non-negative squares has no cancellation and keeps float32's digits, as the CPU path's
    per-sample accumulation does. ``owned``: c is the caller's scratch, squared in place.
    ``widen=False``: a large block's sums stay float32, for a caller that adds several blocks'
    sums and widens once (one kernel instead of one a block)."""
    squares = c.square_() if owned else c.square()
    if squares.dtype == torch.float64 or squares.numel() <= _WIDE_COPY:
        return squares.sum(dim, dtype=torch.float64)
    sums = squares.sum(dim, dtype=torch.float32)  # (float32 squares: no copy)
    return sums.double() if widen else sums


def _rows(flat: Tensor) -> tuple[Tensor, Tensor | None]:
    """The vector as rows [n // ROW, ROW] (a view) and the remaining n mod ROW numbers
    (None where there are none: no slices, host work on every call)."""
    rest = flat.numel() % ROW
    if not rest:
        return flat.view(-1, ROW), None
    whole = flat.numel() - rest
    return flat[:whole].view(-1, ROW), flat[whole:]
