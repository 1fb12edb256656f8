"""Parameters: the parameter values θ_t per parameter tensor (copied to numpy)."""

from __future__ import annotations

from cockpit.quantities.base import Quantity, StepData, Value


class Parameters(Quantity):
    needs_losses = False

    def compute(self, data: StepData) -> dict[str, Value]:
        return {
            f"Parameters/{name}": {"values": p.detach().cpu().numpy().copy()}
            for name, p in data.params.items()
        }
