"""HessTopEV: the k largest eigenvalues λ_1 ≥ … ≥ λ_k of the mini-batch loss's Hessian H_B,
by the λ_max Lanczos with its error-bounded stopping rule and deflation
(:mod:`cockpit.curvature.top_eigenvalues`).

Recorded as ``{"values": [k], "upper": [k]}``: ``values`` are lower bounds ν_i ≤ λ_i (the
Rayleigh–Ritz values on the k vectors found) and ``upper`` the certified upper bounds, so
λ_i ∈ [ν_i, upper_i] for all i except with probability k·``miss_probability``. The note
gives the products spent and the largest relative bracket width. Costs k Lanczos runs of
Hessian-vector products on the user's own forward graph plus k products, each summed over
the processes by one all-reduce where the batch is split over processes
(:mod:`cockpit.quantities.hessian_operator`); None when it is split over micro-batches (their
graphs are gone); a non-finite loss gives None with the reason. In no configuration.
"""

from __future__ import annotations

import math

import numpy as np

from cockpit.curvature.top_eigenvalues import TopEigenvalues, top_eigenvalues
from cockpit.quantities.base import StepData, Value
from cockpit.quantities.descriptor import PURPLE, Descriptor, Panel
from cockpit.quantities.hessian_operator import HessianOperatorQuantity
from cockpit.schedules import Schedule


class HessTopEV(HessianOperatorQuantity):
    descriptor = Descriptor(
        panel=Panel("HessTopEV", "curvature", "Top Hessian eigenvalues λ_1 ≥ … ≥ λ_k of H_B",
                    order=1.5),
        color=PURPLE)
    def __init__(self, schedule: Schedule | int | None = None, *, k: int = 3,
                 tol: float = 1e-3, max_iter: int = 100, miss_probability: float = 1e-3,
                 seed: int = 0):
        super().__init__(schedule, seed=seed)
        if k < 1 or not tol > 0 or max_iter < 1 or not 0 < miss_probability < 1:
            raise ValueError("HessTopEV needs k >= 1, tol > 0, max_iter >= 1 and "
                             f"0 < miss_probability < 1 (got k={k}, tol={tol})")
        self.k, self.tol, self.max_iter = k, tol, max_iter
        self.miss_probability = miss_probability

    def solve(self, matvec, dim, dtype, device) -> TopEigenvalues | str:
        if self.k > dim:
            return f"k={self.k} exceeds the number of parameters ({dim})"
        return top_eigenvalues(matvec, dim, self.k, tol=self.tol, max_iter=self.max_iter,
                               miss_probability=self.miss_probability,
                               generator=self.generator, dtype=dtype, device=device)

    def compute(self, data: StepData) -> dict[str, Value]:
        result = self.take_result(data)
        if result is None:
            return {"HessTopEV": None}
        values, upper = np.asarray(result.values), np.asarray(result.upper)
        if not np.isfinite(values).all():
            data.notes["HessTopEV"] = "a Hessian-vector product was not finite"
            return {"HessTopEV": None}
        width = float(np.max((upper - values) / np.maximum(np.abs(values), 1e-300)))
        confidence = 1 - self.k * self.miss_probability
        data.notes["HessTopEV"] = (
            f"{result.num_matvecs} Hessian-vector products; λ_i ∈ [values_i, upper_i] with "
            f"probability ≥ {confidence:g}, widest relative bracket {width:.1e}"
            + ("" if result.converged and math.isfinite(width)
               else f" (tol={self.tol:g} not reached within max_iter)"))
        return {"HessTopEV": {"values": values, "upper": upper}}
