"""Exact histogram kernels for individual-gradient histograms (paper eq. 15 and 16).

GradHist1d (eq. 15) histograms the |B|×D individual-gradient elements {g_n(θ_j)}; GradHist2d
(eq. 16) histograms the pairs {(g_n(θ_j), θ_j)}.

Bin semantics (one definition, used by every kernel here)
---------------------------------------------------------
For ``BinSpec(lo, hi, bins)`` the bin of a *finite* value x is

    idx(x) = clamp(floor((x - lo) * bins / (hi - lo)), 0, bins - 1),

evaluated in float64 on float64(x), left to right, i.e. exactly the Python expression
``min(max(math.floor((float(x) - lo) * bins / (hi - lo)), 0), bins - 1)``.
So bin k holds [e_k, e_{k+1}) with e_k = lo + k (hi - lo) / bins up to float64 rounding;
values below lo go to bin 0 and values >= hi go to bin ``bins - 1`` (outliers are clamped
into the edge bins, as in the paper). Exact zeros land in the bin containing 0, and
-0.0 lands with 0.0. ``BinSpec.edges`` returns the nominal edges (``torch.linspace``) for
plotting; a value lying within one rounding error of an edge is binned by the formula above.

Non-finite values (NaN, +inf, -inf) are *not* counted in any bin. Every kernel returns a
:class:`Histogram` ``(counts, n_nonfinite)`` with ``counts.sum() + n_nonfinite`` equal to
the number of histogrammed elements. An infinite gradient is a bug to report, not an outlier
to hide in an edge bin.

Kernels
-------
* :func:`histogram_dense` - any tensor; chunked float64 index computation + ``bincount``.
* :func:`histogram_outer` - all N·I·J products delta[n, i] * a[n, j] (per-sample gradients of
  a Linear layer, g_n = δ_n a_nᵀ) without materializing them (sorted a_n + binary searches).
* :func:`histogram2d_dense` - pairs (g[n, j], θ_j) with one ``bincount`` over flat indices.

All kernels accept float16/bfloat16/float32/float64 on any device, return counts (int64) on
the input's device and never modify their inputs.
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "BinSpec",
    "Histogram",
    "histogram2d_dense",
    "histogram_dense",
    "histogram_outer",
    "reference_bin_index",
]

# Elements per CPU chunk: below ATen's intra-op grain size (32768), so every op of the chunk
# loop runs on the calling thread. Crossing it makes each op synchronize the intra-op thread
# pool, which measured 10-30x slower on a loaded 2-core machine. Parallelism instead comes
# from splitting the input over Python worker threads (ATen ops release the GIL).
_CHUNK = 32_000
_MIN_ELEMENTS_PER_WORKER = 1 << 20
_GENERIC_CHUNK = 1 << 20
_MAX_QUERIES_PER_BLOCK = 1 << 20
_INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


@dataclass(frozen=True)
class BinSpec:
    """``bins`` equal-width bins over [lo, hi); outliers clamp into the edge bins."""

    lo: float
    hi: float
    bins: int

    def __post_init__(self) -> None:
        if isinstance(self.bins, bool) or not isinstance(self.bins, int):
            raise ValueError(f"BinSpec.bins must be an int, got {self.bins!r}")
        if self.bins < 1:
            raise ValueError(f"BinSpec.bins must be >= 1, got {self.bins}")
        for name in ("lo", "hi"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"BinSpec.{name} must be a real number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"BinSpec.{name} must be finite, got {value!r}")
        if not self.lo < self.hi:
            raise ValueError(f"BinSpec needs lo < hi, got lo={self.lo}, hi={self.hi}")
        if not math.isfinite(float(self.hi) - float(self.lo)):
            raise ValueError(f"BinSpec width hi - lo overflows: lo={self.lo}, hi={self.hi}")
        object.__setattr__(self, "lo", float(self.lo))
        object.__setattr__(self, "hi", float(self.hi))

    def edges(self, dtype: torch.dtype = torch.float64, device=None) -> Tensor:
        """The ``bins + 1`` nominal bin edges lo = e_0 < ... < e_bins = hi."""
        return torch.linspace(self.lo, self.hi, self.bins + 1, dtype=dtype, device=device)


class Histogram(NamedTuple):
    """Bin counts (int64) and the number of NaN/±inf elements left out of ``counts``."""

    counts: Tensor
    n_nonfinite: Tensor  # 0-dim int64 on the counts' device


# ---------------------------------------------------------------------------------------
# reference bin index and exact thresholds
# ---------------------------------------------------------------------------------------


def _scaled_positions(x64: Tensor, spec: BinSpec) -> Tensor:
    """(x - lo) * bins / (hi - lo) in float64, in place on a float64 buffer."""
    return x64.sub_(spec.lo).mul_(spec.bins).div_(spec.hi - spec.lo)


def reference_bin_index(x: Tensor, spec: BinSpec) -> Tensor:
    """Bin index (int64) of every element, the definition in the module docstring.

    Non-finite elements get index ``spec.bins`` (one past the last bin).
    """
    x64 = x.to(torch.float64, copy=True)
    finite = torch.isfinite(x64)
    idx = _scaled_positions(x64, spec).floor_().clamp_(0, spec.bins - 1)
    return torch.where(finite, idx, float(spec.bins)).long()


def _float_to_key(x: Tensor) -> Tensor:
    """Order-preserving map float -> int64 (−0.0 and +0.0 get neighbouring keys)."""
    int_dtype = _INT_VIEW[x.dtype]
    width = torch.iinfo(int_dtype).bits
    bits = x.view(int_dtype).to(torch.int64)
    magnitude = bits & ((1 << (width - 1)) - 1)
    return torch.where(bits >= 0, bits, -magnitude - 1)


def _key_to_float(key: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`_float_to_key`."""
    int_dtype = _INT_VIEW[dtype]
    width = torch.iinfo(int_dtype).bits
    bits = torch.where(key >= 0, key, -(key + 1) - (1 << (width - 1)))
    return bits.to(int_dtype).view(dtype)


def _key_bounds(dtype: torch.dtype) -> tuple[int, int]:
    """Keys of -inf and +inf."""
    infs = torch.tensor([-math.inf, math.inf], dtype=dtype)
    low, high = _float_to_key(infs).tolist()
    return low, high


def _bisect_keys(lo: Tensor, hi: Tensor, predicate) -> Tensor:
    """Smallest key in (lo, hi] with predicate true, given predicate(lo)=F, predicate(hi)=T.

    ``predicate`` must be monotone (false ... false true ... true) in the key.
    """
    lo, hi = lo.clone(), hi.clone()
    for _ in range(70):
        done = hi == lo + 1
        if bool(done.all()):
            return hi
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        mid = torch.where(done, lo, mid)
        true = predicate(mid)
        hi = torch.where(true, mid, hi)
        lo = torch.where(true, lo, mid)
    raise RuntimeError("key bisection did not converge")  # pragma: no cover


@functools.lru_cache(maxsize=128)
def _thresholds_cpu(spec: BinSpec, dtype: torch.dtype) -> Tensor:
    """t_k (k = 1..bins-1): the smallest value of ``dtype`` with idx(t_k) >= k.

    Because idx is monotone, idx(x) = #{k : t_k <= x} for every finite x of ``dtype``,
    i.e. ``torch.bucketize(x, t, right=True)`` reproduces the reference index exactly.
    """
    k = torch.arange(1, spec.bins, dtype=torch.float64)
    key_lo, key_hi = _key_bounds(dtype)

    def reaches_bin(key: Tensor) -> Tensor:
        x64 = _key_to_float(key, dtype).to(torch.float64)
        pos = _scaled_positions(x64, spec).floor_().clamp_(0, spec.bins - 1)
        return pos >= k

    lo = torch.full_like(k, key_lo, dtype=torch.int64)
    hi = torch.full_like(k, key_hi, dtype=torch.int64)
    return _key_to_float(_bisect_keys(lo, hi, reaches_bin), dtype)


def _thresholds(spec: BinSpec, dtype: torch.dtype, device: torch.device) -> Tensor:
    return _thresholds_cpu(spec, dtype).to(device)


def _check_floating(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INT_VIEW:
        raise TypeError(f"{name} must be float16/bfloat16/float32/float64, got {x.dtype}")


# ---------------------------------------------------------------------------------------
# 1d dense
# ---------------------------------------------------------------------------------------


def _dense_generic(flat: Tensor, spec: BinSpec) -> tuple[Tensor, Tensor]:
    """Device-agnostic path (no host sync): non-finite elements go to an extra bin."""
    out = torch.zeros(spec.bins + 1, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _GENERIC_CHUNK):
        idx = reference_bin_index(flat[start : start + _GENERIC_CHUNK], spec)
        out += torch.bincount(idx, minlength=spec.bins + 1)
    return out[: spec.bins].clone(), out[spec.bins].clone()


def _dense_cpu(flat: Tensor, spec: BinSpec) -> tuple[Tensor, Tensor]:
    """Chunked CPU path: float64 index in an L2-resident buffer, small-int ``bincount``.

    A chunk whose float64 sum is not finite may hold NaN/inf; it takes the masked path.
    """
    n = flat.numel()
    counts = torch.zeros(spec.bins, dtype=torch.int64)
    n_nonfinite = torch.zeros((), dtype=torch.int64)
    if n == 0:
        return counts, n_nonfinite
    size = min(_CHUNK, n)
    buf = torch.empty(size, dtype=torch.float64)
    index_dtype = torch.uint8 if spec.bins <= 256 else torch.int32
    index_buf = torch.empty(size, dtype=index_dtype)
    for start in range(0, n, _CHUNK):
        chunk = flat[start : start + _CHUNK]
        b = buf[: chunk.numel()]
        b.copy_(chunk)
        if not math.isfinite(b.sum().item()):
            c, nf = _dense_generic(chunk, spec)
            counts += c
            n_nonfinite += nf
            continue
        _scaled_positions(b, spec).clamp_(0, spec.bins - 1)  # trunc after clamp == floor
        idx = index_buf[: chunk.numel()]
        idx.copy_(b)
        counts += torch.bincount(idx, minlength=spec.bins)
    return counts, n_nonfinite


@functools.lru_cache(maxsize=8)
def _executor(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cockpit-hist")


def _dense_cpu_parallel(flat: Tensor, spec: BinSpec) -> tuple[Tensor, Tensor]:
    """Split into contiguous parts, one per torch thread, histogrammed concurrently."""
    workers = min(torch.get_num_threads(), flat.numel() // _MIN_ELEMENTS_PER_WORKER)
    if workers <= 1:
        return _dense_cpu(flat, spec)
    step = -(-flat.numel() // workers)
    parts = [flat[s : s + step] for s in range(0, flat.numel(), step)]
    results = list(_executor(workers).map(lambda part: _dense_cpu(part, spec), parts))
    return sum(r[0] for r in results), sum(r[1] for r in results)


def histogram_dense(x: Tensor, spec: BinSpec) -> Histogram:
    """Histogram of all elements of ``x`` (any shape), e.g. eq. (15) on stored gradients.

    Returns ``Histogram(counts [bins] int64, n_nonfinite)``; see the module docstring for
    the exact bin of each value.
    """
    _check_floating("x", x)
    flat = x.reshape(-1)
    if flat.device.type == "cpu":
        counts, n_nonfinite = _dense_cpu_parallel(flat, spec)
    else:
        counts, n_nonfinite = _dense_generic(flat, spec)
    return Histogram(counts, n_nonfinite)


# ---------------------------------------------------------------------------------------
# 1d outer products without materializing
# ---------------------------------------------------------------------------------------


def _outer_materialized(delta: Tensor, a: Tensor, spec: BinSpec) -> Histogram:
    """Fallback: materialize δ_n a_nᵀ block by block and histogram densely."""
    N, I = delta.shape
    J = a.shape[1]
    counts = torch.zeros(spec.bins, dtype=torch.int64, device=delta.device)
    n_nonfinite = torch.zeros((), dtype=torch.int64, device=delta.device)
    rows_i = max(1, min(I, _GENERIC_CHUNK // max(J, 1)))
    rows_n = max(1, _GENERIC_CHUNK // (rows_i * max(J, 1)))
    for n0 in range(0, N, rows_n):
        for i0 in range(0, I, rows_i):
            block = delta[n0 : n0 + rows_n, i0 : i0 + rows_i, None] * a[n0 : n0 + rows_n, None, :]
            c, nf = histogram_dense(block, spec)
            counts += c
            n_nonfinite += nf
    return Histogram(counts, n_nonfinite)


def _smallest_factor_reaching(magnitude: Tensor, threshold: Tensor) -> Tensor:
    """c = min{a : fl(m·a) >= t} over the floats a of the dtype (m > 0, t finite).

    Monotone rounding makes fl(m·a) >= t ⟺ a >= c. A float64 guess t/m brackets c within a
    few ulps; unbracketed cases (underflow/overflow) bisect over the whole float range.
    Returns +inf when no finite a qualifies.
    """
    dtype = magnitude.dtype
    key_min, key_max = _key_bounds(dtype)

    def reaches(key: Tensor, m: Tensor, t: Tensor) -> Tensor:
        return m * _key_to_float(key, dtype) >= t

    guess = (threshold.double() / magnitude.double()).to(dtype)
    g = _float_to_key(guess)
    lo = (g - 4).clamp_(key_min, key_max)
    hi = (g + 4).clamp_(key_min, key_max)
    bracketed = ~reaches(lo, magnitude, threshold) & reaches(hi, magnitude, threshold)
    result = torch.empty_like(g)
    sel = bracketed.nonzero().squeeze(1)
    m_s, t_s = magnitude[sel], threshold[sel]
    result[sel] = _bisect_keys(lo[sel], hi[sel], lambda k: reaches(k, m_s, t_s))
    rest = (~bracketed).nonzero().squeeze(1)
    if rest.numel():
        m_r, t_r = magnitude[rest], threshold[rest]
        lo_r = torch.full_like(rest, key_min)
        hi_r = torch.full_like(rest, key_max)
        result[rest] = _bisect_keys(lo_r, hi_r, lambda k: reaches(k, m_r, t_r))
    return _key_to_float(result, dtype)


def _count_at_least(
    a_sorted: Tensor, sample: Tensor, delta_q: Tensor, threshold: Tensor
) -> Tensor:
    """#{j : fl(δ_q · a[n_q, j]) >= t_q} for every query q (δ_q ≠ 0), int64.

    δ > 0: a >= c. δ < 0: fl(δa) = fl(|δ|·(−a)), so a <= −c, i.e. a < −prev(c).
    """
    N, J = a_sorted.shape
    dtype = a_sorted.dtype
    c = _smallest_factor_reaching(delta_q.abs(), threshold)
    positive = delta_q > 0
    below_neg_c = -_key_to_float(_float_to_key(c) - 1, dtype)
    probe = torch.where(positive, c, below_neg_c)
    # pad the probes of each sample into a row of a [N, M] grid for a batched searchsorted
    per_sample = torch.bincount(sample, minlength=N)
    starts = torch.cumsum(per_sample, 0) - per_sample
    column = torch.arange(sample.numel(), device=sample.device) - starts[sample]
    width = int(per_sample.max().item())
    grid = torch.full((N, width), math.inf, dtype=dtype, device=a_sorted.device)
    grid[sample, column] = probe
    below = torch.searchsorted(a_sorted, grid)[sample, column]  # #{a < probe}
    return torch.where(positive, J - below, below)


def histogram_outer(delta: Tensor, a: Tensor, spec: BinSpec) -> Histogram:
    """Histogram of the N·I·J products δ[n, i]·a[n, j] (in the inputs' dtype), exactly.

    These are the individual gradients g_n = δ_n a_nᵀ of a Linear weight (eq. 15). Let
    G_k = #{products in bins >= k} = Σ_{n,i} #{j : fl(δ_ni a_nj) >= t_k}, with t_k the
    exact threshold of bin k (:func:`_thresholds_cpu`); counts_k = G_k − G_{k+1}.
    Rounding is monotone, so all products of row (n, i) lie in the bins of
    fl(δ_ni·min a_n) and fl(δ_ni·max a_n); only thresholds strictly inside that bin range
    need a binary search in sorted a_n, rows within one bin cost O(1).
    Non-finite inputs or possible overflow fall back to blockwise materialization.
    """
    _check_floating("delta", delta)
    _check_floating("a", a)
    if delta.dim() != 2 or a.dim() != 2 or delta.shape[0] != a.shape[0]:
        raise ValueError(
            f"histogram_outer needs delta [N, I] and a [N, J], got {tuple(delta.shape)} "
            f"and {tuple(a.shape)}"
        )
    if delta.dtype != a.dtype or delta.device != a.device:
        raise ValueError("delta and a must share dtype and device")
    N, I = delta.shape
    J = a.shape[1]
    device, dtype = delta.device, delta.dtype
    if N * I * J == 0:
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return Histogram(torch.zeros(spec.bins, dtype=torch.int64, device=device), zero)
    finfo_max = torch.finfo(dtype).max
    max_product = delta.abs().max().double() * a.abs().max().double()
    if not bool(torch.isfinite(max_product)) or float(max_product) > finfo_max / 4:
        return _outer_materialized(delta, a, spec)  # non-finite input or overflow risk

    thresholds = _thresholds(spec, dtype, device)
    a_sorted = a.sort(dim=1).values
    p_min = delta * a_sorted[:, :1]
    p_max = delta * a_sorted[:, -1:]
    bin_lo = torch.bucketize(torch.minimum(p_min, p_max), thresholds, right=True).view(-1)
    bin_hi = torch.bucketize(torch.maximum(p_min, p_max), thresholds, right=True).view(-1)
    span = bin_hi - bin_lo
    if int(span.sum().item()) > (N * I * J) // 8:
        return _outer_materialized(delta, a, spec)  # too many searches to pay off

    # G_k from rows entirely at or above bin k: J for each row with bin_lo >= k
    rows_from = torch.bincount(bin_lo, minlength=spec.bins)
    at_least = J * rows_from.flip(0).cumsum(0).flip(0)
    # rows spanning several bins: binary searches, blockwise over samples to bound memory
    queries_per_sample = span.view(N, I).sum(1).tolist()
    flat_delta = delta.reshape(-1)
    n0 = 0
    while n0 < N:
        n1, total = n0, 0
        while n1 < N and (n1 == n0 or total + queries_per_sample[n1] <= _MAX_QUERIES_PER_BLOCK):
            total += queries_per_sample[n1]
            n1 += 1
        if total:
            rows = torch.arange(n0 * I, n1 * I, device=device)
            s = span[rows]
            row_q = torch.repeat_interleave(rows, s)
            first = torch.cumsum(s, 0) - s
            offset = torch.arange(row_q.numel(), device=device) - torch.repeat_interleave(first, s)
            k = bin_lo[row_q] + 1 + offset
            ge = _count_at_least(
                a_sorted[n0:n1], row_q // I - n0, flat_delta[row_q], thresholds[k - 1]
            )
            at_least.index_add_(0, k, ge)
        n0 = n1
    counts = at_least.clone()
    counts[:-1] -= at_least[1:]
    return Histogram(counts, torch.zeros((), dtype=torch.int64, device=device))


# ---------------------------------------------------------------------------------------
# 2d dense
# ---------------------------------------------------------------------------------------


def _hist2d_generic(
    g: Tensor, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec
) -> tuple[Tensor, Tensor]:
    """Device-agnostic path: a pair with any non-finite member goes to an extra bin."""
    n_bins = spec_g.bins * spec_theta.bins
    idx_theta = reference_bin_index(theta, spec_theta)
    theta_bad = idx_theta == spec_theta.bins
    out = torch.zeros(n_bins + 1, dtype=torch.int64, device=g.device)
    rows = max(1, _GENERIC_CHUNK // max(g.shape[1], 1))
    for r0 in range(0, g.shape[0], rows):
        idx_g = reference_bin_index(g[r0 : r0 + rows], spec_g)
        flat = idx_g * spec_theta.bins + idx_theta
        bad = (idx_g == spec_g.bins) | theta_bad
        out += torch.bincount(torch.where(bad, n_bins, flat).view(-1), minlength=n_bins + 1)
    return out[:n_bins].view(spec_g.bins, spec_theta.bins).clone(), out[n_bins].clone()


def histogram2d_dense(
    g: Tensor, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec
) -> Histogram:
    """2-D histogram of the pairs (g[n, j], θ_j), eq. (16); counts [bins_g, bins_theta].

    Flat bin idx_g·bins_theta + idx_θ and one ``bincount`` per chunk (no atomics on a hot
    bin). The marginals are sums of the 2-D counts: ``counts.sum(1)`` is the gradient
    histogram (eq. 15), ``counts.sum(0)`` is N times the parameter histogram. A pair with a
    non-finite member is counted in ``n_nonfinite`` only.
    """
    _check_floating("g", g)
    _check_floating("theta", theta)
    if g.dim() != 2 or theta.dim() != 1 or g.shape[1] != theta.shape[0]:
        raise ValueError(
            f"histogram2d_dense needs g [N, D] and theta [D], got {tuple(g.shape)} "
            f"and {tuple(theta.shape)}"
        )
    if g.device != theta.device:
        raise ValueError("g and theta must be on the same device")
    bins_g, bins_t = spec_g.bins, spec_theta.bins
    N, D = g.shape
    if g.device.type != "cpu" or not bool(torch.isfinite(theta).all()):
        return Histogram(*_hist2d_generic(g, theta, spec_g, spec_theta))
    counts = torch.zeros(bins_g * bins_t, dtype=torch.int64)
    n_nonfinite = torch.zeros((), dtype=torch.int64)
    if N * D == 0:
        return Histogram(counts.view(bins_g, bins_t), n_nonfinite)
    theta_idx = reference_bin_index(theta, spec_theta).to(torch.float64)
    cols = min(D, _CHUNK)
    rows = max(1, _CHUNK // cols)
    buf = torch.empty(rows * cols, dtype=torch.float64)
    index_dtype = torch.int16 if bins_g * bins_t <= 32767 else torch.int32
    index_buf = torch.empty(rows * cols, dtype=index_dtype)
    for r0 in range(0, N, rows):
        for c0 in range(0, D, cols):
            block = g[r0 : r0 + rows, c0 : c0 + cols]
            b = buf[: block.numel()].view(block.shape)
            b.copy_(block)
            if not math.isfinite(b.sum().item()):
                c, nf = _hist2d_generic(block, theta[c0 : c0 + cols], spec_g, spec_theta)
                counts += c.view(-1)
                n_nonfinite += nf
                continue
            _scaled_positions(b, spec_g).clamp_(0, bins_g - 1).trunc_()
            b.mul_(bins_t).add_(theta_idx[c0 : c0 + cols])
            idx = index_buf[: block.numel()]
            idx.copy_(b.view(-1))
            counts += torch.bincount(idx, minlength=bins_g * bins_t)
    return Histogram(counts.view(bins_g, bins_t), n_nonfinite)
