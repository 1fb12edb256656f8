"""Learning-rate schedules of the Crowded Valley benchmark (Schmidt et al., 2021, §3).

Each schedule is a factor ``f(t) ∈ [0, 1]`` on the tuned base learning rate η, evaluated per
training step ``t = 0 … T−1`` (``T`` = epochs × steps per epoch); the optimizer uses
``η_t = η · f(t)`` (a ``torch.optim.lr_scheduler.LambdaLR``):

* ``constant``:         f(t) = 1
* ``cosine``:           f(t) = ½ (1 + cos(π t / T))                    (cosine decay to 0)
* ``cosine_restarts``:  cosine decay within cycles of length T_0, 2 T_0, 4 T_0, … with
  T_0 = T / 7 (three cycles fill the budget: T_0 + 2 T_0 + 4 T_0 = T; SGDR, Loshchilov &
  Hutter 2017, with T_mult = 2)
* ``trapezoidal``:      linear warm-up over the first 10 % of the steps, constant, linear
  decay to 0 over the last 10 % (the "trapezoidal" schedule of the benchmark).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

SCHEDULES = ("constant", "cosine", "cosine_restarts", "trapezoidal")


def schedule_factor(name: str, total_steps: int) -> Callable[[int], float]:
    """The factor ``f(t)`` of schedule ``name`` for a run of ``total_steps`` steps."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {name!r}; choose one of {SCHEDULES}")
    total = max(int(total_steps), 1)
    if name == "constant":
        return lambda t: 1.0
    if name == "cosine":
        return lambda t: 0.5 * (1.0 + math.cos(math.pi * min(t, total) / total))
    if name == "cosine_restarts":
        first = total / 7.0

        def restarts(t: int) -> float:
            start, length = 0.0, first
            while t >= start + length and length < 1e12:
                start, length = start + length, 2 * length
            return 0.5 * (1.0 + math.cos(math.pi * (t - start) / length))

        return restarts
    ramp = max(1, round(0.1 * total))

    def trapezoid(t: int) -> float:
        if t < ramp:
            return (t + 1) / ramp
        if t >= total - ramp:
            return max(0.0, (total - t) / ramp)
        return 1.0

    return trapezoid


def lr_scheduler(optimizer: torch.optim.Optimizer, name: str, total_steps: int):
    """A ``LambdaLR`` applying schedule ``name``; call its ``step()`` after every step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_factor(name, total_steps))
