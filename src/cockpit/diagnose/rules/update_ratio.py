"""``update_ratio``: a layer whose update-to-weight ratio ‖Δθ‖/‖θ‖ (UpdateRatio) sits far
from the other layers', or far above the ≈ 1e-3 rule of thumb: it learns at another rate
than the rest of the model (e.g. a wrong learning rate in its parameter group).

Per step, each weight tensor's ratio is divided by the median ratio of the model's other
weight tensors; a layer is named when that quotient stays at or above
``UPDATE_RATIO_FASTER`` (or at or below 1/``UPDATE_RATIO_SLOWER``) at most steps after the
warm-up, or when its own ratio stays above ``UPDATE_RATIO_HUGE``. The comparison needs
``UPDATE_RATIO_MIN_OTHERS`` other weight tensors (with one, a healthy last layer of a
two-layer network already moves several times as fast as the first). Zero ratios are left
to ``frozen_parameters``.
"""

from __future__ import annotations

import warnings

import numpy as np

from cockpit.diagnose import thresholds as T
from cockpit.diagnose.finding import Evidence, Finding
from cockpit.diagnose.record import RunRecord
from cockpit.diagnose.rule import Rule
from cockpit.diagnose.rules._common import after_warmup, pick, share, weight_tensors


def _ratios(record: RunRecord, params: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(steps, [steps, layers] ratios; NaN where missing, zero or not finite)."""
    series = {p: record.series(f"UpdateRatio/{p}") for p in params}
    steps = np.unique(np.concatenate([s for s, _ in series.values()] or [np.empty(0)]))
    table = np.full((steps.size, len(params)), np.nan)
    for j, p in enumerate(params):
        s, v = series[p]
        table[np.searchsorted(steps, s), j] = v
    table[~(np.isfinite(table) & (table > 0))] = np.nan
    return steps.astype(np.int64), table


def check(record: RunRecord) -> list[Finding]:
    recorded = record.parameters("UpdateRatio")
    params = [p for p in weight_tensors(record) if p in recorded] or [
        p for p in recorded if p.rsplit(".", 1)[-1] == "weight"]
    steps, table = _ratios(record, params)
    if steps.size < T.MIN_STEPS:
        return []
    steps, table = after_warmup(steps, table, T.WARMUP_SHARE)
    named, evidence = [], []
    for j, p in enumerate(params):
        own = table[:, j]
        others = np.delete(table, j, axis=1)
        relative = np.full_like(own, np.nan)
        if others.shape[1] >= T.UPDATE_RATIO_MIN_OTHERS:
            with warnings.catch_warnings():  # steps where no other layer has a ratio
                warnings.simplefilter("ignore", RuntimeWarning)
                relative = own / np.nanmedian(others, axis=1)
        known, rel_known = np.isfinite(own), np.isfinite(relative)
        enough = T.MIN_STEPS // 2
        faster = share(relative[rel_known] >= T.UPDATE_RATIO_FASTER)
        slower = share(relative[rel_known] <= 1 / T.UPDATE_RATIO_SLOWER)
        huge = share(own[known] >= T.UPDATE_RATIO_HUGE)
        if max(faster, slower) >= T.PERSISTENT_SHARE and rel_known.sum() >= enough:
            word = "faster" if faster >= slower else "slower"
            median = float(np.nanmedian(relative))
            s, v = pick(steps[rel_known], own[rel_known])
            evidence.append(Evidence(
                f"UpdateRatio/{p}", s, v,
                f"{p} moves {median:.3g}× as fast (relative to its size) as the median of the "
                f"other layers ({word})"))
            named.append(p)
        elif huge >= T.PERSISTENT_SHARE and known.sum() >= enough:
            s, v = pick(steps[known], own[known])
            evidence.append(Evidence(
                f"UpdateRatio/{p}", s, v,
                f"each step changes {p} by {float(np.median(own[known])):.3g} of its norm "
                "(rule of thumb ≈ 1e-3)"))
            named.append(p)
    if not named:
        return []
    return [Finding(
        code="update_ratio", severity="warning", parameters=tuple(named),
        message=f"{', '.join(named[:3])}{' …' if len(named) > 3 else ''}: the update-to-"
                "weight ratio ‖Δθ‖/‖θ‖ sits far from the other layers' (or far above the "
                "≈ 1e-3 rule of thumb): these layers learn at a different rate than the rest.",
        evidence=tuple(evidence[:4]),
        advice="Check the learning rates of the optimizer's parameter groups (a group with "
               "a different lr, a scheduler acting on one group), weight decay on these "
               "layers, and their initialisation scale.",
    )]


RULE = Rule("update_ratio", (("UpdateRatio",),), check)
