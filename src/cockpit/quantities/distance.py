"""Distance ‖θ_t − θ_0‖ and UpdateSize ‖θ_{t+1} − θ_t‖ (paper Table 2), total and per
parameter tensor. θ_0 are the parameters when the Cockpit was created; the update is the one
``optimizer.step()`` actually applied, whatever the optimizer."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cockpit.engine.workspace import workspace
from cockpit.quantities.base import Quantity, StepData, Value, global_and_per_param, sq_norm


def _norms(name: str, per_param: dict[str, float]) -> dict[str, Value]:
    """The global norm and one per parameter tensor from squared norms per tensor."""
    total = math.sqrt(sum(per_param.values()))
    return global_and_per_param(name, {k: math.sqrt(v) for k, v in per_param.items()}, total)


class Distance(Quantity):
    needs_losses = False

    def compute(self, data: StepData) -> dict[str, Value]:
        assert data.initial_params is not None
        per_param = {}
        for k, p in data.params.items():
            # θ_t − θ_0 in scratch memory: a fresh parameter-sized tensor per step costs
            # page faults on a CPU
            diff, _ = workspace().take("distance", p.shape, p.dtype, p.device)
            per_param[k] = sq_norm(torch.sub(p.detach(), data.initial_params[k], out=diff))
        return _norms("Distance", per_param)


class UpdateSize(Quantity):
    needs_losses = False
    needs_update = True

    def compute_after_update(self, data: StepData, update: dict[str, Tensor]) -> dict[str, Value]:
        return _norms("UpdateSize", data.update_sq_norms(update))
