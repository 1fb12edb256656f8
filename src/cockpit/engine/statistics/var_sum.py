"""V = Σ_n (g_n − ḡ) ⊙ (g_n − ḡ), the centered elementwise sum of squares (MeanGSNR eq. 31b,
EarlyStopping eq. 14d), formed without cancellation.

Per parameter, θ's shape, float64. Micro-batches merge by the parallel-variance identity

    V = V_a + V_b + (N_a N_b / N) (ḡ_a − ḡ_b) ⊙ (ḡ_a − ḡ_b)

with their batch means. Ranks sum the second moments V_r + N_r ḡ_r ⊙ ḡ_r, from which
V = Σ_r (V_r + N_r ḡ_r²) − N ḡ² (float64, clamped at 0 against rounding).
"""

from __future__ import annotations

from torch import Tensor

from cockpit.engine.rules.sample_grads import SampleGrads
from cockpit.engine.statistics.backward import BackwardStatistics
from cockpit.engine.statistics.registry import (
    Combine,
    LayerContext,
    Merge,
    RankTotals,
    Statistic,
    register,
)


class VarSum(Statistic):
    name = "var_sum"
    shape = "θ"
    merge = Merge.CENTERED
    combine = Combine.SUM

    def form(self, sg: SampleGrads, layer: LayerContext) -> Tensor:
        return sg.centered_sum_sq()

    def pack(self, stats: BackwardStatistics, name: str, shape: tuple[int, ...]
             ) -> Tensor | None:
        value, mean = stats.var_sum.get(name), stats.batch_grads.get(name)
        if value is None or mean is None:
            return None
        return value.double().reshape(shape) + stats.num_samples * mean.double().pow(2)

    def unpack(self, summed: Tensor, totals: RankTotals, name: str) -> Tensor:
        return (summed - totals.total * totals.mean(name).pow(2)).clamp_(min=0)


VAR_SUM = register(VarSum()).name
