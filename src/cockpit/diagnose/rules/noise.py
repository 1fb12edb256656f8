"""``noise_dominated``: the gradient tests say the batch is too small for the step size.

NormTest (eq. 19c) is θ with θ² = tr Σ̂ / (|B| ‖g_B‖²): the share of the mini-batch
gradient's squared norm that is sampling noise (tr Σ̂/|B| is the variance of g_B). Because
E‖g_B‖² = ‖∇L‖² + tr Σ/|B|, the signal ‖∇L‖² is estimated without bias by ‖g_B‖²(1 − θ²);
when θ ≥ 1 the batch gradient is indistinguishable from noise. A run is noise-dominated when
θ stays near or above 1 *and* the loss is as noisy from step to step as it is high: the
steps are driven by the sampling noise of a too-small batch, not by the gradient.
"""

from __future__ import annotations

import numpy as np

from cockpit.diagnose import thresholds as T
from cockpit.diagnose.finding import Evidence, Finding
from cockpit.diagnose.record import RunRecord
from cockpit.diagnose.rule import Rule
from cockpit.diagnose.rules._common import after_warmup, pick, share


def check(record: RunRecord) -> list[Finding]:
    steps, theta = record.series("NormTest")
    keep = np.isfinite(theta)
    steps, theta = after_warmup(steps[keep], theta[keep], T.WARMUP_SHARE)
    if len(steps) < T.MIN_STEPS:
        return []
    noisy = share(theta >= T.NORM_TEST_NOISE)
    if noisy < T.PERSISTENT_SHARE:
        return []
    s_l, loss = record.series("Loss")
    loss = loss[np.isfinite(loss)]
    if loss.size < T.MIN_STEPS:
        return []
    jitter = float(np.mean(np.abs(np.diff(loss))) / max(np.mean(np.abs(loss)), 1e-300))
    if jitter < T.LOSS_JITTER:
        return []
    evidence = [Evidence("NormTest", *pick(steps, theta),
                         f"θ ≥ {T.NORM_TEST_NOISE:g} at {noisy:.0%} of the steps: the batch "
                         "gradient is mostly sampling noise"),
                Evidence("Loss", *pick(s_l[np.isfinite(record.series('Loss')[1])], loss),
                         f"mean step-to-step change {jitter:.0%} of the loss")]
    s_b, b = record.series("BatchSize")
    size = f" of {int(np.median(b))}" if b.size else ""
    return [Finding(
        code="noise_dominated", severity="warning",
        message=f"The batch{size} is too small for the step size: the gradient tests say each "
                "step follows sampling noise rather than the gradient.",
        evidence=tuple(evidence),
        advice="Use a larger batch (NormTest suggests about |B|·θ² / 0.5² samples), or lower "
               "the learning rate; gradient accumulation gives a larger batch without memory.",
    )]


RULE = Rule("noise_dominated", (("NormTest", "Loss"),), check)
