"""Fitting the measured update ``a = θ_{t+1} − θ_t`` in the span of a basis ``V`` (rows: the
tensors :func:`cockpit.engine.update_prediction.sgd_update_basis` snapshots): least-squares
coefficients ``c`` with ``a ≈ Vᵀc``, accepted when ``‖a − Vᵀc‖ ≤ rtol ‖a‖ + atol``. Then
``s_tᵀ g_n = Σ_k c_k (V_kᵀ g_n)`` for every sample, from the projections on the basis.

:class:`BasisFits` forms every tensor's fit on the device without reading it (normal
equations VVᵀc = Va in the tensors' dtype, solved in float64 by LU, residuals measured
directly); :meth:`BasisFits.accept` decides on the host copy and solves once more, from
normal equations accumulated in float64 (SVD on the host), what failed. On the
accelerators' path the fits of all tensors are formed at once, in a fixed number of ops
(:func:`_fit_in_blocks`); on the CPU one tensor at a time, without a copy of the bases.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from cockpit.engine import float_sums
from cockpit.engine.chunk_cat import chunk_cat_takes
from cockpit.engine.histograms.device import device_path
from cockpit.engine.workspace import PARAMETER_SIZED, workspace

_TINY = 1e-300


def fit_basis_coefficients(
    basis: Tensor | Sequence[Tensor], actual: Tensor, rtol: float = 1e-4, atol: float = 0.0,
    actual_sq: float | None = None,
) -> Tensor | None:
    """Least-squares coefficients c with ``actual ≈ Σ_k c_k basis_k`` (float64, on the CPU).

    Accepted when ``‖actual − Σ c_k basis_k‖ ≤ rtol ‖actual‖ + atol``, else None; ``atol``
    covers the rounding in measuring ``actual`` (a difference of parameters); ``actual_sq``
    is ‖actual‖² if the caller has it already. Then
    ``s_tᵀ g_n = Σ_k c_k (basis_kᵀ g_n)`` for any vector g_n, also if the basis is degenerate.
    ``basis``: a stacked tensor ``[k, ...]`` (as from :func:`sgd_update_basis`) or a list.
    See :func:`fit_basis_coefficients_many`.
    """
    if actual_sq is None:
        actual_sq = float(float_sums.sq_norm(actual))
    return fit_basis_coefficients_many([basis], [actual], rtol, [atol], [actual_sq])[0]


def fit_basis_coefficients_many(
    bases: Sequence[Tensor | Sequence[Tensor]], actuals: Sequence[Tensor], rtol: float,
    atols: Sequence[float], actual_sqs: Sequence[float],
) -> list[Tensor | None]:
    """:func:`fit_basis_coefficients` of several tensors at once (``actual_sqs``: ‖actual‖²
    of each): every fit is solved and checked on the device (:class:`BasisFits`), then read
    once; only fits that fail there are read again (:meth:`BasisFits.accept`)."""
    fits = BasisFits(bases, actuals)
    host = to_host(torch.cat([fits.coefficients, fits.residual_norms.to(
        fits.coefficients.device)])).numpy()
    answer = fits.accept(host[len(fits.coefficients):], rtol, atols, actual_sqs)
    results: list[Tensor | None] = []
    offset = 0
    for index, (vectors, _) in enumerate(fits.problems):
        k = len(vectors)
        results.append(answer[index] if index in answer
                       else torch.from_numpy(host[offset : offset + k].copy()))
        offset += k
    return results


class BasisFits:
    """Least-squares fits ``a ≈ Vᵀc`` of several tensors, formed on the device without
    reading it: ``coefficients`` (float64, every tensor's c in turn) solve each tensor's
    normal equations VVᵀc = Va (BLAS products in the tensors' dtype, solved in float64),
    ``residual_norms`` (float64) are ‖a − Vᵀc‖ of each, measured directly. On the host,
    :meth:`accept` decides by them and solves once more what failed. ``problems``: (V, a)
    of each tensor (on the accelerators' path as given: V [k, *shape] or [k, D], a [*shape];
    elsewhere flattened: V [k, D], a [D]).

    On the accelerators' path (plain tensors on one device) all fits are formed together,
    per dtype and basis size, in blocks (:func:`_fit_in_blocks`: a fixed number of ops for
    any number of tensors, a copy of the bases and updates while it runs); elsewhere (the
    CPU path: no such copy; sharded tensors; several devices) one tensor at a time.

    The k×k systems (k ≤ 3) are scaled to a unit diagonal (Jacobi) and solved by LU
    (``solve_ex``: no error check, which would read the device); a row of zeros (a zero
    basis vector: a zero-initialised bias with weight decay) gets coefficient 0. A singular
    system (two parallel basis vectors) or non-finite one leaves a non-finite residual,
    which fails the check.
    """

    def __init__(self, bases: Sequence[Tensor | Sequence[Tensor]], actuals: Sequence[Tensor]):
        device = actuals[0].device if actuals else torch.device("cpu")
        packed = _packed(bases, actuals, device)
        self.problems = []  # (V [k, *shape], a [*shape]) per tensor, not flattened (views)
        for basis, actual in zip(bases, actuals, strict=True):
            k = len(basis)
            if isinstance(basis, _Slot):  # (its view only where needed)
                vectors = basis if packed is not None else basis.vectors().to(actual.dtype)
            elif k == 0:
                vectors = actual.reshape(-1)[:0].view(0, -1)
            elif isinstance(basis, Tensor):
                vectors = basis.to(actual.dtype)
            else:
                vectors = torch.stack([b.reshape(actual.shape).to(actual.dtype) for b in basis])
            self.problems.append((vectors, actual))
        if packed is not None:
            self.coefficients, self.residual_norms = _fit_in_blocks(self.problems, device,
                                                                    packed)
            return
        if _in_blocks(self.problems, device):
            self.coefficients, self.residual_norms = _fit_in_blocks(self.problems, device)
            return
        self.problems = [_flat(v, t) for v, t in self.problems]
        self.coefficients = _solve_on_device(
            [_normal_equations(v, t) for v, t in self.problems], device)
        self.residual_norms = _residual_norms(self.problems, self.coefficients, device)

    def accept(self, residual_norms: Sequence[float], rtol: float, atols: Sequence[float],
               actual_sqs: Sequence[float]) -> dict[int, Tensor | None]:
        """The fits ``coefficients`` does not give, by index: ``residual_norms`` is the host
        copy of ``residual_norms``; a fit is accepted when ``‖a − Vᵀc‖ ≤ rtol ‖a‖ + atol``.
        A tensor without a basis or with a non-finite ‖a‖² has no fit (None); one that
        failed is solved once more from normal equations accumulated in float64 (by LAPACK's
        SVD on the host, which reads the device): they square the condition number of V,
        and directions that are nearly parallel (the gradient and SGD's momentum buffer when
        consecutive gradients agree) leave float32 products too inaccurate for a fit that
        exists. What fails then has no fit (None)."""
        answer: dict[int, Tensor | None] = {}
        retry = []
        for index, ((vectors, target), residual, atol, target_sq) in enumerate(zip(
                self.problems, residual_norms, atols, actual_sqs, strict=True)):
            if not len(vectors) or not math.isfinite(target_sq):
                answer[index] = None
                continue
            tolerance = rtol * math.sqrt(target_sq) + atol + _TINY
            if not residual <= tolerance:  # (NaN: fails)
                answer[index] = None
                retry.append((index, vectors, target, tolerance))
        if retry:
            systems = [_normal_equations_float64(*_flat(v, t)) for _, v, t, _ in retry]
            host = to_host(_flat_systems(systems, retry[0][2].device)).numpy()
            answer.update(_fit_on_host(retry, host))
        return answer


def _solve_on_device(systems: list[tuple[Tensor, Tensor]], device: torch.device) -> Tensor:
    """c of every system (VVᵀ, Va), float64 in turn on ``device`` (see :class:`BasisFits`);
    one batched solve per basis size."""
    by_size: dict[int, list[int]] = {}
    for index, (gram, _) in enumerate(systems):
        by_size.setdefault(len(gram), []).append(index)
    pieces: dict[int, Tensor] = {}
    for k, indices in by_size.items():
        if k == 0:
            continue
        grams = torch.stack([systems[i][0].to(device) for i in indices]).double()
        rhs = torch.stack([systems[i][1].to(device) for i in indices]).double()
        solved = _solve_batched(grams, rhs)
        if len(by_size) == 1:
            return solved.reshape(-1)
        pieces.update(zip(indices, solved.unbind(0), strict=True))
    if not pieces:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.cat([pieces[i] for i in range(len(systems)) if i in pieces])


def _solve_batched(grams: Tensor, rhs: Tensor) -> Tensor:
    """c of the float64 systems ``grams`` [n, k, k] c = ``rhs`` [n, k] (``grams`` is
    overwritten): Jacobi-scaled, a zero row gives c = 0, solved by LU (see
    :class:`BasisFits`)."""
    diagonal = grams.diagonal(dim1=1, dim2=2)
    zero = diagonal == 0
    scale = diagonal.add(zero).rsqrt_()  # (a zero row: 1)
    grams.mul_(scale.unsqueeze(2) * scale.unsqueeze(1))
    diagonal.add_(zero)  # a zero row's equation: c = Va = 0
    solution = torch.linalg.solve_ex(grams, (rhs * scale).unsqueeze(2)).result
    return solution.squeeze(2).mul_(scale)


# Elements per block of the batched fit (accelerators). Each block's (k+1)×(k+1) Gram matrix
# sums b products in the tensors' dtype (the blocks are then summed in float64); a tensor's
# rows are padded with zeros to whole blocks (< b elements each); the Gram matrices take
# (k+1)²/b of the rows' memory (< 2 % for k ≤ 3); and 1024 × (k+1) elements per block keep
# the batched products efficient kernels (not thousands of tiny matrices).
_BLOCK = 1024
# Blocks per group at most (a tensor larger than that is a group of its own): F, the copy of
# a group's bases and updates, stays below (k + 1) · 2^25 elements (384 MiB in float32 for
# k = 2; the per-tensor fit held all residuals at once, one parameter-sized copy), at the
# cost of one more set of ops per 2^25 elements.
_CHUNK_BLOCKS = 2**25 // _BLOCK


def _in_blocks(problems: list[tuple[Tensor, Tensor]], device: torch.device) -> bool:
    """Whether the fits are formed all at once (:func:`_fit_in_blocks`): on the
    accelerators' path of a device with a segmented sum (CUDA; the CPU when forced), plain
    non-empty floating-point tensors on that device (sharded ones, DTensors, tensors on
    several devices and other accelerators take the fits one tensor at a time)."""
    return bool(problems) and all(
        _packs_on(target, device) and type(vectors) is Tensor and vectors.device == device
        for vectors, target in problems)


def packs(tensor: Tensor) -> bool:
    """Whether bases of ``tensor``'s shape and device go into :class:`PackedBases`: plain
    non-empty floating-point tensors on the accelerators' path of a device with a
    segmented sum (CUDA; the CPU when forced)."""
    return (type(tensor) is Tensor and tensor.is_floating_point() and tensor.numel() > 0
            and tensor.device.type in ("cuda", "cpu") and device_path(tensor.device))


def _packs_on(tensor: Tensor, device: torch.device) -> bool:
    """:func:`packs` for a tensor on ``device``."""
    return packs(tensor) and tensor.device == device


def _packed(bases: Sequence, actuals: Sequence[Tensor], device: torch.device
            ) -> PackedBases | None:
    """The :class:`PackedBases` whose slots ``bases`` are, all of them in order, if the
    updates ``actuals`` fit its rows (their sizes and dtypes, plain tensors on its device,
    on the accelerators' path); else None."""
    first = bases[0] if len(bases) else None
    if not isinstance(first, _Slot):
        return None
    packed = first.packed
    if len(bases) != len(packed.spec) or not all(
            isinstance(b, _Slot) and b.packed is packed and b.index == i
            for i, b in enumerate(bases)):
        return None
    if tuple((len(b), a.numel(), a.dtype) for b, a in zip(bases, actuals, strict=True)
             ) != packed.spec or packed.rows[0].device != device:
        return None
    return packed if all(_packs_on(a, device) for a in actuals) else None


class _Group(NamedTuple):
    """Problems of one dtype and basis size k, laid out as rows ``F`` [k + 1, blocks·b]:
    the k basis vectors and the target, each tensor in whole blocks of b elements."""

    members: list[int]  # indices of the problems, in order
    k: int
    dtype: torch.dtype
    blocks: int  # in all
    pads: list[tuple[Tensor, Tensor] | None]  # per member: zeros after V [k, p] and a [p]
    owner: Tensor  # [blocks]: the member (position in ``members``) of each block
    lengths: Tensor  # [members]: blocks per member


class _Layout(NamedTuple):
    groups: list[_Group]
    coefficient_order: Tensor | None  # the groups' coefficients → problem order (None: same)
    norm_order: Tensor | None  # the groups' residual norms → problem order


# Layouts recently used (the same parameters every tracked step): key → _Layout.
_LAYOUTS: OrderedDict[tuple, _Layout] = OrderedDict()
_LAYOUTS_KEPT = 4


def _spec(problems: list[tuple[Tensor, Tensor]]) -> tuple[tuple[int, int, torch.dtype], ...]:
    """(k, D, dtype) of every problem: what its place in the blocks depends on."""
    return tuple((len(v), t.numel(), t.dtype) for v, t in problems)


def _layout(spec: tuple[tuple[int, int, torch.dtype], ...], device: torch.device) -> _Layout:
    """The blocks of problems with ``spec`` (:func:`_spec`; cached: built on the host once
    per set of shapes, its index tensors moved to ``device`` without waiting)."""
    key = (device, _CHUNK_BLOCKS, spec)
    layout = _LAYOUTS.get(key)
    if layout is not None:
        _LAYOUTS.move_to_end(key)
        return layout
    by_kind: dict[tuple[torch.dtype, int], list[list[int]]] = {}
    filled: dict[tuple[torch.dtype, int], int] = {}  # blocks in the last chunk of each kind
    for index, (k, numel, dtype) in enumerate(spec):
        kind, blocks = (dtype, k), max(1, -(-numel // _BLOCK))
        chunks = by_kind.setdefault(kind, [[]])
        if chunks[-1] and filled[kind] + blocks > _CHUNK_BLOCKS:
            chunks.append([])
            filled[kind] = 0
        chunks[-1].append(index)
        filled[kind] = filled.get(kind, 0) + blocks
    groups, coefficient_slots, norm_slots = [], [], []
    for (dtype, k), members in ((kind, c) for kind, chunks in by_kind.items() for c in chunks):
        counts = [max(1, -(-spec[i][1] // _BLOCK)) for i in members]
        widest = max(n * _BLOCK - spec[i][1] for n, i in zip(counts, members, strict=True))
        zeros = torch.zeros((k + 1) * widest, dtype=dtype, device=device)
        pads = []
        for n, i in zip(counts, members, strict=True):
            pad = n * _BLOCK - spec[i][1]
            pads.append((zeros[: k * pad].view(k, pad), zeros[:pad]) if pad else None)
        owner = torch.repeat_interleave(torch.arange(len(members)), torch.tensor(counts))
        groups.append(_Group(members, k, dtype, sum(counts), pads, to_device(owner, device),
                             to_device(torch.tensor(counts), device)))
        coefficient_slots += [(i, r) for i in members for r in range(k)]
        norm_slots += members
    coefficient_order = _order(coefficient_slots, device)
    norm_order = _order(norm_slots, device)
    layout = _Layout(groups, coefficient_order, norm_order)
    _LAYOUTS[key] = layout
    while len(_LAYOUTS) > _LAYOUTS_KEPT:
        _LAYOUTS.popitem(last=False)
    return layout


def _order(slots: list, device: torch.device) -> Tensor | None:
    """The index that gathers values listed by ``slots`` in sorted order (None: already)."""
    order = sorted(range(len(slots)), key=slots.__getitem__)
    if order == list(range(len(slots))):
        return None
    return to_device(torch.tensor(order), device)


class PackedBases:
    """The bases of several tensors copied at once into the rows F of the batched fit
    (:func:`_fit_in_blocks`): one ``_chunk_cat`` per basis row and group, where the
    tensors must be copied anyway (before the optimizer step changes θ and its momentum
    buffer in place). ``bases``: the rows of each tensor (k of them, of its shape and
    dtype; k ≥ 1), all non-empty, on ``device``. ``slots()`` stand for each tensor's basis
    in :class:`BasisFits`, which copies the updates into rows of their own while the fit
    runs. Memory: the k rows of every tensor, rounded up to whole blocks, as long as the
    slots live (the stacked bases they replace took as much)."""

    def __init__(self, bases: Sequence[Sequence[Tensor]], device: torch.device):
        self.spec = tuple((len(rows), rows[0].numel(), rows[0].dtype) for rows in bases)
        self.layout = _layout(self.spec, device)
        self.rows: list[Tensor] = []
        for group in self.layout.groups:
            k = group.k
            rows = torch.empty(k, 1, group.blocks * _BLOCK, dtype=group.dtype,
                               device=device)
            for r in range(k):
                pieces = []
                for index, pad in zip(group.members, group.pads, strict=True):
                    row = bases[index][r]
                    pieces.append(row if row.dim() else row.view(1))
                    if pad is not None:
                        pieces.append(pad[1])
                _flat_cat(pieces, 0, rows[r])
            self.rows.append(rows)

    def slots(self) -> list[_Slot]:
        """Each tensor's basis, in the order given."""
        slots: list[_Slot | None] = [None] * len(self.spec)
        for rows, group in zip(self.rows, self.layout.groups, strict=True):
            offset = 0
            for index in group.members:
                numel = self.spec[index][1]
                slots[index] = _Slot(self, index, rows, offset, numel)
                offset += max(1, -(-numel // _BLOCK)) * _BLOCK
        return slots  # type: ignore[return-value]


class _Slot:
    """One tensor's basis inside :class:`PackedBases`: ``len`` is k; :meth:`vectors` the
    basis as V [k, D] (a view, made when asked for: the host's retry of a failed fit)."""

    __slots__ = ("index", "numel", "offset", "packed", "rows")

    def __init__(self, packed: PackedBases, index: int, rows: Tensor, offset: int,
                 numel: int):
        self.packed, self.index, self.rows = packed, index, rows
        self.offset, self.numel = offset, numel

    def __len__(self) -> int:
        return self.rows.shape[0]  # (not len(): Tensor.__len__ is a Python function)

    def vectors(self) -> Tensor:
        return self.rows[:, 0, self.offset : self.offset + self.numel]


def _fit_in_blocks(problems: list[tuple[Tensor, Tensor]], device: torch.device,
                   packed: PackedBases | None = None) -> tuple[Tensor, Tensor]:
    """``coefficients`` and ``residual_norms`` of :class:`BasisFits`, every tensor at once:
    per dtype and basis size, the rows ``F`` = [V; a] of all tensors in blocks of b elements
    (:class:`_Group`); one batched product gives every block's Gram matrix F_j F_jᵀ (VVᵀ,
    Va), summed per tensor in float64; one batched solve; the residuals a − Vᵀc of every
    block by one batched product (written over F's row a), their squares summed per tensor
    in float64. A fixed number of ops for any number of tensors; F is a copy of the bases
    and targets while the fit runs (the residuals take its row a); with ``packed``, whose
    rows hold the bases already, only the targets are copied (and take the residuals)."""
    layout = _layout(_spec(problems), device) if packed is None else packed.layout
    rows: list[Tensor | None] = ([None] * len(layout.groups) if packed is None
                                 else list(packed.rows))
    with torch.no_grad():
        fitted = [_fit_group(problems, group, device, group_rows)
                  for group, group_rows in zip(layout.groups, rows, strict=True)]
        if len(fitted) == 1:
            return fitted[0]
        coefficients = torch.cat([c for c, _ in fitted])
        norms = torch.cat([r for _, r in fitted])
    if layout.coefficient_order is not None:
        coefficients = coefficients.index_select(0, layout.coefficient_order)
    if layout.norm_order is not None:
        norms = norms.index_select(0, layout.norm_order)
    return coefficients, norms


def _fit_group(problems: list[tuple[Tensor, Tensor]], group: _Group, device: torch.device,
               rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Coefficients (every member's c in turn) and residual norms of one :class:`_Group`
    (``rows``: its basis rows V [k, 1, blocks·b], from :class:`PackedBases`)."""
    k = group.k
    vectors: list[Tensor] = []
    targets: list[Tensor] = []
    for index, pad in zip(group.members, group.pads, strict=True):
        v, t = problems[index]
        if rows is None:
            vectors.append(v if v.dim() > 1 else v.view(k, 1))  # (a scalar parameter's)
        targets.append(t if t.dim() else t.view(1))
        if pad is not None:
            vectors.append(pad[0])
            targets.append(pad[1])
    length = group.blocks * _BLOCK
    if rows is None:  # F = [V; a], one product for VVᵀ and Va of every block
        rows = torch.empty(k + 1, 1, length, dtype=group.dtype, device=device)
        if k:
            _flat_cat(vectors, 1, rows[:k])
        _flat_cat(targets, 0, rows[k])
        blocks = rows.view(k + 1, group.blocks, _BLOCK).transpose(0, 1)  # [blocks, k+1, b]
        grams = _sum_blocks(torch.bmm(blocks, blocks.transpose(1, 2)), group)
        if k == 0:  # no basis: the residual is a
            return grams.new_zeros(0), grams.view(-1).sqrt_()
        gram, rhs = grams[:, :k, :k], grams[:, :k, k]
        basis, residuals = blocks[:, :k], blocks[:, k:]  # [blocks, 1, b]: a, then a − Vᵀc
    else:  # V held (until the decision), a only while the fit runs
        target = torch.empty(1, length, dtype=group.dtype, device=device)
        _flat_cat(targets, 0, target)
        basis = rows.view(k, group.blocks, _BLOCK).transpose(0, 1)  # [blocks, k, b]
        residuals = target.view(group.blocks, 1, _BLOCK)
        grams = _sum_blocks(torch.cat([torch.bmm(basis, basis.transpose(1, 2)),
                                       torch.bmm(basis, residuals.transpose(1, 2))], dim=2),
                            group)  # [members, k, k + 1]
        gram, rhs = grams[..., :k], grams[..., k]
    coefficients = _solve_batched(gram, rhs)
    per_block = coefficients.to(group.dtype).index_select(0, group.owner).unsqueeze(1)
    residuals.baddbmm_(per_block, basis, alpha=-1)
    norms = _sum_blocks(torch.bmm(residuals, residuals.transpose(1, 2)), group)
    return coefficients.reshape(-1), norms.view(-1).sqrt_()


def _sum_blocks(per_block: Tensor, group: _Group) -> Tensor:
    """Each member's sum over its blocks, in float64 (one segmented sum: deterministic, no
    atomics). ``unsafe``: without it, torch checks the lengths by reading them from the
    device (a wait); the layout gives every member at least one block, summing to all."""
    return torch.segment_reduce(per_block.double(), "sum", lengths=group.lengths, axis=0,
                                unsafe=True)


def _flat_cat(tensors: list[Tensor], dim: int, out: Tensor) -> None:
    """``tensors`` flattened from ``dim`` on and concatenated there, into ``out``: one op
    (``_chunk_cat``, FSDP2's copy-in, where this torch has it), not a view per tensor."""
    if chunk_cat_takes(tensors):
        torch._chunk_cat(tensors, dim, 1, out=out)
        return
    torch.cat([t.flatten(dim) for t in tensors], dim=dim, out=out.flatten(dim))


def _residual_norms(problems: list[tuple[Tensor, Tensor]], coefficients: Tensor,
                    device: torch.device) -> Tensor:
    """‖a − Vᵀc‖ of every problem, float64 on ``device`` (NaN-free inputs give finite
    norms); one cast and split of ``coefficients`` per dtype."""
    if not problems:
        return torch.zeros(0, dtype=torch.float64, device=device)
    sizes = [len(v) for v, _ in problems]
    fused = device_path(device) and all(  # (not for DTensors: their own norms)
        type(target) is Tensor and target.device == device for _, target in problems)
    by_dtype: dict[torch.dtype, tuple[Tensor, ...]] = {}
    norms, residuals_fused = [], []
    for i, problem in enumerate(problems):
        vectors, target = _flat(*problem)
        if target.dtype not in by_dtype:
            by_dtype[target.dtype] = coefficients.to(target.dtype).split(sizes)
        c = by_dtype[target.dtype][i]
        if fused:  # fresh residuals, one multi-tensor norm for all (accelerators)
            residuals_fused.append(torch.addmv(target, vectors.T, c, alpha=-1))
            continue
        scratch, _ = workspace().take(PARAMETER_SIZED, target.shape, target.dtype,
                                      target.device)
        residual = torch.addmv(target, vectors.T, c, alpha=-1, out=scratch)
        norms.append(torch.linalg.vector_norm(residual).to(device))
    if fused:
        norms = list(torch._foreach_norm(residuals_fused, dtype=torch.float64))
    return torch.stack(norms).to(torch.float64)


def _fit_on_host(pending: list, host: np.ndarray) -> dict[int, Tensor | None]:
    """Coefficients (or None) of the ``pending`` problems (index, V, a, tolerance) from
    ``host``, the host copy of their flat normal equations: solved by LAPACK's gelsd (SVD),
    accepted by their residual (one more read of the device)."""
    answer: dict[int, Tensor | None] = {index: None for index, *_ in pending}
    solved, offset = [], 0
    for index, vectors, target, tolerance in pending:
        k = len(vectors)
        system = host[offset : offset + k * k + k]
        offset += k * k + k
        if not np.isfinite(system).all():
            continue  # no fit exists: None
        coefficients = np.linalg.lstsq(system[: k * k].reshape(k, k), system[k * k :],
                                       rcond=None)[0]
        solved.append((index, vectors, target, tolerance, torch.from_numpy(coefficients)))
    if not solved:
        return answer
    device = solved[0][2].device
    on_device = to_device(torch.cat([c for *_, c in solved]), device)
    residuals = to_host(_residual_norms([(v, t) for _, v, t, _, _ in solved], on_device,
                                         device)).tolist()
    for (index, _, _, tolerance, coefficients), residual in zip(solved, residuals,
                                                                strict=True):
        if residual <= tolerance:
            answer[index] = coefficients
    return answer


def _flat_systems(systems: list[tuple[Tensor, Tensor]], device: torch.device) -> Tensor:
    """[VVᵀ flat, Vᵀa] of every tensor in one float64 vector (concatenated in their dtypes,
    then cast once: the cast to float64 is exact either way)."""
    parts = [(part if part.dim() == 1 else part.reshape(-1)).to(device)
             for gram, rhs in systems for part in (gram, rhs)]
    if not parts:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.cat(parts).double()


def to_host(x: Tensor) -> Tensor:
    """float64 copy on the CPU: the fit's read of the device."""
    return x.detach().to("cpu", torch.float64)


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on ``device`` without waiting (pinned, non-blocking copy)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _flat(vectors: Tensor | _Slot, target: Tensor) -> tuple[Tensor, Tensor]:
    """V as [k, D] and a as [D] (views)."""
    if isinstance(vectors, _Slot):
        vectors = vectors.vectors()
    return (vectors if vectors.dim() == 2 else vectors.reshape(len(vectors), -1),
            target if target.dim() == 1 else target.reshape(-1))


def _normal_equations(vectors: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """VVᵀ and Vᵀa in the tensors' dtype (two BLAS products) on their device."""
    return vectors @ vectors.T, vectors @ target


# Elements per block of the float64 normal equations: the float64 copies stay in cache.
_FLOAT64_BLOCK = 2**16


def _normal_equations_float64(vectors: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """VVᵀ and Vᵀa accumulated in float64, block by block (no float64 copy of V)."""
    k = vectors.shape[0]
    gram = torch.zeros(k, k, dtype=torch.float64, device=vectors.device)
    rhs = torch.zeros(k, dtype=torch.float64, device=vectors.device)
    for start in range(0, target.numel(), _FLOAT64_BLOCK):
        block = vectors[:, start : start + _FLOAT64_BLOCK].double()
        gram.addmm_(block, block.T)
        rhs.addmv_(block, target[start : start + _FLOAT64_BLOCK].double())
    return gram, rhs
