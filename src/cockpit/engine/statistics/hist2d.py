"""Counts of the pairs (g_{n,j}, θ_j) in the bins of the engine's two ``hist2d_specs``
(GradHist2d eq. 16).

Per parameter [bins_g, bins_θ]; micro-batches and ranks add (with the pairs (0, θ_j) of the
samples that did not reach the parameter: :meth:`Hist2d.absent`).
On accelerators the lanes of every parameter's counts are summed at once when the backward
pass ends (:meth:`Hist2d.finish`, as for :mod:`~cockpit.engine.statistics.hist1d`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from cockpit.engine.histograms.device import LaneCounts, sum_lanes
from cockpit.engine.rules.sample_grads import SampleGrads
from cockpit.engine.statistics.hist1d import zero_slot
from cockpit.engine.statistics.registry import (
    Counts,
    LayerContext,
    StatisticContext,
    register,
)


class Hist2d(Counts):
    name = "hist2d"
    shape = "[bins_g, bins_θ]"

    def form(self, sg: SampleGrads, layer: LayerContext) -> Tensor | LaneCounts:
        spec_g, spec_theta = layer.context.hist2d_specs
        return sg.histogram2d_lanes(layer.param, spec_g, spec_theta,
                                    layer.context.memory_budget)

    def finish(self, values: Mapping[str, Tensor | LaneCounts]) -> dict[str, Tensor]:
        return sum_lanes(values)

    def slot_shape(self, param_shape: torch.Size, context: StatisticContext) -> tuple[int, ...]:
        spec_g, spec_theta = context.hist2d_specs
        return (spec_g.bins, spec_theta.bins)

    def absent(self, samples: int, name: str, context: StatisticContext) -> Tensor:
        """The pairs (0, θ_j), ``samples`` times: the θ histogram in the gradient bin of 0
        (non-finite θ_j left out, as in the pairs)."""
        spec_g, spec_theta = context.hist2d_specs
        theta = LayerContext(name, context).param.reshape(-1)
        finite = torch.isfinite(theta)
        bins = spec_theta.bin_index(torch.where(finite, theta, 0))
        counts = torch.zeros(spec_g.bins, spec_theta.bins, dtype=torch.int64,
                             device=theta.device)
        counts[zero_slot(spec_g)].index_add_(0, bins, finite.long())
        return counts.mul_(samples)


HIST2D = register(Hist2d()).name
