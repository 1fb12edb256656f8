r"""Small parameters' individual gradients side by side: their statistics in a few kernels.

A tracked step on an accelerator is bound by the host issuing kernels, and a bias costs
about as many of them as a weight (a norm, a histogram's three, the dot products). The
processor (:class:`~cockpit.engine.processing.CallProcessor`) holds the individual
gradients of small parameters (biases, normalization weights: at most :data:`SMALL_BYTES`)
until the end of the backward pass and forms their statistics together from

    G = [G_1 | … | G_P] ∈ R^{N × ΣD_p}   (G_p: parameter p's individual gradients as rows)

and the 0/1 matrix S ∈ R^{ΣD_p × P} that sums the columns of each parameter:

* ‖g_{n,p}‖ = √((G ⊙ G) S)_{np};
* Σ_n g_{n,p} ⊙ g_{n,p} (TICDiag eq. 29): the column sums of G ⊙ G in float64, split by
  parameter;
* g_{n,p}ᵀu_{k,p} = ((G ⊙ U_k) S)_{np} for K directions U_k = [u_{k,1} | … | u_{k,P}];
* the histogram counts of GradHist1d (eq. 15): the search index of every element (the same
  edges as one parameter alone) plus p·(bins + 2), counted by one ``histc`` over
  P·(bins + 2) bins. Float32 counts are exact below 2^24 elements, which
  :data:`MOST_ELEMENTS` bounds.

The values are the same as one parameter at a time up to the order of float additions.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from cockpit.engine.dtypes import in_dtype
from cockpit.engine.float_sums import sample_sum_sq
from cockpit.engine.histograms.device import bin_index, device_path
from cockpit.engine.histograms.exact import BinSpec, device_edges
from cockpit.engine.rules.sample_grads import DenseSampleGrads, SampleGrads

SMALL_BYTES = 2**20
"""The most bytes of individual gradients (|B|·D·itemsize) a parameter may have to wait for
the end of the backward pass (a bias of 2,048 float32 numbers at |B| = 128)."""

MOST_ELEMENTS = 2**24
"""The most elements of G at once (float32 histogram counts are exact below 2^24)."""


def is_small(sg: SampleGrads) -> bool:
    """Whether a parameter's individual gradients may go side by side: explicit ones
    (:class:`DenseSampleGrads`) on an accelerator, at most :data:`SMALL_BYTES` of them."""
    return (type(sg) is DenseSampleGrads and device_path(sg.unscaled.device)
            and sg.scratch_bytes() <= SMALL_BYTES)


class SideBySide:
    """G = [G_1 | … | G_P] of parameters with the same number of samples, dtype and device
    (``grads``: each parameter's individual gradients [N, *shape], or these divided by its
    entry of ``scales``)."""

    def __init__(self, grads: Sequence[Tensor], scales: Sequence[float] | None = None):
        rows = [g if g.dim() == 2 else g.reshape(g.shape[0], -1) for g in grads]
        self._shapes = [g.shape[1:] for g in grads]  # (for sum_sq)
        self.sizes = tuple(r.shape[1] for r in rows)
        self.rows = torch.cat(rows, dim=1)
        # one multiplication for all, the same products as one parameter at a time
        if scales is not None and len(set(scales)) == 1 and scales[0] != 1.0:
            self.rows.mul_(scales[0])
        elif scales is not None and len(set(scales)) > 1:
            self.rows.mul_(_column_scales(self.sizes, tuple(scales), self.rows.dtype,
                                          self.rows.device))

    @property
    def indicator(self) -> Tensor:
        """S ∈ {0, 1}^{ΣD × P} (column j belongs to parameter p), in G's dtype."""
        return _indicator(self.sizes, self.rows.dtype, self.rows.device)

    def norms(self) -> list[Tensor]:
        """‖g_{n,p}‖, [N] per parameter."""
        squares = (self.rows * self.rows) @ self.indicator  # [N, P]
        return list(squares.sqrt_().unbind(1))

    def sum_sq(self) -> list[Tensor]:
        """Σ_n g_{n,p} ⊙ g_{n,p} in float64, of parameter p's shape: the squares in G's dtype
        summed over the samples as one parameter alone (views of one [ΣD] sum)."""
        sums = sample_sum_sq(self.rows)
        return [part.view(shape) for part, shape in zip(sums.split(self.sizes), self._shapes,
                                                         strict=True)]

    def dots(self, directions: Sequence[Sequence[Tensor]]) -> Tensor:
        """[g_{n,p}ᵀu_{k,p}]_{k,n,p}, [K, N, P] (``directions[p]``: parameter p's K
        directions, each of the parameter's shape or flat)."""
        k = len(directions[0])
        flat = torch.cat([d[i] if d[i].dim() == 1 else d[i].reshape(-1)
                          for i in range(k) for d in directions])
        products = self.rows.unsqueeze(0) * in_dtype(flat.view(k, 1, -1), self.rows.dtype)
        return products @ self.indicator

    def histograms(self, spec: BinSpec) -> list[Tensor]:
        """Counts [bins] (int64) of every parameter's N·D_p elements in ``spec``'s bins,
        with the edges and the clipping of one parameter alone."""
        x, edges = device_edges(self.rows, spec)
        slots = edges.numel() + 1
        spread = torch.add(bin_index(x, edges), _offsets(self.sizes, slots, x.device))
        total = len(self.sizes) * slots
        counts = torch.histc(spread, bins=total, min=0, max=total)
        return list(counts.view(-1, slots)[:, 1:-1].long().unbind(0))


@functools.lru_cache(maxsize=32)
def _indicator(sizes: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    columns = _owners(sizes, device)
    return (columns.unsqueeze(1) == torch.arange(len(sizes), device=device)).to(dtype)


@functools.lru_cache(maxsize=32)
def _offsets(sizes: tuple[int, ...], slots: int, device: torch.device) -> Tensor:
    """p·slots + ½ for the columns of parameter p, float32 (exact: below 2^23)."""
    return _owners(sizes, device).float().mul_(slots).add_(0.5)


@functools.lru_cache(maxsize=32)
def _column_scales(sizes: tuple[int, ...], scales: tuple[float, ...], dtype: torch.dtype,
                   device: torch.device) -> Tensor:
    """Parameter p's scale for each of its columns, [ΣD], in the precision a multiplication
    of ``dtype`` by a number computes in (float32 for half types)."""
    wide = torch.float32 if dtype.itemsize < 4 else dtype
    return torch.cat([torch.full((size,), scale, dtype=wide)
                      for size, scale in zip(sizes, scales, strict=True)]).to(device)


def _owners(sizes: tuple[int, ...], device: torch.device) -> Tensor:
    """The parameter p of each column, [ΣD] (made once per layout: no read of the device)."""
    return torch.cat([torch.full((size,), p, dtype=torch.int32, device=device)
                      for p, size in enumerate(sizes)])


def groups(shapes: Sequence[tuple[int, torch.dtype, torch.device, int]], bins: int
           ) -> list[list[int]]:
    """Indices of parameters that go side by side: the same (N, dtype, device), at most
    :data:`MOST_ELEMENTS` elements and fewer than 2^22 histogram slots at once
    (``shapes[i]``: N, dtype, device and D of parameter i)."""
    out: list[list[int]] = []
    open_groups: dict[tuple, tuple[list[int], int]] = {}
    for i, (n, dtype, device, size) in enumerate(shapes):
        key = (n, dtype, device)
        members, elements = open_groups.get(key, ([], 0))
        if members and (elements + n * size > MOST_ELEMENTS
                        or (len(members) + 1) * (bins + 2) >= 2**22):
            members, elements = [], 0
        if not members:
            out.append(members)
        members.append(i)
        open_groups[key] = (members, elements + n * size)
    return out
