"""Configurations of instruments (paper Table 1).

* ``"economy"``: Loss, Distance, UpdateSize, GradNorm, GradHist1d, NormTest, InnerTest,
  OrthoTest, Alpha, GradientNoiseScale (from NormTest's sums), ParamNorm, UpdateRatio
  (weight norms and update-to-weight ratios per layer), and DeadUnits (not in the
  paper; for the ``dead_units`` diagnosis, one pass over the weights' batch gradients:
  ≤ 0.5 % of a training step, benchmarks/RESULTS.md);
* ``"business"``: economy + HessTrace and TICDiag;
* ``"full"``: business + HessMaxEV and GradHist2d.

Parameters, Time, CABS, EarlyStopping and MeanGSNR are in no configuration; add them by hand.
"""

from __future__ import annotations

import cockpit.quantities as q
from cockpit.schedules import Schedule

_ECONOMY = ["Loss", "Distance", "UpdateSize", "GradNorm", "GradHist1d", "NormTest",
            "InnerTest", "OrthoTest", "Alpha", "DeadUnits", "GradientNoiseScale", "ParamNorm",
            "UpdateRatio"]
_BUSINESS = [*_ECONOMY, "HessTrace", "TICDiag"]
_FULL = [*_BUSINESS, "HessMaxEV", "GradHist2d"]
CONFIGURATIONS = {"economy": _ECONOMY, "business": _BUSINESS, "full": _FULL}

# Instruments specified by the paper that this version does not provide yet.
NOT_YET_AVAILABLE: dict[str, str] = {}


def configuration(name: str, schedule: Schedule | int | None = None) -> list[q.Quantity]:
    """The instruments of configuration ``name``, each tracked with ``schedule``.

    ``schedule`` is a callable ``step -> bool`` (see :mod:`cockpit.schedules`), an int k
    (every k steps) or None (every step).
    """
    if name not in CONFIGURATIONS:
        raise ValueError(
            f"unknown configuration {name!r}; choose one of {sorted(CONFIGURATIONS)}"
        )
    names = CONFIGURATIONS[name]
    missing = [n for n in names if n in NOT_YET_AVAILABLE]
    if missing:
        raise NotImplementedError(
            f"configuration {name!r} needs {', '.join(missing)}, which this version of "
            f"Cockpit does not provide yet (planned in {NOT_YET_AVAILABLE[missing[0]]}). "
            "Use configuration('economy') or list the instruments you need."
        )
    return [getattr(q, n)(schedule) for n in names]
