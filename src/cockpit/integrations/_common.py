"""What the trainer integrations share: their arguments, and a sink that hands the scalar
instruments to a trainer's loggers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

PREFIX = "cockpit/"


def check_cockpit_kwargs(kwargs: Mapping[str, Any]) -> None:
    """The integrations take Cockpit's arguments except those the trainer owns."""
    for owned in ("model", "optimizer", "grad_scaler"):
        if owned in kwargs:
            raise TypeError(
                f"CockpitCallback takes Cockpit's arguments except `{owned}`: the trainer "
                "owns it and the callback hands it to Cockpit")


def scalars(values: Mapping[str, Any]) -> dict[str, float]:
    """The real-number instruments of a step, named ``cockpit/<name>`` (histograms, arrays
    and values not computed are left out: they stay in the run log and sinks)."""
    out = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isinf(value):
            continue
        out[PREFIX + name] = float(value)
    return out


class LoggerSink:
    """A Cockpit sink that calls ``log(metrics, step)`` with the scalar instruments of every
    recorded step (a trainer's loggers: TensorBoard, Weights & Biases, CSV, …)."""

    def __init__(self, log: Callable[[dict[str, float], int], None]):
        self._log = log

    def write_step(self, step: int, values: Mapping[str, Any],
                   notes: Mapping[str, str] | None = None) -> None:
        metrics = scalars(values)
        if metrics:
            self._log(metrics, int(step))

    def close(self) -> None:
        pass
