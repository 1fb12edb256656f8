"""Fitting the measured update ``a = θ_{t+1} − θ_t`` in the span of a basis ``V`` (rows: the
tensors :func:`cockpit.engine.update_prediction.sgd_update_basis` snapshots): least-squares
coefficients ``c`` with ``a ≈ Vᵀc``, accepted when ``‖a − Vᵀc‖ ≤ rtol ‖a‖ + atol``. Then
``s_tᵀ g_n = Σ_k c_k (V_kᵀ g_n)`` for every sample, from the projections on the basis.

:class:`BasisFits` forms every tensor's fit on the device without reading it (normal
equations VVᵀc = Va in the tensors' dtype, solved in float64 by LU, residuals measured
directly); :meth:`BasisFits.accept` decides on the host copy and solves once more, from
normal equations accumulated in float64 (SVD on the host), what failed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from cockpit.engine.histograms.device import device_path
from cockpit.engine.workspace import workspace

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
        target = actual.reshape(-1)
        actual_sq = float(torch.dot(target, target))
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
    :meth:`accept` decides by them and solves once more what failed.

    The k×k systems (k ≤ 3) are scaled to a unit diagonal (Jacobi) and solved by LU
    (``solve_ex``: no error check, which would read the device); a row of zeros (a zero
    basis vector: a zero-initialised bias with weight decay) gets coefficient 0. A singular
    system (two parallel basis vectors) or non-finite one leaves a non-finite residual,
    which fails the check.
    """

    def __init__(self, bases: Sequence[Tensor | Sequence[Tensor]], actuals: Sequence[Tensor]):
        self.problems = []  # (V, a) per tensor
        for basis, actual in zip(bases, actuals, strict=True):
            target = actual if actual.dim() == 1 else actual.reshape(-1)  # (a view: host work)
            k = len(basis)
            if k == 0:
                vectors = target[:0].view(0, -1)
            elif isinstance(basis, Tensor):
                vectors = (basis if basis.dim() == 2 else basis.reshape(k, -1)).to(target.dtype)
            else:
                vectors = torch.stack([b.reshape(-1).to(target.dtype) for b in basis])
            self.problems.append((vectors, target))
        device = actuals[0].device if actuals else torch.device("cpu")
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
            systems = [_normal_equations_float64(v, t) for _, v, t, _ in retry]
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
        diagonal = grams.diagonal(dim1=1, dim2=2)
        live = diagonal > 0
        scale = torch.where(live, diagonal, 1.0).rsqrt_().mul_(live)
        scaled = grams.mul_(scale.unsqueeze(2) * scale.unsqueeze(1))
        scaled.diagonal(dim1=1, dim2=2).add_(~live)  # zero rows: c = 0
        solution = torch.linalg.solve_ex(scaled, (rhs * scale).unsqueeze(2)).result
        solved = solution.squeeze(2).mul_(scale)
        if len(by_size) == 1:
            return solved.reshape(-1)
        pieces.update(zip(indices, solved.unbind(0), strict=True))
    if not pieces:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.cat([pieces[i] for i in range(len(systems)) if i in pieces])


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
    for i, (vectors, target) in enumerate(problems):
        if target.dtype not in by_dtype:
            by_dtype[target.dtype] = coefficients.to(target.dtype).split(sizes)
        c = by_dtype[target.dtype][i]
        if fused:  # fresh residuals, one multi-tensor norm for all (accelerators)
            residuals_fused.append(torch.addmv(target, vectors.T, c, alpha=-1))
            continue
        scratch, _ = workspace().take("fit residual", target.shape, target.dtype,
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
