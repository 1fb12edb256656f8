"""The state of one tracked backward pass, shared by the hooks that fill it
(:class:`~cockpit.engine.capture.hooks.Capture`), the per-call processing that reads it
(:class:`~cockpit.engine.processing.CallProcessor`) and the
:class:`~cockpit.engine.tracker.ModuleTracker` that resets it at each ``begin()``."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class BackwardState:
    """What the hooks of a tracked backward pass have learned so far.

    Attributes:
        weights: w_n = ∂L/∂ℓ_n of the backpropagated loss (from the hook on ``losses``).
        weight_value: float(w_n) where the weights are uniform (read once per backward).
        weights_problem: why the weights do not describe a mean (or sum) of the losses.
        multi_use: parameters used by more than one call (their individual gradients are
            summed over calls before they are reduced).
        seen_grads: the gradient each parameter received in this backward pass.
        pure_grads: parameters whose seen gradient is this backward's Σ_n w·g_n alone.
        spare_grads: the last tracked step's batch-gradient copies, reused as this one's.
        frozen_pass: during the extra backward pass of BatchNorm's frozen statistics.
        suspended: while rules run a module again (torch.func): the hooks stay quiet.
        probing: during Cockpit's own backpropagations (diagonal curvature).
    """

    weights: Tensor | None = None
    weight_value: float = 1.0
    weights_problem: str | None = None
    multi_use: set[str] = field(default_factory=set)
    seen_grads: dict[str, Tensor] = field(default_factory=dict)
    pure_grads: set[str] = field(default_factory=set)
    spare_grads: dict[str, Tensor] = field(default_factory=dict)
    frozen_pass: bool = False
    suspended: bool = False
    probing: bool = False
