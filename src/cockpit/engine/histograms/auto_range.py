"""GradHist1d's default range, set from the data (paper eq. 15 with bins that fit the run).

Without ``hist_bins=``, GradHist1d's range is decided once, from the first tracked step's
elements: that step counts every element's magnitude in a universal log-linear grid (the
float32 exponent and the top MAGNITUDE_BITS bits of the mantissa — identical on every
rank and for every micro-batch, so its counts add like any histogram's), the range is
chosen from the sum over layers, micro-batches and ranks, and the step's own counts are
then regrouped exactly into the chosen linear bins (see :func:`regroup`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cockpit.engine.histograms.exact import BinSpec

MAGNITUDE_BITS = 5  # 32 sub-buckets per octave: every edge k·w, |k| ≤ 64, w = 2^q, aligns
_OCTAVES = 254  # float32's normal exponents; smaller magnitudes share the first bucket
_PER_SIGN = (_OCTAVES << MAGNITUDE_BITS)
# Keys per step: the magnitudes of the non-negative elements, then of the negative ones.
MAGNITUDE_KEYS = 2 * _PER_SIGN
# Share of the first tracked step's elements the automatic range may leave outside.
AUTO_RANGE_OUTSIDE = 1e-4
_AUTO_BINS = 100
_MIN_WIDTH_EXP, _MAX_WIDTH_EXP = -120, 100


@dataclass(frozen=True)
class AutoRange:
    """The default of ``Cockpit(hist_bins=...)``: ``BinSpec(−50w, 50w, 100)`` with a power of
    two w chosen at the first tracked step such that the inner bins [−49w, 49w) hold all but
    at most ``outside`` (a share) of that step's finite elements. The two edge bins hold
    exactly the elements beyond ±49w. The range is then kept, except that it narrows by 4
    when a step's elements have shrunk into a quarter of it (:func:`narrower_range`): the
    bins nest, so steps stay comparable by merging bins. While undecided, ``bins`` is the
    size of the magnitude counts (:func:`magnitude_counts`)."""

    outside: float = AUTO_RANGE_OUTSIDE
    bins: int = MAGNITUDE_KEYS


@dataclass(frozen=True)
class DecidedRange(BinSpec):
    """The BinSpec an :class:`AutoRange` settled on: its two edge bins hold exactly the
    elements beyond ±``inner`` = ±(hi − one bin width)."""

    @property
    def inner(self) -> float:
        return self.hi - (self.hi - self.lo) / self.bins


def magnitude_counts(chunks: Iterable[Tensor]) -> Tensor:
    """Counts of the finite elements of ``chunks`` over the MAGNITUDE_KEYS log-linear keys.

    Key of x ≥ 0 (also −0): ⌊bits(x)/2^(23−MAGNITUDE_BITS)⌋ − 32 clamped to [0, _PER_SIGN),
    i.e. bucket [L, U) of width 2^(e−MAGNITUDE_BITS) in the octave [2^e, 2^(e+1)), computed
    on float32 bits (float64 values on the same grid from their own bits, exactly). For
    x < 0 the key of the next float below |x| (offset by _PER_SIGN): |x| ∈ (L, U], so that
    x ∈ [−U, −L) is closed where the linear bins are."""
    counts = None
    for chunk in chunks:
        keys = _keys(chunk.detach().reshape(-1))
        if counts is None:
            counts = torch.zeros(MAGNITUDE_KEYS + 1, dtype=torch.int64, device=keys.device)
            one = torch.ones(1, dtype=torch.int64, device=keys.device)
        # (not bincount, which reads the largest key from the device for its output size)
        counts.index_add_(0, keys, one.expand(keys.numel()))
    if counts is None:
        return torch.zeros(MAGNITUDE_KEYS, dtype=torch.int64)
    return counts[:MAGNITUDE_KEYS]


def _keys(x: Tensor) -> Tensor:
    """The magnitude key of every element of the flat ``x`` (:func:`magnitude_counts`), and
    MAGNITUDE_KEYS for the non-finite ones (a slot that is dropped: no boolean indexing,
    whose output size would be a read of the device). Float32 values' keys in int32
    (about 14 bytes of temporaries per element instead of 64-bit keys' 50)."""
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # float16/bfloat16 exactly
    if x.dtype == torch.float32:
        bits, mantissa, exponent = x.contiguous().view(torch.int32), 23, 8
    else:
        bits, mantissa, exponent = x.contiguous().view(torch.int64), 52, 11
    magnitude = bits & ((1 << (mantissa + exponent)) - 1)
    nonfinite = magnitude >= ((1 << exponent) - 1) << mantissa  # exponent bits all ones
    below = (bits < 0) & (magnitude > 0)  # x < 0: the key of the next float below |x|
    magnitude -= below.to(magnitude.dtype)
    key = magnitude.bitwise_right_shift_(mantissa - MAGNITUDE_BITS)
    if mantissa == 52:  # rebase the float64 exponent onto float32's
        key -= (1023 - 127) << MAGNITUDE_BITS
    key = key.sub_(1 << MAGNITUDE_BITS).clamp_(0, _PER_SIGN - 1)
    key += below.to(key.dtype) * _PER_SIGN
    return key.masked_fill_(nonfinite, MAGNITUDE_KEYS)


@functools.lru_cache(maxsize=1)
def _bucket_bounds() -> tuple[np.ndarray, np.ndarray]:
    """(L, U) of the non-negative keys' buckets [L, U) (the first starts at 0)."""
    raw = np.arange(_PER_SIGN) + (1 << MAGNITUDE_BITS)
    exponent = (raw >> MAGNITUDE_BITS) - 127
    fraction = raw & ((1 << MAGNITUDE_BITS) - 1)
    lower = np.ldexp(1.0 + fraction / (1 << MAGNITUDE_BITS), exponent)
    upper = lower + np.ldexp(1.0, exponent - MAGNITUDE_BITS)
    lower[0] = 0.0
    return lower, upper


def choose_auto_spec(total: np.ndarray, outside: float = AUTO_RANGE_OUTSIDE) -> DecidedRange:
    """The BinSpec(−50w, 50w, 100), w = 2^q, whose inner range [−49w, 49w) holds all but at
    most ``outside`` of the elements counted in ``total`` (magnitude counts, summed over
    layers). No nonzero element: the paper's [−2, 2]."""
    total = np.asarray(total, dtype=np.float64)
    per_key = total[:_PER_SIGN] + total[_PER_SIGN:]
    _, upper = _bucket_bounds()
    n = per_key.sum()
    nonzero = np.flatnonzero(per_key[1:]) + 1
    if nonzero.size == 0:  # all |x| < 2^−126: any range counts them exactly
        return DecidedRange(-2.0, 2.0, 100)
    beyond = np.cumsum(per_key[::-1])[::-1] - per_key  # elements in buckets above key k
    key = int(np.flatnonzero(beyond <= outside * n)[0])
    reach = float(upper[key])  # every element of buckets ≤ key has |x| ≤ reach
    q = math.ceil(math.log2(reach / (_AUTO_BINS // 2 - 1)))
    q = min(max(q, _MIN_WIDTH_EXP), _MAX_WIDTH_EXP)
    r = math.ldexp(_AUTO_BINS // 2, q)
    return DecidedRange(-r, r, _AUTO_BINS)


def narrower_range(counts: np.ndarray, spec: DecidedRange, outside: float = AUTO_RANGE_OUTSIDE,
                   factor: int = 4) -> DecidedRange | None:
    """``spec`` shrunk by ``factor`` when a step's counts (the whole network's, in
    ``spec``'s bins) hold all but at most ``outside`` of their elements in the bins the
    narrower inner range covers, else None. Widths stay powers of two times the first, so
    the bins of the ranges nest: a coarser step's bins are unions of a finer one's."""
    counts = np.asarray(counts, dtype=np.float64)
    m = spec.bins // 2
    k = (m - 1) // factor  # bins either side of 0 inside the narrower inner range
    n = counts.sum()
    if n == 0 or k < 1 or n - counts[m - k:m + k].sum() > outside * n:
        return None
    if spec.hi / factor < math.ldexp(_AUTO_BINS // 2, _MIN_WIDTH_EXP):
        return None
    return DecidedRange(spec.lo / factor, spec.hi / factor, spec.bins)


def regroup(counts: Tensor, spec: BinSpec) -> Tensor:
    """Magnitude counts (:func:`magnitude_counts`) as the counts of ``spec``'s linear bins
    (int64), exact for spec = BinSpec(−50w, 50w, 100), w = 2^q, q ≥ −120: a bucket of
    width ≤ w lies in one linear bin (both are aligned multiples of powers of two) and a
    wider one starts at ≥ 64w, beyond the inner range."""
    lower, upper = _bucket_bounds()
    scale, m = spec.scale, spec.bins // 2
    up = np.clip(np.floor(lower * scale) + m, 0, spec.bins - 1).astype(np.int64)
    down = np.clip(np.floor(-upper * scale) + m, 0, spec.bins - 1).astype(np.int64)
    index = torch.from_numpy(np.concatenate([up, down])).to(counts.device)
    out = torch.zeros(spec.bins, dtype=torch.int64, device=counts.device)
    return out.index_add_(0, index, counts.reshape(-1).long())
