"""Loss: the mini-batch loss L_B(θ_t) = (1/|B|) Σ_n ℓ_n(θ_t) (paper eq. 1 / 6a)."""

from __future__ import annotations

from cockpit.quantities.base import Quantity, StepData, Value, to_float


class Loss(Quantity):
    def compute(self, data: StepData) -> dict[str, Value]:
        assert data.losses is not None
        return {"Loss": to_float(data.losses.double().mean())}
