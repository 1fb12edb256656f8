"""Takeuchi information criterion approximations from a mini-batch (paper B.9):

    TICTrace = ( (1/|B|) Σ_n ‖g_n‖² ) / ( Tr(H_B) + ε )                         (eq. 28)
    TICDiag  = (1/|B|) Σ_j [Σ_n g_n ⊙ g_n]_j / ( max([H_B]_jj, 0) + ε )         (eq. 29)

with H_B's diagonal from ``curvature=`` (exact GGN by default) and ε = 1e-7 (``eps=``),
which keeps directions without curvature finite; negative diagonal entries (possible for
Hutchinson estimates or non-convex Hessians) are clamped to 0 before adding ε.
"""

from __future__ import annotations

import math

from cockpit.engine.tracker import SQ_NORMS, SUM_SQ
from cockpit.quantities.base import StepData, Value, to_float
from cockpit.quantities.curvature_base import DiagonalCurvatureQuantity


class _TIC(DiagonalCurvatureQuantity):
    def __init__(self, *args, eps: float = 1e-7, **kwargs):
        super().__init__(*args, **kwargs)
        if not eps >= 0:
            raise ValueError(f"eps must be ≥ 0, got {eps}")
        self.eps = eps


class TICDiag(_TIC):
    needs = frozenset({SUM_SQ})

    def compute(self, data: StepData) -> dict[str, Value]:
        diagonal = self.take_diagonal(data)
        stats = data.stats
        assert stats is not None
        total = 0.0
        for name, second_moment in stats.sum_sq.items():
            curvature = diagonal[name].double().clamp(min=0) + self.eps
            total += to_float((second_moment.double() / curvature).sum())
        return {"TICDiag": total / stats.num_samples}


class TICTrace(_TIC):
    needs = frozenset({SQ_NORMS})

    def compute(self, data: StepData) -> dict[str, Value]:
        diagonal = self.take_diagonal(data)
        stats = data.stats
        assert stats is not None
        trace = math.fsum(to_float(d.double().sum()) for d in diagonal.values())
        mean_sq_norm = sum(to_float(v.double().sum()) for v in stats.sq_norms.values())
        return {"TICTrace": mean_sq_norm / stats.num_samples / (trace + self.eps)}
