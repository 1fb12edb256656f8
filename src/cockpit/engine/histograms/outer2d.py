"""Exact 2-D histogram of Linear-layer individual gradients without the N×I×J products.

For a Linear weight W ∈ R^{I×J} without sequence dims the individual gradients are the outer
products g_n = δ_n a_nᵀ (δ ∈ R^{N×I}, a ∈ R^{N×J}); the element g_{n,i,j} = fl(δ_{n,i}·a_{n,j})
pairs with θ_{i,j} = W[i, j]. :func:`histogram2d_outer` returns the counts

    H[b, k] = #{(n, i, j) : k_g(g_{n,i,j}) = b, k_θ(θ_{i,j}) = k}       (paper eq. 16)

bit for bit equal to materializing the products and applying
:func:`~cockpit.engine.histograms.exact.histogram2d_dense` (bins k(·) as defined in
:mod:`cockpit.engine.histograms.exact`; a pair with a non-finite product or θ is counted in no bin
but in ``num_nonfinite``).

Classes. The columns of sample n split into Pos_n = {j : a_{n,j} > 0},
Neg_n = {j : a_{n,j} < 0} and Zero_n = {j : a_{n,j} = ±0}; the products of Zero_n are ±0.0
and fall into z = k(0.0) (for finite δ, including δ = 0). For a row (n, i) the map
a ↦ fl(δ_{n,i}·a) is monotone, so along Pos_n sorted by |a| the bins run monotonically from
the *near* end (the a closest to 0) to the *far* end (largest |a|), and likewise along Neg_n.
Each class gets a base bin per row, b⁺(n, i) = k(fl(δ_{n,i}·ā⁺_n)) with ā⁺_n the class mean
clamped into [min Pos_n, max Pos_n] (so b⁺ lies between the near-end and the far-end bin),
likewise b⁻ from Neg_n. Bins are always those of exact products fl(δ·a), never decided by a
sign: a tiny negative product can round into z, an odd bin count puts 0 inside a bin.

Base counts by matrix products. Counting every product of Pos_n in b⁺, of Neg_n in b⁻ and of
Zero_n in z gives, with the 0/1 matrices C⁺_b[n, i] = [b⁺(n, i) = b], C⁻_b[n, i] =
[b⁻(n, i) = b], P[n, j] = [j ∈ Pos_n], Q[n, j] = [j ∈ Neg_n], Z[n, j] = [j ∈ Zero_n],

    W_b = C⁺_bᵀ P + C⁻_bᵀ Q + [b = z]·1ᵀ Z ∈ R^{I×J},
    H_base[b, k] = Σ_{(i,j) : k_θ(θ_ij) = k} W_b[i, j],

i.e. one ``bincount`` of k_θ weighted by W_b (per block of rows i). The entries of W_b are
integers ≤ N, exact in float32 while N < 2^24, and a block's weighted counts stay below 2^24.
Only the distinct base bins b ≠ z that occur need a product (usually 1–3): since
Σ_b W_b[i, j] = N for every (i, j), row z is N·#{(i, j) : k_θ(θ_ij) = k} minus the others.

Moved products. A row is *light* when both end products of each class fall into the class's
base bin: then its base counts are exact. Otherwise the products of a class that leave the
base bin b lie at its ends: by monotonicity they are the m entries nearest to that end, with
m an exact threshold count, m = #{j in the class end : fl(δ a_{n,j}) ≥ t_{b+1}} if that end's
bin is above b and #{… < t_b} if below (t_k = the exact thresholds of k_g, see
:func:`~cockpit.engine.histograms.exact._thresholds`). Per class end only the K entries nearest to
it are kept (``topk``, or one sort when K is large); K is bounded from the a-space crossing
points t/δ with a margin. m is located by a ``searchsorted`` guess at the crossing point and
verified with the exact products on both sides of the boundary (bisection where the guess
fails); a count reaching K while the class is longer redoes everything with the sorted rows.
The m products are formed (rows grouped by m; a task gathers the first M ≥ m entries of each
row's end list as rows of one tensor), binned exactly and moved: +1 at (k_g(p), k_θ), −1 at
(b, k_θ); window entries beyond m cancel, or are masked where the window could reach past
the class or into the products moved from its other end. A class end that moves products in
only a few rows (e.g. rows with a tiny δ whose near-end products round into z) is scanned
instead: its rows are formed whole to find the moved products. Rows that would move more than
half of their products are formed whole and binned directly: +1 at (k_g(p), k_θ), −1 at the
base bin of p's class.

Work and fallbacks. On CPU the θ bins, the base counts, the scans and the ``topk`` run in the
worker threads of :mod:`cockpit.engine.histograms.exact` while the moved products are counted, and
the binning tasks are shared by up to ``torch.get_num_threads()`` threads. Small layers
(fewer than ``_MIN_PRODUCTS`` products) and unsupported dtypes form their products for blocks
of samples and bin them with ``histogram2d_dense``. Samples with a non-finite entry or a
possibly overflowing product take a blockwise dense kernel (products formed in cache-sized
blocks, flat index k_g·(bins_θ + 1) + k_θ, one ``bincount`` per block), and so do layers
whose factored cost (estimated from a subsample of a before the counts, then from the exact
counts) exceeds forming all products (δ large against the bin width). Non-finite θ are
binned into an extra column whose total is added to ``num_nonfinite``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
from torch import Tensor

from cockpit.engine.dtypes import promote
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.histograms import rounding
from cockpit.engine.histograms.exact import (
    _MAX_WORKERS,
    BinSpec,
    _chunk_size,
    _device_dtype,
    _fast_path_ok,
    _index_dtype,
    _pool,
    _sample_keys,
    _sum_over_chunks,
    _thresholds,
    histogram2d_dense,
    pairs_on_device,
    summed,
)

# Below this many products the layer is formed and binned by histogram2d_dense (fixed costs
# of the factored path dominate; measured crossover 1–2·10⁶ products on a 2-core CPU).
_MIN_PRODUCTS = 2**20
# A row that would move more than this fraction of its J products is formed whole.
_HEAVY_FRACTION = 0.5
# Cost of one window element (gathered product, θ-index gather, two bincounts) in units of
# one product of the dense kernel, and the fixed cost of the factored path in the same
# units per element of the I×J matrices. If the factored path is estimated to cost more than
# forming all N·I·J products, the dense kernel runs instead.
_WINDOW_COST = 3.5
_HEAVY_COST = 1.5
_BASE_COST = 0.8
_MATMUL_COST = 0.01
# A class end that moves products in at most _FEW_ROWS·N rows is scanned: its rows are
# formed whole to find the moved products (no topk, no windows).
_FEW_ROWS = 2.0
# Relative margin of the a-space crossing points that bound the kept extreme entries.
_SLACK = 2**-20
# Use one sort of a instead of two ``topk`` when the extreme entries kept per sample exceed
# J / _TOPK_FRACTION.
_TOPK_FRACTION = 2
# Elements per task of the window kernel, the weighted bincounts and the dense kernel (CPU).
_CHUNK = 2**17
# Subsampled columns per sample and rows per class end for the early cost estimate.
_ESTIMATE_COLUMNS = 64
_ESTIMATE_ROWS = 4096


def _check_shapes(delta: Tensor, a: Tensor, theta: Tensor) -> None:
    N, I = delta.shape
    J = a.shape[1]
    if a.shape[0] != N:
        raise ValueError(f"delta {tuple(delta.shape)} and a {tuple(a.shape)} differ in N")
    if theta.numel() != I * J:
        raise ValueError(f"theta has {theta.numel()} elements, expected {I}·{J}")


def _device_pairs(delta: Tensor, a: Tensor, theta: Tensor, spec_g: BinSpec,
                  spec_theta: BinSpec, budget: int | None = histogram_device.DEFAULT_BUDGET
                  ) -> histogram_device.Pairs:
    """The pairs counted on the accelerator path (the products in blocks of samples whose
    scratch fits ``budget`` bytes)."""
    _check_shapes(delta, a, theta)
    dtype = _device_dtype(delta.dtype, a.dtype)
    shape = (delta.shape[1], a.shape[1])
    pairs = pairs_on_device(theta if theta.shape == shape else theta.reshape(shape), dtype,
                            spec_g, spec_theta, budget)
    pairs.add_products(delta.to(dtype), a.to(dtype))
    return pairs


def histogram2d_outer_counts(delta: Tensor, a: Tensor, theta: Tensor, spec_g: BinSpec,
                             spec_theta: BinSpec) -> Tensor:
    """The counts of :func:`histogram2d_outer` alone (on accelerators without the count of
    the other pairs)."""
    return summed(histogram2d_outer_lanes(delta, a, theta, spec_g, spec_theta))


def histogram2d_outer_lanes(delta: Tensor, a: Tensor, theta: Tensor, spec_g: BinSpec,
                            spec_theta: BinSpec,
                            budget: int | None = histogram_device.DEFAULT_BUDGET
                            ) -> Tensor | histogram_device.LaneCounts:
    """:func:`histogram2d_outer_counts`, on accelerators with the lanes not yet summed (see
    :func:`cockpit.engine.histograms.device.sum_lanes`) and the products formed in blocks
    whose scratch fits ``budget`` bytes (None: no limit)."""
    if histogram_device.device_path(delta.device):
        return _device_pairs(delta, a, theta, spec_g, spec_theta, budget).lane_counts()
    return histogram2d_outer(delta, a, theta, spec_g, spec_theta)[0]


def histogram2d_outer(
    delta: Tensor, a: Tensor, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec
) -> tuple[Tensor, int]:
    """Counts of the pairs (fl(δ[n, i]·a[n, j]), θ[i, j]) as a [bins_g, bins_θ] matrix.

    Equal to ``histogram2d_dense((delta[:, :, None] * a[:, None, :]).flatten(1),
    theta.flatten(), spec_g, spec_theta)`` without forming the N×I×J products (see the
    module docstring). ``theta`` holds the I·J parameters (any shape, row-major [I, J]).
    Returns ``(counts int64 [bins_g, bins_θ], num_nonfinite)``.
    """
    if histogram_device.device_path(delta.device):
        return _device_pairs(delta, a, theta, spec_g, spec_theta).result()
    delta, a, theta = delta.detach(), a.detach(), theta.detach()
    N, I = delta.shape
    J = a.shape[1]
    _check_shapes(delta, a, theta)
    dtype = promote(delta.dtype, a.dtype)
    if N * I * J == 0:
        shape = (spec_g.bins, spec_theta.bins)
        return torch.zeros(shape, dtype=torch.long, device=delta.device), 0
    if (not _fast_path_ok(spec_g, dtype) or N >= 2**24 or I * J >= 2**31
            or N * I * J < _MIN_PRODUCTS):
        return _plain(delta, a, theta, spec_g, spec_theta)
    delta, a = delta.to(dtype), a.to(dtype)
    T = spec_theta.bins + 1  # θ bins and one column for non-finite θ
    theta_job = _Theta(theta, spec_theta, I, J, background=_parallel(delta.device))
    bound = delta.abs().amax(1).double() * a.abs().amax(1).double()
    clean = torch.isfinite(bound) & (bound <= torch.finfo(dtype).max / 4)
    if bool(clean.all()):
        counts, num_nonfinite = _factored(delta, a, theta_job, spec_g, T), 0
    else:
        k_theta = theta_job.bins()
        counts, num_nonfinite = _dense(delta[~clean], a[~clean], k_theta, spec_g, T, False)
        if bool(clean.any()):
            counts += _factored(delta[clean], a[clean], theta_job, spec_g, T)
    counts = counts.view(spec_g.bins, T)
    return counts[:, :-1].contiguous(), num_nonfinite + int(counts[:, -1].sum())


def _plain(
    delta: Tensor, a: Tensor, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec
) -> tuple[Tensor, int]:
    """Form the products for blocks of samples and apply histogram2d_dense (small layers,
    unsupported dtypes)."""
    N, I = delta.shape
    J = a.shape[1]
    step = max(1, _CHUNK * 32 // (I * J))
    counts = torch.zeros(spec_g.bins, spec_theta.bins, dtype=torch.long, device=delta.device)
    num_nonfinite = 0
    for n0 in range(0, N, step):
        g = delta[n0 : n0 + step, :, None] * a[n0 : n0 + step, None, :]
        more, bad = histogram2d_dense(g.flatten(1), theta.reshape(-1), spec_g, spec_theta)
        counts += more
        num_nonfinite += bad
    return counts, num_nonfinite


def _parallel(device: torch.device) -> bool:
    """Whether independent work may run in the worker threads of cockpit.engine.histograms.exact."""
    return device.type == "cpu" and torch.get_num_threads() > 1 and not rounding.work_here()


def _run(tasks: list[Callable[[], Tensor]], size: int, device: torch.device) -> Tensor:
    """Σ of the tasks' results (int64 [size]), tasks taken in order by up to
    ``torch.get_num_threads()`` of Cockpit's worker threads on CPU (in the caller elsewhere,
    or when the caller is such a thread)."""

    def work() -> Tensor:
        total = torch.zeros(size, dtype=torch.long, device=device)
        while (c := next(counter)) < len(tasks):
            total += tasks[c]()
        return total

    counter = itertools.count()  # next() is atomic under the GIL
    if device.type != "cpu" or rounding.work_here():
        return work()
    # The caller only waits: binning forms its products rounded toward −∞ in Cockpit's own
    # threads (histograms.rounding), so work in the caller would hand every task over.
    workers = min(torch.get_num_threads(), len(tasks), _MAX_WORKERS)
    futures = [_pool().submit(work) for _ in range(max(1, workers))]
    total = futures[0].result()
    for f in futures[1:]:
        total += f.result()
    return total


class _Job:
    """A result computed in a worker thread while the caller goes on (``background``), or
    at once."""

    def __init__(self, fn: Callable[[], object], background: bool):
        self._future = _pool().submit(fn) if background else None
        self._value = None if background else fn()

    def get(self):
        return self._future.result() if self._future is not None else self._value


class _Theta(_Job):
    """k_θ [I, J] and its counts over the θ bins."""

    def __init__(self, theta: Tensor, spec: BinSpec, I: int, J: int, background: bool):
        def job() -> tuple[Tensor, Tensor]:
            k = _theta_bins(theta.reshape(-1), spec).view(I, J)
            return k, torch.bincount(k.view(-1), minlength=spec.bins + 1)

        super().__init__(job, background)

    def bins(self) -> Tensor:
        return self.get()[0]


def _theta_bins(theta: Tensor, spec: BinSpec) -> Tensor:
    """k_θ of every parameter; non-finite θ get the extra bin ``spec.bins``. The smallest
    integer type that holds bins + 1 values keeps the table small for the gathers."""
    dtype = _index_dtype(spec.bins + 1)
    if (theta.dtype in (torch.float32, torch.float64) and theta.numel()
            and bool(torch.isfinite(theta).all())):
        return spec.bin_values(theta.clone()).to(dtype)
    k = spec.bin_index(theta).masked_fill_(~torch.isfinite(theta), spec.bins)
    return k.to(dtype)


def _bin_(y: Tensor, spec: BinSpec, out: Tensor) -> Tensor:
    """k(y) into the integer tensor ``out`` for y without NaN, overwriting y.

    :meth:`BinSpec.bin_values` (±inf clamped into the edge bins).
    """
    return out.copy_(spec.bin_values(y))


# --------------------------------------------------------------------------- dense


def _dense(
    delta: Tensor, a: Tensor, k_theta: Tensor, spec_g: BinSpec, T: int, clean: bool
) -> tuple[Tensor, int]:
    """Flat counts [bins_g·T] of all products, formed in cache-sized blocks.

    ``clean``: all products are known to be finite (no masking needed).
    """
    N, I = delta.shape
    J = a.shape[1]
    device = delta.device
    dump = spec_g.bins * T
    size = _chunk_size(device, N * I * J)
    rows_i = max(1, min(I, size // J))
    rows_n = max(1, size // (rows_i * J)) if rows_i == I else 1
    blocks_i = -(-I // rows_i)

    def buffers() -> tuple[Tensor, ...]:
        m = rows_n * rows_i * J
        return (torch.empty(m, dtype=delta.dtype, device=device),
                torch.empty(m, dtype=torch.int32, device=device))

    def task(c: int, bufs: tuple[Tensor, ...]) -> tuple[Tensor, int]:
        n0, i0 = (c // blocks_i) * rows_n, (c % blocks_i) * rows_i
        d = delta[n0 : n0 + rows_n, i0 : i0 + rows_i, None]
        shape = (d.shape[0], d.shape[1], J)
        m = shape[0] * shape[1] * J
        products = torch.mul(d, a[n0 : n0 + rows_n, None, :], out=bufs[0][:m].view(shape))
        kt = k_theta[i0 : i0 + rows_i]
        bad = 0
        if not clean:
            finite = torch.isfinite(products)
            bad = int(finite.numel() - finite.sum())
            if bad:
                flat = spec_g.bin_index(products.masked_fill(~finite, 0)) * T + kt
                flat = flat.masked_fill_(~finite, dump)
                return torch.bincount(flat.view(-1), minlength=dump + 1)[:dump], bad
        index = _bin_(products, spec_g, bufs[1][:m].view(shape))
        index.mul_(T).add_(kt)
        return torch.bincount(index.view(-1), minlength=dump), 0

    return _sum_over_chunks(-(-N // rows_n) * blocks_i, buffers, task)


# --------------------------------------------------------------------------- factored


def _factored(delta: Tensor, a: Tensor, theta: _Theta, spec_g: BinSpec, T: int) -> Tensor:
    """Flat counts [bins_g·T] for samples whose products are all finite (module doc)."""
    N, I = delta.shape
    J = a.shape[1]
    device, dtype = delta.device, delta.dtype
    z = int(spec_g.bin_index(torch.zeros(1, dtype=dtype, device=device)))
    flat_delta = delta.reshape(-1)
    classes = [_Class(a, sign) for sign in (1, -1)]
    classes = [c for c in classes if bool(c.size.any())]
    if not classes:  # a = 0: every product is ±0
        counts = torch.zeros(spec_g.bins, T, dtype=torch.long, device=device)
        counts[z] = N * theta.get()[1]
        return counts.view(-1)
    for c in classes:
        c.reference_values(a)
    ends = torch.stack([e for c in classes for e in (c.mid, c.far, c.near)])  # [3C, N]
    products = ends.unsqueeze(2) * delta  # [3 per class, N, I]
    end_bins = _bin_(products, spec_g, torch.empty_like(products, dtype=torch.long))
    end_bins = end_bins.view(len(ends), N * I)

    # base bin of each class: the bin of its reference product; the products outside it
    # are moved, at the far end (|a| large) and at the near end (|a| small) of the class
    thresholds = _thresholds(spec_g, dtype, device)
    heavy = torch.zeros(N * I, dtype=torch.bool, device=device)
    sides = []
    for k, c in enumerate(classes):
        c.base = end_bins[3 * k]
        for far in (True, False):
            end = end_bins[3 * k + (1 if far else 2)]
            rows = (end != c.base).nonzero().squeeze(1)
            if rows.numel():
                sides.append(_Side(c, far, rows, scan=rows.numel() <= _FEW_ROWS * N))
    for s in sides:
        end = end_bins[3 * classes.index(s.cls) + (1 if s.far else 2)]
        s.b = s.cls.base.index_select(0, s.rows)
        s.up = end.index_select(0, s.rows) > s.b  # moved: fl(δa) ≥ t_{b+1} or fl(δa) < t_b
        s.t = thresholds.index_select(0, s.b - 1 + s.up.long())
        s.delta = flat_delta.index_select(0, s.rows)
        s.n = s.rows // I  # the sample of each row
        s.moved = torch.zeros_like(s.rows)
    others = _other_bins(classes, z, spec_g)
    if _estimate(a, classes, others, sides, heavy, I) > N * I * J:
        return _dense(delta, a, theta.bins(), spec_g, T, clean=True)[0]
    # the base counts of all rows (heavy ones are corrected by their tasks) run in a
    # worker thread while the moved products are counted
    size = spec_g.bins * T
    base = _Job(lambda: _run(_base_tasks(a, classes, others, z, theta.bins(), spec_g, T),
                             size, device), background=_parallel(device))
    scans = [_Job(functools.partial(_scan, a, s, I), _parallel(device)) for s in sides if s.scan]
    _extremes(a, [s for s in sides if not s.scan], I)
    for job in scans:
        job.get()

    for c in classes:  # moved per row and class; a window may run into the other end
        c.moved = torch.zeros(N * I, dtype=torch.long, device=device)
    for s in sides:
        s.cls.moved.index_add_(0, s.rows, s.moved)
    for s in sides:
        others_moved = s.cls.moved.index_select(0, s.rows) - s.moved
        s.room = s.cls.size.index_select(0, s.n) - others_moved
    heavy |= sum(c.moved for c in classes) > _HEAVY_FRACTION * J
    heavy_rows = heavy.nonzero().squeeze(1)
    windows = 0
    for s in sides:
        keep = (~heavy.index_select(0, s.rows)).nonzero().squeeze(1)
        s.rows, s.n, s.moved, s.b, s.room = (
            t.index_select(0, keep) for t in (s.rows, s.n, s.moved, s.b, s.room))
        windows += int(s.moved.sum())
        if s.scan:
            s.hits = [t[~heavy.index_select(0, s.hits[0])] for t in s.hits]
    estimate = (
        _WINDOW_COST * windows + _HEAVY_COST * heavy_rows.numel() * J
        + len(others) * (_BASE_COST * I * J + _MATMUL_COST * N * I * J * len(classes))
    )
    k_theta, theta_counts = theta.get()
    if estimate > N * I * J:
        base.get()  # let the worker finish before the dense kernel takes all threads
        return _dense(delta, a, k_theta, spec_g, T, clean=True)[0]

    counts = torch.zeros(spec_g.bins, T, dtype=torch.long, device=device)
    counts[z] = N * theta_counts  # every product at z, then moved to the other rows
    tasks = []
    for s in sides:
        if s.scan:
            tasks.append(functools.partial(_hit_counts, s, k_theta, spec_g, T))
        elif s.rows.numel():
            tasks += _window_tasks(flat_delta, s, k_theta, spec_g, T)
    if heavy_rows.numel():
        tasks += _heavy_tasks(delta, a, k_theta, heavy_rows, classes, z, spec_g, T)
    moved = _run(tasks, size, device)
    return counts.view(-1) + base.get() + moved


def _other_bins(classes: list[_Class], z: int, spec_g: BinSpec) -> list[int]:
    """The base bins other than z that occur (each costs a matrix product)."""
    occupied = sum(torch.bincount(c.base, minlength=spec_g.bins) for c in classes)
    occupied[z] = 0
    return occupied.nonzero().squeeze(1).tolist()


def _estimate(
    a: Tensor, classes: list[_Class], others: list[int], sides: list[_Side], heavy: Tensor,
    I: int,
) -> float:
    """Cost of the factored path in products of the dense kernel, before the exact counts.

    Moved counts are estimated from ~64 subsampled columns per sample (where the a-space
    crossing point falls among them); skipped when even full windows would be cheap.
    """
    N, J = a.shape
    cost = _HEAVY_COST * int(heavy.sum()) * J
    cost += len(others) * (_BASE_COST * I * J + _MATMUL_COST * N * I * J * len(classes))
    bound = cost + sum(s.rows.numel() for s in sides) * min(_HEAVY_COST, _WINDOW_COST) * J
    if bound <= N * I * J:
        return cost
    sub = a[:, :: max(1, J // _ESTIMATE_COLUMNS)]
    L = sub.shape[1]
    samples = torch.arange(N, device=a.device).repeat_interleave(L)
    for c in classes:
        member = sub > 0 if c.sign > 0 else sub < 0
        sorted_sub = sub.abs().masked_fill_(~member, torch.inf).sort(dim=1).values
        keys = _sample_keys(sorted_sub.view(-1).float(), samples)
        members = member.sum(1)
        for s in (s for s in sides if s.cls is c and s.rows.numel()):
            step = max(1, s.rows.numel() // _ESTIMATE_ROWS)  # a subset of the rows
            n = s.n[::step]
            crossing = (s.t[::step].double() / s.delta[::step].double()).abs().float()
            below = torch.searchsorted(keys, _sample_keys(crossing, n)) - n * L
            within = (members[n] - below) if s.far else below.clamp(max=members[n])
            moved = within.double() * (J / L)
            cost += float((_WINDOW_COST * moved).clamp_(max=_HEAVY_COST * J).sum()) * step
    return cost


class _Class:
    """Pos (sign 1) or Neg (sign −1) entries of every a_n: masks, sizes, reference values."""

    def __init__(self, a: Tensor, sign: int):
        self.sign = sign
        self.mask = a > 0 if sign > 0 else a < 0
        self.size = self.mask.sum(1)
        self.base = self.moved = None

    def reference_values(self, a: Tensor) -> None:
        """near, far: the class entries closest to and farthest from 0 (0 if empty); mid:
        the class mean clamped into [near, far]."""
        if self.sign > 0:
            self.far = a.amax(1).clamp(min=0)
            self.near = a.masked_fill(~self.mask, torch.inf).amin(1)
            mean = a.clamp(min=0).sum(1) / self.size.clamp(min=1)
        else:
            self.far = a.amin(1).clamp(max=0)
            self.near = a.masked_fill(~self.mask, -torch.inf).amax(1)
            mean = a.clamp(max=0).sum(1) / self.size.clamp(min=1)
        self.near = self.near.masked_fill_(self.size == 0, 0)
        low, high = (self.near, self.far) if self.sign > 0 else (self.far, self.near)
        self.mid = torch.minimum(torch.maximum(mean, low), high)


class _Side:
    """Rows (n·I + i) that move products at one end (far or near) of one class."""

    def __init__(self, cls: _Class, far: bool, rows: Tensor, scan: bool):
        self.cls, self.sign, self.far, self.rows, self.scan = cls, cls.sign, far, rows, scan
        self.n = self.b = self.up = self.t = self.delta = self.room = None
        self.vals = self.cols = self.moved = self.hits = None


def _scan(a: Tensor, s: _Side, I: int) -> None:
    """Moved counts and entries of a side with few rows, by forming its rows whole:
    ``s.hits`` = (row n·I + i, column j, product) of every moved product."""
    J = a.shape[1]
    step = max(1, _CHUNK // J)
    moved, hits = [], []
    for r0 in range(0, s.rows.numel(), step):
        n, d = s.n[r0 : r0 + step], s.delta[r0 : r0 + step].unsqueeze(1)
        products = a.index_select(0, n).mul_(d)
        hit = (products >= s.t[r0 : r0 + step].unsqueeze(1)) == s.up[r0 : r0 + step].unsqueeze(1)
        hit &= s.cls.mask.index_select(0, n)
        moved.append(hit.sum(1))
        k, j = hit.nonzero().unbind(1)
        hits.append((s.rows[r0 : r0 + step].index_select(0, k), j, products[k, j]))
    s.moved = torch.cat(moved)
    s.hits = [torch.cat(t) for t in zip(*hits, strict=True)]


def _hit_counts(s: _Side, k_theta: Tensor, spec_g: BinSpec, T: int) -> Tensor:
    """+1 at (k_g(p), k_θ) and −1 at (b, k_θ) for the moved products of a scanned side."""
    rows, cols, products = s.hits
    I, J = k_theta.shape
    dump = spec_g.bins * T
    kt = k_theta.view(-1).index_select(0, (rows % I) * J + cols).long()
    plus = _bin_(products.clone(), spec_g, torch.empty_like(kt)).mul_(T).add_(kt)
    base = s.cls.base.index_select(0, rows)
    counts = torch.bincount(plus, minlength=dump)
    counts -= torch.bincount(base.mul_(T).add_(kt), minlength=dump)
    return counts


def _extremes(a: Tensor, sides: list[_Side], I: int) -> None:
    """End-first values and columns of the classes of every a_n, and exact moved counts.

    Each side keeps the K entries of its class end (``topk``, or one sort when the K are
    large), with K bounded from the a-space crossing points t/δ plus a margin. The counts
    are exact (bisection with the real products) and verified: if a count reaches K while
    the class is longer, everything is redone with K = J from the sorted rows.
    """
    N, J = a.shape
    bounds = []
    for s in sides:
        key = s.sign * (s.t.double() / s.delta.double())  # crossing point of |a|
        slack = key.abs() * _SLACK + torch.finfo(a.dtype).tiny
        if s.far:  # moved: |a| ≥ crossing
            init, bound, reduce = torch.inf, key - slack, "amin"
        else:  # moved: |a| ≤ crossing
            init, bound, reduce = -torch.inf, key + slack, "amax"
        per_sample = torch.full((N,), init, dtype=torch.float64, device=a.device)
        per_sample = per_sample.scatter_reduce_(0, s.n, bound, reduce)
        per_sample = (s.sign * per_sample).to(a.dtype).unsqueeze(1)  # in a's units
        inside = (a >= per_sample) if s.far == (s.sign > 0) else (a <= per_sample)
        bounds.append(min(J, int((inside & s.cls.mask).sum(1).max()) + 1))
    for full in (False, True):
        ks = [J if full else k for k in bounds]
        arrays = _end_arrays(a, sides, ks, full or sum(ks) > J / _TOPK_FRACTION)
        ok = True
        for s, k, (vals, cols) in zip(sides, ks, arrays, strict=True):
            s.vals, s.cols = vals.contiguous(), cols.to(torch.int32).contiguous()
            s.moved = _count_moved(s, s.n)
            ok &= not bool(((s.moved == k) & (s.cls.size[s.n] > k)).any())
        if ok:
            return


def _end_arrays(
    a: Tensor, sides: list[_Side], ks: list[int], by_sort: bool
) -> list[tuple[Tensor, Tensor]]:
    """[N, K] values and columns of each class end, end first; ±inf past the class."""
    J = a.shape[1]
    out = []
    if by_sort:
        sorted_a, perm = torch.sort(a, dim=1)
    for s, k in zip(sides, ks, strict=True):
        if not by_sort:
            key = a if s.far else torch.where(s.cls.mask, a, s.sign * torch.inf)
            out.append(_topk(key, k, largest=(s.sign > 0) == s.far))
        elif s.far:  # largest a first for Pos, smallest first for Neg
            vals, cols = (sorted_a.flip(1), perm.flip(1)) if s.sign > 0 else (sorted_a, perm)
            out.append((vals[:, :k], cols[:, :k]))
        else:  # Pos: positions J − n_pos, J − n_pos + 1, …; Neg: n_neg − 1, n_neg − 2, …
            r = torch.arange(k, device=a.device)
            size = s.cls.size.unsqueeze(1)
            index = ((J - size) + r) if s.sign > 0 else (size - 1 - r)
            index = index.clamp_(0, J - 1)
            vals = torch.gather(sorted_a, 1, index).masked_fill_(r >= size, s.sign * torch.inf)
            out.append((vals, torch.gather(perm, 1, index)))
    return out


def _topk(x: Tensor, k: int, largest: bool) -> tuple[Tensor, Tensor]:
    """``torch.topk`` along rows; on CPU the rows are shared by the worker threads."""
    parts = min(torch.get_num_threads(), _MAX_WORKERS, x.shape[0]) if _parallel(x.device) else 1
    if parts <= 1:
        return tuple(torch.topk(x, k, dim=1, largest=largest))
    jobs = [_Job(functools.partial(torch.topk, chunk, k, dim=1, largest=largest), w > 0)
            for w, chunk in reversed(list(enumerate(x.chunk(parts))))]
    results = [job.get() for job in reversed(jobs)]
    return torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])


def _count_moved(s: _Side, sample: Tensor) -> Tensor:
    """m per row of the side: a ``searchsorted`` guess at the a-space crossing point in the
    end-first rows, verified with the exact products on both sides of the boundary; rows
    whose guess fails are bisected."""
    N, K = s.vals.shape
    magnitude = s.vals.abs()
    inside = (s.sign * s.vals > 0) & (magnitude < torch.inf)
    # u is non-decreasing along every row: −|v| at the far end, |v| at the near end
    u = (-magnitude if s.far else magnitude).masked_fill_(~inside, torch.inf)
    rows_of = torch.arange(N, device=u.device).repeat_interleave(K)
    keys = _sample_keys(u.view(-1).float(), rows_of)
    crossing = (s.t.double() / s.delta.double()).abs()
    query = _sample_keys((-crossing if s.far else crossing).float(), sample)
    guess = torch.searchsorted(keys, query, right=True) - sample * K
    flat = s.vals.view(-1)

    def moved(r: Tensor) -> Tensor:
        v = flat.index_select(0, sample * K + r.clamp(0, K - 1))
        hit = (v * s.delta >= s.t) == s.up
        return hit & ((v > 0) & (v < torch.inf) if s.sign > 0 else (v < 0) & (v > -torch.inf))

    ok = ((guess == 0) | moved(guess - 1)) & ((guess == K) | ~moved(guess))
    bad = (~ok).nonzero().squeeze(1)
    if bad.numel():
        guess[bad] = _bisect(s.vals, sample[bad], s, bad)
    return guess


def _bisect(vals: Tensor, sample: Tensor, s: _Side, subset: Tensor) -> Tensor:
    """m = #{r : v_r in the class and moved} along the end-first rows (exact).

    Branchless binary search: moved(r) is true for r < m and false after.
    """
    K = vals.shape[1]
    flat = vals.view(-1)
    last = sample * K + (K - 1)
    found = torch.zeros_like(sample)
    step = 1 << (K.bit_length() - 1)
    while step:
        probe = found + step  # test entry probe − 1 (if probe ≤ K)
        v = flat.index_select(0, last - (K - probe).clamp_(min=0))
        hit = (v * s.delta[subset] >= s.t[subset]) == s.up[subset]
        hit &= (v > 0) & (v < torch.inf) if s.sign > 0 else (v < 0) & (v > -torch.inf)
        hit &= probe <= K
        found.add_(hit.to(found.dtype), alpha=step)
        step >>= 1
    return found


def _base_tasks(
    a: Tensor, classes: list[_Class], others: list[int], z: int,
    k_theta: Tensor, spec_g: BinSpec, T: int,
) -> list[Callable[[], Tensor]]:
    """Tasks adding bincount(k_θ, weights=W_b) to row b and subtracting it from row z, for
    blocks of rows i; W_b by one matrix product per block. Float32 weights are integers
    ≤ N and a block's counts stay below 2^24 (exact)."""
    N, J = a.shape
    I = k_theta.shape[0]
    if not others:
        return []
    columns = torch.cat([c.mask.to(torch.float32) for c in classes])  # [C·N, J]
    bases = [c.base.view(N, I) for c in classes]
    block = max(1, min(_CHUNK, 2**24 // N) // J)

    def task(i0: int, b: int) -> Tensor:
        coef = torch.cat([(base[:, i0 : i0 + block] == b).to(torch.float32) for base in bases])
        weights = (coef.T @ columns).view(-1)  # W_b for the block, integers ≤ N
        kt = k_theta[i0 : i0 + block].view(-1)
        row = torch.bincount(kt, weights=weights, minlength=T).long()
        out = torch.zeros(spec_g.bins, T, dtype=torch.long, device=a.device)
        out[b] += row
        out[z] -= row
        return out.view(-1)

    return [functools.partial(task, i0, b) for b in others for i0 in range(0, I, block)]


def _window_tasks(
    flat_delta: Tensor, s: _Side, k_theta: Tensor, spec_g: BinSpec, T: int
) -> list[Callable[[], Tensor]]:
    """Tasks adding +1 at (k_g(p), k_θ) and −1 at (b, k_θ) for the moved products p of one
    side.

    Rows sorted by their count m are grouped into tasks of at most ``_CHUNK`` elements; a
    task reads the first M entries (M = its largest m) of each row's end-first array, all
    gathered as rows of one tensor (rows ordered by i, so a θ row serves several samples).
    Entries r ≥ m of the same class have bin b and cancel; where the window may reach past
    the class or into its other end's moved entries (room < M), they are masked.
    """
    I, J = k_theta.shape
    device = flat_delta.device
    dump = spec_g.bins * T
    order = torch.argsort(s.moved)
    moved = s.moved.index_select(0, order)
    values, per_value = torch.unique_consecutive(moved, return_counts=True)
    chunk = _CHUNK if device.type == "cpu" else 2**24
    tasks = []  # (width, first row, end row)

    def close(width: int, start: int, end: int) -> None:
        step = max(1, chunk // width)
        tasks.extend((width, r0, min(end, r0 + step)) for r0 in range(start, end, step))

    first = group = width = 0
    for m, count in zip(values.tolist(), per_value.tolist(), strict=True):
        if group and (group + count) * m > chunk:  # close the group of smaller counts
            close(width, first - group, first)
            group = 0
        group, width, first = group + count, m, first + count
    close(width, first - group, first)
    sizes = torch.tensor([r1 - r0 for _, r0, r1 in tasks], device=device)
    task_of = torch.repeat_interleave(torch.arange(len(tasks), device=device), sizes)
    rows, sample = s.rows.index_select(0, order), s.n.index_select(0, order)
    order = order[torch.argsort(task_of * I + (rows - sample * I))]  # by task, then by i
    rows, sample, moved, room = (t.index_select(0, order) for t in (s.rows, s.n, s.moved, s.room))
    offset = ((rows - sample * I) * J).to(torch.int32).unsqueeze(1)
    delta = flat_delta.index_select(0, rows).unsqueeze(1)
    index_dtype = _index_dtype(dump + 1)
    base = (s.b.index_select(0, order) * T).to(index_dtype).unsqueeze(1)
    flat_theta = k_theta.view(-1)

    def task(M: int, r0: int, r1: int) -> Tensor:
        n = sample[r0:r1]
        products = s.vals[:, :M].index_select(0, n).mul_(delta[r0:r1])
        cols = s.cols[:, :M].index_select(0, n).add_(offset[r0:r1])
        kt = flat_theta.index_select(0, cols.view(-1)).view(cols.shape)
        plus = _bin_(products, spec_g, torch.empty(cols.shape, dtype=index_dtype, device=device))
        plus = torch.add(kt, plus, alpha=T, out=plus)
        minus = torch.add(kt, base[r0:r1])
        if bool((room[r0:r1] < M).any()):
            outside = torch.arange(M, device=device) >= moved[r0:r1].unsqueeze(1)
            plus.masked_fill_(outside, dump)
            minus.masked_fill_(outside, dump)
        counts = torch.bincount(plus.view(-1), minlength=dump + 1)
        counts -= torch.bincount(minus.view(-1), minlength=dump + 1)
        return counts[:dump]

    return [functools.partial(task, *t) for t in tasks]


def _heavy_tasks(
    delta: Tensor, a: Tensor, k_theta: Tensor, rows: Tensor, classes: list[_Class], z: int,
    spec_g: BinSpec, T: int,
) -> list[Callable[[], Tensor]]:
    """Tasks adding +1 at (k_g(p), k_θ) and −1 at (base, k_θ) for all products p of the
    rows (n·I + i), formed whole; base is the base bin of p's class (z for a = 0)."""
    I = delta.shape[1]
    J = a.shape[1]
    dump = spec_g.bins * T
    step = max(1, _chunk_size(a.device, rows.numel() * J) // J)
    flat_delta = delta.reshape(-1)

    def task(r0: int) -> Tensor:
        r = rows[r0 : r0 + step]
        n = r // I
        values = a.index_select(0, n)
        kt = k_theta.index_select(0, r - n * I)
        base = torch.full(kt.shape, z, dtype=torch.int32, device=a.device)
        for c in classes:
            row_base = c.base.index_select(0, r).to(torch.int32).unsqueeze(1)
            base = torch.where(c.mask.index_select(0, n), row_base, base)
        index = _bin_(values.mul_(flat_delta[r].unsqueeze(1)), spec_g,
                      torch.empty_like(kt, dtype=torch.int32))
        counts = torch.bincount(index.mul_(T).add_(kt).view(-1), minlength=dump)
        counts -= torch.bincount(base.mul_(T).add_(kt).view(-1), minlength=dump)
        return counts

    return [functools.partial(task, r0) for r0 in range(0, rows.numel(), step)]
