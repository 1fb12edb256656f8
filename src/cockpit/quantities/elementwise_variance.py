"""Elementwise gradient mean and variance shared by MeanGSNR and EarlyStopping.

For every parameter element j, from the sums collected in the backward pass:

    ḡ_j = [g_B]_j,   V_j = Σ_n (g_{n,j} − ḡ_j)²  (= (|B|−1)·[Σ̂_B]_jj, eq. 7b/8).

V_j is accumulated centered and in float64 by the engine, which avoids the cancellation of
Σ_n g_{n,j}² − |B| ḡ_j² when the noise is small compared with the mean. Elements whose
individual gradients are all equal (V_j = 0, e.g. all zero) carry no noise information and
are excluded; "equal up to rounding" means V_j ≤ 64·ε·(V_j + |B| ḡ_j²) with ε the machine
epsilon of the parameter's dtype. So are elements whose gradient is zero up to rounding (the
key bias of attention, rows of unused tokens): Σ_n g_{n,j}² ≤ (64·ε)²·max_k Σ_n g_{n,k}² over
the same parameter tensor. D counts only included elements.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.quantities.base import StepData


def mean_and_variance_sum(data: StepData, name: str) -> tuple[Tensor, Tensor]:
    """(ḡ², V) of the included elements of one parameter tensor, flattened, float64."""
    assert data.stats is not None
    n = data.stats.num_samples
    grad = data.batch_grads[name]
    variance_sum = data.stats.var_sum[name].double().flatten()
    mean_sq = grad.double().flatten().pow(2)
    floor = 64 * torch.finfo(grad.dtype).eps
    second_moment = variance_sum + n * mean_sq
    included = (variance_sum > floor * second_moment) & (
        second_moment > floor**2 * second_moment.max()
    )
    return mean_sq[included], variance_sum[included]
