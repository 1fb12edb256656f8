"""‖g_n‖₁ = Σ_j |g_{n,j}|, the ℓ₁ norm of each individual gradient.

Per parameter [N], float64; micro-batches concatenate their samples, ranks gather them.
For a Linear weight without sequence dimensions, g_n = δ_n a_nᵀ and |δ_{n,i} a_{n,j}| =
|δ_{n,i}| |a_{n,j}|, so ‖g_n‖₁ = ‖δ_n‖₁ ‖a_n‖₁ without forming g_n; any other layer sums the
absolute values of its (shared, see :func:`shared_chunks`) materialized chunks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.engine.rules.sample_grads import OuterSampleGrads, SampleGrads
from cockpit.engine.statistics.registry import Combine, LayerContext, Merge, Statistic, register


class L1Norms(Statistic):
    name = "l1_norms"
    shape = "[N]"
    merge = Merge.CONCAT
    combine = Combine.GATHER

    def form(self, sg: SampleGrads, layer: LayerContext) -> Tensor:
        if isinstance(sg, OuterSampleGrads):
            return (sg.delta.abs().sum(1, dtype=torch.float64)
                    * sg.a.abs().sum(1, dtype=torch.float64))
        return torch.cat([c.reshape(c.shape[0], -1).abs().sum(1, dtype=torch.float64)
                          for c in sg.chunks()])


L1_NORMS = register(L1Norms()).name
