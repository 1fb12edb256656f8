"""``missing_zero_grad``: gradients accumulate across steps — the gradient the optimizer
steps on differs from this step's batch gradient (read from GradientMismatch,
1 − cos∠(p.grad at the optimizer step, the batch gradient Cockpit saw))."""

from __future__ import annotations

from cockpit.diagnose import thresholds as T
from cockpit.diagnose.finding import Evidence, Finding
from cockpit.diagnose.record import RunRecord
from cockpit.diagnose.rule import Rule
from cockpit.diagnose.rules._common import pick, share


def check(record: RunRecord) -> list[Finding]:
    steps, mismatch = record.series("GradientMismatch")
    if len(steps) < T.MIN_STEPS:
        return []
    # the first step of a loop without zero_grad is still clean: look from the second on
    later = steps > steps[0]
    steps, mismatch = steps[later], mismatch[later]
    if share(mismatch > T.GRADIENT_MISMATCH) < T.PERSISTENT_SHARE:
        return []
    s, v = pick(steps, mismatch)
    return [Finding(
        code="missing_zero_grad", severity="warning", step=int(steps[mismatch >
                                                                    T.GRADIENT_MISMATCH][0]),
        message="The optimizer steps on a gradient that differs from this step's batch "
                "gradient: gradients seem to accumulate across steps (zero_grad missing?).",
        evidence=(Evidence("GradientMismatch", s, v,
                           "1 − cos∠(gradient stepped on, batch gradient); 0 when they agree"),),
        advice="Call optimizer.zero_grad() (or model.zero_grad()) once per step before the "
               "backward pass; with gradient accumulation, zero after the optimizer step.",
    )]


RULE = Rule("missing_zero_grad", (("GradientMismatch",),), check)
