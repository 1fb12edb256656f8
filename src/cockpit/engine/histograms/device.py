"""Exact histograms on accelerators: no read of the device, no contended counter.

The CPU kernels of :mod:`cockpit.engine.histograms.exact` are built for a CPU: directed rounding in
NumPy, worker threads, sorted rows searched per query, chunk-by-chunk decisions read from
the data (a chunk with a non-finite value takes another path). On a GPU each of those
decisions is a wait for the device, and ``bincount`` into a few crowded bins serializes on
atomic adds (gradient elements pile up in the one or two bins around zero). This path takes
no decision from the data:

* bin index by comparison with the edges rounded up to the values' dtype, t_k = ⌈e_k⌉
  (``torch.bucketize``): x ≥ e_k ⟺ x ≥ t_k for every float x of the dtype, so
  k(x) = #{k : t_k ≤ x} is exact at every edge (the searched form of the CPU path; a GPU
  has no directed rounding);
* a non-finite value gets the extra index ``bins`` (counted in no bin, returned as the
  number of non-finite values, a device tensor);
* counting: element i adds to copy (i mod 32) of the histogram (``histc`` of
  index + (i mod 32)·(bins + 1)), and the copies are summed. On CUDA ``histc`` with few
  bins keeps a private histogram per thread block in shared memory; with 32 copies the
  threads of a warp (consecutive elements) add to 32 different counters even when every
  element falls into the same bin (``bincount`` would read the device for its output size);
* the individual gradients of a Linear layer, δ_n a_nᵀ, are formed in chunks of at most
  2^24 products (the same products fl(δ·a) the CPU path bins).

:func:`device_path` tells the histogram functions (and other choices made per device, such
as the squared norms of :func:`cockpit.quantities.base.sq_norms`) to take this path: on
every device but the CPU, and on the CPU inside :func:`forced` (tests: the counts must
equal the CPU path's, and the host-sync count of a CPU step then predicts the GPU's).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import Tensor

_LANES = 32
CHUNK = 2**24  # elements per chunk: bounds the index buffers; float counts stay exact
_SHARED_COUNTERS = 12 * 1024  # float counters in 48 KiB of a block's shared memory
_forced = False


def device_path(device: torch.device) -> bool:
    """Whether histograms on ``device`` take this module's path."""
    return device.type != "cpu" or _forced


@contextlib.contextmanager
def forced() -> Iterator[None]:
    """Take the accelerator path on the CPU too (tests)."""
    global _forced
    previous, _forced = _forced, True
    try:
        yield
    finally:
        _forced = previous


@functools.lru_cache(maxsize=64)
def _lane_offsets(length: int, lanes: int, stride: int, device: torch.device) -> Tensor:
    """(i mod lanes)·stride + ½ for i < length, float32 (exact: every value is below 2^24)."""
    lane = torch.arange(length, dtype=torch.int32, device=device) % lanes
    return (lane * stride).float() + 0.5


def _spread_count(index: Tensor, num_bins: int) -> Tensor:
    """The counts [num_bins] (int64) of the flat indices in [0, num_bins), counted over
    copies of the bins: element i adds to copy i mod L (L ≤ 32 copies that fit a block's
    shared memory). ``histc`` needs no read of the device (``bincount`` reads the largest
    index for its output size); its float counts are exact below 2^24 per chunk, and the
    index + ½ lies inside its bin whatever the rounding of histc's bin arithmetic (the
    int32 index and the float32 offset (i mod L)·num_bins + ½ add exactly in float32)."""
    lanes = max(1, min(_LANES, _SHARED_COUNTERS // num_bins))
    length = max(_LANES, 1 << max(index.numel() - 1, 0).bit_length())  # few cached sizes
    spread = torch.add(_lane_offsets(length, lanes, num_bins, index.device)[: index.numel()],
                       index)
    total = lanes * num_bins
    counts = torch.histc(spread, bins=total, min=0, max=total)
    return counts.view(lanes, num_bins).sum(0, dtype=torch.long)


def bin_index(x: Tensor, thresholds: Tensor, bins: int) -> Tensor:
    """k(x) ∈ [0, bins) for finite x and ``bins`` for NaN/±inf, int32 (``thresholds``: the
    inner edges rounded up to x's dtype)."""
    index = torch.bucketize(x, thresholds, right=True, out_int32=True)
    return torch.where(torch.isfinite(x), index, bins)


def _split(counts: Tensor, bins: int) -> tuple[Tensor, Tensor]:
    return counts[:bins], counts[bins]


def dense(x: Tensor, thresholds: Tensor, bins: int) -> tuple[Tensor, Tensor]:
    """Counts [bins] of the finite elements of ``x`` and the number of non-finite ones."""
    flat = x.detach().reshape(-1)
    if flat.numel() <= CHUNK:  # one chunk: no accumulator (few ops per parameter)
        return _split(_spread_count(bin_index(flat, thresholds, bins), bins + 1), bins)
    counts = torch.zeros(bins + 1, dtype=torch.long, device=flat.device)
    for start in range(0, flat.numel(), CHUNK):
        counts += _spread_count(bin_index(flat[start : start + CHUNK], thresholds, bins),
                                bins + 1)
    return _split(counts, bins)


def outer(delta: Tensor, a: Tensor, thresholds: Tensor, bins: int) -> tuple[Tensor, Tensor]:
    """Counts of the products δ[n, i]·a[n, j], formed in chunks of samples."""
    N, I = delta.shape
    J = a.shape[1]
    rows = max(1, CHUNK // max(I * J, 1))
    if rows >= N:
        products = (delta[:, :, None] * a[:, None, :]).view(-1)
        return _split(_spread_count(bin_index(products, thresholds, bins), bins + 1), bins)
    counts = torch.zeros(bins + 1, dtype=torch.long, device=delta.device)
    for start in range(0, N, rows):
        products = delta[start : start + rows, :, None] * a[start : start + rows, None, :]
        counts += _spread_count(bin_index(products.view(-1), thresholds, bins), bins + 1)
    return _split(counts, bins)


def dense_2d(g: Tensor, theta: Tensor, thresholds_g: Tensor, bins_g: int,
             thresholds_theta: Tensor, bins_theta: int) -> tuple[Tensor, Tensor]:
    """Counts [bins_g, bins_θ] of the pairs (g[n, j], θ[j]) with both finite, and the number
    of the other pairs."""
    theta = theta.detach().reshape(-1)
    g = g.detach().reshape(-1, theta.numel())
    theta_index = bin_index(theta, thresholds_theta, bins_theta)
    cells = bins_g * bins_theta
    counts = torch.zeros(cells + 1, dtype=torch.long, device=g.device)
    rows = max(1, CHUNK // max(theta.numel(), 1))
    for start in range(0, g.shape[0], rows):
        g_index = bin_index(g[start : start + rows], thresholds_g, bins_g)
        flat = g_index * bins_theta + theta_index
        valid = (g_index < bins_g) & (theta_index < bins_theta)
        counts += _spread_count(torch.where(valid, flat, cells).reshape(-1), cells + 1)
    return counts[:cells].view(bins_g, bins_theta), counts[cells]
