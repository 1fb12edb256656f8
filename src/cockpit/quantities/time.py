"""Time: wall-clock seconds since the Cockpit was created, at the tracked step."""

from __future__ import annotations

from cockpit.quantities.base import Quantity, StepData, Value
from cockpit.quantities.descriptor import Descriptor


class Time(Quantity):
    descriptor = Descriptor(describes_batch=False, problems=())
    needs_losses = False

    def compute(self, data: StepData) -> dict[str, Value]:
        return {"Time": data.time}
