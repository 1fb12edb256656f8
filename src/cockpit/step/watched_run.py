"""What every tracked step of one Cockpit shares: the model's tracker and parameters, the
optimizer, the settings, and where the values go."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from cockpit.engine.histograms.exact import BinSpec
from cockpit.engine.tracker import ModuleTracker
from cockpit.loop_checks import (
    JOINING,
    OutsideBackwardWatch,
    joining,
    learning_rate,
    stepped_params,
)
from cockpit.quantities.base import Quantity
from cockpit.step.hist_range import HistogramRange
from cockpit.step.recorder import Recorder
from cockpit.step.warn_once import WarnOnce


@dataclass
class WatchedRun:
    """The run Cockpit watches, as its steps see it.

    ``ranks`` (processes whose statistics are combined at the current step: 1 while
    DistributedDataParallel's join() is active), ``group_ranks`` (those combined outside
    join(); 1 after it turned out that not every process runs Cockpit) and ``accumulating``
    (backward passes are micro-batches, said or learned at the first such step) change while
    the run goes on."""

    tracker: ModuleTracker
    quantities: list[Quantity]
    optimizer: torch.optim.Optimizer | None
    params: dict[str, Tensor]  # the model's trainable parameters, by name
    initial: dict[str, Tensor] | None  # θ_0, kept where an instrument reads it
    grad_scaler: Any
    batchnorm: str | None
    hist2d_specs: tuple[BinSpec, BinSpec]
    hist: HistogramRange
    warn: WarnOnce
    watch: OutsideBackwardWatch
    recorder: Recorder
    ranks: int
    accumulating: bool
    start_time: float = field(default_factory=time.perf_counter)
    # the model's DistributedDataParallel wrappers (their join() is looked at every step)
    ddp: tuple[torch.nn.Module, ...] = ()
    group_ranks: int = 0  # (0: ranks)
    optimizer_steps: int = 0  # the watched optimizer's steps so far
    _detached: dict[str, Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.group_ranks = self.group_ranks or self.ranks

    def ranks_at_step(self) -> bool:
        """Set ``ranks`` for a new tracked step; True where DistributedDataParallel's join()
        makes it this process's alone (:data:`~cockpit.loop_checks.JOINING`)."""
        joined = self.group_ranks > 1 and joining(self.ddp)
        self.ranks = 1 if joined else self.group_ranks
        if joined:
            self.warn(JOINING, key="ddp-join")
        return joined

    def stepped_params(self) -> dict[str, Tensor]:
        """The model's parameters the optimizer steps on (all without an optimizer)."""
        return stepped_params(self.optimizer, self.params)

    def detached_params(self) -> dict[str, Tensor]:
        """The parameters outside autograd: aliases of their data, no copies. An alias is kept
        from step to step while it still covers its parameter's data exactly (a detach is
        host work per tensor on an accelerator); ``p.data = …`` gets a fresh one, and so does
        a sharded parameter at every step."""
        kept = self._detached
        fresh = {}
        for name, p in self.params.items():
            alias = kept.get(name)
            fresh[name] = alias if alias is not None and _aliases(alias, p) else p.detach()
        self._detached = fresh
        return fresh

    def learning_rate(self) -> float | None:
        return learning_rate(self.optimizer, self.params)

    def gradient_scale(self) -> float:
        """The GradScaler's factor in the gradients of the coming backward pass."""
        return 1.0 if self.grad_scaler is None else float(self.grad_scaler.get_scale())


_PLAIN = (Tensor, torch.nn.Parameter)  # (not DTensors and other subclasses: no data_ptr)


def _aliases(alias: Tensor, param: Tensor) -> bool:
    """Whether ``alias`` (a detached view kept from an earlier step) still shows exactly
    ``param``'s data: the same memory, shape, strides and dtype (a replaced ``p.data``
    moves the memory: the alias holds the old storage, so it cannot be reused)."""
    return (type(param) in _PLAIN and alias.dtype == param.dtype and alias.device == param.device
            and alias.shape == param.shape and alias.stride() == param.stride()
            and alias.data_ptr() == param.data_ptr())
