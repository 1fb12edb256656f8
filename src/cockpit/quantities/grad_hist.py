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

import functools

import numpy as np
import torch
from torch import Tensor

from cockpit.engine.histograms.auto_range import DecidedRange
from cockpit.engine.histograms.exact import BinSpec
from cockpit.engine.readout import Later
from cockpit.engine.statistics import HIST1D, HIST2D
from cockpit.quantities.base import Quantity, StepData, Value, Values
from cockpit.quantities.descriptor import BLUE, Descriptor, Panel


@functools.lru_cache(maxsize=16)
def _edges(spec: BinSpec) -> np.ndarray:
    """The float64 edges e_0 … e_bins of ``spec`` (read-only, formed once per spec: the
    reported edges are always float64 on the host, whatever the gradients' dtype and
    device)."""
    edges = spec.edges(torch.float64, "cpu").numpy()
    edges.flags.writeable = False
    return edges


def _counts(counts: dict[str, Tensor]) -> Tensor:
    """The counts of every parameter as one int64 tensor [P, *bins] (one copy to the host):
    the matrix itself where the counts are its rows in order (as the accelerator path's
    lane sums leave them), else their stack."""
    rows = list(counts.values())
    matrix = rows[0]._base
    if (matrix is not None and matrix.shape == (len(rows), *rows[0].shape)
            and matrix.is_contiguous()
            and all(row._base is matrix and row.is_contiguous()
                    and row.storage_offset() == matrix.storage_offset() + i * matrix.stride(0)
                    for i, row in enumerate(rows))):
        return matrix
    return torch.stack(rows)


class GradHist1d(Quantity):
    descriptor = Descriptor(
        panel=Panel("GradHist1d", "gradients", "Histogram of individual gradient elements g_n,j",
                    order=3),
        color=BLUE, per_parameter=True, reads_gradient=True)
    needs = frozenset({HIST1D})

    def compute(self, data: StepData) -> Values:
        stats = data.stats
        assert stats is not None
        spec = data.hist_spec
        if not isinstance(spec, BinSpec):  # range not yet set: no layer was binned
            data.notes[self.name] = "no layer's individual gradients were binned"
            return {self.name: None}
        edges = _edges(spec)
        extra = {"range": spec.inner} if isinstance(spec, DecidedRange) else {}
        names = list(stats.hist1d)
        if not names:
            counts = np.zeros(spec.bins, dtype=np.int64)
            return {"GradHist1d": {"counts": counts, "edges": edges, **extra}}

        def values(stacked) -> dict[str, Value]:
            per_param = stacked.astype(np.int64)
            out: dict[str, Value] = {"GradHist1d": {"counts": per_param.sum(0),
                                                    "edges": edges, **extra}}
            for name, c in zip(names, per_param, strict=True):
                out[f"GradHist1d/{name}"] = {"counts": c, "edges": edges, **extra}
            return out

        return Later(values, _counts(stats.hist1d), name="GradHist1d")


class GradHist2d(Quantity):
    descriptor = Descriptor(
        panel=Panel("GradHist2d", "gradients", "Parameters θ_j vs. individual gradients g_n,j",
                    order=5, size=1.25),
        color=BLUE, reads_gradient=True)
    needs = frozenset({HIST2D})

    def compute(self, data: StepData) -> Values:
        stats = data.stats
        assert stats is not None
        spec_g, spec_theta = data.hist2d_specs
        edges_g, edges_theta = _edges(spec_g), _edges(spec_theta)
        names = list(stats.hist2d)

        def histogram(counts: np.ndarray) -> dict[str, np.ndarray]:
            return {"counts": counts, "edges_grad": edges_g, "edges_param": edges_theta}

        if not names:
            return {"GradHist2d": histogram(
                np.zeros((spec_g.bins, spec_theta.bins), dtype=np.int64))}

        def values(stacked) -> dict[str, Value]:
            per_param = stacked.astype(np.int64)
            out: dict[str, Value] = {"GradHist2d": histogram(per_param.sum(0))}
            for name, c in zip(names, per_param, strict=True):
                out[f"GradHist2d/{name}"] = histogram(c)
            return out

        return Later(values, _counts(stats.hist2d), name="GradHist2d")
