"""MeanGSNR: the average gradient signal-to-noise ratio (paper eq. 30, 31a, 31b).

    GSNR_j = ḡ_j² / ( (|B|−1)/|B| · [Σ̂_B]_jj ) = |B| ḡ_j² / Σ_n (g_{n,j} − ḡ_j)²,
    MeanGSNR = (1/D) Σ_j GSNR_j.

This is the middle expression of (31a): the squared mean over the biased (1/|B|) variance,
which matches the definition (30). The rightmost expression printed in (31a) lacks the factor
|B| in the numerator; we follow the definition. Elements without gradient noise are
excluded (see :mod:`cockpit.quantities.elementwise_variance`); |B| = 1 gives None.

``convention="original"`` reproduces the original package instead:
GSNR_j = ḡ_j² / ( (1/|B|) Σ_n (g_{n,j} − ḡ_j)² + ε ) with ε = ``epsilon`` (1e-5), averaged
over all D elements.
"""

from __future__ import annotations

import math

from cockpit.engine.statistics import VAR_SUM
from cockpit.quantities.base import Quantity, StepData, Value, to_float
from cockpit.quantities.descriptor import Descriptor
from cockpit.quantities.elementwise_variance import check_convention, mean_and_variance_sum
from cockpit.schedules import Schedule


class MeanGSNR(Quantity):
    descriptor = Descriptor(reads_gradient=True)
    needs = frozenset({VAR_SUM})

    def __init__(self, schedule: Schedule | int | None = None, *, convention: str = "cockpit",
                 epsilon: float = 1e-5):
        super().__init__(schedule)
        check_convention(convention, epsilon)
        self.convention, self.epsilon = convention, epsilon

    def compute(self, data: StepData) -> dict[str, Value]:
        assert data.stats is not None
        n = data.stats.num_samples
        if n < 2:
            data.notes["MeanGSNR"] = "undefined for a batch of one sample (no variance)"
            return {"MeanGSNR": None}
        original = self.convention == "original"
        out: dict[str, Value] = {}
        total, count = 0.0, 0
        for name in data.stats.var_sum:
            mean_sq, variance_sum = mean_and_variance_sum(
                data, name, exclude_noise_free=not original)
            if original:
                gsnr = mean_sq / (variance_sum / n + self.epsilon)
            else:
                gsnr = n * mean_sq / variance_sum
            gsnr_sum = to_float(gsnr.sum())
            total += gsnr_sum
            count += mean_sq.numel()
            out[f"MeanGSNR/{name}"] = gsnr_sum / mean_sq.numel() if mean_sq.numel() else None
        out["MeanGSNR"] = total / count if count else math.nan
        return {"MeanGSNR": out.pop("MeanGSNR"), **out}
