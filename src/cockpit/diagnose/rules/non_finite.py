"""``non_finite``: the loss or the gradients became NaN or ±inf."""

from __future__ import annotations

import numpy as np

from cockpit.diagnose.finding import Evidence, Finding
from cockpit.diagnose.record import RunRecord
from cockpit.diagnose.rule import Rule
from cockpit.diagnose.rules._common import layer_order


def check(record: RunRecord) -> list[Finding]:
    first: int | None = None
    evidence = []
    for name in ("Loss", "GradNorm"):
        steps, values = record.series(name)
        bad = ~np.isfinite(values)
        if bad.any():
            step = int(steps[bad][0])
            first = step if first is None else min(first, step)
            evidence.append(Evidence(name, (step,), (float(values[bad][0]),),
                                     f"first non-finite at step {step}, "
                                     f"{int(bad.sum())} of {len(values)} steps non-finite"))
    if first is None:
        return []
    params = []
    for param in layer_order(record):
        steps, values = record.series(f"GradNorm/{param}")
        at = values[steps == first]
        if at.size and not np.isfinite(at[0]):
            params.append(param)
    where = f" (gradients of {', '.join(params[:3])}{' …' if len(params) > 3 else ''})" \
        if params else ""
    return [Finding(
        code="non_finite", severity="error", step=first, parameters=tuple(params),
        message=f"The loss or the gradients became NaN or infinite at step {first}{where}.",
        evidence=tuple(evidence),
        advice="Look for NaN/inf in the inputs of that step, lower the learning rate, clip "
               "gradients, and check divisions, logarithms and exponentials in the model and "
               "loss (e.g. use log_softmax / cross_entropy rather than log(softmax)).",
    )]


RULE = Rule("non_finite", (("Loss",), ("GradNorm",)), check)
