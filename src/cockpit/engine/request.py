"""What the instruments of a tracked step ask of the engine: one declared request.

The Cockpit builds a :class:`StepRequest` from the tracked instruments' ``needs`` before the
step's first backward pass; instruments add to it in ``prepare`` (Alpha registers the
directions to project on), and the engine's hooks read it during each backward pass of the
step. No instrument writes engine state directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

DirectionProvider = Callable[[str, Tensor, Tensor], "list | None"]
"""fn(parameter name, parameter, gradient the optimizer will see) → a basis of directions
(tensors, or :data:`cockpit.engine.processing.GRADIENT`), or None if it cannot predict one.

A provider may also have ``many(names, params, grads)`` → one such basis (or None) per
parameter, for many parameters at once: the engine then asks it once, at the end of the
backward pass, for the small parameters (see ``CallProcessor.reduce_side_by_side``)."""


@dataclass
class StepRequest:
    """The per-sample work of one tracked step.

    Attributes:
        needs: names of the per-sample statistics to reduce in the hooks
            (see :mod:`cockpit.engine.statistics`).
        directions: key → parameter name → direction u known before the backward pass;
            the engine records g_nᵀu as ``projections[key]``.
        direction_providers: key → :data:`DirectionProvider`, called per parameter once
            its gradient is known (e.g. Alpha's predicted update).
        keep_calls: keep each layer call's input and individual output gradients until
            after the optimizer step, for projections on directions known only then
            (Alpha's general path).
        gradient_scale: a GradScaler's factor on the gradients of the backward pass.
        split: the step's batch is split over micro-batches or processes; statistics that
            need the whole batch's mean gradient (g_nᵀḡ) are formed at the reduction point,
            not in the hooks, and update predictions from a partial gradient are not made.
        union_gram: keep the calls until the reduction point, to form g_nᵀḡ there.
        defer: process every layer call after the backward pass, when the gradient the
            optimizer will step on is known (``p.grad``, synchronized over processes by
            DistributedDataParallel): update predictions then see the global gradient.
    """

    needs: frozenset[str]
    directions: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    direction_providers: dict[str, DirectionProvider] = field(default_factory=dict)
    keep_calls: bool = False
    gradient_scale: float = 1.0
    split: bool = False
    union_gram: bool = False
    defer: bool = False

    def release_directions(self) -> None:
        """The backward pass ended and its projections are formed: the directions and the
        providers (with what they hold: Alpha's s_{t−1}, a parameter-sized copy) are no
        longer read, so their memory is free before the optimizer step."""
        self.directions = {}
        self.direction_providers = {}
