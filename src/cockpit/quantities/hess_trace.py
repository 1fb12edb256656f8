"""HessTrace: Tr(H_B(θ)), the trace of the mini-batch loss's Hessian (paper B.8), total and
per parameter tensor, as the sum of the diagonal curvature chosen by ``curvature=``
(exact GGN by default; see :mod:`cockpit.curvature.diagonal`)."""

from __future__ import annotations

import math

from cockpit.quantities.base import StepData, Value, global_and_per_param, to_float
from cockpit.quantities.curvature_base import DiagonalCurvatureQuantity


class HessTrace(DiagonalCurvatureQuantity):
    def compute(self, data: StepData) -> dict[str, Value]:
        diagonal = self.take_diagonal(data)
        per_param = {k: to_float(d.double().sum()) for k, d in diagonal.items()}
        total = math.fsum(per_param.values())
        return global_and_per_param("HessTrace", per_param, total)
