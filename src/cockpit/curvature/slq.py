"""Spectral density of a symmetric operator by stochastic Lanczos quadrature (SLQ; Ghorbani,
Krishnan and Xiao 2019, after Golub and Meurant; Lin, Saad and Yang 2016).

The spectral density of H ∈ ℝ^{D×D} with eigenpairs (λ_i, u_i) is

    ρ(λ) = (1/D) Σ_i δ(λ − λ_i),      ∫ f(λ) ρ(λ) dλ = (1/D) tr f(H).

For a unit probe v, vᵀ f(H) v = Σ_i (u_iᵀv)² f(λ_i) is the integral of f against the
probe's spectral measure. m Lanczos steps from q_1 = v give T_m; with its eigenpairs
(θ_j, s_j), Gauss quadrature

    vᵀ f(H) v ≈ Σ_j τ_j f(θ_j),      τ_j = (e_1ᵀ s_j)²,

is exact for every polynomial f of degree ≤ 2m − 1. A probe with i.i.d. Rademacher entries
divided by √D has E[v vᵀ] = I/D, so averaging P probes' quadratures estimates
(1/D) tr f(H) without bias for those f:

    ρ(λ) ≈ (1/P) Σ_p Σ_j τ_{p,j} δ(λ − θ_{p,j}).

The nodes θ and weights τ are returned as [P, m] arrays (weights of each probe sum to 1).
Full reorthogonalization keeps T_m accurate; an invariant subspace reached before m steps
(β ≈ 0) ends that probe early with its quadrature exact (unused columns: weight 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["lanczos_quadrature"]


def lanczos_quadrature(
    matvec: Callable[[Tensor], Tensor],
    dim: int,
    *,
    probes: int,
    steps: int,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor]:
    """(nodes, weights), each [probes, steps] in float64: every probe's Gauss quadrature
    of its spectral measure (module docstring). ``matvec``: v ↦ H v on flat vectors."""
    if probes < 1 or steps < 1:
        raise ValueError(f"probes and steps must be ≥ 1, got {probes} and {steps}")
    steps = min(steps, dim)
    nodes = torch.zeros(probes, steps, dtype=torch.float64)
    weights = torch.zeros(probes, steps, dtype=torch.float64)
    eps = torch.finfo(dtype).eps
    for p in range(probes):
        signs = torch.randint(0, 2, (dim,), generator=generator, device=(
            generator.device if generator is not None else "cpu"))
        q = (2.0 * signs - 1.0).to(dtype=dtype, device=device) / dim**0.5
        basis: list[Tensor] = []
        alphas: list[float] = []
        betas: list[float] = []
        for _ in range(steps):
            basis.append(q)
            w = matvec(q).reshape(-1).to(q)
            alpha = torch.dot(q, w).item()
            alphas.append(alpha)
            for _ in range(2):  # full reorthogonalization, twice
                for b in basis:
                    w = w - torch.dot(b, w) * b
            beta = torch.linalg.vector_norm(w).item()
            if not (math.isfinite(alpha) and math.isfinite(beta)):
                nodes[p], weights[p] = math.nan, math.nan  # a non-finite product H v
                break
            if len(basis) == steps or beta <= 1e3 * eps * max(abs(a) for a in alphas):
                break
            betas.append(beta)
            q = w / beta
        if nodes[p].isnan().any():
            continue
        T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
        if betas:
            off = torch.tensor(betas, dtype=torch.float64)
            T += torch.diag(off, 1) + torch.diag(off, -1)
        theta, s = torch.linalg.eigh(T)
        k = len(alphas)
        nodes[p, :k] = theta
        weights[p, :k] = s[0].pow(2)
        if k < steps:
            nodes[p, k:] = theta[-1]
    return nodes, weights
