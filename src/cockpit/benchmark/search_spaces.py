"""Search spaces and budgets of the Crowded Valley protocol (Schmidt, Schneider, Hennig,
ICML 2021).

The protocol tunes each optimizer by random search over a fixed space per hyperparameter:
``LU(a, b)`` is log-uniform on [a, b], ``U(a, b)`` uniform. The spaces below follow the
shape of the paper's table of tuning distributions (learning rates log-uniform over four to
five decades, momentum-like constants log-uniform towards 1, ε log-uniform over many
decades). The paper's text is not among this project's references and the ranges were
written from memory of its table, not checked against it: treat them as defaults to
review, and override any of them with ``--space name=LU(low,high)``. The one-shot budget
runs each optimizer once with its default hyperparameters (``DEFAULTS``: the authors'
defaults, as in the paper).

Budgets (number of tuning runs with seed 0): ``one-shot`` 1 (defaults), ``small`` 25,
``medium`` 50, ``large`` 75 — the paper's numbers. ``scale`` multiplies them (at least one
run), e.g. ``scale=0.2`` gives 5 / 10 / 15 for quick studies. With one random sampler seed
the medium budget's first 25 runs are the small budget's runs (medium ⊇ small), as in the
paper. The paper's large budget also refines the search space around the medium budget's
best setting; here the large budget uses the same spaces (stated, not hidden).
The best setting (best final validation metric) is then rerun with further seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BUDGETS = {"one-shot": 1, "small": 25, "medium": 50, "large": 75}


@dataclass(frozen=True)
class Dist:
    """A tuning distribution: ``log`` uniform (LU) or uniform (U) on [low, high]."""

    low: float
    high: float
    log: bool = True

    def __str__(self) -> str:
        return f"{'LU' if self.log else 'U'}({self.low:g}, {self.high:g})"


SEARCH_SPACES: dict[str, dict[str, Dist]] = {
    "sgd": {"lr": Dist(1e-5, 1.0)},
    "momentum": {"lr": Dist(1e-5, 1.0), "momentum": Dist(0.5, 0.999)},
    "nag": {"lr": Dist(1e-5, 1.0), "momentum": Dist(0.5, 0.999)},
    "adam": {"lr": Dist(1e-4, 1.0), "beta1": Dist(0.5, 0.999), "beta2": Dist(0.8, 0.999),
             "eps": Dist(1e-10, 1.0)},
    "adamw": {"lr": Dist(1e-4, 1.0), "beta1": Dist(0.5, 0.999), "beta2": Dist(0.8, 0.999),
              "eps": Dist(1e-10, 1.0)},
    "nadam": {"lr": Dist(1e-4, 1.0), "beta1": Dist(0.5, 0.999), "beta2": Dist(0.8, 0.999),
              "eps": Dist(1e-10, 1.0)},
    "radam": {"lr": Dist(1e-4, 1.0), "beta1": Dist(0.5, 0.999), "beta2": Dist(0.8, 0.999),
              "eps": Dist(1e-10, 1.0)},
    "rmsprop": {"lr": Dist(1e-4, 1.0), "alpha": Dist(0.8, 0.999), "eps": Dist(1e-10, 1.0)},
    "adagrad": {"lr": Dist(1e-4, 1.0), "eps": Dist(1e-10, 1.0)},
    "adadelta": {"lr": Dist(1e-4, 10.0), "rho": Dist(0.5, 0.999), "eps": Dist(1e-10, 1.0)},
}

DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 1e-2},
    "momentum": {"lr": 1e-2, "momentum": 0.9},
    "nag": {"lr": 1e-2, "momentum": 0.9},
    "adam": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    "adamw": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    "nadam": {"lr": 2e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    "radam": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    "rmsprop": {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8},
    "adagrad": {"lr": 1e-2, "eps": 1e-10},
    "adadelta": {"lr": 1.0, "rho": 0.9, "eps": 1e-6},
}


def search_space(optimizer: str, overrides: dict[str, Dist] | None = None) -> dict[str, Dist]:
    """The tuning distributions of ``optimizer`` (with ``overrides`` replacing or adding)."""
    key = optimizer.lower()
    space = dict(SEARCH_SPACES.get(key, {}))
    space.update(overrides or {})
    if not space:
        raise ValueError(
            f"no search space for optimizer {optimizer!r}; the protocol defines spaces for "
            f"{', '.join(SEARCH_SPACES)}. For another optimizer give its space, e.g. "
            "--space lr=LU(1e-5,1)"
        )
    return space


def defaults(optimizer: str) -> dict[str, Any]:
    """The one-shot (default) hyperparameters of ``optimizer`` ({} for an unknown one)."""
    return dict(DEFAULTS.get(optimizer.lower(), {}))


def budget_trials(budget: str | int, scale: float = 1.0) -> int:
    """Number of tuning runs of ``budget`` (a name or a number), times ``scale``."""
    if isinstance(budget, int) or str(budget).isdigit():
        return max(1, int(budget))
    if budget not in BUDGETS:
        raise ValueError(f"unknown budget {budget!r}; choose one of {', '.join(BUDGETS)} "
                         "or give a number of runs")
    if budget == "one-shot":
        return 1
    return max(1, math.ceil(BUDGETS[budget] * scale))


def parse_dist(text: str) -> Dist:
    """``LU(1e-5, 1)`` or ``U(0, 1)`` → :class:`Dist`."""
    text = text.strip().replace(" ", "")
    for prefix, log in (("LU(", True), ("U(", False)):
        if text.upper().startswith(prefix) and text.endswith(")"):
            low, high = (float(v) for v in text[len(prefix):-1].split(","))
            if not low < high or (log and low <= 0):
                raise ValueError(f"bad range in {text!r}: need 0 < low < high for LU")
            return Dist(low, high, log)
    raise ValueError(f"cannot read distribution {text!r}; write LU(low,high) or U(low,high)")
