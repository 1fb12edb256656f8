"""GradNorm: the mini-batch gradient norm ‖g_B(θ_t)‖, g_B = (1/|B|) Σ_n ∇ℓ_n (eq. 6b)."""

from __future__ import annotations

import math

from cockpit.quantities.base import Quantity, StepData, Value, global_and_per_param


class GradNorm(Quantity):
    needs_losses = False

    def compute(self, data: StepData) -> dict[str, Value]:
        per_param = {name: data.grad_sq_norm(name) for name in data.batch_grads}
        total = math.sqrt(sum(per_param.values()))
        return global_and_per_param(
            "GradNorm", {k: math.sqrt(v) for k, v in per_param.items()}, total
        )
