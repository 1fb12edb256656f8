"""DeadUnits: the share of a layer's output units whose gradient is exactly zero for every
sample of the mini-batch (not in the paper; added for the ``dead_units`` diagnosis).

A unit is an output row of a Linear weight W ∈ R^{out×in} or an output channel of a
convolution's weight. The individual gradient of row i is g_n,i = δ_n,i a_nᵀ (summed over
positions for a convolution), where δ_n,i is the gradient w.r.t. the unit's pre-activation.
A ReLU unit that is inactive on every sample has δ_n,i = 0 for all n, so every g_n,i and
therefore the mini-batch gradient's row ḡ_i = (1/|B|) Σ_n g_n,i are exactly zero.
Conversely, ḡ_i = 0 exactly while some g_n,i ≠ 0 needs an exact floating-point
cancellation of continuous values, which does not happen in practice. So

    DeadUnits/<weight> = #{i : ḡ_i = 0 exactly} / #units,

read from the mini-batch gradient alone: one pass over the weight's gradient per tracked step,
no individual gradients (hence cheap enough for the economy configuration; see
benchmarks/RESULTS.md, "Diagnosis"). ``DeadUnits`` without a parameter is the share over the
units of all Linear and convolution weights. Embedding tables and other parameters are not
counted (a token missing from the batch has a zero row without being dead).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from cockpit.engine.readout import Later
from cockpit.quantities.base import Quantity, StepData, Value, Values
from cockpit.quantities.descriptor import Descriptor

_UNIT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class DeadUnits(Quantity):
    descriptor = Descriptor(per_parameter=True)
    needs_losses = False

    def __init__(self, schedule=None):
        super().__init__(schedule)
        self._weights: set[str] | None = None

    def _unit_weights(self, data: StepData) -> set[str]:
        if self._weights is None:
            owners = {} if data.engine is None else data.engine.parameter_owners
            self._weights = {name for name, (module, attr) in owners.items()
                             if attr == "weight" and isinstance(module, _UNIT_LAYERS)}
        return self._weights

    def compute(self, data: StepData) -> Values:
        names, row_sums = [], []
        for name in sorted(self._unit_weights(data)):
            grad = data.batch_grads.get(name)
            if grad is None or grad.dim() < 2:
                continue
            names.append(name)
            # Σ_j |ḡ_i,j| per unit i: zero exactly when the unit's row is (a sum of
            # non-negative numbers is 0 only if each is; 5× faster than a row max on a CPU)
            row_sums.append(torch.linalg.vector_norm(grad, ord=1,
                                                    dim=tuple(range(1, grad.dim()))))
        if not names:
            data.notes["DeadUnits"] = "no Linear or convolution weight received a gradient"
            return {"DeadUnits": None}
        sizes = [r.numel() for r in row_sums]

        def values(sums) -> dict[str, Value]:
            out: dict[str, Value] = {}
            dead = units = 0
            for name, rows in zip(names, np.split(sums, np.cumsum(sizes)[:-1]), strict=True):
                zero = int(np.count_nonzero(rows == 0))
                out[f"DeadUnits/{name}"] = zero / rows.shape[0]
                dead, units = dead + zero, units + rows.shape[0]
            return {"DeadUnits": dead / units, **out}

        return Later(values, torch.cat(row_sums), name="DeadUnits")
