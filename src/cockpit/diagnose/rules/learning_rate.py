"""Step size: ``lr_too_large`` and ``lr_too_small`` (paper §3.3, Fig. 5).

Alpha (eq. 9–10) places the step on a noise-informed quadratic fit of the loss along the
update: α = −1 means the step stayed at its start (far too short: the fit's minimum lies
far ahead), 0 the valley floor, +1 the far side at the height of the start, and α > 1 a
step that climbed up the other side (overshoot).
"""

from __future__ import annotations

import numpy as np

from cockpit.diagnose import thresholds as T
from cockpit.diagnose.finding import Evidence, Finding
from cockpit.diagnose.record import RunRecord
from cockpit.diagnose.rule import Rule
from cockpit.diagnose.rules._common import after_warmup, pick, share


def _loss_change(record: RunRecord) -> tuple[float, np.ndarray, np.ndarray] | None:
    """(relative change of the loss from the first to the last fifth of the run, steps,
    losses); None when there is too little data."""
    steps, loss = record.series("Loss")
    keep = np.isfinite(loss)
    steps, loss = steps[keep], loss[keep]
    if len(steps) < T.MIN_STEPS:
        return None
    k = max(len(loss) // 5, 1)
    head, tail = float(np.mean(loss[:k])), float(np.mean(loss[-k:]))
    if head == 0:
        return None
    return (tail - head) / abs(head), steps, loss


def _oscillation(loss: np.ndarray) -> float:
    """Mean |Δloss| between consecutive steps relative to the mean loss."""
    if loss.size < 3:
        return 0.0
    return float(np.mean(np.abs(np.diff(loss))) / max(np.mean(np.abs(loss)), 1e-300))


def check_too_large(record: RunRecord) -> list[Finding]:
    evidence = []
    steps, alpha = record.series("Alpha")
    keep = np.isfinite(alpha)
    steps, alpha = after_warmup(steps[keep], alpha[keep], T.WARMUP_SHARE)
    overshoot = (len(steps) >= T.MIN_STEPS
                 and share(alpha > T.ALPHA_OVERSHOOT) >= T.ALPHA_OVERSHOOT_SHARE)
    if overshoot:
        s, v = pick(steps, alpha)
        evidence.append(Evidence("Alpha", s, v, f"α > {T.ALPHA_OVERSHOOT:g} at "
                                 f"{share(alpha > T.ALPHA_OVERSHOOT):.0%} of the steps "
                                 f"(median {float(np.median(alpha)):.2f})"))
    curvature = False
    s_h, lam = record.series("HessMaxEV")
    s_lr, lr = record.series("LearningRate")
    common = np.intersect1d(s_h, s_lr)
    if common.size >= 1:
        prod = lam[np.searchsorted(s_h, common)] * lr[np.searchsorted(s_lr, common)]
        if share(prod > T.LR_TIMES_LAMBDA_MAX) >= T.PERSISTENT_SHARE:
            curvature = True
            s, v = pick(common, prod)
            evidence.append(Evidence("HessMaxEV × LearningRate", s, v,
                                     f"lr·λ_max > {T.LR_TIMES_LAMBDA_MAX:g}: gradient descent "
                                     "diverges along the sharpest direction"))
    change = _loss_change(record)
    rising = False
    if change is not None:
        rel, s_l, loss = change
        rising = rel > T.LOSS_RISE
        shaky = _oscillation(loss) > T.LOSS_OSCILLATION
        if rising or shaky:
            s, v = pick(s_l, loss)
            evidence.append(Evidence("Loss", s, v, f"loss changed by {rel:+.0%} over the run"
                                     + (", oscillating" if shaky else "")))
    if not (overshoot and (rising or True)) and not curvature:
        return []
    return [Finding(
        code="lr_too_large", severity="warning",
        message="The steps overshoot: the learning rate looks too large for this problem.",
        evidence=tuple(evidence),
        advice="Lower the learning rate (try a factor 3–10), add a warm-up, or clip gradients.",
    )]


def check_too_small(record: RunRecord) -> list[Finding]:
    steps, alpha = record.series("Alpha")
    keep = np.isfinite(alpha)
    steps, alpha = after_warmup(steps[keep], alpha[keep], T.WARMUP_SHARE)
    if len(steps) < T.MIN_STEPS:
        return []
    short = share(alpha < T.ALPHA_UNDERSHOOT)
    if short < T.ALPHA_UNDERSHOOT_SHARE:
        return []
    evidence = [Evidence("Alpha", *pick(steps, alpha),
                         f"α < {T.ALPHA_UNDERSHOOT:g} at {short:.0%} of the steps: each step "
                         "ends far before the minimum along its direction")]
    change = _loss_change(record)
    if change is not None:
        rel, s_l, loss = change
        if rel < -T.LOSS_PROGRESS:  # the loss does go down: not a crawl
            return []
        evidence.append(Evidence("Loss", *pick(s_l, loss),
                                 f"loss changed by only {rel:+.1%} over the run"))
    s_u, upd = record.series("UpdateSize")
    s_d, dist = record.series("Distance")
    if s_u.size and s_d.size:
        evidence.append(Evidence("UpdateSize", *pick(s_u, upd), "size of each step"))
    return [Finding(
        code="lr_too_small", severity="warning",
        message="The steps are far too short: the learning rate looks too small, the loss "
                "barely moves.",
        evidence=tuple(evidence),
        advice="Raise the learning rate (try a factor 10), or use a learning-rate range test "
               "to find the largest rate at which the loss still falls.",
    )]


RULES = [
    Rule("lr_too_large", (("Alpha",), ("HessMaxEV", "LearningRate")), check_too_large),
    Rule("lr_too_small", (("Alpha", "Loss"),), check_too_small),
]
