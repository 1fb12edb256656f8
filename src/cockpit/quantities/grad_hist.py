"""GradHist1d and GradHist2d.

GradHist1d: histogram of all |B|×D individual-gradient elements {g_n,j} (paper eq. 15),
for the whole network and per parameter tensor.

Bins: 100 over a range set from the first tracked step's data (``DecidedRange``: the edge bins
hold exactly the elements beyond ±``range``, recorded as the field ``"range"``), or the
user's ``hist_bins=`` (the paper's view: ``BinSpec(-2, 2, 100)``; values outside are clamped
into the edge bins). The counts of the whole network are the sums of the per-parameter counts.

GradHist2d: 2-D histogram of the |B|×D pairs (g_n,j, θ_j) (paper eq. 16), whole network and
per parameter tensor; defaults as in the paper's view: 40 gradient bins over [−1, 1] × 50
parameter bins over [−2, 2], outliers clamped. The marginals are the row and column sums.
"""

from __future__ import annotations

import numpy as np
import torch

from cockpit.engine.histogram import BinSpec, DecidedRange
from cockpit.engine.tracker import HIST1D, HIST2D
from cockpit.quantities.base import Quantity, StepData, Value


class GradHist1d(Quantity):
    needs = frozenset({HIST1D})

    def compute(self, data: StepData) -> dict[str, Value]:
        stats = data.stats
        assert stats is not None
        spec = data.hist_spec
        if not isinstance(spec, BinSpec):  # range not yet set: no layer was binned
            data.notes[self.name] = "no layer's individual gradients were binned"
            return {self.name: None}
        edges = spec.edges(torch.float64, "cpu").numpy()
        extra = {"range": spec.inner} if isinstance(spec, DecidedRange) else {}
        out: dict[str, Value] = {}
        total = None
        for name, counts in stats.hist1d.items():
            c = counts.cpu().numpy().astype(np.int64)
            total = c if total is None else total + c
            out[f"GradHist1d/{name}"] = {"counts": c, "edges": edges, **extra}
        if total is None:
            total = np.zeros(data.hist_spec.bins, dtype=np.int64)
        return {"GradHist1d": {"counts": total, "edges": edges, **extra}, **out}


class GradHist2d(Quantity):
    needs = frozenset({HIST2D})

    def compute(self, data: StepData) -> dict[str, Value]:
        stats = data.stats
        assert stats is not None
        spec_g, spec_theta = data.hist2d_specs
        edges_g = spec_g.edges(torch.float64, "cpu").numpy()
        edges_theta = spec_theta.edges(torch.float64, "cpu").numpy()
        out: dict[str, Value] = {}
        total = np.zeros((spec_g.bins, spec_theta.bins), dtype=np.int64)
        for name, counts in stats.hist2d.items():
            c = counts.cpu().numpy().astype(np.int64)
            total = total + c
            out[f"GradHist2d/{name}"] = {"counts": c, "edges_grad": edges_g,
                                         "edges_param": edges_theta}
        return {"GradHist2d": {"counts": total, "edges_grad": edges_g,
                               "edges_param": edges_theta}, **out}
