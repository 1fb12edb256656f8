"""Loss: the mini-batch loss L_B(θ_t) = (1/|B|) Σ_n ℓ_n(θ_t) (paper eq. 1 / 6a)."""

from __future__ import annotations

from cockpit.engine.readout import Later
from cockpit.quantities.base import Quantity, StepData, Values
from cockpit.quantities.descriptor import BATCH, DARK, Descriptor, Panel


class Loss(Quantity):
    descriptor = Descriptor(
        panel=Panel("Loss", "gray", "Mini-batch loss L_B(θ)", order=1, size=1.6,
                    readout=("Loss", "LearningRate", "BatchSize")),
        color=DARK, problems=(BATCH,))  # of the batch's losses, with or without a gradient

    def compute(self, data: StepData) -> Values:
        assert data.losses is not None
        mean, _ = data.loss_mean_var()  # (shared with Alpha, which reads the variance too)
        return Later(lambda mean: {"Loss": float(mean)}, mean, name="Loss")
