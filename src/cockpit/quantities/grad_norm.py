"""GradNorm: the mini-batch gradient norm ‖g_B(θ_t)‖, g_B = (1/|B|) Σ_n ∇ℓ_n (eq. 6b)."""

from __future__ import annotations

from cockpit.quantities.base import Quantity, StepData, Values, per_param_norms
from cockpit.quantities.descriptor import BLUE, Descriptor, Panel


class GradNorm(Quantity):
    descriptor = Descriptor(panel=Panel("GradNorm", "step size", "Gradient norm ‖g_B‖", order=3,
                                     readout=("GradNorm", "LearningRate")),
                            color=BLUE, per_parameter=True, reads_gradient=True)
    needs_losses = False

    def compute(self, data: StepData) -> Values:
        return per_param_norms("GradNorm", list(data.batch_grads), data.grad_norms())
