"""What the trainer integrations share: their arguments, and a sink that hands the scalar
instruments to a trainer's loggers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cockpit.store.sinks import is_per_parameter

PREFIX = "cockpit/"


def check_cockpit_kwargs(kwargs: Mapping[str, Any]) -> None:
    """The integrations take Cockpit's arguments except those the trainer owns."""
    for owned in ("model", "optimizer", "grad_scaler"):
        if owned in kwargs:
            raise TypeError(
                f"CockpitCallback takes Cockpit's arguments except `{owned}`: the trainer "
                "owns it and the callback hands it to Cockpit")


#: Values a trainer logs itself: sent to its loggers only with ``per_parameter``
TRAINER_OWNED = frozenset({"LearningRate", "BatchSize"})


def scalars(values: Mapping[str, Any], per_parameter: bool = False) -> dict[str, float]:
    """The real-number instruments of a step, named ``cockpit/<name>`` (histograms, arrays
    and values not computed are left out: they stay in the run log and sinks). The values
    of each parameter (``<instrument>/<parameter>``), and the learning rate and batch size
    the trainer logs itself, only with ``per_parameter``: the totals are about a dozen
    scalars a step, the per-parameter values several per tensor."""
    out = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not per_parameter and (is_per_parameter(name) or name in TRAINER_OWNED):
            continue
        if math.isinf(value):
            continue
        out[PREFIX + name] = float(value)
    return out


class LoggerSink:
    """A Cockpit sink that calls ``log(metrics, step)`` with the scalar instruments of every
    recorded step (a trainer's loggers: TensorBoard, Weights & Biases, CSV, …); the totals
    only, unless ``per_parameter``."""

    def __init__(self, log: Callable[[dict[str, float], int], None],
                 per_parameter: bool = False):
        self._log = log
        self.per_parameter = per_parameter

    def write_step(self, step: int, values: Mapping[str, Any],
                   notes: Mapping[str, str] | None = None) -> None:
        metrics = scalars(values, self.per_parameter)
        if metrics:
            self._log(metrics, int(step))

    def close(self) -> None:
        pass


def measure_clipped_updates(cockpit, clips: bool, elementwise: bool = False) -> None:
    """The trainer clips the gradient after the backward pass Cockpit watched. Clipping by
    the norm rescales the gradient: an SGD update stays in the span Alpha predicts (any
    multiple of the gradient and the momentum buffer), an Adam-like update is not linear in
    the gradient and every prediction would fail — the first step's α with it. Clipping
    each element (``elementwise``, by value) leaves that span for every optimizer. Alpha
    then measures the real update from the first step on (its general path)."""
    from cockpit.engine.update_prediction import supported_base
    from cockpit.quantities import Alpha

    optimizer = cockpit.optimizer
    if not clips or optimizer is None:
        return
    if supported_base(optimizer) is torch.optim.SGD and not elementwise:
        return
    for quantity in cockpit.quantities:
        if isinstance(quantity, Alpha):
            quantity.predict = False
