"""HessDensity: the spectral density of the mini-batch loss's Hessian H_B by stochastic
Lanczos quadrature (:mod:`cockpit.curvature.slq`; PyHessian's method, Ghorbani et al. 2019):

    ρ(λ) = (1/D) Σ_i δ(λ − λ_i(H_B)) ≈ (1/P) Σ_p Σ_j τ_{p,j} δ(λ − θ_{p,j}),

from P = ``probes`` Rademacher probes and m = ``steps`` Lanczos steps each (P·m Hessian-vector
products on the user's own forward graph). Its moments ∫ λ^k ρ = tr(H_B^k)/D are estimated
without bias for k ≤ 2m − 1. Recorded as ``{"nodes", "weights"}`` ([P, m] arrays, each
probe's weights summing to 1); the cockpit view draws the density smoothed by a Gaussian of
width ``0.02·(λ_max − λ_min)`` on a log axis, as PyHessian does.

Off by default (no configuration holds it): P·m products cost about as much as P·m
backward passes, so track it on a sparse schedule. Over processes each product is summed
over the ranks (one all-reduce; :mod:`cockpit.quantities.hessian_operator`), and every rank
draws the same probes; None when the batch is split over micro-batches (their graphs are
gone); a non-finite loss gives None with the reason.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.curvature.slq import lanczos_quadrature
from cockpit.quantities.base import StepData, Value
from cockpit.quantities.descriptor import PURPLE, Descriptor, Panel
from cockpit.quantities.hessian_operator import HessianOperatorQuantity
from cockpit.schedules import Schedule


class HessDensity(HessianOperatorQuantity):
    descriptor = Descriptor(
        panel=Panel("HessDensity", "curvature",
                    "Hessian eigenvalue density (stochastic Lanczos quadrature)", order=5),
        color=PURPLE)
    def __init__(self, schedule: Schedule | int | None = None, *, probes: int = 16,
                 steps: int = 32, seed: int = 0):
        super().__init__(schedule, seed=seed)
        if probes < 1 or steps < 1:
            raise ValueError(f"HessDensity needs probes ≥ 1 and steps ≥ 1, got probes={probes}, "
                             f"steps={steps}")
        self.probes, self.steps = probes, steps

    def solve(self, matvec, dim, dtype, device) -> tuple[Tensor, Tensor]:
        return lanczos_quadrature(matvec, dim, probes=self.probes, steps=self.steps,
                                  generator=self.generator, dtype=dtype, device=device)

    def compute(self, data: StepData) -> dict[str, Value]:
        result = self.take_result(data)
        if result is None:
            return {"HessDensity": None}
        nodes, weights = result
        if not bool(torch.isfinite(nodes).all()):
            data.notes["HessDensity"] = "a Hessian-vector product was not finite"
            return {"HessDensity": None}
        data.notes["HessDensity"] = (
            f"stochastic Lanczos quadrature: {self.probes} probes × {nodes.shape[1]} steps")
        return {"HessDensity": {"nodes": nodes.numpy(), "weights": weights.numpy()}}


def density_moments(value: dict, orders: int = 4) -> list[float]:
    """∫ λ^k ρ(λ) dλ ≈ tr(H^k)/D for k = 1 … ``orders`` from a recorded HessDensity value."""
    nodes = torch.as_tensor(value["nodes"], dtype=torch.float64)
    weights = torch.as_tensor(value["weights"], dtype=torch.float64)
    return [float((weights * nodes**k).sum(1).mean()) for k in range(1, orders + 1)]
