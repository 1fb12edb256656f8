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

from cockpit.curvature.diagonal import GGN
from cockpit.quantities.base import StepData, Value, global_and_per_param, to_float
from cockpit.quantities.curvature_base import DiagonalCurvatureQuantity, standard_error


class HessTrace(DiagonalCurvatureQuantity):
    fallback = "hutchinson"

    def compute(self, data: StepData) -> dict[str, Value]:
        if self.skip_non_finite(data):
            return {"HessTrace": math.nan}
        diagonal = self.take_diagonal(data)
        per_param = {k: to_float(d.double().sum()) for k, d in diagonal.items()}
        total = math.fsum(per_param.values())
        out = global_and_per_param("HessTrace", per_param, total)
        replicates = self.replicate_diagonals(data)
        stderr = None
        if replicates is not None:
            stderr = standard_error(
                [math.fsum(to_float(d.double().sum()) for d in r.values()) for r in replicates])
            out["HessTrace.stderr"] = stderr
        if self.method_used in GGN:
            out["HessTrace.ggn"] = 1.0
        data.notes["HessTrace"] = self.describe(data, "HessTrace", stderr)
        return out
