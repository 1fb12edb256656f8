"""Exact histograms on accelerators: no read of the device, no contended counter, few kernels.

The CPU kernels of :mod:`cockpit.engine.histograms.exact` are built for a CPU: directed rounding in
NumPy, worker threads, sorted rows searched per query, chunk-by-chunk decisions read from
the data (a chunk with a non-finite value takes another path). On a GPU each of those
decisions is a wait for the device, and ``bincount`` into a few crowded bins serializes on
atomic adds (gradient elements pile up in the one or two bins around zero). This path takes
no decision from the data, and counts a block of values in three kernels (bucketize, add,
histc), the lanes of all parameters summed in a few more when the backward pass ends:

* search index by one ``torch.bucketize`` (lower bound: #{s ∈ S : s < x}) against the
  sorted edges S = [−∞, t⁻_1, …, t⁻_{bins−1}, F] (:func:`search_edges`), where
  t_k = ⌈e_k⌉ is the inner edge rounded up to the values' dtype, t⁻ the float just below
  it and F the largest finite float. For every float x of the dtype x > t⁻_k ⟺ x ≥ t_k
  ⟺ x ≥ e_k (a GPU has no directed rounding; the CPU path's searched form), so the index
  is 0 for −∞, 1 + k(x) ∈ [1, bins] for finite x (k(x) = #{k : x ≥ e_k}, exact at every
  edge), and bins + 1 for +∞ and NaN (no comparison with NaN holds: the search runs to
  the end, on CPU and CUDA alike). One op, no mask: the non-finite values land in two
  slots of their own;
* counting: element i adds to copy ℓ(i) ∈ [0, L) of the bins+2 slots (``histc`` of
  index + ℓ(i)·(bins + 2) + ½, the lane offsets a small cached tensor broadcast over the
  trailing dimensions), the copies are summed afterwards. On CUDA ``histc`` with few
  bins keeps a private histogram per thread block in shared memory; with L = 32 copies the
  threads of a warp (consecutive elements, ℓ(i) = i mod 32) add to 32 different counters
  even when every element falls into the same bin (``bincount`` would read the device for
  its output size). Which copy an element adds to never changes the sum: the lanes are
  for speed only;
* the counts of the finite values are the slots 1 … bins of every copy, summed over the
  copies (and over a layer's chunks) in one strided ``sum``; the non-finite count is the
  number of values minus their sum (formed only where asked for). The statistics keep each
  parameter's copies (:class:`LaneCounts`) until the backward pass ends and then sum those
  of every parameter together (:func:`sum_lanes`: one ``stack``, one strided ``sum`` per
  number of chunks a parameter has, one ``unbind``), not two ops per parameter;
* blocks (:func:`block_size`): one ``histc`` counts a block of n ≤ L·C values, C = 2^24
  (``COUNTER_LIMIT``). Element i of a block adds to copy ℓ(i) = i mod L (each way the
  offsets are laid over a block gives the element at row-major position i the offset of
  i mod L), so a counter receives at most ⌈n/L⌉ ≤ C counts: every float32 counter stays
  exact (C = 2^24 is a float32, C + 1 is not), and so does the spread index (below
  L·(bins + 2)). Within that, a block's scratch fits the engine's memory budget: its int32
  search index and its spread index (or products buffer), 8 bytes per float32 value.
  Blocks of one tensor are of equal size (±1 row), so that none is a small remainder;
* the individual gradients of a Linear layer, δ_n a_nᵀ, are formed in blocks (the same
  products fl(δ·a) the CPU path bins): all at once where they fit, else rows i of every
  sample (one ``split`` of δ's view), else whole samples; every block is contiguous
  (``bucketize`` would copy it otherwise) and its products buffer receives the lane-spread
  index;
* 2-D histograms (eq. 16, :class:`Pairs`): the cell k_g·(bins_θ + 2) + k_θ of the two
  search indices, θ's index (with the lane offsets, where θ's size is a multiple of L)
  formed once per parameter, so that a chunk of g costs bucketize, one add and histc; the
  finite pairs are the cells with k_g ∈ [1, bins_g] and k_θ ∈ [1, bins_θ]. With θ's
  offsets the copy of a pair is that of its θ_j; a block holds whole samples (every
  position of θ: n/L pairs per copy) or consecutive positions of one sample (⌈n/L⌉), so no
  counter receives more than C here either.

:func:`device_path` tells the histogram functions (and other choices made per device, such
as the norms of :func:`cockpit.quantities.base.norms`) to take this path: on
every device but the CPU, and on the CPU inside :func:`forced` (tests: the counts must
equal the CPU path's, and the op count of a CPU step then predicts the GPU's).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor

from cockpit.engine.histograms import fused

_LANES = 32
COUNTER_LIMIT = 2**24  # counts a float32 counter holds exactly: none receives more
DEFAULT_BUDGET = 2**29  # scratch bytes of a block where the caller names none (the engine's)
_INDEX_BYTES = 4  # the int32 search index of a value
_SHARED_COUNTERS = 12 * 1024  # float counters in 48 KiB of a block's shared memory
_MAX_PATTERN = 2**17  # elements of one cached lane-offset tensor (512 KiB)
# zero tallies sum_lanes may stack to sum all values in one op: a GPU reads 8 MiB in a few
# µs, about the cost of the two ops saved per further number of chunks
_PAD_BYTES = 2**23
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


def search_edges(thresholds: Tensor) -> Tensor:
    """S = [−∞, t⁻_1, …, t⁻_{bins−1}, F] (``bins + 1`` values, the thresholds' dtype) from the
    inner edges rounded up, t_k (t⁻ = the next float below t; F = the largest float)."""
    dtype = thresholds.dtype
    below = torch.nextafter(thresholds, torch.tensor(-math.inf, dtype=dtype))
    return torch.cat([torch.tensor([-math.inf], dtype=dtype), below,
                      torch.tensor([torch.finfo(dtype).max], dtype=dtype)])


def bin_index(x: Tensor, edges: Tensor) -> Tensor:
    """Search index (int32, x's shape): 0 for −∞, 1 + k(x) for finite x, bins + 1 for +∞ and
    NaN (``edges``: :func:`search_edges` in x's dtype)."""
    return torch.bucketize(x, edges, out_int32=True)


def lanes(slots: int) -> int:
    """Copies of ``slots`` counters that fit a block's shared memory (at most 32): a power of
    two, which divides the sizes of most tensors (the offsets then follow their trailing
    dimensions)."""
    most = max(1, min(_LANES, _SHARED_COUNTERS // slots))
    return 1 << (most.bit_length() - 1)


def block_size(slots: int, budget: int | None, bytes_per_value: int) -> int:
    """The most values one ``histc`` over ``slots`` slots counts: L·``COUNTER_LIMIT`` (copy
    i mod L of a counter then receives at most ``COUNTER_LIMIT`` of them), and at most
    ``budget // bytes_per_value`` (the block's scratch; None: no limit), at least one."""
    most = lanes(slots) * COUNTER_LIMIT
    return most if budget is None else max(1, min(most, budget // bytes_per_value))


def _parts(size: int, block: int) -> int:
    """The size of the parts when ``size`` items are cut into the fewest parts of at most
    ``block``, as equal as can be (``size`` where it fits)."""
    return -(-size // -(-size // block)) if size > block else size


def _offsets(shape: tuple[int, ...], num_lanes: int, stride: int, device: torch.device
             ) -> Tensor:
    """(i mod L)·stride + ½ at the row-major positions i of ``shape``, float32 (exact: every
    value is below 2^24)."""
    lane = torch.arange(math.prod(shape), dtype=torch.int32, device=device) % num_lanes
    return ((lane * stride).float() + 0.5).view(shape)


_pattern = functools.lru_cache(maxsize=128)(_offsets)  # shapes of at most _MAX_PATTERN


def _lane_shape(shape: torch.Size, num_lanes: int) -> tuple[int, ...] | None:
    """The shortest trailing part of ``shape`` whose size is a multiple of L (then the
    position there fixes i mod L of a row-major element), if small enough to cache."""
    size = 1
    for k in range(len(shape) - 1, -1, -1):
        size *= shape[k]
        if size % num_lanes == 0:
            return tuple(shape[k:]) if size <= _MAX_PATTERN else None
    return None


def tally(index: Tensor, slots: int, out: Tensor | None = None) -> Tensor:
    """Lane counts [L·slots] (float32) of a contiguous int index in [0, slots): ``histc`` of
    index + ℓ·slots + ½. ``out`` (float, the index's shape) may receive the spread index."""
    num_lanes = lanes(slots)
    trailing = _lane_shape(index.shape, num_lanes)
    if trailing is not None:
        spread = torch.add(index, _pattern(trailing, num_lanes, slots, index.device), out=out)
    elif index.numel() % num_lanes == 0:  # rows of L
        spread = torch.add(index.reshape(-1, num_lanes),
                           _pattern((num_lanes,), num_lanes, slots, index.device),
                           out=None if out is None else out.view(-1, num_lanes))
    else:  # flat positions (odd sizes): offsets of a power-of-two length, cached if small
        flat = index.reshape(-1)
        length = max(_LANES, 1 << max(flat.numel() - 1, 0).bit_length())
        offsets = (_pattern if length <= _MAX_PATTERN else _offsets)(
            (length,), num_lanes, slots, index.device)[: flat.numel()]
        spread = torch.add(flat, offsets, out=None if out is None else out.view(-1))
    total = num_lanes * slots
    return torch.histc(spread, bins=total, min=0, max=total)


def finite_counts(tallies: Sequence[Tensor], slots: int, shape: tuple[int, ...],
                  strides: tuple[int, ...], first: int) -> Tensor:
    """The counts (int64, ``shape``) of the slots first + Σ_d c_d·strides_d, summed over the
    lanes of every tally (one strided sum; float32 counts of at most 2^24 convert exactly)."""
    per_lane = lanes(slots) * slots
    if len(tallies) == 1:
        view = tallies[0].as_strided((lanes(slots), *shape), (slots, *strides), first)
        return view.sum(0, dtype=torch.long)
    stacked = torch.stack(list(tallies))
    view = stacked.as_strided((len(tallies), lanes(slots), *shape),
                              (per_lane, slots, *strides), first)
    return view.sum((0, 1), dtype=torch.long)


class LaneCounts:
    """Counts (int64, ``shape``) of the slots first + Σ_d c_d·strides_d, kept as the lane
    counts of each chunk (:func:`tally`: float32 [L·slots] each) until their lanes are summed:
    by :meth:`counts` for this one value, or by :func:`sum_lanes` for many parameters at once
    (a few ops for all of them instead of two per parameter). Adding two concatenates their
    tallies: the counts of the union of their values (a parameter's sample chunks, or
    micro-batches), exact as every count is; adding a tensor sums the lanes first."""

    def __init__(self, tallies: list[Tensor], slots: int, shape: tuple[int, ...],
                 strides: tuple[int, ...], first: int):
        self.tallies, self.slots = tallies, slots
        self.shape, self.strides, self.first = tuple(shape), tuple(strides), first

    @property
    def layout(self) -> tuple:
        """What values whose tallies can be summed together share."""
        tally = self.tallies[0]
        return self.slots, self.shape, self.strides, self.first, tally.dtype, tally.device

    @property
    def device(self) -> torch.device:
        return self.tallies[0].device

    def to(self, device: torch.device | str) -> LaneCounts:
        return LaneCounts([t.to(device) for t in self.tallies], self.slots, self.shape,
                          self.strides, self.first)

    def counts(self) -> Tensor:
        """The counts (int64, ``shape``): every lane of every tally summed in one op."""
        return finite_counts(self.tallies, self.slots, self.shape, self.strides, self.first)

    def __add__(self, other: LaneCounts | Tensor) -> LaneCounts | Tensor:
        if isinstance(other, LaneCounts) and other.layout == self.layout:
            return LaneCounts([*self.tallies, *other.tallies], self.slots, self.shape,
                              self.strides, self.first)
        return self.counts() + (other.counts() if isinstance(other, LaneCounts) else other)

    def __radd__(self, other: Tensor | int) -> LaneCounts | Tensor:
        if isinstance(other, int) and other == 0:  # the start of ``sum``
            return self
        return other + self.counts()


def sum_lanes(values: Mapping[str, Tensor | LaneCounts]) -> dict[str, Tensor]:
    """``values`` with every :class:`LaneCounts` replaced by its counts (the others as they
    are). Values of one layout are summed together: their tallies stacked in one op, then
    one strided ``sum`` over the lanes (and chunks) of all values with the same number of
    tallies K, and one ``unbind``; the ops do not grow with the number of values. Values
    with fewer tallies than the most are padded with a zero tally where that adds at most
    ``_PAD_BYTES`` to the stack (then one sum serves all), else summed per K (most
    parameters have one chunk). The counts are int64 sums of float32 counts of at most 2^24:
    exact."""
    out = dict(values)
    layouts: dict[tuple, list[str]] = {}
    for name, value in values.items():
        if isinstance(value, LaneCounts):
            layouts.setdefault(value.layout, []).append(name)
    for (slots, shape, strides, first, dtype, device), names in layouts.items():
        num_lanes = lanes(slots)
        per_tally = num_lanes * slots
        held = {name: values[name].tallies for name in names}  # type: ignore[union-attr]
        most = max(len(t) for t in held.values())
        padding = sum(most - len(t) for t in held.values()) * per_tally * dtype.itemsize
        if padding <= _PAD_BYTES:
            zero = _zero_tally(per_tally, dtype, device)
            by_size = {most: names}
            held = {name: [*t, *[zero] * (most - len(t))] for name, t in held.items()}
        else:
            by_size = {}
            for name in names:
                by_size.setdefault(len(held[name]), []).append(name)
        order = [name for group in by_size.values() for name in group]
        tallies = [t for name in order for t in held[name]]
        stacked = tallies[0] if len(tallies) == 1 else torch.stack(tallies)
        parts, row = [], 0
        for size, group in by_size.items():
            # the K·L lanes of a value's K consecutive tallies lie `slots` apart
            view = stacked.as_strided((len(group), size * num_lanes, *shape),
                                      (size * per_tally, slots, *strides),
                                      stacked.storage_offset() + row * per_tally + first)
            parts.append(view.sum(1, dtype=torch.long))
            row += size * len(group)
        counts = parts[0] if len(parts) == 1 else torch.cat(parts)
        out.update(zip(order, counts.unbind(0), strict=True))
    return out


@functools.lru_cache(maxsize=16)
def _zero_tally(size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tally of zeros (only ever read: stacked beside the real tallies)."""
    return torch.zeros(size, dtype=dtype, device=device)


def _pieces(x: Tensor, block: int) -> list[Tensor]:
    """``x`` in pieces of at most ``block`` elements (whole rows of dim 0 where they fit)."""
    if x.numel() <= block:
        return [x]
    per_row = math.prod(x.shape[1:])
    if 0 < per_row <= block:
        return list(x.split(_parts(x.shape[0], block // per_row)))
    return list(x.reshape(-1).split(_parts(x.numel(), block)))


def dense_tallies(chunks: Sequence[Tensor], edges: Tensor, budget: int | None = DEFAULT_BUDGET,
                  uniform: tuple[float, float] | None = None) -> list[Tensor]:
    """The lane counts of every element of ``chunks`` (any shapes), in blocks whose index
    and spread index (8 bytes a value) fit ``budget`` (``uniform``: the (lo, hi) of equal
    bins, which the one-pass kernel uses)."""
    slots = edges.numel() + 1
    fuse = bool(chunks) and fused.available(chunks[0], sum(c.numel() for c in chunks))
    block = (fused.block_limit(lanes(slots)) if fuse
             else block_size(slots, budget, _INDEX_BYTES + 4))
    with torch.no_grad():
        return [_tally_values(piece, edges, slots, fuse, uniform=uniform)
                for chunk in chunks for piece in _pieces(chunk, block)]


def _tally_values(x: Tensor, edges: Tensor, slots: int, fuse: bool,
                  out: Tensor | None = None, uniform: tuple[float, float] | None = None
                  ) -> Tensor:
    """Lane counts of ``x``'s search indices: by the one-pass kernel (``fuse``,
    :mod:`cockpit.engine.histograms.fused`) or by bucketize, add and histc (``out``: a
    float buffer of x's shape that may receive the spread index)."""
    if fuse and fused.SWITCH.broken is None:
        try:
            return fused.tally_values(x, edges, lanes(slots), uniform)
        except Exception as error:  # e.g. no compiler for Triton: count without it
            fused.disable(error)
    return tally(bin_index(x, edges), slots, out=out)


def lane_counts_1d(tallies: Sequence[Tensor], bins: int) -> LaneCounts:
    """Counts [bins] of the finite values, their lanes not yet summed."""
    return LaneCounts(list(tallies), bins + 2, (bins,), (1,), 1)


def counts_1d(tallies: Sequence[Tensor], bins: int) -> Tensor:
    """Counts [bins] of the finite values from their lane counts."""
    return lane_counts_1d(tallies, bins).counts()


def dense(x: Tensor, edges: Tensor, bins: int, uniform: tuple[float, float] | None = None
          ) -> tuple[Tensor, Tensor]:
    """Counts [bins] of the finite elements of ``x`` and the number of non-finite ones."""
    counts = counts_1d(dense_tallies([x], edges, uniform=uniform), bins)
    return counts, x.numel() - counts.sum()


def _sample_blocks(delta: Tensor, a: Tensor, block: int
                   ) -> Iterator[tuple[Tensor, Tensor, tuple[slice, slice]]]:
    """Blocks (δ[n, i, None], a[n, None, j], (rows i, columns j)) of at most ``block``
    products δ[n, i]·a[n, j] in the order of the individual gradients [N, I, J]: whole
    samples where one fits, else rows i of one sample, else parts of one row (every block
    then holds the products of consecutive positions of θ)."""
    N, I = delta.shape
    J = a.shape[1]
    d3, a3 = delta.unsqueeze(2), a.unsqueeze(1)
    every = slice(None)
    if block >= N * I * J:
        yield d3, a3, (every, every)
        return
    if block >= I * J:
        rows = _parts(N, block // max(I * J, 1))
        for d, s in zip(d3.split(rows), a3.split(rows), strict=True):
            yield d, s, (every, every)
        return
    rows, columns = max(1, block // J), min(J, block)
    for n in range(N):
        for i in range(0, I, rows):
            for j in range(0, J, columns):
                part = (slice(i, i + rows), slice(j, j + columns))
                yield d3[n : n + 1, part[0]], a3[n : n + 1, :, part[1]], part


def _products(delta: Tensor, a: Tensor, block: int) -> Iterator[Tensor]:
    """The products δ[n, i]·a[n, j] in contiguous blocks of at most ``block``: all at once,
    else in blocks of rows i of every sample where the N·J products of one row fit (one
    ``split`` of δ's view, a's shared), else as :func:`_sample_blocks`."""
    N, I = delta.shape
    J = a.shape[1]
    if block >= N * I * J or block < N * J:
        for d, s, _ in _sample_blocks(delta, a, block):
            yield torch.mul(d, s)
        return
    a3 = a.unsqueeze(1)
    for d in delta.unsqueeze(2).split(_parts(I, block // (N * J)), dim=1):
        yield torch.mul(d, a3)


def outer_tallies(delta: Tensor, a: Tensor, edges: Tensor, budget: int | None = DEFAULT_BUDGET,
                  uniform: tuple[float, float] | None = None) -> list[Tensor]:
    """The lane counts of the products δ[n, i]·a[n, j], formed in blocks whose products
    buffer (which then holds their spread index) and search index fit ``budget``."""
    slots = edges.numel() + 1
    fuse = fused.available(delta, delta.numel() * a.shape[1])
    block = block_size(slots, budget, delta.element_size() + (0 if fuse else _INDEX_BYTES))
    if fuse:
        block = min(block, fused.block_limit(lanes(slots)))
    with torch.no_grad():
        return [_tally_values(products, edges, slots, fuse, out=products, uniform=uniform)
                for products in _products(delta, a, block)]


def outer(delta: Tensor, a: Tensor, edges: Tensor, bins: int,
          uniform: tuple[float, float] | None = None) -> tuple[Tensor, Tensor]:
    """Counts of the products δ[n, i]·a[n, j] and the number of non-finite ones."""
    counts = counts_1d(outer_tallies(delta, a, edges, uniform=uniform), bins)
    return counts, delta.shape[0] * delta.shape[1] * a.shape[1] - counts.sum()


class Pairs:
    """Counting of the pairs (g[n, j], θ_j) over the cells of the two search indices:
    cell = k_g·(bins_θ + 2) + k_θ, the finite pairs in k_g ∈ [1, bins_g], k_θ ∈ [1, bins_θ].
    θ's index (with the lane offsets where the lane of an element depends on j alone) is
    formed once for all chunks of g."""

    def __init__(self, theta: Tensor, edges_g: Tensor, edges_theta: Tensor,
                 budget: int | None = DEFAULT_BUDGET):
        self.theta_shape = theta.shape
        self.budget = budget
        self.edges_g = edges_g
        self.bins_g, self.bins_theta = edges_g.numel() - 1, edges_theta.numel() - 1
        self.columns = self.bins_theta + 2
        self.slots = (self.bins_g + 2) * self.columns
        self.tallies: list[Tensor] = []
        self.num_pairs = 0
        with torch.no_grad():
            self.theta_index = bin_index(theta, edges_theta)
            num_lanes = lanes(self.slots)
            trailing = _lane_shape(theta.shape, num_lanes)
            # with θ's size a multiple of L the lane of (n, j) is that of j: θ's index
            # carries the offsets, and one add forms a chunk's spread index
            self.theta_spread = None if trailing is None else torch.add(
                self.theta_index, _pattern(trailing, num_lanes, self.slots, theta.device))

    def _add(self, g: Tensor, block: tuple[slice, ...] = (), out: Tensor | None = None
             ) -> None:
        """Count the pairs of g [n, *θ[block]'s shape] (``out``: a float buffer of g's shape
        that may receive the spread index)."""
        self.num_pairs += g.numel()
        g_index = bin_index(g, self.edges_g)
        if self.theta_spread is not None:
            theta = self.theta_spread[block] if block else self.theta_spread
            spread = torch.add(theta, g_index, alpha=self.columns, out=out)
            total = lanes(self.slots) * self.slots
            self.tallies.append(torch.histc(spread, bins=total, min=0, max=total))
        else:
            theta = self.theta_index[block] if block else self.theta_index
            cells = torch.add(theta, g_index, alpha=self.columns)
            self.tallies.append(tally(cells, self.slots, out=out))

    def add_rows(self, g: Tensor) -> None:
        """Count the pairs (g[n, j], θ_j) of g [n, D] (θ flat [D]), in blocks of rows (or
        of columns of one row, where a row exceeds a block) whose search index and spread
        index (8 bytes a pair) fit the budget."""
        D = self.theta_shape.numel()
        if g.shape[1:] != self.theta_shape:
            g = g.reshape(-1, *self.theta_shape)
        block = block_size(self.slots, self.budget, _INDEX_BYTES + 4)
        with torch.no_grad():
            if block < D:
                for n in range(g.shape[0]):
                    for j in range(0, D, block):
                        self._add(g[n : n + 1, j : j + block], (slice(j, j + block),))
                return
            rows = _parts(g.shape[0], block // max(D, 1))
            for piece in ([g] if rows >= g.shape[0] else g.split(rows)):
                self._add(piece)

    def add_products(self, delta: Tensor, a: Tensor) -> None:
        """Count the pairs (fl(δ[n, i]·a[n, j]), θ[i, j]) (θ of shape [I, J]), the products
        formed in blocks whose products buffer (which then holds their spread index) and
        search index fit the budget."""
        block = block_size(self.slots, self.budget, delta.element_size() + _INDEX_BYTES)
        with torch.no_grad():
            for d, s, part in _sample_blocks(delta, a, block):
                products = torch.mul(d, s)
                whole = part[0] == slice(None) and part[1] == slice(None)
                self._add(products, () if whole else part, out=products)

    def lane_counts(self) -> LaneCounts:
        """Counts [bins_g, bins_θ] of the finite pairs, their lanes not yet summed."""
        return LaneCounts(self.tallies, self.slots, (self.bins_g, self.bins_theta),
                          (self.columns, 1), self.columns + 1)

    def counts(self) -> Tensor:
        """Counts [bins_g, bins_θ] of the finite pairs."""
        return self.lane_counts().counts()

    def result(self) -> tuple[Tensor, Tensor]:
        """Counts [bins_g, bins_θ] of the finite pairs and the number of the others."""
        counts = self.counts()
        return counts, self.num_pairs - counts.sum()
