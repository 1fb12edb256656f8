"""‖g_n‖, the norm of each individual gradient. Instruments that read ‖g_n‖² (NormTest eq.
19c, the gradient noise scale, TIC, CABS) square it on the host or inside their own
reduction: per parameter one kernel less than forming the squares on the device.

Per parameter [N]; micro-batches concatenate their samples, ranks gather them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from cockpit.engine.rules.sample_grads import SampleGrads
from cockpit.engine.side_by_side import SideBySide
from cockpit.engine.stacked import StackedGrads
from cockpit.engine.statistics.registry import Combine, LayerContext, Merge, Statistic, register


class Norms(Statistic):
    name = "norms"
    shape = "[N]"
    merge = Merge.CONCAT
    combine = Combine.GATHER

    def form(self, sg: SampleGrads, layer: LayerContext) -> Tensor:
        if layer.materialized_on_accelerator:  # (by a histogram, formed before)
            return sg.chunk_norms()
        return sg.norms()

    def form_side_by_side(self, side: SideBySide, layers: Sequence[LayerContext]
                          ) -> list[Tensor]:
        return side.norms()

    def form_stacked(self, stack: StackedGrads, layers: Sequence[LayerContext]
                     ) -> list[Tensor]:
        return stack.norms()


NORMS = register(Norms()).name
