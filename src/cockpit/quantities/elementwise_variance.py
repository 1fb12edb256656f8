"""Elementwise gradient mean and variance shared by MeanGSNR and EarlyStopping.

For every parameter element j, from the sums collected in the backward pass:

    ḡ_j = [g_B]_j,   V_j = Σ_n (g_{n,j} − ḡ_j)²  (= (|B|−1)·[Σ̂_B]_jj, eq. 7b/8).

V_j is accumulated centered and in float64 by the engine, which avoids the cancellation of
Σ_n g_{n,j}² − |B| ḡ_j² when the noise is small compared with the mean.

Two conventions (``convention=`` of MeanGSNR and EarlyStopping, docs/conventions.md):

* ``"cockpit"`` (default): elements whose individual gradients are all equal (V_j = 0, e.g.
  all zero) carry no noise information and are excluded; "equal up to rounding" means
  V_j ≤ 64·ε·(V_j + |B| ḡ_j²) with ε the machine epsilon of the parameter's dtype. So are
  elements whose gradient is zero up to rounding (the key bias of attention, rows of unused
  tokens): Σ_n g_{n,j}² ≤ (64·ε)²·max_k Σ_n g_{n,k}² over the same parameter tensor. D counts
  only included elements. No constant is added.
* ``"original"``: the original package's definitions — a constant ``epsilon`` (1e-5) is
  added to the elementwise variance in the denominator and the average runs over all D
  elements (an element without noise and without gradient contributes 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.quantities.base import StepData

CONVENTIONS = ("cockpit", "original")


def check_convention(convention: str, epsilon: float) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(
            f"convention must be 'cockpit' (default: noise-free elements excluded, no ε) or "
            f"'original' (the original package: ε added to the variance, mean over all "
            f"elements), got {convention!r}")
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be ≥ 0, got {epsilon}")


def mean_and_variance_sum(data: StepData, name: str, *, exclude_noise_free: bool = True
                          ) -> tuple[Tensor, Tensor]:
    """(ḡ², V) of one parameter tensor's elements, flattened, float64: the included
    elements (``exclude_noise_free=True``, the Cockpit convention) or all of them."""
    assert data.stats is not None
    n = data.stats.num_samples
    grad = data.batch_grads[name]
    variance_sum = data.stats.var_sum[name].double().flatten()
    mean_sq = grad.double().flatten().pow(2)
    if not exclude_noise_free:
        return mean_sq, variance_sum
    floor = 64 * torch.finfo(grad.dtype).eps
    second_moment = variance_sum + n * mean_sq
    included = (variance_sum > floor * second_moment) & (
        second_moment > floor**2 * second_moment.max()
    )
    return mean_sq[included], variance_sum[included]
