"""Parameters: the parameter values θ_t per parameter tensor (copied to numpy)."""

from __future__ import annotations

from cockpit.quantities.base import Quantity, StepData, Value
from cockpit.quantities.descriptor import Descriptor


class Parameters(Quantity):
    descriptor = Descriptor(per_parameter=True, describes_batch=False)
    needs_losses = False

    def compute(self, data: StepData) -> dict[str, Value]:
        return {
            f"Parameters/{name}": {"values": p.detach().cpu().numpy().copy()}
            for name, p in data.params.items()
        }
