"""‖g_n‖², the squared norm of each individual gradient (NormTest eq. 19c, TIC, CABS, …).

Per parameter [N]; micro-batches concatenate their samples, ranks gather them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from cockpit.engine.rules.sample_grads import SampleGrads
from cockpit.engine.stacked import StackedGrads
from cockpit.engine.statistics.registry import Combine, LayerContext, Merge, Statistic, register


class SqNorms(Statistic):
    name = "sq_norms"
    shape = "[N]"
    merge = Merge.CONCAT
    combine = Combine.GATHER

    def form(self, sg: SampleGrads, layer: LayerContext) -> Tensor:
        if layer.materialized_on_accelerator:  # (by a histogram, formed before)
            return sg.chunk_norms().square()
        return sg.sq_norms()

    def form_stacked(self, stack: StackedGrads, layers: Sequence[LayerContext]
                     ) -> list[Tensor]:
        return [norms.square() for norms in stack.norms()]


SQ_NORMS = register(SqNorms()).name
