"""The optimizer against the model: which of the model's parameters it steps on, and the
warning at construction when it does not own them all."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import Tensor

from cockpit._stacklevel import user_stacklevel
from cockpit.loop_checks.gradient import listed


def stepped_params(optimizer: torch.optim.Optimizer | None, params: dict[str, Tensor]
                   ) -> dict[str, Tensor]:
    """The model's parameters ``optimizer`` steps on (all of them without an optimizer):
    ``optimizer.zero_grad()`` never clears the others, so they are not read by the loop
    checks (frozen_parameters is the finding for those)."""
    if optimizer is None:
        return params
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {name: p for name, p in params.items() if id(p) in owned}


def model_param_groups(optimizer: torch.optim.Optimizer | None, params: dict[str, Tensor]
                       ) -> list[dict]:
    """The optimizer's parameter groups that hold parameters of the model."""
    if optimizer is None:
        return []
    ids = {id(p) for p in params.values()}
    return [g for g in optimizer.param_groups if any(id(p) in ids for p in g["params"])]


def learning_rate(optimizer: torch.optim.Optimizer | None, params: dict[str, Tensor]
                  ) -> float | None:
    """The one learning rate of the groups holding the model's parameters (None where
    they differ or there is none)."""
    rates = {float(group["lr"]) for group in model_param_groups(optimizer, params)
             if "lr" in group}
    return rates.pop() if len(rates) == 1 else None


def check_optimizer_owns_parameters(optimizer: torch.optim.Optimizer | None,
                                    params: dict[str, Tensor]) -> list[str]:
    """Say at construction which of the model's trainable parameters the optimizer does
    not own (returned); its settings are recorded only for the groups holding the
    model's."""
    if optimizer is None:
        return []
    stepped = stepped_params(optimizer, params)
    missing = [name for name in params if name not in stepped]
    kind = type(optimizer).__name__
    if params and len(missing) == len(params):
        warnings.warn(
            f"the optimizer passed to Cockpit ({kind}) owns none of the model's parameters: "
            "pass the optimizer that trains this model (Cockpit(model, ..., optimizer=opt)). "
            "Its learning rate and settings are not recorded as the model's, and the "
            "update instruments (UpdateSize, Alpha) measure steps that do not change this "
            "model", RuntimeWarning, stacklevel=user_stacklevel())
    elif missing:
        warnings.warn(
            f"the optimizer passed to Cockpit ({kind}) does not own {len(missing)} of the "
            f"model's {len(params)} trainable parameters: {listed(missing, 8)}. "
            "If another optimizer trains them, Cockpit takes θ_t before the first optimizer "
            "step of a tracked step and θ_(t+1) when the next step's block opens (after "
            "every optimizer's step), and Alpha projects the layers' calls on that update "
            "(its general path); its learning rate is recorded for its own parameters only. "
            "Freeze them (requires_grad=False) if nothing should train them",
            RuntimeWarning, stacklevel=user_stacklevel())
    return missing


def steps_any(optimizer: torch.optim.Optimizer, params: Iterable[Tensor]) -> bool:
    """Whether ``optimizer`` steps on any of ``params`` (asked once per optimizer)."""
    ids = set(map(id, params))
    return any(id(p) in ids for group in optimizer.param_groups for p in group["params"])
