"""EarlyStopping: the evidence-based criterion of Mahsereci et al. 2017 (paper eq. 14d),

    1 − |B|(|B|−1)/D · Σ_d ḡ_d² / Σ_n (g_{n,d} − ḡ_d)²,

whose positive values suggest stopping. Elements without gradient noise are excluded and
not counted in D (see :mod:`cockpit.quantities.elementwise_variance`); |B| = 1 gives None.

``convention="original"`` reproduces the original package instead:
1 − |B|/D · Σ_d ḡ_d² / ( Σ_n (g_{n,d} − ḡ_d)² / (|B|−1) + ε ) with ε = ``epsilon`` (1e-5) and
D all elements (eq. 14c with ε added to the sample variance).
"""

from __future__ import annotations

import math

from cockpit.engine.statistics import VAR_SUM
from cockpit.quantities.base import Quantity, StepData, Value, to_float
from cockpit.quantities.descriptor import Descriptor
from cockpit.quantities.elementwise_variance import check_convention, mean_and_variance_sum
from cockpit.schedules import Schedule


class EarlyStopping(Quantity):
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
            data.notes["EarlyStopping"] = "undefined for a batch of one sample (no variance)"
            return {"EarlyStopping": None}
        original = self.convention == "original"
        ratio_sum, count = 0.0, 0
        for name in data.stats.var_sum:
            mean_sq, variance_sum = mean_and_variance_sum(
                data, name, exclude_noise_free=not original)
            if original:
                ratio_sum += to_float((mean_sq / (variance_sum / (n - 1) + self.epsilon)).sum())
            else:
                ratio_sum += to_float((mean_sq / variance_sum).sum()) * (n - 1)
            count += mean_sq.numel()
        if count == 0:
            return {"EarlyStopping": math.nan}
        return {"EarlyStopping": 1.0 - n / count * ratio_sum}
