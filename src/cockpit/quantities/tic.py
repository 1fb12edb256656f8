"""Takeuchi information criterion approximations from a mini-batch (paper B.9):

    TICTrace = ( (1/|B|) Σ_n ‖g_n‖² ) / ( Tr(H_B) + ε )                         (eq. 28)
    TICDiag  = (1/|B|) Σ_j [Σ_n g_n ⊙ g_n]_j / ( max([H_B]_jj, 0) + ε )         (eq. 29)

with H_B's diagonal from ``curvature=`` and ε = 1e-7 (``eps=``), which keeps directions
without curvature finite; negative diagonal entries (possible for Hutchinson estimates or
non-convex Hessians) are clamped to 0 before adding ε. ``curvature="auto"`` uses the exact
Hessian diagonal where available; otherwise TICTrace falls back to the Hutchinson trace
(unbiased), TICDiag to the GGN diagonal (an elementwise ratio of a noisy estimate would be
biased), each with a warning and a note (:mod:`cockpit.curvature.diagonal`).

With a stochastic diagonal, ``"<Instrument>.stderr"`` is the delta-method standard error:
TICTrace · SE(Tr) / (Tr + ε) for TICTrace; for TICDiag the standard error of the replicates'
projections ∇f(ĥ)ᵀ h_m, f(h) = (1/|B|) Σ_j s_j / (max(h_j, 0) + ε).
"""

from __future__ import annotations

import math

import torch

from cockpit.curvature.hvp import flatten_tensors
from cockpit.engine.readout import Noted
from cockpit.engine.statistics import NORMS, SUM_SQ
from cockpit.quantities.base import StepData, Value, Values, to_float
from cockpit.quantities.curvature_base import (
    DiagonalCurvatureQuantity,
    replicate_totals,
    standard_error,
)
from cockpit.quantities.descriptor import GREEN, ORANGE, Descriptor, Panel
from cockpit.quantities.gradient_tests import sample_sq_norm_total

TIC_PANEL = Panel("TIC", "curvature", "Takeuchi information criterion (TIC)", order=3,
                  readout=("TICDiag", "TICTrace"))


class _TIC(DiagonalCurvatureQuantity):
    def __init__(self, *args, eps: float = 1e-7, **kwargs):
        super().__init__(*args, **kwargs)
        if not eps >= 0:
            raise ValueError(f"eps must be ≥ 0, got {eps}")
        self.eps = eps


class TICDiag(_TIC):
    descriptor = Descriptor(panel=TIC_PANEL, color=GREEN, reads_gradient=True)
    needs = frozenset({SUM_SQ})

    def compute(self, data: StepData) -> Values:
        finite = self.finite_flag(data)
        if finite is False:
            return {"TICDiag": math.nan}
        diagonal = self.take_diagonal(data)
        stats = data.stats
        assert stats is not None
        n = stats.num_samples
        names = list(stats.sum_sq)
        second_moments = [stats.sum_sq[k].double() for k in names]
        hs = [diagonal[k].double() for k in names]
        # every parameter's terms in a few multi-tensor kernels: Σ_j s_j / (max(h_j, 0) + ε),
        # a sum of non-negative terms (s_j ≥ 0), i.e. the ℓ1 norm of the ratios
        curvatures = torch._foreach_clamp_min(hs, 0.0) if hs else []
        if hs and self.eps:
            torch._foreach_add_(curvatures, self.eps)
        ratios = torch._foreach_div(second_moments, curvatures) if hs else []
        parts = [torch.stack(torch._foreach_norm(ratios, ord=1, dtype=torch.float64))
                 if ratios else torch.zeros(0, dtype=torch.float64)]
        replicates = self.replicate_diagonals(data)
        if replicates is not None and hs:
            # the first-order change of each term with h_j: −s_j / c_j² where h_j > 0
            # ((h > 0) as max(sign h, 0)), and its sum over j for every replicate: one
            # matrix-vector product of the replicates laid end to end with the slopes
            slopes = torch._foreach_mul(torch._foreach_div(ratios, curvatures),
                                        torch._foreach_clamp_min(torch._foreach_sign(hs), 0.0))
            torch._foreach_mul_(slopes, -1.0 / n)
            laid = flatten_tensors([r[k] for r in replicates for k in names])
            parts.append(laid.view(len(replicates), -1).double() @ flatten_tensors(slopes))

        def values(term_sums, replicate_totals=None) -> Noted:
            total = 0.0
            for term in term_sums:
                total += float(term)
            out: dict[str, Value] = {"TICDiag": total / n}
            stderr = None
            if replicate_totals is not None:
                stderr = standard_error([float(t) for t in replicate_totals])
                out["TICDiag.stderr"] = stderr
            return Noted(out, {"TICDiag": self.describe(data, "TICDiag", stderr)})

        return self.later_if_finite(finite, values, *parts)


class TICTrace(_TIC):
    descriptor = Descriptor(panel=TIC_PANEL, color=ORANGE, reads_gradient=True)
    needs = frozenset({NORMS})
    fallback = "hutchinson"

    def compute(self, data: StepData) -> dict[str, Value]:
        if self.skip_non_finite(data):
            return {"TICTrace": math.nan}
        diagonal = self.take_diagonal(data)
        stats = data.stats
        assert stats is not None
        trace = math.fsum(to_float(d.double().sum()) for d in diagonal.values())
        value = sample_sq_norm_total(data) / stats.num_samples / (trace + self.eps)
        out: dict[str, Value] = {"TICTrace": value}
        stderr = None
        replicates = self.replicate_diagonals(data)
        if replicates is not None:
            trace_se = standard_error(replicate_totals(replicates).tolist())
            stderr = abs(value) * trace_se / abs(trace + self.eps)
            out["TICTrace.stderr"] = stderr
        data.notes["TICTrace"] = self.describe(data, "TICTrace", stderr)
        return out
