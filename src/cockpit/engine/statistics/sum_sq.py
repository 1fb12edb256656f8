"""Σ_n g_n ⊙ g_n, the elementwise second moment summed over samples (TICDiag eq. 29).

Per parameter, θ's shape, float64; micro-batches and ranks add.
"""

from __future__ import annotations

from torch import Tensor

from cockpit.engine.rules.sample_grads import SampleGrads
from cockpit.engine.statistics.registry import Combine, LayerContext, Merge, Statistic, register


class SumSq(Statistic):
    name = "sum_sq"
    shape = "θ"
    merge = Merge.ADD
    combine = Combine.SUM

    def form(self, sg: SampleGrads, layer: LayerContext) -> Tensor:
        return sg.sum_sq()


SUM_SQ = register(SumSq()).name
