"""Search spaces, defaults and budgets of the Crowded Valley protocol (Schmidt, Schneider,
Hennig, ICML 2021).

The protocol tunes each optimizer by random search over a fixed distribution per
hyperparameter: ``LU(a, b)`` is log-uniform on [a, b] (uniform in log x), ``U(a, b)`` uniform.
Override any of them with ``--space name=LU(low,high)``.

**Where the numbers come from.** The paper's text is not among this project's references.
The spaces and defaults below are read off the authors' public results repository
(github.com/SirRob1997/Crowded-Valley---Results), whose result paths spell out every run's
hyperparameters (``.../<optimizer>/...__beta1__9.65e-01__...__learning_rate__3.15e-03/
random_seed__42__<time>.json``). The settings read — 375 tuning settings: of 9 optimizers
on quadratic_deep (constant learning rate), of SGD, Momentum, RMSProp and Adam on
cifar10_3c3d (cosine), of SGD on mnist_vae (cosine with warm restarts) and of Adam on
tolstoi_char_rnn; and the one-shot runs — are committed in
``benchmarks/data/crowded_valley_settings.txt``; ``python benchmarks/crowded_valley_spaces.py``
rebuilds the evidence table ``benchmarks/data/crowded_valley_spaces.csv`` from them and
``tests/benchmark/test_crowded_valley_spaces.py`` checks the spaces below against it. What
they show:

* Every tuned value is, to 10⁻⁹ of its uniform draw, the image of a draw of numpy's
  ``RandomState(42)`` under the distribution below (run i of an optimizer with k tuned
  hyperparameters takes draws k·i … k·i+k−1, learning rate first). This pins the bounds,
  not merely brackets them: learning rate ``LU(1e-4, 1)`` for all nine optimizers; the
  momentum of Momentum / NAG, RMSProp's decay (``alpha`` in torch) and Adadelta's ρ
  ``LU(1e-3, 1)``; β₁ ``LU(0.5, 0.999)`` and β₂ ``LU(0.8, 0.999)`` for Adam, NAdam, RAdam,
  log-uniform in β itself, not in 1−β. (The authors' code wrote the β bounds as rounded
  log10 values, 10^-0.301, 10^-0.0969, 10^-0.00043, i.e. 0.50003, 0.80002, 0.99901; the
  nominal values here differ from them by less than 10⁻⁴ relative.)
* Not tuned at all: ε (fixed at the framework default: 1e-8 Adam and Adadelta, 1e-7 NAdam
  and RAdam, 1e-10 RMSProp), RMSProp's momentum (0, not centered) and Adagrad's initial
  accumulator (0.1). So no ε is in any space here; it is fixed through ``DEFAULTS``.
* One-shot runs (``DEFAULTS``) use the TensorFlow / Keras defaults, with momentum 0.99 for
  Momentum and NAG: learning rate 1e-2 (SGD, Momentum, NAG, Adagrad) or 1e-3 (Adam, NAdam,
  RAdam, RMSProp, Adadelta), β = (0.9, 0.999), RMSProp decay 0.9, Adadelta ρ 0.95. The
  numbers are taken over as they are; where TensorFlow's formula differs from torch's they
  do not mean exactly the same (RMSProp adds ε inside the square root and starts the mean
  square at 1; TF's Adam adds ε before the bias correction).
* The repository has one-shot runs and one tuning folder, ``large_budget``, with 50 tuning
  runs per problem, schedule and optimizer: the draws used go up to run 49 and no further in
  any folder read, all from the same fixed distributions. In quadratic_deep / Momentum runs
  0 … 24 date from December 2019 and runs 25 … 49 from April 2020: a 25-run budget extended
  to 50, i.e. the small and medium budgets below.

Not verified: ``adamw`` (AdamW is not in the benchmark; its space copies Adam's and its
weight decay stays at torch's default), and the large budget's refined search spaces (not in
the repository).

Budgets (number of tuning runs with seed 0), as the talk in this project's references lists
them: ``one-shot`` 1 (defaults), ``small`` 25, ``medium`` 50, ``large``
75 "with refined search spaces". How the paper refines them is not known here: the large
budget uses the same spaces (stated, not hidden). ``scale`` multiplies the numbers (at least
one run), e.g. ``scale=0.2`` gives 5 / 10 / 15 for quick studies. In the results repository
the medium budget's first 25 runs are the small budget's runs (one numpy stream). Here they
are not: each budget is its own Optuna study, whose sampler is seeded from the study's name,
which includes the budget (:mod:`cockpit.benchmark.sweep`), so a medium sweep draws 50
settings of its own and shares no setting with a small sweep (medium is not a superset of
small). The best setting (best final validation metric) is then rerun with further seeds
(the repository: 9 more, seeds 43 … 51).
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


LR = Dist(1e-4, 1.0)  # every optimizer's learning rate
DECAY = Dist(1e-3, 1.0)  # heavy-ball momentum, RMSProp's decay (alpha), Adadelta's rho
BETA1, BETA2 = Dist(0.5, 0.999), Dist(0.8, 0.999)

SEARCH_SPACES: dict[str, dict[str, Dist]] = {
    "sgd": {"lr": LR},
    "momentum": {"lr": LR, "momentum": DECAY},
    "nag": {"lr": LR, "momentum": DECAY},
    "adam": {"lr": LR, "beta1": BETA1, "beta2": BETA2},
    "adamw": {"lr": LR, "beta1": BETA1, "beta2": BETA2},  # not verified (see above)
    "nadam": {"lr": LR, "beta1": BETA1, "beta2": BETA2},
    "radam": {"lr": LR, "beta1": BETA1, "beta2": BETA2},
    "rmsprop": {"lr": LR, "alpha": DECAY},
    "adagrad": {"lr": LR},
    "adadelta": {"lr": LR, "rho": DECAY},
}

DEFAULTS: dict[str, dict[str, Any]] = {  # also the fixed values of untuned hyperparameters
    "sgd": {"lr": 1e-2},
    "momentum": {"lr": 1e-2, "momentum": 0.99},
    "nag": {"lr": 1e-2, "momentum": 0.99},
    "adam": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    "adamw": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},  # not verified
    "nadam": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-7},
    "radam": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-7},
    "rmsprop": {"lr": 1e-3, "alpha": 0.9, "eps": 1e-10},  # momentum 0, not centered: torch's
    "adagrad": {"lr": 1e-2, "initial_accumulator_value": 0.1},
    "adadelta": {"lr": 1e-3, "rho": 0.95, "eps": 1e-8},
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
            "--space lr=LU(1e-4,1)"
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
    # rounded first: 25 × 0.28 is 7.000000000000001 in floating point, and 7 runs are meant
    return max(1, math.ceil(round(BUDGETS[budget] * scale, 9)))


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
