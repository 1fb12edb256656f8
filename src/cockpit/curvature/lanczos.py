"""Largest eigenvalue of a symmetric operator from matrix-vector products (paper B.7, eq. 26).

    λ_max(H) = max_{v ≠ 0} vᵀ H v / vᵀ v                                          (26)

:func:`lanczos_max_eigenvalue` — Lanczos with full reorthogonalization. After k steps
with orthonormal Krylov basis Q_k = [q_1, …, q_k] the operator satisfies

    H Q_k = Q_k T_k + β_k q_{k+1} e_kᵀ,      T_k = tridiag(β, α, β),

and the largest Ritz pair (θ, s) of T_k gives the estimate θ ≤ λ_max with Ritz vector
y = Q_k s. Its residual is ‖H y − θ y‖ = |β_k · s_k| (last component of s), and the
iteration stops once |β_k s_k| ≤ atol + tol · |θ| (atol = 0 by default). For a
symmetric operator the residual r bounds the distance of θ to the spectrum, and the
eigenvalue error is typically far smaller, ≈ r²/gap. So ``tol`` is conservative: on
cifar10_3c3d (benchmarks/hessmaxev_solvers.py) tol=1e-3 gave relative errors ≈ 2e-5 and
tol=3e-2 gave ≈ 1–3e-3, the accuracy that power iteration's default stopping rule
actually reaches, with about 3× fewer Hessian-vector products.

It returns the LARGEST ALGEBRAIC eigenvalue, as eq. (26) defines λ_max. The original
Cockpit package (like PyHessian) used power iteration, which returns the eigenvalue of
largest MAGNITUDE, i.e. a negative number when the Hessian's most negative eigenvalue
dominates; :func:`power_iteration` reproduces that method for comparison.

Warm start: a previous eigenvector passed as ``v0`` is used (normalized) as the first
Lanczos vector q_1. When the Hessian changes little between steps, q_1 already lies
close to the top eigenvector and few steps suffice. Like any Krylov method, the result
can only contain eigen-directions present in q_1: if the Krylov space becomes invariant
(breakdown, β_k ≈ 0) before the space is exhausted, the iteration continues with a
fresh random vector orthogonal to the basis, so a warm start that misses the top
eigenvector entirely is still corrected. A breakdown after such a random vector (or with
a random start) means the top eigenvalue was found exactly (with probability one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["EigResult", "lanczos_max_eigenvalue", "power_iteration"]

MatVec = Callable[[Tensor], Tensor]


@dataclass
class EigResult:
    """An eigenvalue estimate.

    Attributes:
        value: Eigenvalue estimate.
        vector: Unit-norm eigenvector estimate (dtype and device of the iteration).
        num_matvecs: Number of operator applications used.
        converged: Whether the stopping criterion was met before ``max_iter``.
    """

    value: float
    vector: Tensor
    num_matvecs: int
    converged: bool


def _random_vector(
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator | None,
) -> Tensor:
    """Standard-normal vector on ``device``, drawn from ``generator`` wherever it lives."""
    gen_device = device if generator is None else generator.device
    return torch.randn(dim, generator=generator, dtype=dtype, device=gen_device).to(device)


def _start_vector(
    dim: int | None,
    v0: Tensor | None,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    generator: torch.Generator | None,
) -> tuple[Tensor, bool]:
    """Return (unit start vector, whether it is random)."""
    if v0 is not None:
        v0 = v0.detach().reshape(-1)
        if dim is not None and v0.numel() != dim:
            raise ValueError(f"v0 has {v0.numel()} entries but dim={dim}.")
        norm = torch.linalg.vector_norm(v0)
        if norm > 0 and torch.isfinite(norm):
            return v0 / norm, False
        dim, dtype, device = v0.numel(), v0.dtype, v0.device  # unusable: fall back to random
    if dim is None or dim < 1:
        raise ValueError("Give a positive `dim` or a start vector `v0`.")
    dtype = torch.get_default_dtype() if dtype is None else dtype
    device = torch.device("cpu") if device is None else torch.device(device)
    v = _random_vector(dim, dtype, device, generator)
    return v / torch.linalg.vector_norm(v), True


def _orthogonalize(w: Tensor, basis: list[Tensor]) -> Tensor:
    """Remove the components of ``w`` along the orthonormal ``basis``.

    Modified Gram-Schmidt, applied twice ("twice is enough"); one vector at a time so
    no k×D copy of the basis is ever made.
    """
    for _ in range(2):
        for q in basis:
            w = w - torch.dot(q, w) * q
    return w


def lanczos_max_eigenvalue(
    matvec: MatVec,
    dim: int | None = None,
    *,
    v0: Tensor | None = None,
    tol: float = 1e-3,
    atol: float = 0.0,
    max_iter: int = 100,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> EigResult:
    """Largest algebraic eigenvalue of a symmetric operator by Lanczos (eq. 26).

    Args:
        matvec: v ↦ H v for flat vectors of length D; H must be symmetric.
        dim: D. Needed only without ``v0``.
        v0: Warm start (e.g. the previous eigenvector), used as the first Lanczos
            vector. Sets dtype and device of the iteration. Random start if None.
        tol: Stop when the Ritz residual |β_k s_k| ≤ atol + tol · |θ|.
        atol: Absolute part of the tolerance (useful when λ_max may be ≈ 0).
        max_iter: Maximum number of matrix-vector products (= Krylov dimension). The
            basis holds up to ``max_iter`` vectors of length D (full reorthogonalization).
        generator: Random generator for the start vector and breakdown restarts.
        dtype, device: For a random start without ``v0`` (defaults: torch default dtype,
            CPU).

    Returns:
        EigResult with the largest Ritz value, its unit Ritz vector, the number of
        operator applications and whether the tolerance was met. A non-finite product
        H v gives ``value=nan, converged=False``.
    """
    if max_iter < 1:
        raise ValueError("max_iter must be at least 1.")
    q, is_random = _start_vector(dim, v0, dtype, device, generator)
    dim = q.numel()
    eps = torch.finfo(q.dtype).eps
    basis: list[Tensor] = []
    alphas: list[float] = []
    betas: list[float] = []  # betas[i] couples basis[i] and basis[i + 1]
    theta, s_top = 0.0, torch.ones(1, dtype=torch.float64)
    residual = math.inf
    num_matvecs = 0
    converged = False

    while num_matvecs < max_iter:
        basis.append(q)
        w = matvec(q).reshape(-1).to(q)
        num_matvecs += 1
        alpha = torch.dot(q, w).item()
        alphas.append(alpha)
        w = _orthogonalize(w, basis)
        beta = torch.linalg.vector_norm(w).item()
        if not (math.isfinite(alpha) and math.isfinite(beta)):
            return EigResult(math.nan, q, num_matvecs, converged=False)  # non-finite operator

        T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
        if betas:
            off = torch.tensor(betas, dtype=torch.float64)
            T += torch.diag(off, 1) + torch.diag(off, -1)
        evals, evecs = torch.linalg.eigh(T)
        theta, s_top = evals[-1].item(), evecs[:, -1]
        residual = abs(beta * s_top[-1].item())
        scale = max(abs(evals[0].item()), abs(theta))  # ‖T_k‖₂, estimates ‖H‖₂

        breakdown = beta <= 1e3 * eps * max(scale, 1e-300) or beta == 0.0
        if len(basis) == dim or (breakdown and is_random):
            converged = True  # invariant subspace containing all directions of a random vector
            break
        if breakdown:
            # Warm start spans an invariant subspace: continue with a random direction.
            q = _orthogonalize(_random_vector(dim, q.dtype, q.device, generator), basis)
            q = q / torch.linalg.vector_norm(q)
            betas.append(0.0)
            is_random = True
            continue
        if residual <= atol + tol * abs(theta):
            converged = True
            break
        q = w / beta
        betas.append(beta)

    ritz = torch.zeros_like(basis[0])
    for coefficient, q in zip(s_top.tolist(), basis, strict=True):
        ritz.add_(q, alpha=coefficient)
    ritz = ritz / torch.linalg.vector_norm(ritz)
    return EigResult(value=theta, vector=ritz, num_matvecs=num_matvecs, converged=converged)


def power_iteration(
    matvec: MatVec,
    dim: int | None = None,
    *,
    v0: Tensor | None = None,
    max_iter: int = 100,
    rtol: float = 1e-3,
    atol: float = 1e-6,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> EigResult:
    """Dominant eigenvalue (largest MAGNITUDE) by power iteration, as the original package.

    v ← H v / ‖H v‖ from a random start; the Rayleigh quotient λ = vᵀ H v is the
    estimate, and the iteration stops once it changes by less than atol + rtol · |λ|
    between two iterations, or after ``max_iter`` products. Note the result is the
    eigenvalue of largest |λ| (it can be negative), not eq. (26)'s largest algebraic one;
    the stopping rule tests stagnation, not accuracy.
    """
    v, _ = _start_vector(dim, v0, dtype, device, generator)
    value: float | None = None
    num_matvecs = 0
    while num_matvecs < max_iter:
        hv = matvec(v).reshape(-1).to(v)
        num_matvecs += 1
        new_value = torch.dot(v, hv).item()
        norm = torch.linalg.vector_norm(hv)
        if not (math.isfinite(new_value) and torch.isfinite(norm)):
            return EigResult(math.nan, v, num_matvecs, False)
        if norm == 0:
            return EigResult(0.0, v, num_matvecs, True)
        v = hv / norm
        if value is not None and abs(new_value - value) < atol + rtol * abs(new_value):
            return EigResult(new_value, v, num_matvecs, True)
        value = new_value
    return EigResult(value if value is not None else 0.0, v, num_matvecs, False)
