"""``dead_units``: a large share of a layer's units give exactly zero gradient for every
sample (read from the DeadUnits instrument)."""

from __future__ import annotations

import numpy as np

from cockpit.diagnose import thresholds as T
from cockpit.diagnose.finding import Evidence, Finding
from cockpit.diagnose.record import RunRecord
from cockpit.diagnose.rule import Rule
from cockpit.diagnose.rules._common import after_warmup, layer_order, pick, share


def check(record: RunRecord) -> list[Finding]:
    params, evidence = [], []
    for param in layer_order(record):
        steps, dead = record.series(f"DeadUnits/{param}")
        s_b, b = record.series("BatchSize")
        small = s_b[b < T.DEAD_MIN_BATCH]
        keep = ~np.isin(steps, small)
        steps, dead = steps[keep], dead[keep]
        if len(steps) < T.MIN_STEPS:
            continue
        steps, dead = after_warmup(steps, dead, T.WARMUP_SHARE)
        if share(dead >= T.DEAD_UNIT_SHARE) >= T.PERSISTENT_SHARE:
            params.append(param)
            s, v = pick(steps, dead)
            evidence.append(Evidence(f"DeadUnits/{param}", s, v,
                                     f"share of {param}'s units with a zero gradient for "
                                     "every sample"))
    if not params:
        return []
    return [Finding(
        code="dead_units", severity="warning", parameters=tuple(params),
        message=f"Many units of {', '.join(params[:3])}{' …' if len(params) > 3 else ''} "
                f"give exactly zero gradient for every sample (at least "
                f"{T.DEAD_UNIT_SHARE:.0%} of the layer's units): they are dead and do not learn.",
        evidence=tuple(evidence[:4]),
        advice="Check the initialisation of these layers (large negative biases), lower the "
               "learning rate, or use an activation without a flat zero region "
               "(LeakyReLU, GELU).",
    )]


RULE = Rule("dead_units", (("DeadUnits",),), check, T.MIN_STEPS)
