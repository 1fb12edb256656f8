"""Loss: the mini-batch loss L_B(θ_t) = (1/|B|) Σ_n ℓ_n(θ_t) (paper eq. 1 / 6a)."""

from __future__ import annotations

from cockpit.engine.readout import Later
from cockpit.quantities.base import Quantity, StepData, Values


class Loss(Quantity):
    def compute(self, data: StepData) -> Values:
        assert data.losses is not None
        return Later(lambda mean: {"Loss": float(mean)}, data.losses.double().mean(),
                     name="Loss")
