"""The run's metadata, stored once at the head of the run log: the model, the optimizer's
settings for the model's parameters, the instruments and their schedules, versions."""

from __future__ import annotations

import platform
import time
from typing import Any

import torch
from torch import Tensor, nn

from cockpit._version import __version__
from cockpit.engine.rules.batchnorm_frozen import APPROXIMATION
from cockpit.loop_checks import model_param_groups, stepped_params
from cockpit.quantities.base import Quantity
from cockpit.quantities.descriptor import METADATA_KEY, describe_instruments


def run_metadata(model: nn.Module, tracked_model: nn.Module, params: dict[str, Tensor],
                 optimizer: torch.optim.Optimizer | None, quantities: list[Quantity],
                 batchnorm: str | None, precision: str | None = None) -> dict[str, Any]:
    """``model``: as passed to Cockpit; ``tracked_model``: the module its hooks are on
    (inside torch.compile's wrapper); ``params``: its trainable parameters by name;
    ``precision``: what the values describe under a mixed precision policy (None: the
    parameters' own precision)."""
    # only an optimizer that trains (some of) this model, only its groups that do
    groups = model_param_groups(optimizer, params)
    stepped = stepped_params(optimizer, params)
    return {
        "model": repr(model),
        "model_class": type(tracked_model).__name__,
        "num_parameters": int(sum(p.numel() for p in params.values())),
        "parameters": {k: list(p.shape) for k, p in params.items()},
        "optimizer": type(optimizer).__name__ if groups else None,
        "optimizer_hyperparameters": [
            {k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in groups
        ] if groups else None,
        "parameters_not_in_optimizer": [n for n in params if n not in stepped],
        "quantities": [q.name for q in quantities],
        "schedules": {q.name: repr(q.schedule) for q in quantities},
        # panels, colours, recorded names: `cockpit plot` draws them in a fresh process
        METADATA_KEY: describe_instruments(quantities),
        "versions": {
            "cockpit": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "start_time": time.time(),
        "device": str(next(iter(params.values())).device) if params else "cpu",
        "batchnorm": (None if batchnorm is None
                      else {"mode": batchnorm, "note": APPROXIMATION}),
        "mixed_precision": precision,
    }


def cockpit_metadata(cockpit: Any) -> dict[str, Any]:
    """The metadata :func:`run_metadata` makes for the run log of ``cockpit`` (a
    :class:`~cockpit.Cockpit`, with or without a ``logdir``), from the same parts: what a
    view drawn from the Cockpit object reads (the parameters in the model's order, the
    model and optimizer of the title). Nothing is written; ``start_time`` is now."""
    tracker = cockpit.tracker
    return run_metadata(cockpit.model, tracker.model, dict(tracker.params), cockpit.optimizer,
                        list(cockpit.quantities), cockpit.batchnorm, tracker.precision_note)


def _jsonable(value: Any) -> bool:
    return isinstance(value, bool | int | float | str | type(None)) or (
        isinstance(value, tuple | list) and all(isinstance(v, int | float) for v in value)
    )
