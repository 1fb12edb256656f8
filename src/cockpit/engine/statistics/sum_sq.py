"""Σ_n g_n ⊙ g_n, the elementwise second moment summed over samples (TICDiag eq. 29).

Per parameter, θ's shape, float64; micro-batches and ranks add. Small parameters side by
side and Linear weights stacked take one square and one sum for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from cockpit.engine.rules.sample_grads import SampleGrads
from cockpit.engine.side_by_side import SideBySide
from cockpit.engine.stacked import StackedGrads
from cockpit.engine.statistics.registry import Combine, LayerContext, Merge, Statistic, register


class SumSq(Statistic):
    name = "sum_sq"
    shape = "θ"
    merge = Merge.ADD
    combine = Combine.SUM

    def form(self, sg: SampleGrads, layer: LayerContext) -> Tensor:
        return sg.sum_sq()

    def form_side_by_side(self, side: SideBySide, layers: Sequence[LayerContext]
                          ) -> list[Tensor]:
        return side.sum_sq()

    def form_stacked(self, stack: StackedGrads, layers: Sequence[LayerContext]
                     ) -> list[Tensor]:
        return stack.sum_sq()


SUM_SQ = register(SumSq()).name
