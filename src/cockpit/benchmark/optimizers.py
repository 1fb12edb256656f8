"""Optimizers by name: any ``torch.optim`` class (case-insensitive), the benchmark's aliases
``momentum`` (SGD with heavy-ball momentum) and ``nag`` (SGD with Nesterov momentum), or the
user's own class by import path ``package.module:Class``.

Hyperparameters are the keyword arguments of the optimizer's constructor; Adam-like
optimizers also accept ``beta1`` / ``beta2`` for the two entries of ``betas`` (the search
spaces tune them separately).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "momentum": ("SGD", {"momentum": 0.9}),
    "nag": ("SGD", {"momentum": 0.9, "nesterov": True}),
}


def _torch_optimizers() -> dict[str, type]:
    return {
        name.lower(): cls
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
    }


def available_optimizers() -> list[str]:
    """Names accepted by :func:`resolve_optimizer` (besides import paths)."""
    return sorted([*_torch_optimizers(), *ALIASES])


def resolve_optimizer(name: str) -> tuple[type, dict[str, Any]]:
    """(optimizer class, fixed keyword arguments of the alias) for ``name``."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(
                f"cannot import module {module_name!r} of optimizer {name!r}: {error}. "
                "Give the class as 'package.module:Class' on the Python path."
            ) from error
        cls = getattr(module, attr, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(
                f"{name!r} is not a torch.optim.Optimizer subclass "
                f"(module {module_name!r} has {attr!r} = {cls!r})"
            )
        return cls, {}
    key = name.lower()
    if key in ALIASES:
        base, fixed = ALIASES[key]
        return getattr(torch.optim, base), dict(fixed)
    table = _torch_optimizers()
    if key not in table:
        raise ValueError(
            f"unknown optimizer {name!r}; choose one of {', '.join(available_optimizers())} "
            "or give your own class as 'package.module:Class'"
        )
    return table[key], {}


def accepted_hyperparameters(cls: type) -> list[str]:
    """Keyword arguments of ``cls.__init__`` besides ``params`` (+ beta1/beta2 for betas)."""
    names = [
        p.name for p in inspect.signature(cls.__init__).parameters.values()
        if p.name not in ("self", "params") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if "betas" in names:
        names += ["beta1", "beta2"]
    return names


def optimizer_kwargs(name: str, hyperparameters: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """The class and constructor keyword arguments for ``name`` with ``hyperparameters``.

    Unknown hyperparameters are an error naming the accepted ones.
    """
    cls, fixed = resolve_optimizer(name)
    accepted = accepted_hyperparameters(cls)
    unknown = sorted(set(hyperparameters) - set(accepted))
    if unknown:
        raise ValueError(
            f"optimizer {name!r} ({cls.__name__}) has no hyperparameter "
            f"{', '.join(map(repr, unknown))}; it accepts {', '.join(accepted)}"
        )
    kwargs = {**fixed, **hyperparameters}
    if "beta1" in kwargs or "beta2" in kwargs:
        default = inspect.signature(cls.__init__).parameters["betas"].default
        b1, b2 = kwargs.pop("betas", default)
        kwargs["betas"] = (float(kwargs.pop("beta1", b1)), float(kwargs.pop("beta2", b2)))
    return cls, kwargs


def build_optimizer(name: str, params, hyperparameters: dict[str, Any]) -> torch.optim.Optimizer:
    """Construct optimizer ``name`` over ``params`` with ``hyperparameters``."""
    cls, kwargs = optimizer_kwargs(name, hyperparameters)
    return cls(params, **kwargs)
