"""Exact histograms of individual-gradient elements (paper eq. 15 and 16).

Bins: ``BinSpec(lo, hi, bins)`` has edges e_k = lo + k·(hi − lo)/bins, in exact rational
arithmetic. A finite value x falls into bin

    k(x) = #{k ∈ 1 … bins − 1 : x ≥ e_k} = clamp(⌊(x − lo)·bins/(hi − lo)⌋, 0, bins − 1)

(exact real arithmetic), so bin k holds e_k ≤ x < e_{k+1}, values below ``lo`` are clamped
into the first and values at or above ``hi`` into the last bin ("outliers clamped into the
edge bins", as in the paper); ±0 fall into the bin that holds 0. Non-finite values (NaN,
±inf) are counted in no bin; every function returns ``(counts, num_nonfinite)``. The counts
are exact at every edge, for float32 and float64 data on every path (tested against
``fractions.Fraction`` at, just below and just above every edge).

Exact bins. For x of a float dtype, x ≥ e_k ⟺ x ≥ T_k with T_k = e_k rounded *up* to the
dtype (computed once per spec and dtype from the rational edge), so k(x) = #{k : x ≥ T_k}.
The kernels first estimate the bin with one to three cheap float operations whose error is
bounded (:func:`_edges_cpu` proves the bounds per spec and dtype) and then compare x with
the one rounded-up edge that can be wrong:

* zero-edge form (zero is an edge e_m, e.g. the defaults (−2, 2, 100), (−1, 1, 40)):
  i = clamp(⌊fl(x·s↑)⌋ + m, 0, bins − 1) with s↑ = bins/(hi − lo) rounded a little up. The
  sign of x alone decides between [e_(m−1), 0) and [0, e_(m+1)) at every magnitude, and an
  error can only put x one bin further from zero, so the two bins at zero (the bulk of a
  gradient) are exact as estimated; an estimate i outside them is corrected to
  i − [i > m] + [x ≥ outer(i)] (outer(i) = T_i above zero, T_(i+1) below). Blocks of 4096
  whose estimates stay in the two bins are skipped; a few corrections are made one by one,
  many with one gather over the block.
* general form (other specs, and blocks of values spread over many bins):
  i = clamp(⌊fl(c + s·x)⌋, 0, bins − 1), never above the exact bin and at most one below,
  then i += [x ≥ T_(i+1)] with one gather of the rounded-up edges.

Specs for which neither bound holds (e.g. bins narrower than a few float spacings, or a
scale outside the dtype's range) and other dtypes (converted to float64, exact for float16
and bfloat16) bisect T directly (``torch.bucketize``), which is exact too. The kernels:

* :func:`histogram_dense` bins chunk by chunk in cache-sized buffers; one range reduction
  per chunk detects NaN/±inf (and decides whether the clamp is needed at all); only chunks
  that hold non-finite values take the masked path.
* :func:`histogram_outer` never forms the N·I·J products p = fl(δ_{n,i}·a_{n,j}). Because
  k(·) is monotone, k(p) = #{k ≥ 1 : p ≥ T_k} with the rounded-up edges T_k as thresholds.
  For a fixed row (n, i) the map j ↦ fl(δ·s_j) over the sorted a_n = s is monotone, so
  #{j : fl(δ·s_j) ≥ T_k} is a boundary index in s: it is located with one
  ``searchsorted`` at T_k/δ and then *verified* with the exact product on both sides of
  the boundary; the rare unverified queries are bisected with the exact product. A row
  whose products all fall into one bin costs O(1). Rows spanning many bins (|δ| large
  against the bin width), samples with non-finite entries or a possible overflow, and
  small layers are materialized block by block instead (a measured cost model decides).
* :func:`histogram2d_dense` is the dense kernel with a fused flat index
  k_g·bins_θ + k_θ and one ``bincount`` per chunk.

On CPU the chunks are shared by up to ``torch.get_num_threads()`` worker threads (so the
serial ``bincount`` runs on every core); on other devices each call is one chunk.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

# Elements per chunk on CPU: the float buffer (2 MiB for float32) and the index buffer stay
# in cache. Chunks are spread over a few Python worker threads (torch releases the GIL inside
# ops), which also runs the single-threaded ``bincount`` on every core. 2^19 measured 1.2–1.5×
# faster than 2^18 on 3C3D/2C2D conv gradients (1-D and 2-D; fewer ops per element), 2^20
# slower again (2 cores, 2 MiB L2 each, 36 MiB L3).
_CPU_CHUNK = 2**19
# Below this many products histogram_outer simply materializes them (measured crossover).
_MIN_OUTER_PRODUCTS = 2**19
# A row (n, i) whose products spread over more than _SPAN_PER_J · J bins is materialized
# instead of searched: one exact search costs about as much as binning 40 materialized
# products (measured on the 3C3D fc1 shape: ~180 ns per search, ~4.5 ns per product).
_SPAN_PER_J = 1 / 40
_MIN_HEAVY_SPAN = 1
# Cost model in units of one product binned by the blockwise materialization: a search
# costs _SEARCH_COST, a product of a separately materialized wide row _ROW_COST. If the
# estimate exceeds N·I·J, the whole layer is materialized instead (δ of order 1).
_SEARCH_COST = 40.0
_ROW_COST = 1.3
# Bound on the searches processed at once (memory of the query tensors).
_MAX_QUERIES_PER_BLOCK = 2**20
# Two lanes of bin indices fit into a byte while 2·bins ≤ 256 (lane 1 stored as k − bins ∈
# [−bins, −1]); see _count.
_MAX_LANE_BINS = 128


@dataclass(frozen=True)
class BinSpec:
    lo: float = -2.0
    hi: float = 2.0
    bins: int = 100

    def __post_init__(self):
        if int(self.bins) != self.bins or self.bins < 1:
            raise ValueError(f"BinSpec needs a positive integer number of bins, got {self.bins}")
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)) or not self.lo < self.hi:
            raise ValueError(f"BinSpec needs finite lo < hi, got lo={self.lo}, hi={self.hi}")

    @property
    def scale(self) -> float:
        return self.bins / (self.hi - self.lo)

    def edges(self, dtype: torch.dtype = torch.float64, device=None) -> Tensor:
        return torch.linspace(self.lo, self.hi, self.bins + 1, dtype=dtype, device=device)

    def exact_edges(self) -> tuple[Fraction, ...]:
        """e_0 … e_bins in exact rational arithmetic."""
        return _exact_edges(self.lo, self.hi, self.bins)

    @property
    def zero_bin(self) -> int | None:
        """m with e_m = 0 exactly, if zero is an inner edge (then [e_(m−1), 0) holds every
        negative value and [0, e_(m+1)) every non-negative one, however small)."""
        return _zero_bin(self.lo, self.hi, self.bins)

    def bin_index(self, x: Tensor) -> Tensor:
        """k(x) = #{k ≥ 1 : x ≥ e_k} (int64) for finite x, exact (module docstring);
        ±inf fall into the edge bins, NaN into an unspecified bin."""
        if x.dtype not in (torch.float32, torch.float64):
            x = x.double()  # exact for float16, bfloat16 and integers up to 2^53
        edges = _edges(self, x.dtype, x.device)
        if not edges.fast:
            return torch.bucketize(x, edges.thresholds, right=True)
        out = torch.empty(x.shape, dtype=torch.long, device=x.device)
        if _bins_into(x, edges, out, strict=True) is not None:
            return out
        return _bins_into(torch.where(torch.isnan(x), 0.0, x), edges, out)


# --------------------------------------------------------------------------- exact edges


@functools.lru_cache(maxsize=256)
def _exact_edges(lo: float, hi: float, bins: int) -> tuple[Fraction, ...]:
    low, width = Fraction(lo), Fraction(hi) - Fraction(lo)
    return tuple(low + k * width / bins for k in range(bins + 1))


@functools.lru_cache(maxsize=256)
def _zero_bin(lo: float, hi: float, bins: int) -> int | None:
    """m with lo + m·(hi − lo)/bins = 0 in exact (rational) arithmetic, 0 < m < bins."""
    m = -Fraction(lo) * bins / (Fraction(hi) - Fraction(lo))
    return int(m) if m.denominator == 1 and 0 < m < bins else None


_NUMPY_FLOAT = {torch.float32: np.float32, torch.float64: np.float64}


def _round_up(value: Fraction, dtype: torch.dtype) -> float:
    """The smallest float of ``dtype`` ≥ value (+inf above the largest finite float)."""
    kind = _NUMPY_FLOAT[dtype]
    largest = Fraction(float(np.finfo(kind).max))
    if value > largest:
        return math.inf
    if value <= -largest:
        return -float(largest)
    c = kind(float(value))  # within a rounding or two of value
    while Fraction(float(c)) < value:
        c = np.nextafter(c, kind(np.inf))
    while Fraction(float(below := np.nextafter(c, kind(-np.inf)))) >= value:
        c = below
    return float(c)


def _round_down(value: Fraction, dtype: torch.dtype) -> float:
    """The largest float of ``dtype`` ≤ value (−inf below the smallest finite float)."""
    return -_round_up(-value, dtype)


@dataclass(frozen=True)
class _Edges:
    """A BinSpec's exact edges in one float dtype (module docstring, "Exact bins").

    ``thresholds``: T_k = e_k rounded up to the dtype, k = 1 … bins − 1 (x ≥ e_k ⟺ x ≥ T_k
    for every x of the dtype).

    Zero-edge form (``zero`` = m, zero is the edge e_m): estimate ⌊fl(x·s↑)⌋ + m with s↑ a
    little above bins/(hi − lo), exact in the bins m − 1 and m and otherwise at most one bin
    too far from zero; ``outer``[k] is the edge to compare with: T_k for k > m (the estimate
    is one too high iff x < T_k), T_(k+1) for k < m − 1 (one too low iff x ≥ T_(k+1)), NaN
    for the two exact bins.

    General form (``zero`` None): estimate ⌊fl(c + s·x)⌋ (``offset`` c, ``scale`` s) never
    above the exact bin and at most one below; ``upper``[k] = T_(k+1) (NaN for the last bin):
    the estimate is one too low iff x ≥ T_(k+1).

    ``general``: the general form is exact for every float of the dtype; ``fast``: one of
    the two forms is (else every kernel bisects ``thresholds``).
    """

    thresholds: Tensor
    upper: Tensor
    offset: Tensor
    scale: float
    fast: bool
    zero: int | None = None
    zero_scale: float = math.nan
    outer: Tensor | None = None
    general: bool = False

    @functools.cached_property
    def outer_numpy(self) -> np.ndarray:
        return self.outer.cpu().numpy()

    def to(self, device: torch.device) -> _Edges:
        return _Edges(self.thresholds.to(device), self.upper.to(device),
                      self.offset.to(device), self.scale, self.fast, self.zero,
                      self.zero_scale, None if self.outer is None else self.outer.to(device),
                      self.general)


@functools.lru_cache(maxsize=64)
def _edges_cpu(spec: BinSpec, dtype: torch.dtype) -> _Edges:
    """The tables of :class:`_Edges`, with the error bounds that decide the form.

    Let S = bins/(hi − lo), R = max(|lo|, |hi|), u the unit roundoff of the dtype.

    Zero-edge form (zero = e_m exactly): s↑ = S/(1 − u) rounded up to the dtype. For x > 0,
    fl(x·s↑) ≥ x·s↑·(1 − u) ≥ x·S where the product is normal (where it is subnormal it is
    below 1 and so is x·S), and fl(x·s↑) ≤ x·S + Δ₀ with Δ₀ = R·(s↑·(1 + u) − S) for
    x ≤ R; symmetrically for x < 0. With Δ₀ ≤ 1/2 the estimate ⌊fl(x·s↑)⌋ + m equals the
    exact bin or lies one further from m, and never across zero: fl keeps the sign of x·s↑
    when s↑ > 1/2 (no nonzero product rounds to ±0), so ⌊·⌋ + m is m − 1 for every
    negative x with |x·S| < 1 and m for every non-negative one. Values beyond lo or hi
    are estimated at least as far out and clamped into the edge bins.

    General form: for finite x in [lo, hi] let p = S·(x − lo) and s = S rounded to the
    dtype. fl(c + s·x), with or without a fused multiply-add, differs from c + S·x by at
    most ε = |s − S|·R + u·(S + |s − S|)·R + u·(bins + 1) + 2·(smallest subnormal). With
    c = −S·lo − 2ε rounded down to the dtype the estimate lies in [p − Δ, p],
    Δ = (−S·lo − c) + ε. Below lo the estimate is at most its value at ⌈lo⌉ (monotone), so
    below 1 if S·(⌈lo⌉ − lo) < 1; above hi at least its value at ⌊hi⌋, so above bins − 2 if
    Δ + S·(hi − ⌊hi⌋) < 1. Both are required with margin 1/2; then the estimated bin
    clamp(⌊fl(c + s·x)⌋, 0, bins − 1) is the exact bin or one below it.
    """
    edges = spec.exact_edges()
    thresholds = [_round_up(e, dtype) for e in edges[1:-1]]
    upper = [*thresholds, math.nan]
    kind = _NUMPY_FLOAT[dtype]
    finfo = np.finfo(kind)
    u = Fraction(float(finfo.eps)) / 2
    tiny = Fraction(float(finfo.smallest_subnormal))
    lo, hi = Fraction(spec.lo), Fraction(spec.hi)
    exact = spec.bins / (hi - lo)
    radius = max(abs(lo), abs(hi))
    largest = Fraction(float(finfo.max))
    usable = (exact <= largest and radius <= largest and exact * radius <= largest / 4
              and hi <= largest)
    general = False
    scale = offset = math.nan
    if usable:
        scale = float(kind(float(exact)))
        err = abs(Fraction(scale) - exact)
        eps = err * radius + u * (exact + err) * radius + u * (spec.bins + 1) + 2 * tiny
        offset = _round_down(-exact * lo - 2 * eps, dtype)
        if math.isfinite(offset) and scale > 0:
            deficit = (-exact * lo - Fraction(offset)) + eps
            below = exact * (Fraction(_round_up(lo, dtype)) - lo)
            above = deficit + exact * (hi - Fraction(_round_down(hi, dtype)))
            general = (below <= Fraction(1, 2) and above <= Fraction(1, 2)
                       and Fraction(float(finfo.tiny)) <= Fraction(scale))
    m = spec.zero_bin
    zero_scale, outer = math.nan, None
    if usable and m is not None:
        zero_scale = _round_up(exact / (1 - u), dtype)
        overshoot = radius * (Fraction(zero_scale) * (1 + u) - exact)
        if zero_scale > 0.5 and math.isfinite(zero_scale) and overshoot <= Fraction(1, 2):
            outer = torch.tensor([thresholds[k - 1] if k > m else thresholds[k] if k < m - 1
                                  else math.nan for k in range(spec.bins)], dtype=dtype)
    return _Edges(torch.tensor(thresholds, dtype=dtype), torch.tensor(upper, dtype=dtype),
                  torch.tensor(offset, dtype=dtype), scale, general or outer is not None,
                  m if outer is not None else None, zero_scale, outer, general)


@functools.lru_cache(maxsize=64)
def _edges(spec: BinSpec, dtype: torch.dtype, device: torch.device) -> _Edges:
    return _edges_cpu(spec, dtype).to(device)


def _fast_path_ok(spec: BinSpec, dtype: torch.dtype) -> bool:
    """Whether the fast kernels (estimate and one correction) are exact for ``dtype``."""
    return dtype in _NUMPY_FLOAT and _edges_cpu(spec, dtype).fast


_LOCAL = threading.local()


def _scratch(slot: str, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat buffer of n elements, reused by the calling thread (CPU), else new."""
    if device.type != "cpu":
        return torch.empty(n, dtype=dtype, device=device)
    if n > 4 * _CPU_CHUNK:  # not kept: a one-off large call
        return torch.empty(n, dtype=dtype)
    buffers = _LOCAL.__dict__.setdefault("buffers", {})
    buf = buffers.get((slot, dtype))
    if buf is None or buf.numel() < n:
        buf = buffers[(slot, dtype)] = torch.empty(max(n, _CPU_CHUNK), dtype=dtype)
    return buf[:n]


def _bins_into(
    x: Tensor, edges: _Edges, out: Tensor, work: Tensor | None = None, strict: bool = False,
    spread: bool = False,
) -> Tensor | None:
    """Exact k(x) of every element of x (float32/float64 of a fast spec, no NaN; ±inf into
    the edge bins) written to the contiguous integer tensor ``out`` of x's shape.

    Zero-edge form: i = clamp(⌊fl(x·s↑)⌋ + m, 0, bins − 1), exact in the bins m − 1 and m
    (the bulk of a gradient's elements) and at most one bin too far from zero elsewhere,
    corrected with the rounded-up edge ``edges.outer``[i] for the elements outside those
    two bins (:func:`_fix_outer`). General form: i = clamp(⌊fl(c + s·x)⌋, 0, bins − 1),
    never above the exact bin and at most one below, then i += [x ≥ T_(i+1)] for every
    element with T_(i+1) gathered from ``edges.upper``. See :func:`_edges_cpu` for the
    bounds. ``work`` (contiguous, x's shape and dtype, not x itself) receives the
    estimate; ``strict``: return None, with ``out`` untouched, if an estimate is not
    finite (NaN/±inf input or overflow); ``spread``: the caller expects values spread over
    many bins (the general form then costs fewer passes).
    """
    bins = edges.upper.numel()
    n = x.numel()
    if n == 0:
        return out
    if not out.is_contiguous():  # the corrections write through flat views of out
        dense = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        if _bins_into(x, edges, dense, work, strict, spread) is None:
            return None
        return out.copy_(dense)
    if work is None:
        work = _scratch("work", n, x.dtype, x.device).view(x.shape)
    m = edges.zero if not (spread and edges.general) else None
    if m is not None:  # the old kernel's three passes, with s rounded up
        y = torch.mul(x, edges.zero_scale, out=work)
        y.floor_()
        y.add_(m)
    else:
        y = torch.add(edges.offset, x, alpha=edges.scale, out=work)
    ranges = _block_ranges(y) if m is not None and y.device.type == "cpu" else None
    if ranges is not None:
        low, high = float(ranges[0].min()), float(ranges[1].max())
    else:
        low, high = torch.stack(torch.aminmax(y)).tolist()
    finite = math.isfinite(low) and math.isfinite(high)
    if strict and not finite:
        return None
    if low < 0 or high >= bins or not finite:
        y.clamp_(0, bins - 1)  # for y ≥ 0 the truncating cast below is ⌊y⌋
    if m is not None:
        out.copy_(y)
        if low >= m - 1 and high <= m:
            return out
        return _fix_outer(x, edges, out, y, ranges)
    wide = out.dtype in (torch.int32, torch.int64)
    index = out if wide else _scratch("index", n, torch.int32, x.device).view(x.shape)
    index.copy_(y)
    upper = torch.index_select(edges.upper, 0, index.view(-1), out=y.view(-1)).view(x.shape)
    reached = _greater_equal(x, upper)
    if index is not out:
        out.copy_(index)
    return _add_flags(out, reached)


def _greater_equal(x: Tensor, y: Tensor) -> Tensor:
    """x ≥ y into a reused bool buffer (NumPy's loop on CPU: ~1.5× torch's on one core)."""
    flags = _scratch("bool", x.numel(), torch.bool, x.device).view(x.shape)
    if x.device.type == "cpu":
        np.greater_equal(x.detach().numpy(), y.detach().numpy(), out=flags.numpy())
    else:
        torch.ge(x, y, out=flags)
    return flags


def _add_flags(out: Tensor, flags: Tensor) -> Tensor:
    """out += flags (bool), in out's integer type (same-type loops only: mixed types take
    torch's slow casting loop)."""
    if out.dtype in (torch.int8, torch.uint8):
        return out.add_(flags.view(out.dtype))
    step = _scratch("wide_step", out.numel(), out.dtype, out.device).view(out.shape)
    return out.add_(step.copy_(flags))


# Block length of the range check that locates the estimates outside the two bins at zero.
_BLOCK = 4096
_UNSIGNED = {torch.int8: np.uint8, torch.uint8: np.uint8, torch.int16: np.uint16,
             torch.int32: np.uint32, torch.int64: np.uint64}


def _block_ranges(y: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Minimum and maximum of every block of ``_BLOCK`` elements of the contiguous CPU
    tensor y (the last block may be shorter); NumPy's reductions, ~2× torch's aminmax."""
    flat = y.detach().numpy().reshape(-1)
    full = flat.size - flat.size % _BLOCK
    blocks = flat[:full].reshape(-1, _BLOCK)
    lows, highs = blocks.min(axis=1), blocks.max(axis=1)
    if full < flat.size:
        lows = np.append(lows, flat[full:].min())
        highs = np.append(highs, flat[full:].max())
    return lows, highs


def _outer_candidates(
    index: Tensor, m: int, ranges: tuple[np.ndarray, np.ndarray] | None
) -> np.ndarray | Tensor | None:
    """Flat positions of the estimates outside the bins m − 1 and m (int64, a NumPy array
    on CPU), or None when they are many (then one gather over all elements is cheaper).

    On CPU only the blocks whose estimates leave the two bins (``ranges``: their minimum
    and maximum, few in a gradient) are searched, with one unsigned comparison
    (i − (m − 1) wraps for i < m − 1)."""
    flat = index.reshape(-1)
    n = flat.numel()
    if ranges is None or index.device.type != "cpu":
        outside = (flat < m - 1) | (flat > m)
        return None if int(outside.sum()) > n // 16 else outside.nonzero().squeeze(1)
    lows, highs = ranges
    blocks = np.flatnonzero((lows < m - 1) | (highs > m))
    if blocks.size > lows.size // 4:
        return None
    kind = _UNSIGNED[flat.dtype]
    values = flat.numpy().view(kind)
    full = n // _BLOCK
    if blocks.size and blocks[-1] == full:  # the shorter last block: search it whole
        tail = full * _BLOCK + _flat_nonzero(values[full * _BLOCK:] - kind(m - 1) > 1)
        blocks = blocks[:-1]
    else:
        tail = None
    picked = values[: full * _BLOCK].reshape(full, _BLOCK)[blocks]
    offsets = _flat_nonzero(np.subtract(picked, kind(m - 1), out=picked).reshape(-1) > 1)
    positions = blocks[offsets // _BLOCK] * _BLOCK + offsets % _BLOCK
    if tail is not None:
        positions = np.concatenate([positions, tail])
    return None if positions.size > n // 16 else positions


def _flat_nonzero(mask: np.ndarray) -> np.ndarray:
    """np.flatnonzero, by successive ``argmax`` scans when the count is small (each stops
    at the next true entry)."""
    count = int(np.count_nonzero(mask))
    if count > 64:
        return np.flatnonzero(mask)
    positions = np.empty(count, dtype=np.int64)
    start = 0
    for k in range(count):
        start += int(mask[start:].argmax())
        positions[k] = start
        start += 1
    return positions


def _fix_outer(
    x: Tensor, edges: _Edges, out: Tensor, work: Tensor,
    ranges: tuple[np.ndarray, np.ndarray] | None,
) -> Tensor:
    """Zero-edge form: the estimates i outside the bins m − 1 and m become i − [i > m] +
    [x ≥ outer[i]] (for i > m: one too high iff x < T_i; for i < m − 1: one too low iff
    x ≥ T_(i+1)). Few such elements are corrected one by one, many with one gather."""
    m = edges.zero
    candidates = _outer_candidates(out, m, ranges)
    n = out.numel()
    if isinstance(candidates, np.ndarray):  # CPU, few: in NumPy (small calls are cheaper)
        if candidates.size:
            flat = out.numpy().reshape(-1)
            est = flat[candidates].astype(np.int64)
            values = x.detach().numpy().flat[candidates]
            edge = edges.outer_numpy[est]
            flat[candidates] = est - (est > m) + (values >= edge)
        return out
    if candidates is not None:
        if candidates.numel() == 0:
            return out
        flat = out.view(-1)
        est = flat.index_select(0, candidates).long()
        values = x[torch.unravel_index(candidates, x.shape)]
        edge = edges.outer.index_select(0, est)
        fixed = est - (est > m).long() + (values >= edge).long()
        flat.index_copy_(0, candidates, fixed.to(out.dtype))
        return out
    # many: one gather; the step −[i > m] + [x ≥ outer[i]] ∈ {−1, 0, 1} as bytes
    above = _scratch("above", n, torch.bool, x.device).view(x.shape)
    if x.device.type == "cpu":
        np.greater(out.numpy(), m, out=above.numpy())
    else:
        torch.gt(out, m, out=above)
    wide = out.dtype in (torch.int32, torch.int64)
    index = out if wide else _scratch("index", n, torch.int32, x.device).view(x.shape)
    if not wide:
        index.copy_(out)
    edge = torch.index_select(edges.outer, 0, index.view(-1), out=work.view(-1)).view(x.shape)
    reached = _greater_equal(x, edge)
    step = torch.sub(reached.view(torch.int8), above.view(torch.int8),
                     out=_scratch("step", n, torch.int8, x.device).view(x.shape))
    if out.dtype in (torch.int8, torch.uint8):
        return out.add_(step.view(out.dtype))
    return out.add_(_scratch("wide_step", n, out.dtype, x.device).view(x.shape).copy_(step))


# --------------------------------------------------------------------------- helpers


def _sorted_rows(x: Tensor) -> Tensor:
    """Each row of ``x`` in ascending order. On CPU NumPy's vectorized sort (measured 10×
    faster than ``torch.sort``, which also computes the permutation: 0.4 vs 4.2 ms for the
    3C3D fc1 input, 128×1152)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.sort(x.detach().numpy(), axis=1))
    return torch.sort(x, dim=1).values


def _chunk_size(device: torch.device, n: int) -> int:
    """Cache-sized chunks on CPU; one chunk elsewhere (no Python loop on accelerators)."""
    return max(1, min(n, _CPU_CHUNK)) if device.type == "cpu" else max(1, n)


_MAX_WORKERS = 8
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="cockpit-hist")
        return _POOL


def _sum_over_chunks(
    num_chunks: int,
    make_buffers: Callable[[], tuple[Tensor, ...]],
    task: Callable[[int, tuple[Tensor, ...]], tuple[Tensor, int]],
) -> tuple[Tensor, int]:
    """Σ_c task(c, buffers) over chunks c, on up to ``torch.get_num_threads()`` workers.

    Each worker takes every w-th chunk and owns its buffers; results are summed. Workers
    only run on CPU tensors (elsewhere ``num_chunks`` is 1).
    """

    def run(first: int, step: int) -> tuple[Tensor, int]:
        buffers = make_buffers()
        counts, bad = task(first, buffers)
        for c in range(first + step, num_chunks, step):
            more, more_bad = task(c, buffers)
            counts += more
            bad += more_bad
        return counts, bad

    workers = max(1, min(torch.get_num_threads(), num_chunks, _MAX_WORKERS))
    if workers == 1 or threading.current_thread().name.startswith("cockpit-hist"):
        return run(0, 1)
    futures = [_pool().submit(run, w, workers) for w in range(1, workers)]
    counts, bad = run(0, workers)  # the calling thread is worker 0
    for f in futures:
        more, more_bad = f.result()
        counts += more
        bad += more_bad
    return counts, bad


def _index_dtype(num_bins: int) -> torch.dtype:
    if num_bins <= 2**8:
        return torch.uint8
    if num_bins <= 2**15:
        return torch.int16
    return torch.int32 if num_bins <= 2**31 else torch.int64


def _counting_dtype(num_bins: int) -> torch.dtype:
    """Index type of the 1-D kernels: int8 when :func:`_count` can use two lanes."""
    return torch.int8 if num_bins <= _MAX_LANE_BINS else _index_dtype(num_bins)


@functools.lru_cache(maxsize=16)
def _lane_offsets(length: int, num_bins: int, device: torch.device) -> Tensor:
    """0, −bins, 0, −bins, … (int8): the lane of every second element."""
    offsets = torch.zeros(length, dtype=torch.int8, device=device)
    offsets[1::2] = -num_bins
    return offsets


def _count(index: Tensor, num_bins: int) -> Tensor:
    """``bincount`` of bin indices (int64 counts of length ``num_bins``); overwrites an
    int8 ``index``.

    Gradient elements come in long runs that fall into the same one or two central bins, and
    ``bincount`` then increments one counter serially (each increment waits for the last:
    1.4–1.8 ns per element on a CPU, against 0.8 for spread indices). With int8 indices every
    second element counts into a second copy of the bins (byte values 256 − bins … 255), which
    halves those dependency chains; the copies are summed afterwards.
    """
    flat = index.reshape(-1)
    if flat.dtype != torch.int8:
        return torch.bincount(flat, minlength=num_bins)
    length = max(_CPU_CHUNK, 1 << (flat.numel() - 1).bit_length())  # few cached sizes
    flat.add_(_lane_offsets(length, num_bins, flat.device)[: flat.numel()])
    counts = torch.bincount(flat.view(torch.uint8), minlength=256)
    return counts[:num_bins] + counts[256 - num_bins:]


def _reference_dense(x: Tensor, spec: BinSpec) -> tuple[Tensor, int]:
    """The plain definition: mask non-finite values, ``bin_index``, ``bincount``."""
    flat = x.reshape(-1)
    finite = torch.isfinite(flat)
    num_nonfinite = int(flat.numel() - finite.sum())
    if num_nonfinite:
        flat = flat[finite]
    return torch.bincount(spec.bin_index(flat), minlength=spec.bins), num_nonfinite


def _looks_spread(flat: Tensor, spec: BinSpec) -> bool:
    """Whether more than 1 in 1000 of a strided sample of ~4096 values lies outside the two
    bins at zero: then most blocks of the zero-edge form need the gathered correction and
    the general form is cheaper (measured 2.0–2.4 against 2.6–3.2 ns/element from 0.5 %
    outside on; the zero-edge form wins below ~0.01 %). Only a choice of cost: both forms
    are exact."""
    m = spec.zero_bin
    if m is None or flat.numel() < 1024:
        return False
    sample = flat[:: max(1, flat.numel() // _BLOCK)]
    edges = spec.exact_edges()
    outside = (sample < float(edges[m - 1])) | (sample >= float(edges[m + 1]))
    return int(outside.sum()) * 1000 > sample.numel()


def _sample_products(delta: Tensor, a: Tensor) -> Tensor:
    """About 4·_BLOCK of the products δ[n, i]·a[n, j] on a strided grid (for
    :func:`_looks_spread`)."""
    N, I = delta.shape
    step_n = max(1, N // 4)
    d = delta[::step_n, :: max(1, I // 32)]
    x = a[::step_n, :: max(1, a.shape[1] // 32)]
    return (d[:, :, None] * x[:, None, :]).reshape(-1)


def _bin_chunk(
    chunk: Tensor, spec: BinSpec, work: Tensor, index: Tensor, spread: bool = False
) -> Tensor | None:
    """Exact k(x) of every element of ``chunk`` (float32/float64, fast spec) written to
    ``index`` (an integer type).

    ``work`` (contiguous, same shape as ``chunk``, not ``chunk`` itself) receives the
    estimated positions. Returns None, with ``index`` untouched, when the chunk holds a value
    whose estimated position is not finite (NaN/±inf input or overflow): the caller takes
    the masked path.
    """
    edges = _edges(spec, chunk.dtype, chunk.device)
    return _bins_into(chunk, edges, index, work, strict=True, spread=spread)


# --------------------------------------------------------------------------- dense 1d


def histogram_dense(x: Tensor, spec: BinSpec) -> tuple[Tensor, int]:
    """Counts of all elements of ``x`` (any shape), eq. (15) on stored gradients."""
    flat = x.detach().reshape(-1)
    n = flat.numel()
    if n == 0 or not _fast_path_ok(spec, flat.dtype):
        return _reference_dense(flat, spec)
    size = _chunk_size(flat.device, n)
    spread = _looks_spread(flat, spec)

    def buffers() -> tuple[Tensor, ...]:
        return (torch.empty(size, dtype=flat.dtype, device=flat.device),
                torch.empty(size, dtype=_counting_dtype(spec.bins), device=flat.device))

    def task(c: int, bufs: tuple[Tensor, ...]) -> tuple[Tensor, int]:
        chunk = flat[c * size : (c + 1) * size]
        m = chunk.numel()
        idx = _bin_chunk(chunk, spec, bufs[0][:m], bufs[1][:m], spread)
        if idx is None:
            return _reference_dense(chunk, spec)
        return _count(idx, spec.bins), 0

    return _sum_over_chunks(-(-n // size), buffers, task)


# --------------------------------------------------------------------------- outer products


def _float_to_ordered(x: Tensor) -> Tensor:
    """Order-preserving map of float32/float64 bit patterns to signed integers (int64)."""
    if x.dtype == torch.float32:
        bits = x.view(torch.int32).long()
        return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    bits = x.view(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)


def _thresholds(spec: BinSpec, dtype: torch.dtype, device: torch.device) -> Tensor:
    """T_k = e_k rounded up to ``dtype``, k = 1 … bins − 1: for finite p of the dtype,
    k(p) = #{k : T_k ≤ p} (the thresholds of the searches)."""
    return _edges(spec, dtype, device).thresholds

def _sample_keys(values32: Tensor, sample: Tensor) -> Tensor:
    """Keys sample·2³² + rank32(value) that sort (sample, float32 value) pairs as int64."""
    ordered = _float_to_ordered(values32 + 0.0)  # + 0.0 maps −0.0 to +0.0
    return (sample << 32) + ordered + 2**31


def _count_reaching(
    sorted_a: Tensor, keys: Tensor, sample: Tensor, delta: Tensor, threshold: Tensor
) -> Tensor:
    """#{j : fl(δ_q · s[n_q, j]) ≥ t_q} for every query q (δ_q ≠ 0), int64.

    With h(j) = [fl(δ s_j) ≥ t] for δ > 0 and its negation for δ < 0, h is false … false
    true … true along the sorted row; its boundary b is guessed by ``searchsorted`` of
    t/δ, verified with the exact products at b − 1 and b, and bisected where the guess
    fails. The count is J − b for δ > 0 and b for δ < 0.
    """
    J = sorted_a.shape[1]
    flat_a = sorted_a.reshape(-1)
    negative = delta < 0
    base = sample * J
    guess = (threshold.double() / delta.double()).float()
    query = _sample_keys(guess, sample) + negative.long()  # δ < 0: #{s ≤ guess}
    b = torch.searchsorted(keys, query) - base

    def h(j: Tensor, q: Tensor | None = None) -> Tensor:
        if q is None:
            return (delta * flat_a[base + j] >= threshold) ^ negative
        return (delta[q] * flat_a[base[q] + j] >= threshold[q]) ^ negative[q]

    ok = ((b == J) | h(b.clamp(max=J - 1))) & ((b == 0) | ~h((b - 1).clamp(min=0)))
    bad = (~ok).nonzero().squeeze(1)
    if bad.numel():
        low = torch.full_like(bad, -1)  # h(−1) = false, h(J) = true by convention
        high = torch.full_like(bad, J)
        for _ in range(J.bit_length() + 1):
            active = low + 1 < high
            mid = torch.where(active, (low + high) >> 1, 0)
            hit = h(mid, bad)
            high = torch.where(active & hit, mid, high)
            low = torch.where(active & ~hit, mid, low)
        b[bad] = high
    return torch.where(negative, b, J - b)


def _outer_materialized(delta: Tensor, a: Tensor, spec: BinSpec) -> tuple[Tensor, int]:
    """Products δ[n, i]·a[n, j] formed block by block in cache-sized buffers."""
    N, I = delta.shape
    J = a.shape[1]
    device = delta.device
    if N * I * J == 0:
        return torch.zeros(spec.bins, dtype=torch.long, device=device), 0
    dtype = torch.promote_types(delta.dtype, a.dtype)
    size = _chunk_size(device, N * I * J)
    rows_i = max(1, min(I, size // J))
    rows_n = max(1, size // (rows_i * J)) if rows_i == I else 1
    blocks_i = -(-I // rows_i)
    fast = _fast_path_ok(spec, dtype)
    spread = fast and _looks_spread(_sample_products(delta, a), spec)

    def buffers() -> tuple[Tensor, ...]:
        m = rows_n * rows_i * J
        return (torch.empty(m, dtype=dtype, device=device),
                torch.empty(m, dtype=_counting_dtype(spec.bins), device=device),
                torch.empty(m, dtype=dtype, device=device))

    def task(c: int, bufs: tuple[Tensor, ...]) -> tuple[Tensor, int]:
        n0, i0 = (c // blocks_i) * rows_n, (c % blocks_i) * rows_i
        d = delta[n0 : n0 + rows_n, i0 : i0 + rows_i, None]
        x = a[n0 : n0 + rows_n, None, :]
        m = d.shape[0] * d.shape[1] * J
        idx = None
        if fast:
            products = torch.mul(d, x, out=bufs[0][:m].view(d.shape[0], d.shape[1], J))
            work = bufs[2][:m].view_as(products)
            idx = _bin_chunk(products, spec, work, bufs[1][:m].view_as(products), spread)
        if idx is None:
            return _reference_dense(d * x, spec)
        return _count(idx, spec.bins), 0

    return _sum_over_chunks(-(-N // rows_n) * blocks_i, buffers, task)


def _outer_rows_materialized(
    delta_rows: Tensor, sample: Tensor, a: Tensor, spec: BinSpec
) -> Tensor:
    """Counts of the products of selected rows: δ_r · a[sample_r, :] (all finite)."""
    J = a.shape[1]
    R = delta_rows.numel()
    rows = max(1, _chunk_size(a.device, R * J) // J)

    def buffers() -> tuple[Tensor, ...]:
        return (torch.empty(rows, J, dtype=a.dtype, device=a.device),
                torch.empty(rows, J, dtype=_counting_dtype(spec.bins), device=a.device),
                torch.empty(rows, J, dtype=a.dtype, device=a.device))

    def task(c: int, bufs: tuple[Tensor, ...]) -> tuple[Tensor, int]:
        d = delta_rows[c * rows : (c + 1) * rows, None]
        picked = sample[c * rows : (c + 1) * rows]
        w = torch.index_select(a, 0, picked, out=bufs[0][: d.shape[0]])
        w.mul_(d)
        idx = _bin_chunk(w, spec, bufs[2][: d.shape[0]], bufs[1][: d.shape[0]], spread=True)
        if idx is None:  # cannot happen for screened samples; stay exact regardless
            return _reference_dense(d * a[picked], spec)
        return _count(idx, spec.bins), 0

    return _sum_over_chunks(-(-R // rows), buffers, task)[0]


def _outer_sorted(delta: Tensor, a: Tensor, spec: BinSpec) -> Tensor | None:
    """Counts of all products for samples whose products are all finite (see module doc).

    ge[k] = #{products with bin ≥ k}: a row (n, i) whose products lie in bins
    b_lo … b_hi contributes J for k ≤ b_lo and #{j : fl(δ s_j) ≥ t_k} for b_lo < k ≤ b_hi;
    counts[k] = ge[k] − ge[k + 1]. Rows spanning many bins are cheaper to materialize;
    returns None when the estimated cost exceeds materializing the whole layer.
    """
    N, I = delta.shape
    J = a.shape[1]
    device, dtype = delta.device, delta.dtype
    thresholds = _thresholds(spec, dtype, device)
    sorted_a = _sorted_rows(a)
    d = delta.reshape(-1)
    ends = delta.unsqueeze(2) * sorted_a[:, [0, -1]].unsqueeze(1)  # fl is monotone
    bin_ends = spec.bin_index(ends).view(-1, 2)
    b_lo, b_hi = bin_ends.aminmax(dim=1)
    span = b_hi - b_lo
    heavy = span > max(_MIN_HEAVY_SPAN, int(_SPAN_PER_J * J))
    counts = torch.zeros(spec.bins, dtype=torch.long, device=device)
    heavy_rows = heavy.nonzero().squeeze(1)
    searches = int(span.masked_fill(heavy, 0).sum())
    if _SEARCH_COST * searches + _ROW_COST * J * heavy_rows.numel() > span.numel() * J:
        return None
    if heavy_rows.numel():
        counts += _outer_rows_materialized(d[heavy_rows], heavy_rows // I, sorted_a, spec)
    light = ~heavy
    ge = torch.bincount(b_lo[light], minlength=spec.bins).flip(0).cumsum(0).flip(0) * J
    rows = (light & (span > 0)).nonzero().squeeze(1)
    if rows.numel():
        keys = _sample_keys(
            sorted_a.reshape(-1).float(), torch.arange(N, device=device).repeat_interleave(J)
        )
        row_span = span[rows]
        ends_q = torch.cumsum(row_span, 0)
        total = int(ends_q[-1])
        cuts = torch.arange(total // _MAX_QUERIES_PER_BLOCK, device=device) + 1
        cut_rows = torch.searchsorted(ends_q, cuts * _MAX_QUERIES_PER_BLOCK, right=True)
        bounds = [0, *cut_rows.tolist(), rows.numel()]
        for r0, r1 in itertools.pairwise(bounds):
            if r1 <= r0:
                continue
            r, s = rows[r0:r1], row_span[r0:r1]
            q_row = torch.repeat_interleave(r, s)
            first = torch.cumsum(s, 0) - s
            k = torch.arange(q_row.numel(), device=device)
            k += torch.repeat_interleave(b_lo[r] + 1 - first, s)
            reach = _count_reaching(sorted_a, keys, q_row // I, d[q_row], thresholds[k - 1])
            ge.index_add_(0, k, reach)
    counts[:-1] += ge[:-1] - ge[1:]
    counts[-1] += ge[-1]
    return counts


def histogram_outer(delta: Tensor, a: Tensor, spec: BinSpec) -> tuple[Tensor, int]:
    """Counts of all products δ[n, i]·a[n, j] (the individual gradients of a Linear weight).

    g_n = δ_n a_nᵀ (eq. 15 for a Linear layer) without forming the N×I×J tensor; the
    counts equal those of materializing ``delta[:, :, None] * a[:, None, :]`` and applying
    :meth:`BinSpec.bin_index`. Samples with a non-finite entry or a possibly overflowing
    product, small layers and unsupported dtypes are materialized block by block.
    """
    delta, a = delta.detach(), a.detach()
    N, I = delta.shape
    J = a.shape[1]
    if a.shape[0] != N:
        raise ValueError(f"delta {tuple(delta.shape)} and a {tuple(a.shape)} differ in N")
    if (
        N * I * J == 0
        or N * I * J < _MIN_OUTER_PRODUCTS
        or delta.dtype != a.dtype
        or not _fast_path_ok(spec, delta.dtype)
    ):
        return _outer_materialized(delta, a, spec)
    bound = delta.abs().amax(1).double() * a.abs().amax(1).double()
    clean = torch.isfinite(bound) & (bound <= torch.finfo(delta.dtype).max / 4)
    if not bool(clean.all()):
        counts, num_nonfinite = _outer_materialized(delta[~clean], a[~clean], spec)
        if bool(clean.any()):
            more, _ = histogram_outer(delta[clean], a[clean], spec)
            counts += more
        return counts, num_nonfinite
    counts = _outer_sorted(delta, a, spec)
    if counts is None:
        return _outer_materialized(delta, a, spec)
    return counts, 0


# --------------------------------------------------------------------------- dense 2d


def _reference_2d(
    g: Tensor, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec
) -> tuple[Tensor, int]:
    """The plain definition on one block: flat index, mask of non-finite pairs, bincount."""
    flat = spec_g.bin_index(g) * spec_theta.bins + spec_theta.bin_index(theta).unsqueeze(0)
    finite = torch.isfinite(g) & torch.isfinite(theta).unsqueeze(0)
    num_nonfinite = int(finite.numel() - finite.sum())
    if num_nonfinite:
        flat = flat[finite]
    counts = torch.bincount(flat.reshape(-1), minlength=spec_g.bins * spec_theta.bins)
    return counts, num_nonfinite


def histogram2d_dense(
    g: Tensor, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec
) -> tuple[Tensor, int]:
    """Counts of the pairs (g[n, j], θ[j]) as a [bins_g, bins_θ] matrix (eq. 16).

    One flat index k_g·bins_θ + k_θ per pair and a single ``bincount`` per chunk (no scatter
    with atomics into one hot bin). The marginals are the row and column sums of the result.
    """
    flat_theta = theta.detach().reshape(-1)
    g2 = g.detach().reshape(g.shape[0], flat_theta.numel())
    N, D = g2.shape
    num_bins = spec_g.bins * spec_theta.bins
    shape = (spec_g.bins, spec_theta.bins)
    if N * D == 0:
        return torch.zeros(shape, dtype=torch.long, device=g.device), 0
    theta_range = torch.stack(torch.aminmax(flat_theta)).tolist() if flat_theta.numel() else [0]
    if not _fast_path_ok(spec_g, g2.dtype) or not all(map(math.isfinite, theta_range)):
        c, bad = _reference_2d(g2, flat_theta, spec_g, spec_theta)
        return c.view(shape), bad
    index_dtype = _index_dtype(num_bins)
    spread = _looks_spread(g2.reshape(-1), spec_g)
    theta_idx = spec_theta.bin_index(flat_theta).to(index_dtype)
    size = _chunk_size(g.device, N * D)
    cols = min(D, size)
    rows = max(1, size // cols)
    blocks_c = -(-D // cols)

    def buffers() -> tuple[Tensor, ...]:
        return (torch.empty(rows * cols, dtype=g2.dtype, device=g.device),
                torch.empty(rows * cols, dtype=index_dtype, device=g.device))

    def task(c: int, bufs: tuple[Tensor, ...]) -> tuple[Tensor, int]:
        r0, c0 = (c // blocks_c) * rows, (c % blocks_c) * cols
        block = g2[r0 : r0 + rows, c0 : c0 + cols]
        m = block.numel()
        idx = _bin_chunk(block, spec_g, bufs[0][:m].view_as(block), bufs[1][:m].view_as(block),
                         spread)
        if idx is None:
            return _reference_2d(block, flat_theta[c0 : c0 + cols], spec_g, spec_theta)
        torch.add(theta_idx[c0 : c0 + cols], idx, alpha=spec_theta.bins, out=idx)
        return torch.bincount(idx.view(-1), minlength=num_bins), 0

    counts, num_nonfinite = _sum_over_chunks(-(-N // rows) * blocks_c, buffers, task)
    return counts.view(shape), num_nonfinite
