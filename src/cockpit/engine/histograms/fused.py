"""One-pass lane counts on CUDA: the search index and the count of a block of values in one
Triton kernel, where the accelerator path otherwise runs three (``bucketize``, ``add``,
``histc``; :func:`cockpit.engine.histograms.device.tally`) and writes two index tensors of
the block's size.

Each program of the kernel reads a contiguous range of the values, finds every value's search
index k(x) = #{s ∈ S : s < x} in the sorted edges S (the lower bound that ``torch.bucketize``
returns: exact at every edge, 0 for −∞, bins + 1 for +∞; NaN, for which no comparison holds,
is set to bins + 1 as ``bucketize`` returns it) — for equal bins from the estimate
1 + ⌊(x − lo)/w⌋, which is within one of k(x), and one comparison with the edges each way,
else by a binary search —, counts them into a private
histogram (``tl.histogram``, no contended global counter), and adds it once to copy
ℓ = program mod L of the slots in the float32 lane layout [L · slots] of
:func:`~cockpit.engine.histograms.device.tally` (the lanes are then summed as before).

Exactness: a float32 counter is exact up to 2^24. A program reads I·B values (B at once, I a
power of two, a compile-time constant so that few variants are built), the fewest I for which
at most G = L·k programs cover the block; a lane then receives at most k·I·B < 2n/L + 2k·B
counts, so blocks of at most L·(2^23 − k·B) values (:func:`block_limit`) keep every counter
exact.

Used on CUDA where Triton imports (it ships with PyTorch's CUDA builds); elsewhere, and with
``COCKPIT_FUSED_HISTOGRAM=0``, the three-kernel path runs. The kernel also runs in Triton's
interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how the tests check it
without a GPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cockpit.engine.triton_device import KernelSwitch, triton_kernel

BLOCK = 1024  # values a program reads at once
NUM_WARPS = 4
# Fewer values are counted by the three kernels: the kernel's launch costs the host about
# 30 µs more than three aten ops, and saves the GPU about 12 ps a value (an H200 counts 2^25
# values in 0.27–0.29 ms instead of 0.66–0.69 ms); below 2^22 values a tracked step, bound
# by the host, gains nothing.
MIN_VALUES = 2**22
# k: G = L·k programs at most (an H200 counts 2^25 values 10–30 % faster with k = 64 than
# with 16, and the products of a Linear layer's individual gradients 30 % faster)
PROGRAMS_PER_LANE = 64
MAX_UNIFORM_BINS = 2**16  # (x − lo)/w in float32 is then within 0.02 of the exact quotient
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@triton_kernel
def _kernel(triton, tl):
    """The Triton kernel, or None where Triton does not import."""

    @triton.jit
    def count(x_ptr, edges_ptr, out_ptr, n, low_edge, inverse_width,
              EDGES: tl.constexpr, STEPS: tl.constexpr, SLOTS: tl.constexpr,
              PADDED: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr,
              ITERS: tl.constexpr, WIDEN: tl.constexpr, UNIFORM: tl.constexpr):
        pid = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)  # (rows counted apart: n values each)
        x_ptr += row * n
        out_ptr += row * (LANES * SLOTS)
        hist = tl.zeros([PADDED], dtype=tl.int32)
        for step in range(ITERS):
            offsets = (pid * ITERS + step) * BLOCK + tl.arange(0, BLOCK)
            inside = offsets < n
            x = tl.load(x_ptr + offsets, mask=inside, other=0.0)
            if WIDEN:  # 16-bit floats compared as float32 (exact)
                x = x.to(tl.float32)
            if UNIFORM:
                # estimate 1 + ⌊(x − lo)/w⌋ (within one of the index), then one correction
                # each way against the edges themselves: S[k−1] < x ≤ S[k]
                estimate = tl.floor((x - low_edge) * inverse_width) + 1.0
                estimate = tl.minimum(tl.maximum(estimate, 0.0), EDGES * 1.0)
                estimate = tl.where(x == x, estimate, 0.0)  # (NaN: its slot is set below)
                low = tl.minimum(tl.maximum(estimate.to(tl.int32), 0), EDGES)
                below = tl.load(edges_ptr + low - 1, mask=low >= 1, other=0.0)
                if WIDEN:
                    below = below.to(tl.float32)
                low = tl.where((low >= 1) & (below >= x), low - 1, low)
                above = tl.load(edges_ptr + low, mask=low < EDGES, other=0.0)
                if WIDEN:
                    above = above.to(tl.float32)
                low = tl.where((low < EDGES) & (above < x), low + 1, low)
            else:
                low = tl.zeros([BLOCK], dtype=tl.int32)
                high = low + EDGES
                for _ in tl.static_range(STEPS):
                    active = low < high
                    middle = (low + high) // 2
                    edge = tl.load(edges_ptr + middle, mask=active, other=0.0)
                    if WIDEN:
                        edge = edge.to(tl.float32)
                    below = edge < x
                    low = tl.where(active & below, middle + 1, low)
                    high = tl.where(active & (edge >= x), middle, high)
            index = tl.where(x != x, EDGES, low)
            index = tl.where(inside, index, PADDED - 1)  # a spare slot, never read
            hist += tl.histogram(index, PADDED)
        slots = tl.arange(0, PADDED)
        tl.atomic_add(out_ptr + (pid % LANES) * SLOTS + slots, hist.to(tl.float32),
                      mask=slots < SLOTS, sem="relaxed")

    return count


def available(x: Tensor, values: int | None = None) -> bool:
    """Whether ``values`` values like ``x``'s (default: x's own) are counted by the kernel:
    at least :data:`MIN_VALUES` of them, on CUDA (or on the CPU under Triton's interpreter),
    a floating dtype, Triton importable."""
    values = x.numel() if values is None else values
    return (values >= MIN_VALUES and x.dtype in _DTYPES and SWITCH.runs(x)
            and _kernel() is not None)


# used until it fails to compile or run: then the three kernels count (the same counts)
SWITCH = KernelSwitch("histogram kernel", "the histograms are counted by three PyTorch "
                      "kernels instead (same counts, slower)", "COCKPIT_FUSED_HISTOGRAM")
disable = SWITCH.disable


def block_limit(num_lanes: int) -> int:
    """The most values one call counts with every float32 counter exact."""
    return num_lanes * (2**23 - PROGRAMS_PER_LANE * BLOCK)


def tally_values(x: Tensor, edges: Tensor, num_lanes: int,
                 uniform: tuple[float, float] | None = None) -> Tensor:
    """Lane counts [L · slots] (float32, slots = len(edges) + 1) of the search indices of
    ``x``'s values: the sum over lanes equals that of
    ``tally(bin_index(x, edges), slots)``. ``x`` has at most :func:`block_limit` values.
    ``uniform``: (lo, hi) of bins of equal width whose inner edges ``edges`` holds (rounded
    up to x's dtype): the index is estimated from (x − lo)/w and corrected by one comparison
    each way (exact: the estimate is within one of the index for up to
    :data:`MAX_UNIFORM_BINS` bins) instead of a binary search."""
    return tally_rows(x.reshape(1, -1), edges, num_lanes, uniform)[0]


def tally_rows(x: Tensor, edges: Tensor, num_lanes: int,
               uniform: tuple[float, float] | None = None) -> Tensor:
    """:func:`tally_values` of every row of ``x`` [R, M] apart, in one launch: [R, L · slots]
    (the individual gradients of R layers of one shape, each row at most
    :func:`block_limit` values)."""
    rows, n = x.shape
    if n > block_limit(num_lanes):
        raise ValueError(f"{n} values exceed the block of {block_limit(num_lanes)} that "
                         "keeps every float32 counter exact: split them")
    slots = edges.numel() + 1
    out = torch.zeros(rows, num_lanes * slots, dtype=torch.float32, device=x.device)
    if n == 0 or rows == 0:
        return out
    bins = edges.numel() - 1
    uniform = uniform if uniform is not None and bins <= MAX_UNIFORM_BINS else None
    low_edge, inverse_width = (0.0, 0.0) if uniform is None else (
        uniform[0], bins / (uniform[1] - uniform[0]))
    reads = -(-n // BLOCK)
    iters = 1 << max(0, -(-reads // (num_lanes * PROGRAMS_PER_LANE)) - 1).bit_length()
    programs = -(-reads // iters)
    assert -(-programs // num_lanes) * iters * BLOCK <= 2**24  # see the module's docstring
    _kernel()[(programs, rows)](
        x.contiguous(), edges.to(x.dtype).contiguous(), out, n, low_edge,
        inverse_width, EDGES=edges.numel(),
        STEPS=max(1, math.ceil(math.log2(edges.numel() + 1))), SLOTS=slots,
        PADDED=1 << slots.bit_length(), LANES=num_lanes, BLOCK=BLOCK, ITERS=iters,
        WIDEN=x.element_size() == 2, UNIFORM=uniform is not None, num_warps=NUM_WARPS)
    return out
