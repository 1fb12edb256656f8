"""The analytic DeepOBS problems: noisy 2-D test functions and the noisy quadratic.

Each model's forward pass takes a batch of noise samples and returns the individual losses
ℓ_n directly (task ``"function"``).

Noisy 2-D functions (DeepOBS ``two_d_*``): parameters (u, v), noise (x_n, y_n) ~ N(0, 1),

    ℓ_n(u, v) = f(u, v) + u·x_n + v·y_n,

with Beale f = (1.5 − u + uv)² + (2.25 − u + uv²)² + (2.625 − u + uv³)², start (−4.5, 4.5);
Branin f = (v − b u² + c u − r)² + s(1 − t) cos u + s with b = 5.1/(4π²), c = 5/π, r = 6,
s = 10, t = 1/(8π), start (2.5, 12.5); Rosenbrock f = (1 − u)² + 100 (v − u²)², start
(−0.5, 1.5). Train: 10,000 noise draws (seed 42), valid: 10,000 (seed 44), test: zeros (so
the test loss is the deterministic f).

Noisy quadratic (DeepOBS ``quadratic_deep``, after Chaudhari et al. 2017): θ ∈ ℝ¹⁰⁰ starting
at 1, ℓ_n(θ) = ½ (θ − x_n)ᵀ Q (θ − x_n) with x_n ~ N(0, 0.6² I) (1,000 train draws, seed 42;
test seed 43; valid seed 44) and Q = Rᵀ diag(λ) R, 90 eigenvalues λ ~ U(0, 1) and 10 from
U(30, 60), R a Haar-random rotation. Everything is drawn, in DeepOBS's order, from one
``RandomState(42)``: the 90 small eigenvalues, the 10 large ones, then the rotation by the
subgroup algorithm (:func:`subgroup_rotation`), so Q is DeepOBS's matrix (½·1ᵀQ1 = 267.53).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn


class NoisyFunction2D(nn.Module):
    """ℓ_n(u, v) = f(u, v) + u·x_n + v·y_n for a batch of noise ``[B, 2]``; returns ``[B]``."""

    def __init__(self, kind: str):
        super().__init__()
        if kind not in STARTS_2D:
            raise ValueError(f"unknown 2-D function {kind!r}; choose from {sorted(STARTS_2D)}")
        self.kind = kind
        u0, v0 = STARTS_2D[kind]
        # shape [1] rather than DeepOBS's scalars: Cockpit's per-sample statistics need a
        # parameter axis (0-dim parameters are not supported by its engine yet)
        self.u = nn.Parameter(torch.tensor([u0]))
        self.v = nn.Parameter(torch.tensor([v0]))

    def deterministic(self, u: Tensor, v: Tensor) -> Tensor:
        """f(u, v) without noise."""
        if self.kind == "beale":
            return ((1.5 - u + u * v) ** 2 + (2.25 - u + u * v**2) ** 2
                    + (2.625 - u + u * v**3) ** 2)
        if self.kind == "branin":
            b, c, r = 5.1 / (4 * math.pi**2), 5 / math.pi, 6.0
            s, t = 10.0, 1 / (8 * math.pi)
            return (v - b * u**2 + c * u - r) ** 2 + s * (1 - t) * torch.cos(u) + s
        return (1 - u) ** 2 + 100 * (v - u**2) ** 2

    def forward(self, noise: Tensor) -> Tensor:
        u, v = self.u[0], self.v[0]
        # indexing the last axis keeps per-sample evaluation (torch.func.vmap) working
        return self.deterministic(u, v) + u * noise[..., 0] + v * noise[..., 1]


STARTS_2D = {"beale": (-4.5, 4.5), "branin": (2.5, 12.5), "rosenbrock": (-0.5, 1.5)}


class NoisyQuadratic(nn.Module):
    """ℓ_n(θ) = ½ (θ − x_n)ᵀ Q (θ − x_n) for a batch ``x`` of shape ``[B, D]``; θ starts at 1."""

    def __init__(self, hessian: Tensor):
        super().__init__()
        self.register_buffer("hessian", hessian)
        self.theta = nn.Parameter(torch.ones(hessian.shape[0], dtype=hessian.dtype))

    def forward(self, x: Tensor) -> Tensor:
        diff = self.theta - x
        return 0.5 * ((diff @ self.hessian) * diff).sum(dim=-1)


def subgroup_rotation(dim: int, rng: np.random.RandomState) -> np.ndarray:
    """A Haar-random rotation R ∈ SO(dim) by the subgroup algorithm (Diaconis & Shahshahani,
    1987), with DeepOBS's draws and signs.

    Start: the 2-D rotation by the angle t = 2π·u, u ~ U(0, 1), written [[cos t, sin t],
    [−sin t, cos t]]. Step k = 2 … dim − 1 (R_k ∈ SO(k) → R_{k+1}): draw v ~ N(0, I_{k+1})
    and normalize it, put x = (e₁ − v)/‖e₁ − v‖ and R_{k+1} = H (1 ⊕ R_k) with the Householder
    reflection H = I − 2xxᵀ. The result is −R (DeepOBS negates it at the end).
    """
    if dim < 2:
        raise ValueError(f"a rotation needs at least 2 dimensions, got {dim}")
    angle = 2.0 * np.pi * rng.uniform()
    rotation = np.array([[np.cos(angle), np.sin(angle)], [-np.sin(angle), np.cos(angle)]])
    for k in range(2, dim):
        v = rng.normal(size=k + 1)
        v /= np.linalg.norm(v)
        x = -v
        x[0] += 1.0
        x /= np.linalg.norm(x)
        embedded = np.eye(k + 1)
        embedded[1:, 1:] = rotation
        rotation = embedded - 2.0 * np.outer(x, x @ embedded)
    return -rotation


def deep_learning_hessian(dim: int = 100, seed: int = 42) -> Tensor:
    """Q = Rᵀ diag(λ) R as DeepOBS's ``quadratic_deep``: from one ``RandomState(seed)``,
    90 % of λ ~ U(0, 1), then 10 % ~ U(30, 60), then R by :func:`subgroup_rotation`."""
    rng = np.random.RandomState(seed)
    n_large = dim // 10
    eigenvalues = np.concatenate([rng.uniform(0.0, 1.0, dim - n_large),
                                  rng.uniform(30.0, 60.0, n_large)])
    rotation = subgroup_rotation(dim, rng)
    hessian = rotation.T @ np.diag(eigenvalues) @ rotation
    return torch.tensor(hessian, dtype=torch.float32)


def gaussian_noise(size: tuple[int, ...], std: float, seed: int) -> Tensor:
    """Fixed draws N(0, std²) from NumPy's ``RandomState(seed)`` (as DeepOBS)."""
    return torch.tensor(np.random.RandomState(seed).normal(0.0, std, size), dtype=torch.float32)


def two_d_data(train_size: int = 10_000, noise_level: float = 1.0):
    """(train, valid, test) noise of shape [N, 2]: x and y drawn one after the other."""
    def draws(seed: int) -> Tensor:
        rng = np.random.RandomState(seed)
        x = rng.normal(0.0, noise_level, train_size)
        y = rng.normal(0.0, noise_level, train_size)
        return torch.tensor(np.stack([x, y], axis=1), dtype=torch.float32)
    return draws(42), draws(44), torch.zeros(train_size, 2)


def quadratic_data(dim: int = 100, train_size: int = 1000, noise_level: float = 0.6):
    """(train, valid, test) points x_n of shape [N, D]."""
    return tuple(gaussian_noise((train_size, dim), noise_level, seed) for seed in (42, 44, 43))
