"""‖g_n‖², the squared norm of each individual gradient (NormTest eq. 19c, TIC, CABS, …).

Per parameter [N]; micro-batches concatenate their samples, ranks gather them.
"""

from __future__ import annotations

from torch import Tensor

from cockpit.engine.histograms.device import device_path
from cockpit.engine.rules.sample_grads import SampleGrads
from cockpit.engine.statistics.registry import Combine, LayerContext, Merge, Statistic, register


class SqNorms(Statistic):
    name = "sq_norms"
    shape = "[N]"
    merge = Merge.CONCAT
    combine = Combine.GATHER

    def form(self, sg: SampleGrads, layer: LayerContext) -> Tensor:
        # materialized by a statistic formed before (a histogram): from those chunks on
        # accelerators (as Norms)
        if layer.chunks is not None and device_path(layer.chunks[0].device):
            return sg.chunk_norms().square()
        return sg.sq_norms()


SQ_NORMS = register(SqNorms()).name
