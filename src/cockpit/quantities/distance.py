"""Distance ‖θ_t − θ_0‖ and UpdateSize ‖θ_{t+1} − θ_t‖ (paper Table 2), total and per
parameter tensor. θ_0 are the parameters when the Cockpit was created (on a GPU a large
model's wait in the host's memory: :mod:`cockpit.engine.initial_parameters`); the update is
the one ``optimizer.step()`` actually applied, whatever the optimizer."""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.engine import initial_parameters, sharded
from cockpit.engine.workspace import PARAMETER_SIZED, workspace
from cockpit.quantities.base import (
    Quantity,
    StepData,
    Values,
    fused,
    norms,
    norms_of_differences,
    per_param_norms,
    sq_norm_tensor,
)
from cockpit.quantities.descriptor import BLUE, ORANGE, Descriptor, Panel

# the panel the two share
DISTANCES = Panel("Distances", "step size",
                  "Distance from init ‖θ_t − θ_0‖ and update size ‖θ_t+1 − θ_t‖", order=2,
                  readout=("Distance", "UpdateSize"))


class Distance(Quantity):
    descriptor = Descriptor(panel=DISTANCES, color=BLUE, per_parameter=True,
                            describes_batch=False, needs_initial_parameters=True)
    needs_losses = False

    def compute(self, data: StepData) -> Values:
        assert data.initial_params is not None
        if sharded.has_sharded(data.params.values()):
            return per_param_norms("Distance", list(data.params), norms(
                [p.detach() - data.initial_params[k] for k, p in data.params.items()]))
        params = list(data.params.values())
        initial = [data.initial_params[k] for k in data.params]
        elsewhere = initial_parameters.held_apart(initial, params)
        if fused(params) or elsewhere:
            return per_param_norms("Distance", list(data.params), norms_of_differences(
                params, initial, bring=elsewhere))
        sq = []
        for k, p in data.params.items():
            # θ_t − θ_0 in scratch memory (a fresh parameter-sized tensor per step costs page
            # faults on a CPU), its norm taken before the buffer serves the next parameter
            diff, _ = workspace().take(PARAMETER_SIZED, p.shape, p.dtype, p.device)
            sq.append(sq_norm_tensor(torch.sub(p, data.initial_params[k], out=diff)))
        return per_param_norms("Distance", list(data.params),
                               torch.stack(sq).double().sqrt_())


class UpdateSize(Quantity):
    descriptor = Descriptor(panel=DISTANCES, color=ORANGE, per_parameter=True,
                            describes_batch=False)
    needs_losses = False
    needs_update = True

    def compute_after_update(self, data: StepData, update: dict[str, Tensor]) -> Values:
        return per_param_norms("UpdateSize", list(update), data.update_norm_vector(update))
