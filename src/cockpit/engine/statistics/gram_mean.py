"""g_nᵀḡ with ḡ = (1/N) Σ_m g_m the mean over the backward pass' own samples (InnerTest eq. 22c,
OrthoTest eq. 25b).

Per parameter [N]. It is relative to the mean of the batch that formed it, so two micro-batches'
values cannot be merged: for a split batch the reduction point forms it over the union
(:class:`~cockpit.engine.reduction.step_reduction.StepReduction`). Ranks gather their samples'
values (formed against the global ḡ). Where the layer has a closed form (a Gram matrix for Linear
layers, ``fuse_dots`` false) it is formed here; otherwise it is one row of the processor's fused
dot-product pass, beside the projections.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from cockpit.engine.rules.sample_grads import SampleGrads
from cockpit.engine.stacked import StackedGrads
from cockpit.engine.statistics.registry import Combine, LayerContext, Merge, Statistic, register


class GramMean(Statistic):
    name = "gram_mean"
    shape = "[N]"
    merge = Merge.NONE
    combine = Combine.GATHER
    fused_dot = True

    def form(self, sg: SampleGrads, layer: LayerContext) -> Tensor | None:
        return None if sg.fuse_dots else sg.gram_mean()

    def form_stacked(self, stack: StackedGrads, layers: Sequence[LayerContext]
                     ) -> list[None]:
        return [None] * len(layers)  # (stacked on accelerators: a row of the dot products)


GRAM_MEAN = register(GramMean()).name
