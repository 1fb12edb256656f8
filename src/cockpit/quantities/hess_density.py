"""HessDensity: the spectral density of the mini-batch loss's Hessian H_B by stochastic
Lanczos quadrature (:mod:`cockpit.curvature.slq`; PyHessian's method, Ghorbani et al. 2019):

    ρ(λ) = (1/D) Σ_i δ(λ − λ_i(H_B)) ≈ (1/P) Σ_p Σ_j τ_{p,j} δ(λ − θ_{p,j}),

from P = ``probes`` Rademacher probes and m = ``steps`` Lanczos steps each (P·m Hessian-vector
products on the user's own forward graph). Its moments ∫ λ^k ρ = tr(H_B^k)/D are estimated
without bias for k ≤ 2m − 1. Recorded as ``{"nodes", "weights"}`` ([P, m] arrays, each
probe's weights summing to 1); the cockpit view draws the density smoothed by a Gaussian of
width ``0.02·(λ_max − λ_min)`` on a log axis, as PyHessian does.

Off by default (no configuration holds it): P·m products cost about as much as P·m
backward passes, so track it on a sparse schedule. Needs the whole batch's graph (None when
the batch is split over micro-batches or processes); a non-finite loss gives None with the
reason.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.curvature.diagonal import hessian_vector_product
from cockpit.curvature.slq import lanczos_quadrature
from cockpit.quantities.base import Quantity, StepData, Value
from cockpit.schedules import Schedule


class HessDensity(Quantity):
    whole_batch_graph = True

    def __init__(self, schedule: Schedule | int | None = None, *, probes: int = 16,
                 steps: int = 32, seed: int = 0):
        super().__init__(schedule)
        if probes < 1 or steps < 1:
            raise ValueError(f"HessDensity needs probes ≥ 1 and steps ≥ 1, got probes={probes}, "
                             f"steps={steps}")
        self.probes, self.steps = probes, steps
        self.generator = torch.Generator().manual_seed(seed)
        self._result: tuple[Tensor, Tensor] | None = None
        self._skipped: str | None = None

    def prepare(self, step: int, tracker, optimizer, losses: Tensor | None) -> None:
        self._result, self._skipped = None, None
        if losses is None or tracker.request.split:
            return
        if not bool(torch.isfinite(losses.detach()).all()):
            self._skipped = "non-finite loss at this step: no Hessian-vector products"
            return
        hvp = hessian_vector_product(tracker, losses, tracker.params)
        first = next(iter(tracker.params.values()))
        with tracker.suspended():
            self._result = lanczos_quadrature(
                hvp.matvec, hvp.dim, probes=self.probes, steps=self.steps,
                generator=self.generator, dtype=first.dtype, device=first.device)

    def compute(self, data: StepData) -> dict[str, Value]:
        result, self._result = self._result, None
        skipped, self._skipped = self._skipped, None
        if skipped is not None or result is None:
            data.notes["HessDensity"] = skipped or "not computed (no individual losses)"
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
