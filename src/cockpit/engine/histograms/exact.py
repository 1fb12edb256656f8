"""Exact histograms of individual-gradient elements (paper eq. 15 and 16).

Bins: ``BinSpec(lo, hi, bins)`` has edges e_k = lo + k·(hi − lo)/bins in exact (rational)
arithmetic. A finite value x falls into bin

    k(x) = #{k ∈ 1 … bins − 1 : x ≥ e_k} = clamp(⌊(x − lo) · bins / (hi − lo)⌋, 0, bins − 1),

so bin k holds [e_k, e_{k+1}), values below ``lo`` are counted in the first and values at or
above ``hi`` in the last bin ("outliers clamped into the edge bins", as in the paper), and a
negative value, however small, lies below an edge at 0. Non-finite values (NaN, ±inf) are
counted in no bin; every function returns ``(counts, num_nonfinite)``. The counts are exact
at every edge, in float32 and float64, on every path below; two ways of evaluating k:

* Rounded form, where s = bins/(hi − lo) and m = −lo·s are an exact float and an integer
  (the defaults (−2, 2, 100), (−1, 1, 40), (−2, 2, 50); also (0, 1, 10), …): the edges are
  e_k = (k − m)/s and k(x) = clamp(⌊x·s⌋ + m, 0, bins − 1). The product and the sum are
  rounded toward −∞ (:mod:`.rounding`): fl↓(y) ≥ j ⟺ y ≥ j for every integer
  j, so ⌊fl↓(fl↓(x·s) + m)⌋ = ⌊x·s⌋ + m exactly, at the cost of the two operations. (Rounded
  to nearest, a value just below an edge could round up onto it and be counted one bin
  high.) On CPU, where the platform supports it (checked once).
* Searched form otherwise (other specs, other devices, platforms without directed
  rounding): the number of inner edges rounded up to the value's dtype that are ≤ x
  (x ≥ e_k ⟺ x ≥ ⌈e_k⌉ for every float x of that dtype; ``torch.bucketize``, ~10× slower).

The fast kernels:

* :func:`histogram_dense` bins chunk by chunk in cache-sized buffers; on CPU in NumPy in
  Cockpit's worker threads (multiply and add rounded down, min/max, clamp where needed,
  truncating cast: on values ≥ 0 truncation is the floor); only chunks with non-finite
  values take the masked path.
* :func:`histogram_outer` never forms the N·I·J products p = fl(δ_{n,i}·a_{n,j}). Because
  k(·) is monotone, k(p) = #{k ≥ 1 : p ≥ t_k} with t_k = e_k rounded up to the dtype.
  For a fixed row (n, i) the map j ↦ fl(δ·s_j) over the sorted a_n = s is
  monotone, so #{j : fl(δ·s_j) ≥ t_k} is a boundary index in s: it is located with one
  ``searchsorted`` at t_k/δ and then *verified* with the exact product on both sides of
  the boundary; the rare unverified queries are bisected with the exact product. A row
  whose products all fall into one bin costs O(1). Rows spanning many bins (|δ| large
  against the bin width), samples with non-finite entries or a possible overflow, and
  small layers are materialized block by block instead (a measured cost model decides).
* :func:`histogram2d_dense` is the dense kernel with a fused flat index
  k_g·bins_θ + k_θ and one ``bincount`` per chunk.

On CPU the chunks are shared by up to ``torch.get_num_threads()`` worker threads (so the
serial ``bincount`` runs on every core); on other devices each call is one chunk. Other
dtypes (float16, bfloat16) are binned as float64, which holds them exactly.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

from cockpit.engine.dtypes import in_dtype, promote
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.histograms import rounding

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

    @property
    def zero_bin(self) -> int | None:
        """m with e_m = 0 exactly (lo·bins/(hi − lo) = −m), if zero is an inner edge (used
        where ``scale`` is finite in the values' dtype)."""
        return _zero_bin(self.lo, self.hi, self.bins)

    def bin_index(self, x: Tensor) -> Tensor:
        """k(x) for finite x (int64), exact (see the module docstring)."""
        if x.dtype not in (torch.float32, torch.float64):
            x = x.double()  # exact for float16/bfloat16/integers
        return self.bin_values(x.detach().clone()).long()

    def bin_values(self, y: Tensor) -> Tensor:
        """k(y) as integral floats, in place in y's dtype (float32/float64, no NaN; ±inf go
        to the edge bins): ⌊fl↓(fl↓(y·s) + m)⌋ clamped to [0, bins − 1] where that form is
        exact, else the number of inner edges rounded up to the dtype that are ≤ y."""
        form = _exact_form(self, y.dtype)
        if form is not None and y.device.type == "cpu" and rounding.available():
            values = y.detach().numpy()
            rounding.in_own_thread(_position, values, form, values)
            np.clip(values, 0, self.bins - 1, out=values)
            np.floor(values, out=values)
            return y
        edges = _thresholds(self, y.dtype, y.device)
        return y.copy_(torch.bucketize(y, edges, right=True))


# --------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=256)
def _zero_bin(lo: float, hi: float, bins: int) -> int | None:
    """m with lo + m·(hi − lo)/bins = 0 in exact (rational) arithmetic, 0 < m < bins."""
    m = -Fraction(lo) * bins / (Fraction(hi) - Fraction(lo))
    return int(m) if m.denominator == 1 and 0 < m < bins else None


@functools.lru_cache(maxsize=256)
def _exact_form(spec: BinSpec, dtype: torch.dtype) -> tuple[float, int] | None:
    """(s, m) with k(x) = clamp(⌊x·s⌋ + m, 0, bins − 1) in exact arithmetic and s, m
    exactly representable in ``dtype`` (float32/float64): s = bins/(hi − lo) and
    m = −lo·s an integer, i.e. e_k = (k − m)/s. The defaults qualify ((−2, 2, 100): s = 25,
    m = 50; (−1, 1, 40); (−2, 2, 50)), so does (0, 1, 10); (−3, 3, 100) does not."""
    if dtype not in (torch.float32, torch.float64):
        return None
    scale = spec.bins / (Fraction(spec.hi) - Fraction(spec.lo))
    m = -Fraction(spec.lo) * scale
    largest = Fraction(torch.finfo(dtype).max)
    if m.denominator != 1 or scale > largest or abs(m) > largest:
        return None
    s, m_float = torch.tensor([float(scale), float(m)], dtype=dtype).tolist()
    if Fraction(s) != scale or Fraction(m_float) != m:
        return None
    return s, int(m)


def symmetric_fast_spec(reach: float, bins: int = 100) -> BinSpec:
    """The narrowest BinSpec(−r, r, bins) with r ≥ reach whose bins take the rounded form
    (s = bins/(2r) = c·2^j with c = k/32, k = 32 … 63, and r an exact float; m = bins/2
    needs an even ``bins``). E.g. reach 0.1 → r = 0.125, reach 0.04 → r = 0.048828125."""
    if not (reach > 0 and math.isfinite(reach)) or bins < 2 or bins % 2:
        raise ValueError(f"needs a finite reach > 0 and an even bins ≥ 2, got {reach}, {bins}")
    limit = Fraction(bins, 2) / Fraction(reach)  # s ≤ bins/(2·reach) keeps r ≥ reach
    j = math.floor(math.log2(limit))
    best = None
    for exponent in (j - 1, j, j + 1):
        for k in range(32, 64):
            scale = Fraction(k, 32) * Fraction(2) ** exponent
            r = Fraction(bins, 2) / scale
            if scale <= limit and Fraction(float(r)) == r and (best is None or scale > best):
                best = scale
    r = float(Fraction(bins, 2) / best)
    return BinSpec(-r, r, bins)


def warn_if_slow(spec: BinSpec, name: str) -> None:
    """Warn (at setup) when ``spec`` is binned by search, ~10× slower per element."""
    if _exact_form(spec, torch.float32) is not None:
        return
    hint = ""
    if spec.lo == -spec.hi and spec.bins % 2 == 0:
        fast = symmetric_fast_spec(spec.hi, spec.bins)
        hint = f"; BinSpec({fast.lo!r}, {fast.hi!r}, {fast.bins}) covers the range at full speed"
    warnings.warn(
        f"{name}={spec}: bins/(hi − lo) is not an exact float or lo not a whole number of bins "
        "from 0, so every element is compared with the bin edges (exact counts, about 10× "
        f"slower binning){hint}", stacklevel=3)


@functools.lru_cache(maxsize=256)
def _fast_path_ok(spec: BinSpec, dtype: torch.dtype) -> bool:
    """The fast kernels need lo, hi, scale (> 0) and bins − 1 exactly usable in ``dtype``."""
    if dtype not in (torch.float32, torch.float64):
        return False
    values = torch.tensor([spec.lo, spec.hi, spec.scale, spec.bins - 1], dtype=dtype).tolist()
    *_, scale, top = values
    return all(map(math.isfinite, values)) and scale > 0 and top == spec.bins - 1


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


_MAX_WORKERS = rounding.MAX_WORKERS
_pool = rounding.pool


def _sum_over_chunks(
    num_chunks: int,
    make_buffers: Callable[[], tuple[Tensor, ...]],
    task: Callable[[int, tuple[Tensor, ...]], tuple[Tensor, int]],
) -> tuple[Tensor, int]:
    """Σ_c task(c, buffers) over chunks c, on up to ``torch.get_num_threads()`` workers.

    Each worker takes every w-th chunk and owns its buffers; results are summed. On CPU the
    workers are Cockpit's own threads and the caller waits (products rounded toward −∞ are
    only formed there, see :mod:`.rounding`); a single chunk (on other devices
    always) runs in the caller.
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
    if num_chunks == 1 or rounding.work_here():
        return run(0, 1)
    futures = [_pool().submit(run, w, workers) for w in range(workers)]
    counts, bad = futures[0].result()
    for f in futures[1:]:
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


def _position(x: np.ndarray, form: tuple[float, int], out: np.ndarray) -> np.ndarray:
    """out ← fl↓(fl↓(x·s) + m), whose floor is ⌊x·s⌋ + m exactly (``out`` may be ``x``)."""
    scale, m = form
    return rounding.multiply_down(x, scale, out, m)


def _bin_rounded(x: np.ndarray, form: tuple[float, int], bins: int, work: np.ndarray,
                 index: np.ndarray) -> bool:
    """k(x) into ``index`` by :func:`_position`, in NumPy in a worker thread (the chunks
    are the parallelism: NumPy's loops stay in this thread, torch's would start more
    threads; measured 2.0 against 2.25 ns/element with the count). False if a scaled value
    is not finite (NaN/±inf input or overflow)."""
    _position(x, form, work)
    low, high = float(work.min()), float(work.max())
    if not (math.isfinite(low) and math.isfinite(high)):
        return False
    if low < 0 or high >= bins:
        np.clip(work, 0, bins - 1, out=work)
    # work ≥ 0 now, so the truncating cast is ⌊·⌋; work < bins, so ⌊work⌋ ≤ bins − 1
    np.copyto(index, work, casting="unsafe")
    return True


def _bin_chunk(chunk: Tensor, spec: BinSpec, work: Tensor, index: Tensor) -> Tensor | None:
    """k(x) of every element of ``chunk`` written to ``index`` (a small int type).

    ``work`` (same shape as ``chunk``, may be ``chunk`` itself) receives intermediate
    values. Returns None, with ``index`` untouched, when the chunk holds a non-finite value
    (or one whose scaled position overflows): the caller takes the masked path.
    """
    form = _exact_form(spec, chunk.dtype)
    if form is not None and chunk.device.type == "cpu" and rounding.available():
        binned = rounding.in_own_thread(_bin_rounded, chunk.numpy(), form, spec.bins,
                                        work.numpy(), index.numpy())
        return index if binned else None
    low, high = torch.stack(torch.aminmax(chunk)).tolist()
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    edges = _thresholds(spec, chunk.dtype, chunk.device)
    return index.copy_(torch.bucketize(chunk, edges, right=True, out_int32=True))


# --------------------------------------------------------------------------- dense 1d


def histogram_dense(x: Tensor, spec: BinSpec) -> tuple[Tensor, int]:
    """Counts of all elements of ``x`` (any shape), eq. (15) on stored gradients."""
    if histogram_device.device_path(x.device):
        return histogram_device.dense(*device_edges(x, spec), spec.bins, (spec.lo, spec.hi))
    flat = x.detach().reshape(-1)
    n = flat.numel()
    if n == 0 or not _fast_path_ok(spec, flat.dtype):
        return _reference_dense(flat, spec)
    size = _chunk_size(flat.device, n)

    def buffers() -> tuple[Tensor, ...]:
        return (torch.empty(size, dtype=flat.dtype, device=flat.device),
                torch.empty(size, dtype=_counting_dtype(spec.bins), device=flat.device))

    def task(c: int, bufs: tuple[Tensor, ...]) -> tuple[Tensor, int]:
        chunk = flat[c * size : (c + 1) * size]
        m = chunk.numel()
        idx = _bin_chunk(chunk, spec, bufs[0][:m], bufs[1][:m])
        if idx is None:
            return _reference_dense(chunk, spec)
        return _count(idx, spec.bins), 0

    return _sum_over_chunks(-(-n // size), buffers, task)


def histogram_dense_counts(chunks: Sequence[Tensor], spec: BinSpec) -> Tensor:
    """The counts of all elements of ``chunks`` (the sum of :func:`histogram_dense`'s counts;
    on accelerators the lane counts of every chunk summed in one op, and no count of the
    non-finite elements)."""
    return summed(histogram_dense_lanes(chunks, spec))


def histogram_dense_lanes(chunks: Sequence[Tensor], spec: BinSpec,
                          budget: int | None = histogram_device.DEFAULT_BUDGET
                          ) -> Tensor | histogram_device.LaneCounts:
    """:func:`histogram_dense_counts`, on accelerators with the lanes not yet summed (see
    :func:`cockpit.engine.histograms.device.sum_lanes`) and the scratch of a block within
    ``budget`` bytes (None: no limit)."""
    if chunks and histogram_device.device_path(chunks[0].device):
        tallies = []
        for chunk in chunks:
            values, edges = device_edges(chunk, spec)
            tallies += histogram_device.dense_tallies([values], edges, budget,
                                                      uniform=(spec.lo, spec.hi))
        return histogram_device.lane_counts_1d(tallies, spec.bins)
    return _sum([histogram_dense(c, spec)[0] for c in chunks])


def summed(counts: Tensor | histogram_device.LaneCounts) -> Tensor:
    """Counts with their lanes summed."""
    return counts.counts() if isinstance(counts, histogram_device.LaneCounts) else counts


# --------------------------------------------------------------------------- outer products


def _float_to_ordered(x: Tensor) -> Tensor:
    """Order-preserving map of float32/float64 bit patterns to signed integers (int64)."""
    if x.dtype == torch.float32:
        bits = x.view(torch.int32).long()
        return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    bits = x.view(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)


@functools.lru_cache(maxsize=64)
def _thresholds_cpu(spec: BinSpec, dtype: torch.dtype) -> Tensor:
    """t_k = the inner edge e_k rounded up to ``dtype`` (the smallest float ≥ e_k; +inf
    beyond the largest float), k = 1 … bins − 1, so that x ≥ e_k ⟺ x ≥ t_k for every x of
    the dtype and k(x) = #{k : t_k ≤ x}."""
    t = np.dtype(np.float32 if dtype == torch.float32 else np.float64).type
    largest = Fraction(float(torch.finfo(dtype).max))
    width = (Fraction(spec.hi) - Fraction(spec.lo)) / spec.bins
    up = []
    for k in range(1, spec.bins):
        e = Fraction(spec.lo) + k * width
        if e > largest or e <= -largest:
            up.append(math.inf if e > 0 else -float(largest))
            continue
        v = t(float(e))  # within a rounding or two of e
        while Fraction(float(v)) < e:
            v = np.nextafter(v, t(math.inf))
        while Fraction(float(below := np.nextafter(v, t(-math.inf)))) >= e:
            v = below
        up.append(float(v))
    return torch.tensor(up, dtype=dtype)


def _thresholds(spec: BinSpec, dtype: torch.dtype, device: torch.device) -> Tensor:
    return _thresholds_cpu(spec, dtype).to(device)


@functools.lru_cache(maxsize=64)
def _search_edges_on(spec: BinSpec, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The accelerator path's search edges (:func:`.device.search_edges`) of the thresholds,
    kept on ``device`` (copied there once, not at every step)."""
    return histogram_device.search_edges(_thresholds_cpu(spec, dtype)).to(device)


def _device_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The values' common dtype where it is float32/float64; float16/bfloat16 are binned as
    float32, which holds them (no ``torch.promote_types`` where the dtypes agree: it is an
    op of its own)."""
    dtype = dtypes[0] if len(set(dtypes)) == 1 else functools.reduce(promote, dtypes)
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def device_edges(x: Tensor, spec: BinSpec) -> tuple[Tensor, Tensor]:
    """x in a dtype the accelerator path bins, and its search edges there."""
    dtype = _device_dtype(x.dtype)
    return in_dtype(x, dtype), _search_edges_on(spec, dtype, x.device)


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
    dtype = promote(delta.dtype, a.dtype)
    size = _chunk_size(device, N * I * J)
    rows_i = max(1, min(I, size // J))
    rows_n = max(1, size // (rows_i * J)) if rows_i == I else 1
    blocks_i = -(-I // rows_i)
    fast = _fast_path_ok(spec, dtype)

    def buffers() -> tuple[Tensor, ...]:
        m = rows_n * rows_i * J
        return (torch.empty(m, dtype=dtype, device=device),
                torch.empty(m, dtype=_counting_dtype(spec.bins), device=device))

    def task(c: int, bufs: tuple[Tensor, ...]) -> tuple[Tensor, int]:
        n0, i0 = (c // blocks_i) * rows_n, (c % blocks_i) * rows_i
        d = delta[n0 : n0 + rows_n, i0 : i0 + rows_i, None]
        x = a[n0 : n0 + rows_n, None, :]
        m = d.shape[0] * d.shape[1] * J
        idx = None
        if fast:
            products = torch.mul(d, x, out=bufs[0][:m].view(d.shape[0], d.shape[1], J))
            idx = _bin_chunk(products, spec, products, bufs[1][:m].view_as(products))
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
                torch.empty(rows, J, dtype=_counting_dtype(spec.bins), device=a.device))

    def task(c: int, bufs: tuple[Tensor, ...]) -> tuple[Tensor, int]:
        d = delta_rows[c * rows : (c + 1) * rows, None]
        picked = sample[c * rows : (c + 1) * rows]
        w = torch.index_select(a, 0, picked, out=bufs[0][: d.shape[0]])
        w.mul_(d)
        idx = _bin_chunk(w, spec, w, bufs[1][: d.shape[0]])
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


def _outer_on_device(delta: Tensor, a: Tensor, spec: BinSpec) -> tuple[Tensor, Tensor, Tensor]:
    """δ and a in the accelerator path's dtype, and the search edges there."""
    if delta.dim() != 2 or a.dim() != 2 or a.shape[0] != delta.shape[0]:
        raise ValueError(f"delta {tuple(delta.shape)} and a {tuple(a.shape)} differ in N")
    dtype = _device_dtype(delta.dtype, a.dtype)
    return (in_dtype(delta, dtype), in_dtype(a, dtype),
            _search_edges_on(spec, dtype, delta.device))


def histogram_outer_counts(delta: Tensor, a: Tensor, spec: BinSpec) -> Tensor:
    """The counts of :func:`histogram_outer` alone (on accelerators without the count of
    the non-finite products)."""
    return summed(histogram_outer_lanes(delta, a, spec))


def histogram_outer_lanes(delta: Tensor, a: Tensor, spec: BinSpec,
                          budget: int | None = histogram_device.DEFAULT_BUDGET
                          ) -> Tensor | histogram_device.LaneCounts:
    """:func:`histogram_outer_counts`, on accelerators with the lanes not yet summed (see
    :func:`cockpit.engine.histograms.device.sum_lanes`) and the products formed in blocks
    whose scratch fits ``budget`` bytes (None: no limit)."""
    if histogram_device.device_path(delta.device):
        tallies = histogram_device.outer_tallies(*_outer_on_device(delta, a, spec), budget,
                                                 uniform=(spec.lo, spec.hi))
        return histogram_device.lane_counts_1d(tallies, spec.bins)
    return histogram_outer(delta, a, spec)[0]


def histogram_outer(delta: Tensor, a: Tensor, spec: BinSpec) -> tuple[Tensor, int]:
    """Counts of all products δ[n, i]·a[n, j] (the individual gradients of a Linear weight).

    g_n = δ_n a_nᵀ (eq. 15 for a Linear layer) without forming the N×I×J tensor; the
    counts equal those of materializing ``delta[:, :, None] * a[:, None, :]`` and applying
    :meth:`BinSpec.bin_index`. Samples with a non-finite entry or a possibly overflowing
    product, small layers and unsupported dtypes are materialized block by block.
    """
    if histogram_device.device_path(delta.device):
        return histogram_device.outer(*_outer_on_device(delta, a, spec), spec.bins,
                                      (spec.lo, spec.hi))
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


def pairs_on_device(theta: Tensor, dtype: torch.dtype, spec_g: BinSpec, spec_theta: BinSpec,
                    budget: int | None = histogram_device.DEFAULT_BUDGET
                    ) -> histogram_device.Pairs:
    """The accelerator path's counter of pairs (g, θ) in ``dtype`` (float32/float64), in
    blocks whose scratch fits ``budget`` bytes (None: no limit)."""
    device = theta.device
    return histogram_device.Pairs(theta.to(dtype), _search_edges_on(spec_g, dtype, device),
                                  _search_edges_on(spec_theta, dtype, device), budget)


def _dense_pairs(chunks: Sequence[Tensor], theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec,
                 budget: int | None = histogram_device.DEFAULT_BUDGET
                 ) -> histogram_device.Pairs:
    dtype = _device_dtype(theta.dtype, *(c.dtype for c in chunks))
    pairs = pairs_on_device(theta if theta.dim() == 1 else theta.reshape(-1), dtype, spec_g,
                            spec_theta, budget)
    for chunk in chunks:
        pairs.add_rows(chunk.to(dtype))
    return pairs


def histogram2d_dense_counts(chunks: Sequence[Tensor], theta: Tensor, spec_g: BinSpec,
                             spec_theta: BinSpec) -> Tensor:
    """The counts of the pairs of every chunk [n, D] (the sum of :func:`histogram2d_dense`'s
    counts; on accelerators θ binned once and the lane counts summed in one op)."""
    return summed(histogram2d_dense_lanes(chunks, theta, spec_g, spec_theta))


def histogram2d_dense_lanes(chunks: Sequence[Tensor], theta: Tensor, spec_g: BinSpec,
                            spec_theta: BinSpec,
                            budget: int | None = histogram_device.DEFAULT_BUDGET
                            ) -> Tensor | histogram_device.LaneCounts:
    """:func:`histogram2d_dense_counts`, on accelerators with the lanes not yet summed (see
    :func:`cockpit.engine.histograms.device.sum_lanes`) and the scratch of a block within
    ``budget`` bytes (None: no limit)."""
    if chunks and histogram_device.device_path(chunks[0].device):
        return _dense_pairs(chunks, theta, spec_g, spec_theta, budget).lane_counts()
    return _sum([histogram2d_dense(c, theta, spec_g, spec_theta)[0] for c in chunks])


def _sum(counts: list[Tensor]) -> Tensor:
    """The sum of the counts of the chunks (one chunk: its counts as they are, no op)."""
    if not counts:
        raise ValueError("no chunks to count")
    return sum(counts[1:], counts[0])


def histogram2d_dense(
    g: Tensor, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec
) -> tuple[Tensor, int]:
    """Counts of the pairs (g[n, j], θ[j]) as a [bins_g, bins_θ] matrix (eq. 16).

    One flat index k_g·bins_θ + k_θ per pair and a single ``bincount`` per chunk (no scatter
    with atomics into one hot bin). The marginals are the row and column sums of the result.
    """
    if histogram_device.device_path(g.device):
        return _dense_pairs([g], theta, spec_g, spec_theta).result()
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
        idx = _bin_chunk(block, spec_g, bufs[0][:m].view_as(block), bufs[1][:m].view_as(block))
        if idx is None:
            return _reference_2d(block, flat_theta[c0 : c0 + cols], spec_g, spec_theta)
        torch.add(theta_idx[c0 : c0 + cols], idx, alpha=spec_theta.bins, out=idx)
        return torch.bincount(idx.view(-1), minlength=num_bins), 0

    counts, num_nonfinite = _sum_over_chunks(-(-N // rows) * blocks_c, buffers, task)
    return counts.view(shape), num_nonfinite
