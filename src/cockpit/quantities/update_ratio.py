"""ParamNorm ‖θ_t‖ and UpdateRatio ‖θ_{t+1} − θ_t‖ / ‖θ_t‖, total and per parameter tensor.

The update-to-weight ratio says how far one optimizer step moves a layer relative to its
size; the rule of thumb is ≈ 1e-3 for a healthy layer, and a layer far above the others
learns at a different rate (e.g. a wrong learning rate in its parameter group). The update
is the one ``optimizer.step()`` applied, whatever the optimizer (as UpdateSize's).

A parameter with ‖θ_t‖ = 0 (e.g. a bias initialized to zero) has no ratio: NaN for it, as
for every value that would divide by zero, and its name in the note.
"""

from __future__ import annotations

import math
import operator

from torch import Tensor

from cockpit.engine.readout import Later, Noted
from cockpit.quantities.base import (
    Quantity,
    StepData,
    Value,
    Values,
    global_and_per_param,
    norms,
    per_param_norms,
)
from cockpit.quantities.descriptor import GREEN, ORANGE, Descriptor, Panel

RULE_OF_THUMB = 1e-3  # a healthy layer's ‖s_t‖/‖θ_t‖ (drawn as a reference line)


def param_norms(data: StepData) -> Tensor:
    """‖θ_t‖ per parameter tensor in the order of ``data.params``, float64 on the device,
    formed before ``optimizer.step()`` (once per step: ParamNorm and UpdateRatio read the
    same numbers)."""
    return data.once(_PARAM_NORMS, lambda: norms(list(data.params.values())))


_PARAM_NORMS = "param norms"


class ParamNorm(Quantity):
    descriptor = Descriptor(
        panel=Panel("ParamNorm", "gray", "Parameter norms ‖θ_t‖ per tensor", order=4,
                    size=1.2, readout=("ParamNorm", "ParamNorm/*")),
        color=GREEN, per_parameter=True, describes_batch=False)
    needs_losses = False

    def compute(self, data: StepData) -> Values:
        return per_param_norms("ParamNorm", list(data.params), param_norms(data))


class UpdateRatio(Quantity):
    descriptor = Descriptor(
        panel=Panel("UpdateRatio", "step size",
                    "Update-to-weight ratio ‖θ_t+1 − θ_t‖ / ‖θ_t‖ per tensor", order=4,
                    readout=("UpdateRatio", "UpdateRatio/*")),
        color=ORANGE, per_parameter=True, describes_batch=False)
    needs_losses = False
    needs_update = True

    def compute(self, data: StepData) -> dict[str, Value]:
        param_norms(data)  # θ_t, before the optimizer overwrites it
        return {}

    def compute_after_update(self, data: StepData, update: dict[str, Tensor]) -> Values:
        before = data.formed(_PARAM_NORMS)
        if before is None:  # compute() did not run before the step: θ_t is gone
            data.notes["UpdateRatio"] = "‖θ_t‖ was not read before the optimizer step"
            return {"UpdateRatio": None}
        position = {k: i for i, k in enumerate(data.params)}
        names = [k for k in update if k in position]
        rows = [position[k] for k in names]
        after_rows = [i for i, k in enumerate(update) if k in position]

        def values(before_all, after_all) -> Noted:
            b, a = before_all[rows].tolist(), after_all[after_rows].tolist()
            zero = [k for k, v in zip(names, b, strict=True) if v == 0.0]
            notes = ({"UpdateRatio": (
                f"‖θ_t‖ = 0 for {', '.join(zero[:4])}{' …' if len(zero) > 4 else ''}: no "
                "ratio for them (NaN)")} if zero else {})
            per_param = dict(zip(names, [math.nan if v == 0.0 else u / v
                                         for u, v in zip(a, b, strict=True)], strict=True))
            total_before = math.sqrt(sum(map(operator.mul, b, b)))
            total = (math.sqrt(sum(map(operator.mul, a, a))) / total_before
                     if total_before > 0 else math.nan)
            return Noted(global_and_per_param("UpdateRatio", per_param, total), notes)

        return Later(values, before, data.update_norm_vector(update), name="UpdateRatio")
