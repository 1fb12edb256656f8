"""DeadUnits: the share of a layer's output units whose gradient is exactly zero for every
sample of the mini-batch (not in the paper; added for the ``dead_units`` diagnosis).

A unit is an output row of a Linear weight W ∈ R^{out×in} or an output channel of a
convolution's weight. The individual gradient of row i is g_n,i = δ_n,i a_nᵀ (summed over
positions for a convolution), where δ_n,i is the gradient w.r.t. the unit's pre-activation.
A ReLU unit that is inactive on every sample has δ_n,i = 0 for all n, so every g_n,i and
therefore the mini-batch gradient's row ḡ_i = (1/|B|) Σ_n g_n,i are exactly zero.
Conversely, ḡ_i = 0 exactly while some g_n,i ≠ 0 needs an exact floating-point
cancellation of continuous values, which does not happen in practice. So

    DeadUnits/<weight> = #{i : ḡ_i = 0 and ḡ_b,i = 0 exactly} / #units,

where the layer has a bias b (its gradient is ḡ_b,i = (1/|B|) Σ_n δ_n,i): a unit whose row is
zero only because the layer's input is zero on every sample (every unit before it dead)
still has a bias gradient, and is not dead itself.

read from the mini-batch gradient alone: one pass over the weight's gradient per tracked step,
no individual gradients (hence cheap enough for the economy configuration; see
benchmarks/RESULTS.md, "Diagnosis"). ``DeadUnits`` without a parameter is the share over the
units of all Linear and convolution weights. Embedding tables and other parameters are not
counted (a token missing from the batch has a zero row without being dead).
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import torch
from torch import Tensor, nn

from cockpit.engine.chunk_cat import flat_cat
from cockpit.engine.readout import Later
from cockpit.quantities.base import Quantity, StepData, Value, Values, fused
from cockpit.quantities.descriptor import Descriptor

_UNIT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class DeadUnits(Quantity):
    descriptor = Descriptor(per_parameter=True)
    needs_losses = False

    def __init__(self, schedule=None):
        super().__init__(schedule)
        self._weights: dict[str, str | None] | None = None

    def _unit_weights(self, data: StepData) -> dict[str, str | None]:
        """The Linear and convolution weights, each with its layer's bias (None without)."""
        if self._weights is None:
            owners = {} if data.engine is None else data.engine.parameter_owners
            self._weights = {
                name: (name[: -len("weight")] + "bias"
                       if getattr(module, "bias", None) is not None else None)
                for name, (module, attr) in owners.items()
                if attr == "weight" and isinstance(module, _UNIT_LAYERS)}
        return self._weights

    def compute(self, data: StepData) -> Values:
        names, grads, biases = [], [], []
        weights = self._unit_weights(data)
        for name in sorted(weights):
            grad = data.batch_grads.get(name)
            if grad is None or grad.dim() < 2 or grad.shape[0] == 0:  # (no units)
                continue
            names.append(name)
            grads.append(grad)
            bias_name = weights[name]
            bias = None if bias_name is None else data.batch_grads.get(bias_name)
            biases.append(bias if bias is not None and bias.shape == grad.shape[:1] else None)
        if not names:
            data.notes["DeadUnits"] = "no Linear or convolution weight received a gradient"
            return {"DeadUnits": None}
        sizes = [g.shape[0] for g in grads]
        starts = [0, *itertools.accumulate(sizes[:-1])]

        def values(sums) -> dict[str, Value]:
            # the dead units of each weight: one count over all rows, summed per weight
            dead = np.add.reduceat((sums == 0).astype(np.int64), starts).tolist()
            out: dict[str, Value] = {"DeadUnits": sum(dead) / sum(sizes)}
            out.update((f"DeadUnits/{name}", zero / size)
                       for name, zero, size in zip(names, dead, sizes, strict=True))
            return out

        sums = unit_sums(grads)
        if any(b is not None for b in biases):  # (a unit is dead where its bias is too)
            # (one copy and one absolute value for all biases: three ops, not one per layer)
            sums = sums + torch.cat([g.new_zeros(g.shape[0]) if b is None else b
                                     for g, b in zip(grads, biases, strict=True)]).abs_()
        return Later(values, sums, name="DeadUnits")


def unit_sums(grads: list[Tensor]) -> Tensor:
    """Σ_j |ḡ_i,j| of every unit i (row i of each weight), concatenated: zero exactly where
    the unit's row is (a sum of non-negative numbers is 0 only if each is; 5× faster than a
    row max on a CPU). One norm per weight on a CPU; elsewhere three kernels for all
    weights (:func:`~cockpit.quantities.base.fused`): one copy of them side by side, its
    absolute values, one segmented sum per unit."""
    first = grads[0]
    if not fused(grads) or any(g.dtype != first.dtype or g.device != first.device
                               for g in grads):
        return torch.cat([torch.linalg.vector_norm(g, ord=1, dim=tuple(range(1, g.dim())))
                          for g in grads])
    layout = tuple((g.shape[0], math.prod(g.shape[1:])) for g in grads)
    lengths = _unit_lengths(layout, first.device)
    # ``unsafe``: the lengths sum to the elements by construction (no read of the device)
    return torch.segment_reduce(flat_cat(grads).abs_(), "sum", lengths=lengths, unsafe=True)


@functools.lru_cache(maxsize=8)
def _unit_lengths(layout: tuple[tuple[int, int], ...], device: torch.device) -> Tensor:
    """The elements of each unit's row, for the weights' (units, row length) ``layout``."""
    return torch.tensor([row for units, row in layout for _ in range(units)],
                        device=device)
