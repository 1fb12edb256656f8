"""HessTrace: Tr(H_B(θ)), the trace of the mini-batch loss's Hessian (paper B.8), total and
per parameter tensor, as the sum of the diagonal curvature chosen by ``curvature=``.

The default ``curvature="auto"`` uses the exact Hessian diagonal where available (networks
of linear layers, convolutions, pooling, ReLU and smooth activations, LayerNorm/RMSNorm,
within a budget of vector backpropagations) and otherwise the Hutchinson estimate
(unbiased for Tr(H_B), ``mc_samples`` = 8 Hessian-vector products) with its standard error
``"HessTrace.stderr"``; see :mod:`cockpit.curvature.diagonal`. Chosen explicitly,
``curvature="diag_ggn_exact"`` or ``"diag_ggn_mc"`` give Tr(GGN) instead: then
``"HessTrace.ggn" = 1.0`` is recorded beside the value and the view labels it "Tr(GGN)".
The method of every step is in the step's note.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cockpit.curvature.diagonal import GGN
from cockpit.engine.readout import Noted
from cockpit.quantities.base import StepData, Values, global_and_per_param
from cockpit.quantities.curvature_base import (
    DiagonalCurvatureQuantity,
    replicate_totals,
    standard_error,
)
from cockpit.quantities.descriptor import PURPLE, Descriptor, Panel


class HessTrace(DiagonalCurvatureQuantity):
    descriptor = Descriptor(
        panel=Panel("HessTrace", "curvature", "Hessian trace Tr(H_B): average curvature",
                    order=2, readout=("HessTrace",)),
        color=PURPLE)
    fallback = "hutchinson"

    def compute(self, data: StepData) -> Values:
        finite = self.finite_flag(data)
        if finite is False:
            return {"HessTrace": math.nan}
        diagonal = self.take_diagonal(data)
        names = list(diagonal)
        replicates = self.replicate_diagonals(data)
        ggn = self.method_used in GGN
        sums = [_sums(diagonal, ggn)] + ([] if replicates is None
                                         else [replicate_totals(replicates)])

        def values(per_param_sums, replicate_totals=None) -> Noted:
            per_param = dict(zip(names, map(float, per_param_sums), strict=True))
            out = global_and_per_param("HessTrace", per_param, math.fsum(per_param.values()))
            stderr = None
            if replicate_totals is not None:
                stderr = standard_error([float(t) for t in replicate_totals])
                out["HessTrace.stderr"] = stderr
            if ggn:
                out["HessTrace.ggn"] = 1.0
            return Noted(out, {"HessTrace": self.describe(data, "HessTrace", stderr)})

        return self.later_if_finite(finite, values, *sums)


def _sums(diagonal: dict[str, Tensor], non_negative: bool) -> Tensor:
    """Σ_j of every parameter's diagonal, float64 [P] on the device, by multi-tensor kernels
    for all parameters instead of one sum each. A GGN's diagonal is a sum of squares, ≥ 0
    entry by entry: its sums are ℓ1 norms. A Hessian's may be negative: Σ_j d_j =
    ‖max(d, 0)‖₁ − ‖min(d, 0)‖₁, both accumulated in float64 (NaN and ±∞ stay as in the
    sum)."""
    values = list(diagonal.values())
    if not values:
        return torch.zeros(0, dtype=torch.float64)
    if non_negative:
        return torch.stack(torch._foreach_norm(values, ord=1, dtype=torch.float64))
    positive = torch._foreach_norm(torch._foreach_clamp_min(values, 0.0), ord=1,
                                   dtype=torch.float64)
    negative = torch._foreach_norm(torch._foreach_clamp_max(values, 0.0), ord=1,
                                   dtype=torch.float64)
    return torch.stack(positive) - torch.stack(negative)

