"""``frozen_parameters``: parameters that receive gradients but never change, e.g. left out
of the optimizer."""

from __future__ import annotations

import numpy as np

from cockpit.diagnose import thresholds as T
from cockpit.diagnose.finding import Evidence, Finding
from cockpit.diagnose.record import RunRecord
from cockpit.diagnose.rule import Rule
from cockpit.diagnose.rules._common import layer_order


def check(record: RunRecord) -> list[Finding]:
    frozen, evidence = [], []
    s_total, total = record.series("GradNorm")
    for param in layer_order(record):
        s_g, g = record.series(f"GradNorm/{param}")
        moved_name = f"UpdateSize/{param}" if record.has(f"UpdateSize/{param}") \
            else f"Distance/{param}"
        s_u, u = record.series(moved_name)
        if len(s_u) < T.FROZEN_MIN_STEPS or not np.isfinite(u).all():
            continue
        # a gradient that is rounding noise against the network's (a bias right before a
        # BatchNorm: 0 in exact arithmetic) cannot move the parameter
        whole = np.interp(s_g, s_total, total) if s_total.size else np.zeros_like(g)
        gets_gradient = np.isfinite(g) & (g > T.FROZEN_GRADIENT_SHARE * whole) & (g > 0)
        if u.max() == 0.0 and gets_gradient.any():
            frozen.append(param)
            evidence.append(Evidence(
                moved_name, (int(s_u[0]), int(s_u[-1])), (0.0, 0.0),
                f"{param} did not change in {len(s_u)} recorded steps although its gradient "
                f"norm was up to {float(g[gets_gradient].max()):.3g}"))
    if not frozen:
        return []
    return [Finding(
        code="frozen_parameters", severity="warning", parameters=tuple(frozen),
        message=f"{len(frozen)} parameter tensor(s) receive gradients but never change: "
                f"{', '.join(frozen[:4])}{' …' if len(frozen) > 4 else ''}.",
        evidence=tuple(evidence[:4]),
        advice="Pass all trainable parameters to the optimizer (e.g. "
               "torch.optim.SGD(model.parameters(), ...)), check param_groups and learning "
               "rates of 0, or set requires_grad=False on parameters meant to stay fixed.",
    )]


RULE = Rule("frozen_parameters", (("GradNorm", "UpdateSize"), ("GradNorm", "Distance")), check,
            T.FROZEN_MIN_STEPS)
