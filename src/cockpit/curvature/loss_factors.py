"""Loss Hessians w.r.t. the model output and their symmetric factors (generalized Gauss-Newton).

The GGN of the mean loss L = (1/N) Σ_n ℓ_n(f_n) with f_n = f(θ, x_n) ∈ R^C is

    G = (1/N) Σ_n J_nᵀ (∂²ℓ_n/∂f_n²) J_n,        J_n = ∂f_n/∂θ.

Writing ∂²ℓ_n/∂f_n² = Σ_k s_{k,n} s_{k,n}ᵀ, diag(G) = (1/N) Σ_n Σ_k (J_nᵀ s_{k,n})^{⊙2}:
one vector backpropagation per column k. A Monte-Carlo factor with M ≪ C columns whose
outer products are unbiased for ∂²ℓ_n/∂f_n² gives an unbiased estimate of diag(G).

Supported per-sample losses (``kind``):

* ``"cross_entropy"``: logits f_n ∈ R^C, ℓ_n = −log softmax(f_n)[y_n], p_n = softmax(f_n):

      ∂²ℓ_n/∂f_n² = diag(p_n) − p_n p_nᵀ,
      exact factor    s_{k,n} = √p_{n,k} (e_k − p_n),           k = 1 … C,
      MC factor       s_{m,n} = (p_n − onehot(ŷ_m)) / √M,       ŷ_m ~ Cat(p_n).

  (Also valid with label smoothing; not with class weights.)

* ``"mse"``: ℓ_n = (1/C) Σ_c (f_{n,c} − y_{n,c})², i.e.
  ``F.mse_loss(out, y, reduction="none").mean(1)`` so that ``nn.MSELoss()`` is the batch
  mean of ℓ_n; with ``mse_reduction="sum"``, ℓ_n = Σ_c (f_{n,c} − y_{n,c})². With c = 2/C
  (mean) or c = 2 (sum), and C the number of output entries per sample:

      ∂²ℓ_n/∂f_n² = c · I,
      exact factor    s_{k,n} = √c · e_k,
      MC factor       s_{m,n} = √c · z_m / √M,   z_m ~ N(0, I)

  (z_m is the standardized sample of the Gaussian whose negative log-likelihood is ℓ_n).

All factors are independent of the labels y, detached, and carry the output's dtype and
device. Shapes: output [N, C] → factor [K, N, C] (MSE accepts [N, *] → [K, N, *]).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "SUPPORTED_KINDS",
    "exact_sqrt_factor",
    "loss_hessian_wrt_output",
    "mc_sqrt_factor",
]

SUPPORTED_KINDS = ("cross_entropy", "mse")
MSEReduction = Literal["mean", "sum"]


def _check(output: Tensor, kind: str, mse_reduction: str) -> Tensor:
    if kind not in SUPPORTED_KINDS:
        raise ValueError(
            f"No Gauss-Newton factorization for loss kind {kind!r} (supported: "
            f'{", ".join(SUPPORTED_KINDS)}). Use curvature="hutchinson" for other losses; '
            "it needs only Hessian-vector products."
        )
    if mse_reduction not in ("mean", "sum"):
        raise ValueError(f"mse_reduction must be 'mean' or 'sum', got {mse_reduction!r}.")
    if kind == "cross_entropy" and output.dim() != 2:
        raise ValueError(
            f"cross_entropy expects logits of shape [N, C], got {tuple(output.shape)}. "
            'Flatten extra dimensions into the batch or use curvature="hutchinson".'
        )
    if output.dim() < 2:
        raise ValueError(f"Expected output of shape [N, C, ...], got {tuple(output.shape)}.")
    return output.detach()


def _mse_scale(output: Tensor, mse_reduction: str) -> float:
    """c with ∂²ℓ_n/∂f_n² = c · I."""
    num_entries = math.prod(output.shape[1:])
    return 2.0 / num_entries if mse_reduction == "mean" else 2.0


def loss_hessian_wrt_output(
    output: Tensor, kind: str, mse_reduction: MSEReduction = "mean"
) -> Tensor:
    """Per-sample ∂²ℓ_n/∂f_n² as a tensor [N, C, C] (entries of f_n flattened for MSE)."""
    output = _check(output, kind, mse_reduction)
    N = output.shape[0]
    flat = output.reshape(N, -1)
    C = flat.shape[1]
    if kind == "cross_entropy":
        p = flat.softmax(dim=1)
        return torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)
    eye = torch.eye(C, dtype=flat.dtype, device=flat.device)
    return (_mse_scale(output, mse_reduction) * eye).expand(N, C, C).clone()


def exact_sqrt_factor(output: Tensor, kind: str, mse_reduction: MSEReduction = "mean") -> Tensor:
    """S [C, N, C] with Σ_k S[k, n] S[k, n]ᵀ = ∂²ℓ_n/∂f_n² (see module docstring)."""
    output = _check(output, kind, mse_reduction)
    N = output.shape[0]
    flat = output.reshape(N, -1)
    C = flat.shape[1]
    eye = torch.eye(C, dtype=flat.dtype, device=flat.device)
    if kind == "cross_entropy":
        p = flat.softmax(dim=1)  # [N, C]
        # S[k, n, c] = √p[n, k] (δ_kc − p[n, c])
        factor = p.T.sqrt().unsqueeze(2) * (eye.unsqueeze(1) - p.unsqueeze(0))
    else:
        scale = math.sqrt(_mse_scale(output, mse_reduction))
        factor = (scale * eye).unsqueeze(1).expand(C, N, C)
    return factor.reshape(C, *output.shape).contiguous()


def mc_sqrt_factor(
    output: Tensor,
    kind: str,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    mse_reduction: MSEReduction = "mean",
) -> Tensor:
    """S [M, N, C] with E[Σ_m S[m, n] S[m, n]ᵀ] = ∂²ℓ_n/∂f_n², M = ``num_samples``."""
    output = _check(output, kind, mse_reduction)
    if num_samples < 1:
        raise ValueError("num_samples must be at least 1.")
    N = output.shape[0]
    flat = output.reshape(N, -1)
    C = flat.shape[1]
    gen_device = flat.device if generator is None else generator.device
    if kind == "cross_entropy":
        p = flat.softmax(dim=1)
        probs = p.to(device=gen_device, dtype=torch.float64)
        labels = torch.multinomial(probs, num_samples, replacement=True, generator=generator)
        onehot = torch.nn.functional.one_hot(labels.T.to(flat.device), C).to(flat.dtype)
        factor = (p.unsqueeze(0) - onehot) / math.sqrt(num_samples)  # [M, N, C]
    else:
        z = torch.randn(num_samples, N, C, generator=generator, dtype=flat.dtype, device=gen_device)
        scale = math.sqrt(_mse_scale(output, mse_reduction) / num_samples)
        factor = scale * z.to(flat.device)
    return factor.reshape(num_samples, *output.shape)
