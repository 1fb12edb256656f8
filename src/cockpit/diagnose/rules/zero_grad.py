"""``missing_zero_grad``: gradients accumulate across steps — the parameters already hold a
gradient when a step's first backward pass begins, so the optimizer steps on more than this
step's batch gradient.

Read from GradientHeld (1 when a parameter the optimizer steps on held a non-zero gradient
as the step's first ``with cockpit(step, ...)`` block opened, 0 after ``zero_grad``). This
is direct evidence, unlike GradientMismatch (1 − cos∠(gradient stepped on, batch gradient)),
which editing gradients on purpose (clip_grad_value_, gradient noise, SAM, an L2 term added
to p.grad) also makes positive; GradientMismatch is shown as supporting evidence only.
"""

from __future__ import annotations

from cockpit.diagnose import thresholds as T
from cockpit.diagnose.finding import Evidence, Finding
from cockpit.diagnose.record import RunRecord
from cockpit.diagnose.rule import Rule
from cockpit.diagnose.rules._common import pick, share


def check(record: RunRecord) -> list[Finding]:
    steps, held = record.series("GradientHeld")
    if len(steps) < T.MIN_STEPS:
        return []
    # the first step of a loop without zero_grad is still clean: look from the second on
    later = steps > steps[0]
    steps, held = steps[later], held[later]
    if not len(steps) or share(held > 0.5) < T.PERSISTENT_SHARE:
        return []
    s, v = pick(steps, held)
    evidence = [Evidence("GradientHeld", s, v,
                         "1: the parameters held a gradient before the step's first backward")]
    m_steps, mismatch = record.series("GradientMismatch")
    if len(m_steps):
        ms, mv = pick(m_steps, mismatch)
        evidence.append(Evidence("GradientMismatch", ms, mv,
                                 "1 − cos∠(gradient stepped on, batch gradient); 0 when they "
                                 "agree"))
    return [Finding(
        code="missing_zero_grad", severity="warning", step=int(steps[held > 0.5][0]),
        message="The parameters already hold a gradient when a step's backward pass begins: "
                "gradients accumulate across steps (zero_grad missing?).",
        evidence=tuple(evidence),
        advice="Call optimizer.zero_grad() (or model.zero_grad()) once per step before the "
               "backward pass; with gradient accumulation, zero after the optimizer step.",
    )]


RULE = Rule("missing_zero_grad", (("GradientHeld",),), check, T.MIN_STEPS)
