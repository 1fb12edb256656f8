"""The k largest eigenvalues of a symmetric operator, each bracketed with a certified error
bound, from the λ_max Lanczos of :mod:`cockpit.curvature.lanczos` and deflation.

For orthonormal vectors Y_j = [y_1, …, y_j] (any, e.g. approximate eigenvectors):

* Cauchy interlacing on the compression Y_kᵀ H Y_k (k×k, eigenvalues ν_1 ≥ … ≥ ν_k) gives
  ν_i ≤ λ_i(H) for i ≤ k: a lower bound.
* Courant–Fischer gives λ_i(H) ≤ max_{v ⟂ y_1 … y_{i−1}, ‖v‖=1} vᵀHv ≤ λ_max(P_i H P_i)
  with P_i = I − Y_{i−1} Y_{i−1}ᵀ: an upper bound. The Lanczos stopping rule certifies
  λ_max(P_i H P_i) ≤ μ_i (1 + tol) + atol for its value μ_i, except with probability δ.

The algorithm takes y_i as the (orthonormalized) Lanczos eigenvector of P_i H P_i, i = 1…k
(P_1 = I: y_1 is the λ_max eigenvector), then forms the compression with k more products.
It returns ν_i with the bracket λ_i ∈ [ν_i, μ_i(1 + tol) + atol], which holds for all i
together except with probability k·δ (union bound). Where the y_i are accurate, ν_i ≈ μ_i
and the bracket is ≈ tol·|λ_i| wide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cockpit.curvature.lanczos import lanczos_max_eigenvalue

__all__ = ["TopEigenvalues", "top_eigenvalues"]


@dataclass
class TopEigenvalues:
    """ν_1 ≥ … ≥ ν_k (lower bounds of λ_1 … λ_k), their certified upper bounds, and the
    number of operator applications; ``converged``: every Lanczos run met its tolerance."""

    values: list[float]
    upper: list[float]
    num_matvecs: int
    converged: bool


def top_eigenvalues(matvec: Callable[[Tensor], Tensor], dim: int, k: int, *,
                    tol: float = 1e-3, atol: float = 0.0, miss_probability: float = 1e-3,
                    max_iter: int = 100, generator: torch.Generator | None = None,
                    dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> TopEigenvalues:
    """The k largest eigenvalues with brackets (module docstring); ``miss_probability`` is δ
    per Lanczos run."""
    if not 1 <= k <= dim:
        raise ValueError(f"k must be between 1 and the dimension {dim}, got {k}")
    basis: list[Tensor] = []
    upper: list[float] = []
    products, converged = 0, True

    def deflated(v: Tensor) -> Tensor:
        for y in basis:
            v = v - torch.dot(y, v) * y
        w = matvec(v).reshape(-1).to(v)
        for y in basis:
            w = w - torch.dot(y, w) * y
        return w

    for _ in range(k):
        result = lanczos_max_eigenvalue(
            deflated, dim, tol=tol, atol=atol, miss_probability=miss_probability,
            max_iter=max_iter, generator=generator, dtype=dtype, device=device)
        products += result.num_matvecs
        converged &= result.converged
        # rel_error is the accuracy certified when the run stopped (inf: none), also short
        # of tol; λ_i ≤ λ_(i−1) carries the previous bound over
        bound = result.value + atol + result.rel_error * abs(result.value)
        upper.append(min(bound, upper[-1]) if upper else bound)
        y = result.vector.reshape(-1)
        for _ in range(2):
            for b in basis:
                y = y - torch.dot(b, y) * b
        basis.append(y / torch.linalg.vector_norm(y))
    images = [matvec(y).reshape(-1).to(y) for y in basis]
    products += k
    compression = torch.tensor([[torch.dot(a, hb).item() for hb in images] for a in basis],
                               dtype=torch.float64)
    compression = (compression + compression.T) / 2
    values = torch.linalg.eigvalsh(compression).flip(0).tolist()
    return TopEigenvalues(values, upper, products, converged)
