"""The one rule for "best setting", shared by ``cockpit bench sweep`` and ``bench analyze``.

The tuning protocol of *Descending through a Crowded Valley* (Schmidt, Schneider & Hennig,
ICML 2021): every setting (hyperparameters and schedule) is trained with the tuning seed
and judged by the final *validation* metric of that run alone — accuracy (higher is
better), or the loss for problems without accuracy (lower is better); a diverged run is the
worst. The best setting is then rerun with further seeds, and its *performance* is the
final *test* metric, mean ± standard deviation (``ddof=0``) over all its seeds.

The tuning seed of a setting is its lowest seed (0 in every sweep), so runs made by hand
with ``cockpit bench run`` are judged the same way. Ties go to the first setting name in
sorted order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np


def final_metric(result: dict[str, Any], split: str = "test") -> float | None:
    """The run's final ``split`` accuracy (metric "accuracy") or loss (metric "loss")."""
    kind = "accuracies" if result["metric"] == "accuracy" else "losses"
    return result[f"{split}_{kind}"][-1]


def selection_value(result: dict[str, Any]) -> float:
    """Final validation metric oriented so that larger is better: accuracy, or −loss;
    −∞ for a diverged run or a missing / non-finite value."""
    value = final_metric(result, "valid")
    if result.get("diverged") or value is None or not math.isfinite(value):
        return -math.inf
    return value if result["metric"] == "accuracy" else -value


def tuning_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of a setting that judges it: the one with the lowest seed."""
    if not runs:
        raise ValueError("a setting without runs cannot be judged")
    return min(runs, key=lambda r: r["seed"])


def best_setting(settings: Mapping[str, list[dict[str, Any]]]) -> str:
    """The setting whose tuning run has the best :func:`selection_value`."""
    if not settings:
        raise ValueError("no settings to choose from")
    return max(sorted(settings), key=lambda s: selection_value(tuning_run(settings[s])))


def performance(runs: list[dict[str, Any]]) -> tuple[float, float, int]:
    """(mean, standard deviation with ddof=0, number of seeds) of the final test metric over
    the runs of one setting; a diverged run's missing value is left out of mean and std (NaN
    when none is left) but counts as a seed."""
    values = [v for v in (final_metric(r) for r in runs) if v is not None and math.isfinite(v)]
    if not values:
        return math.nan, math.nan, len(runs)
    return float(np.mean(values)), float(np.std(values)), len(runs)
