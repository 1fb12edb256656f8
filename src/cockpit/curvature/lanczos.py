"""Largest eigenvalue of a symmetric operator from matrix-vector products (paper B.7, eq. 26).

    λ_max(H) = max_{v ≠ 0} vᵀ H v / vᵀ v                                          (26)

:func:`lanczos_max_eigenvalue` — Lanczos with full reorthogonalization. After k steps
with orthonormal Krylov basis Q_k = [q_1, …, q_k] the operator satisfies

    H Q_k = Q_k T_k + β_k q_{k+1} e_kᵀ,      T_k = tridiag(β, α, β),

and the largest Ritz pair (θ₁, s) of T_k gives the estimate θ₁ ≤ λ_max with Ritz vector
y = Q_k s.

Stopping rule: it bounds the error of λ_max itself, not the distance of θ₁ to *some*
eigenvalue (a small Ritz residual only says the latter: on a logistic regression with
λ₁ = 7.84, λ₂ = 7.42, the rule "residual ≤ 3e-2·θ₁" stopped at θ₁ = 7.13, 9 % low). The
Lanczos vectors are q_{j+1} = P_j(H) q_1 with the polynomials of the three-term recurrence
(P_0 = 1, β_j P_j(x) = (x − α_j) P_{j−1}(x) − β_{j−1} P_{j−2}(x)). For an eigenvector u with
H u = λ u and start component c = uᵀq_1, orthonormality of q_1 … q_{k+1} gives

    c² · S_k(λ) ≤ 1,     S_k(λ) = Σ_{j=0}^{k} P_j(λ)²,

and S_k grows monotonically above the largest Ritz value. So every eigenvalue above
λ* = θ₁ + atol + tol·|θ₁| has c² ≤ 1 / S_k(λ*). A random unit start has a component along
any fixed direction of |z|/√D (z ~ N(0, 1)), which is that small with probability at most
√(2D / (π S_k(λ*))). The iteration stops once this is ≤ ``miss_probability`` δ (1e-3):
then λ_max ∈ [θ₁, λ*] except with probability δ, i.e. the relative error is ≤ ``tol``.
The smallest such relative accuracy (on a 1-2-5 grid) is returned as ``rel_error``. The
rule adapts to the spectrum: a well-separated λ_max is certified in a few steps, a
cluster of close top eigenvalues takes more. Checked against dense eigenvalues on
logistic regression (784→10, |B| = 32: 26 products on average, error ≤ 4e-7 at tol 1e-3
over 72 steps where the residual rule erred by up to 9 %), MLPs and CNNs (tests).

It returns the LARGEST ALGEBRAIC eigenvalue, as eq. (26) defines λ_max. The original
Cockpit package (like PyHessian) used power iteration, which returns the eigenvalue of
largest MAGNITUDE, i.e. a negative number when the Hessian's most negative eigenvalue
dominates; :func:`power_iteration` reproduces that method for comparison.

Warm start: a previous eigenvector passed as ``v0`` is mixed in equal parts with a random
unit vector to form q_1: the previous direction speeds up the convergence of θ₁, and the
random half keeps the guarantee above with four times the S_k threshold: q_1 = (v + m)/‖v + m‖
for unit v and random m, and ‖v + m‖ ≤ 2, so |uᵀq_1| ≤ t needs |uᵀv + uᵀm| ≤ 2t, which a
fixed uᵀv makes no likelier than |uᵀm| ≤ 2t. If the Krylov space
becomes invariant (breakdown, β_k ≈ 0) before the space is exhausted, the iteration
continues with a fresh random vector orthogonal to the basis and the rule restarts for it.
A breakdown with a random start means the top eigenvalue was found exactly (with
probability one). Full reorthogonalization keeps the basis orthonormal in floating point
(the basis holds up to ``max_iter`` vectors of length D, in blocks of four: classical
Gram-Schmidt twice, two matrix-vector products per block, :class:`KrylovBasis`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
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
        num_matvecs: Number of operator applications the result used (the Krylov
            dimension, with the vectors of a restart).
        converged: Whether the stopping criterion was met before ``max_iter``.
        rel_error: Estimated relative error |λ_max − value| / |value| at the stop
            (Lanczos; NaN for power iteration, whose rule bounds no error).
        second: Second-largest Ritz value (Lanczos), for the gap λ₁ − λ₂.
    """

    value: float
    vector: Tensor
    num_matvecs: int
    converged: bool
    rel_error: float = math.nan
    second: float = math.nan
    discarded: int = 0  # products computed ahead of a check and not used (Lanczos)


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


class KrylovBasis:
    """Orthonormal vectors q_1, …, q_k of length D, kept as the rows of blocks of
    ``BLOCK`` rows, zero where unused, each with its transposed view made once:
    projections on all of them take two matrix-vector products per block and no other op
    instead of three ops per vector (a GPU waits for the host issuing them); the zero rows
    add exact zeros. The basis holds at most ``BLOCK`` − 1 unused rows."""

    BLOCK = 4

    def __init__(self) -> None:
        self._blocks: list[Tensor] = []
        self._transposed: list[Tensor] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> Tensor:
        index = index + self._size if index < 0 else index
        if not 0 <= index < self._size:
            raise IndexError(index)
        return self._blocks[index // self.BLOCK][index % self.BLOCK]

    def append(self, q: Tensor) -> None:
        if self._size == len(self._blocks) * self.BLOCK:
            block = q.new_zeros(self.BLOCK, q.numel())
            self._blocks.append(block)
            self._transposed.append(block.T)
        self._blocks[-1][self._size % self.BLOCK].copy_(q if q.dim() == 1 else q.reshape(-1))
        self._size += 1

    def truncate(self, k: int) -> None:
        """Keep q_1, …, q_k."""
        self._size = min(self._size, k)
        kept = -(-self._size // self.BLOCK)
        del self._blocks[kept:], self._transposed[kept:]
        if self._size % self.BLOCK:
            self._blocks[-1][self._size % self.BLOCK:].zero_()

    def _filled(self) -> list[Tensor]:
        """The blocks, the last one cut to its filled rows."""
        if not self._size:
            return []
        last = self._size - self.BLOCK * (len(self._blocks) - 1)
        return [*self._blocks[:-1], self._blocks[-1] if last == self.BLOCK
                else self._blocks[-1][:last]]

    def orthogonalize(self, w: Tensor) -> Tensor:
        """``w`` without its components along the basis: classical Gram-Schmidt applied
        twice ("twice is enough": orthogonal to working precision like the modified one),
        Q_bᵀ(Q_b w) removed block by block."""
        for _ in range(2):
            for block, transposed in zip(self._blocks, self._transposed, strict=True):
                w = torch.addmv(w, transposed, block @ w, alpha=-1)
        return w

    def combine(self, coefficients: list[float]) -> Tensor:
        """Σ_i c_i q_i for the first len(c) vectors."""
        first = self._blocks[0]
        c = torch.tensor(coefficients, dtype=first.dtype, device=first.device)  # (one copy)
        total = None
        for start, block in zip(range(0, len(c), self.BLOCK), self._filled(), strict=False):
            part = c[start:start + self.BLOCK]
            rows = block[:len(part)]
            total = rows.T @ part if total is None else torch.addmv(total, rows.T, part)
        assert total is not None
        return total


def lanczos_max_eigenvalue(
    matvec: MatVec,
    dim: int | None = None,
    *,
    v0: Tensor | None = None,
    tol: float = 1e-3,
    atol: float = 0.0,
    miss_probability: float = 1e-3,
    max_iter: int = 100,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    check_every: int = 4,
) -> EigResult:
    """Largest algebraic eigenvalue of a symmetric operator by Lanczos (eq. 26).

    Args:
        matvec: v ↦ H v for flat vectors of length D; H must be symmetric.
        dim: D. Needed only without ``v0``.
        v0: Warm start (e.g. the previous eigenvector). It is mixed in equal parts with a
            random vector (module docstring), which keeps the stopping rule's guarantee.
            Sets dtype and device of the iteration. Random start if None.
        tol: Relative accuracy asked of λ_max: stop once, with probability ≥ 1 −
            ``miss_probability``, no eigenvalue lies above θ₁ + atol + tol · |θ₁| (θ₁ ≤ λ_max
            always, so then |λ_max − θ₁| ≤ atol + tol · |θ₁|).
        atol: Absolute part of the tolerance (useful when λ_max may be ≈ 0).
        miss_probability: The probability δ that the random start hides an eigenvalue above that
            bound (module docstring).
        max_iter: Maximum number of matrix-vector products (= Krylov dimension). The
            basis holds up to ``max_iter`` vectors of length D (full reorthogonalization).
        generator: Random generator for the start vector and breakdown restarts.
        dtype, device: For a random start without ``v0`` (defaults: torch default dtype,
            CPU).
        check_every: The coefficients α, β are read from the device in one transfer every
            ``check_every`` products (and at the last one allowed), not after each: the
            rule is then evaluated for each iteration in turn, exactly as if read one by
            one, and the products computed past the stop (at most ``check_every`` − 1) are
            discarded. The result equals that of ``check_every=1``; ``num_matvecs`` counts
            the products computed.

    Returns:
        EigResult with the largest Ritz value, its unit Ritz vector, the number of
        operator applications, whether the tolerance was met and the relative accuracy
        reached (``rel_error``). A non-finite product H v gives ``value=nan,
        converged=False``.
    """
    if max_iter < 1:
        raise ValueError("max_iter must be at least 1.")
    if not tol > 0 or atol < 0 or not 0 < miss_probability < 1:
        raise ValueError("Lanczos needs tol > 0, atol >= 0 and 0 < miss_probability < 1.")
    if check_every < 1:
        raise ValueError("check_every must be at least 1.")
    q, is_random = _start_vector(dim, v0, dtype, device, generator)
    dim = q.numel()
    # squared start component that a hidden eigenvector exceeds with probability 1 − δ
    # (a random unit vector's component along a fixed direction is ≈ z/√D, z ~ N(0, 1):
    # P(|z|/√D ≤ c) ≤ c·√(2D/π)); the warm mix shrinks the random part by up to 2
    if not is_random:
        mix = _random_vector(dim, q.dtype, q.device, generator)
        q = q + mix / torch.linalg.vector_norm(mix)
        q = q / torch.linalg.vector_norm(q)
    weight = 1.0 if is_random else 4.0
    required = weight * 2.0 * dim / (math.pi * miss_probability**2)
    eps = torch.finfo(q.dtype).eps
    basis = KrylovBasis()
    alphas: list[float] = []
    betas: list[float] = []  # betas[i] couples basis[i] and basis[i + 1]
    block = 0  # first Lanczos vector of the current Krylov sequence (after a breakdown)
    theta, second, s_top = 0.0, -math.inf, [1.0]
    rel_error = math.inf
    num_matvecs = 0
    converged = False
    discarded = 0
    pending: list[tuple[Tensor, Tensor, Tensor]] = []  # (α, β, w) not yet read

    while num_matvecs < max_iter:
        basis.append(q)
        w = matvec(q)
        w = (w if w.dim() == 1 else w.reshape(-1)).to(q)
        num_matvecs += 1
        alpha = torch.dot(q, w)
        w = basis.orthogonalize(w)
        pending.append((alpha, torch.linalg.vector_norm(w), w))
        if len(pending) < check_every and num_matvecs < max_iter and len(basis) < dim:
            q = w / pending[-1][1]  # ahead of the check, which may yet discard it
            continue
        first = len(basis) - len(pending)  # the basis index of pending[0]
        read = torch.stack([x for a, b, _ in pending for x in (a, b)]).tolist()  # one read
        restart = False
        for i in range(len(pending)):
            alpha, beta = read[2 * i], read[2 * i + 1]
            alphas.append(alpha)
            k = first + i + 1  # basis[:k] is the Krylov basis of this iteration
            if not (math.isfinite(alpha) and math.isfinite(beta)):
                ahead = len(pending) - i - 1
                return EigResult(math.nan, basis[k - 1], num_matvecs - discarded - ahead,
                                 converged=False, discarded=discarded + ahead)

            evals, evecs = _tridiagonal_eigh(alphas, betas)
            theta, s_top = float(evals[-1]), evecs[:, -1].tolist()
            second = float(evals[-2]) if len(alphas) > 1 else -math.inf
            scale = max(abs(float(evals[0])), abs(theta))  # ‖T_k‖₂, estimates ‖H‖₂

            breakdown = beta <= 1e3 * eps * max(scale, 1e-300) or beta == 0.0
            if k == dim or (breakdown and is_random):
                converged, rel_error = True, 0.0  # invariant with all of a random vector
                break
            if breakdown:
                # Warm start spans an invariant subspace: continue with a random direction.
                basis.truncate(k)
                q = basis.orthogonalize(_random_vector(dim, q.dtype, q.device, generator))
                q = q / torch.linalg.vector_norm(q)
                betas.append(0.0)
                is_random, block = True, len(basis)
                required = 2.0 * dim / (math.pi * miss_probability**2)
                restart = True
                break
            a, b = alphas[block:], [*betas[block:], beta]
            rel_error = _accuracy_reached(a, b, theta, atol, required)
            if rel_error <= tol:
                converged = True
                break
            betas.append(beta)
        else:
            q = pending[-1][2] / read[-1]
        discarded += len(pending) - (k - first)
        if converged:
            basis.truncate(k)
            break
        pending = []
        if restart:
            continue

    if len(s_top) != len(basis):
        raise AssertionError("Ritz coefficients and basis differ in length")
    ritz = basis.combine(s_top)
    ritz = ritz / torch.linalg.vector_norm(ritz)
    return EigResult(value=theta, vector=ritz, num_matvecs=num_matvecs - discarded,
                     converged=converged, rel_error=rel_error, second=second,
                     discarded=discarded)


def _tridiagonal_eigh(alphas: list[float], betas: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (ascending) and eigenvectors of T = tridiag(β, α, β), on the host."""
    T = np.diag(np.asarray(alphas, dtype=np.float64))
    if betas:
        off = np.asarray(betas[: len(alphas) - 1], dtype=np.float64)
        T += np.diag(off, 1) + np.diag(off, -1)
    return np.linalg.eigh(T)


def _krylov_weight(alphas: list[float], betas: list[float], x: float) -> float:
    """S_k(x) = Σ_{j=0}^{k} P_j(x)² for the Lanczos polynomials q_{j+1} = P_j(H) q_1
    (P_0 = 1, β_j P_j(x) = (x − α_j) P_{j−1}(x) − β_{j−1} P_{j−2}(x))."""
    previous, current, total = 0.0, 1.0, 1.0
    beta_before = 0.0
    for alpha, beta in zip(alphas, betas, strict=True):
        previous, current = current, ((x - alpha) * current - beta_before * previous) / beta
        beta_before = beta
        total += current * current
        if total > 1e300:
            return math.inf
    return total


def _accuracy_reached(alphas: list[float], betas: list[float], theta: float, atol: float,
                      required: float) -> float:
    """The smallest relative ε (on a grid) such that every eigenvector with eigenvalue above
    θ₁ + atol + ε·|θ₁| has a start component c with c² ≤ 1/``required``, i.e. that no such
    eigenvalue went unseen, except with probability ``miss_probability``."""
    magnitude = max(abs(theta), 1e-300)
    for exponent in range(-12, 1):
        for mantissa in (1.0, 2.0, 5.0):
            epsilon = mantissa * 10.0**exponent
            if _krylov_weight(alphas, betas, theta + atol + epsilon * magnitude) >= required:
                return epsilon
    return math.inf


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
