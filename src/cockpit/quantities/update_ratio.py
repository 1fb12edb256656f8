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

import torch
from torch import Tensor

from cockpit.quantities.base import Quantity, StepData, Value, global_and_per_param


def param_sq_norms(data: StepData) -> dict[str, float]:
    """‖θ_t‖² per parameter tensor, read before ``optimizer.step()`` (computed once per step:
    ParamNorm and UpdateRatio read the same numbers; one host read per device)."""
    cached = data.__dict__.get("_param_sq_norms")
    if cached is None:
        cached = data.__dict__["_param_sq_norms"] = _sq_norms_read_once(data.params)
    return cached


def _sq_norms_read_once(tensors: dict[str, Tensor]) -> dict[str, float]:
    by_device: dict[torch.device, list[str]] = {}
    for name, t in tensors.items():
        by_device.setdefault(t.device, []).append(name)
    out: dict[str, float] = {}
    for names in by_device.values():
        squares = []
        for name in names:
            flat = tensors[name].detach().reshape(-1)
            squares.append((torch.dot(flat, flat) if flat.is_floating_point()
                            else flat.pow(2).sum()).double())
        out.update(zip(names, torch.stack(squares).tolist(), strict=True))
    return {name: out[name] for name in tensors}


class ParamNorm(Quantity):
    needs_losses = False

    def compute(self, data: StepData) -> dict[str, Value]:
        per_param = param_sq_norms(data)
        return global_and_per_param("ParamNorm", {k: math.sqrt(v) for k, v in per_param.items()},
                                    math.sqrt(sum(per_param.values())))


class UpdateRatio(Quantity):
    needs_losses = False
    needs_update = True

    def compute(self, data: StepData) -> dict[str, Value]:
        param_sq_norms(data)  # θ_t, before the optimizer overwrites it
        return {}

    def compute_after_update(self, data: StepData, update: dict[str, Tensor]) -> dict[str, Value]:
        before = data.__dict__.get("_param_sq_norms")
        if before is None:  # compute() did not run before the step: θ_t is gone
            data.notes["UpdateRatio"] = "‖θ_t‖ was not read before the optimizer step"
            return {"UpdateRatio": None}
        after = _sq_norms_read_once(update)
        names = [k for k in after if k in before]
        zero = [k for k in names if before[k] == 0.0]
        if zero:
            data.notes["UpdateRatio"] = (
                f"‖θ_t‖ = 0 for {', '.join(zero[:4])}{' …' if len(zero) > 4 else ''}: no "
                "ratio for them (NaN)")
        per_param = {k: math.nan if before[k] == 0.0 else math.sqrt(after[k] / before[k])
                     for k in names}
        total_before = sum(before[k] for k in names)
        total = (math.sqrt(sum(after[k] for k in names) / total_before) if total_before > 0
                 else math.nan)
        return global_and_per_param("UpdateRatio", per_param, total)
