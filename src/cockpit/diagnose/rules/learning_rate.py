"""Step size: ``lr_too_large`` and ``lr_too_small`` (paper §3.3, Fig. 5).

Alpha (eq. 9–10) places the step on a noise-informed quadratic fit of the loss along the
update: α = −1 means the step stayed at its start, 0 the valley floor, +1 the far side at
the height of the start, and α > 1 a step that climbed up the other side (overshoot).

Too large: α > 1 at most steps, or a loss that jumps to LOSS_SPIKE× its start right after a
step with α > 1, or lr·λ_max > 2 where HessMaxEV is recorded.

Too small (and, where Alpha is recorded, its median near −1 as well: a median near 0 says
the steps reach the valley floor, so a loss that does not fall is not the step size's
fault): α alone does not tell (healthy Adam runs in the zoo sit at α ≈ −0.8 too, and a
tiny SGD step's fit is dominated by the noise); what does is that the steps *cannot* move
the loss: to first order a step changes the loss by at most ‖g_B‖·‖s‖, so
Σ_t ‖g_B,t‖·‖s_t‖ bounds the loss change of the whole run. When that bound is a small
share of the loss and the loss indeed barely moved, the steps are too short.
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


def _spike(record: RunRecord) -> Evidence | None:
    """The loss jumped to LOSS_SPIKE× its start right after a step with α > 1 (one of the
    LOOKBACK steps before): a step that climbed up the far side of the valley."""
    steps, loss = record.series("Loss")
    finite = np.isfinite(loss)
    if finite.sum() < T.MIN_STEPS:
        return None
    start = float(np.median(loss[finite][:3]))
    s_a, alpha = record.series("Alpha")
    for i in np.flatnonzero(finite & (loss >= T.LOSS_SPIKE * start)):
        before = (s_a < steps[i]) & (s_a >= steps[i] - T.SPIKE_LOOKBACK) & np.isfinite(alpha)
        if before.any() and alpha[before].max() > T.ALPHA_OVERSHOOT:
            return Evidence("Loss + Alpha", (int(s_a[before][-1]), int(steps[i])),
                            (float(alpha[before].max()), float(loss[i])),
                            f"after a step with α = {float(alpha[before].max()):.2g} the loss "
                            f"jumped to {float(loss[i]):.3g}, {float(loss[i]) / start:.2g}× "
                            "its start")
    return None


def check_too_large(record: RunRecord) -> list[Finding]:
    evidence = []
    steps, alpha = record.series("Alpha")
    keep = np.isfinite(alpha)
    steps, alpha = after_warmup(steps[keep], alpha[keep], T.WARMUP_SHARE)
    if (len(steps) >= T.MIN_STEPS
            and share(alpha > T.ALPHA_OVERSHOOT) >= T.ALPHA_OVERSHOOT_SHARE):
        s, v = pick(steps, alpha)
        evidence.append(Evidence("Alpha", s, v, f"α > {T.ALPHA_OVERSHOOT:g} at "
                                 f"{share(alpha > T.ALPHA_OVERSHOOT):.0%} of the steps "
                                 f"(median {float(np.median(alpha)):.2f})"))
    spike = _spike(record)
    if spike is not None:
        evidence.append(spike)
    s_h, lam = record.series("HessMaxEV")
    s_lr, lr = record.series("LearningRate")
    common = np.intersect1d(s_h, s_lr)
    if common.size >= 1:
        prod = lam[np.searchsorted(s_h, common)] * lr[np.searchsorted(s_lr, common)]
        if share(prod > T.LR_TIMES_LAMBDA_MAX) >= T.PERSISTENT_SHARE:
            s, v = pick(common, prod)
            evidence.append(Evidence("HessMaxEV × LearningRate", s, v,
                                     f"lr·λ_max > {T.LR_TIMES_LAMBDA_MAX:g}: gradient descent "
                                     "diverges along the sharpest direction"))
    if not evidence:
        return []
    return [Finding(
        code="lr_too_large", severity="warning", step=min(min(e.steps) for e in evidence
                                                          if e.steps),
        message="The steps overshoot: the learning rate looks too large for this problem.",
        evidence=tuple(evidence),
        advice="Lower the learning rate (try a factor 3–10), add a warm-up, or clip gradients.",
    )]


def first_order_reach(record: RunRecord) -> tuple[float, float] | None:
    """(Σ_t ‖g_B,t‖·‖s_t‖ / mean loss, number of steps): the most the steps could have
    changed the loss to first order (|Δℓ| ≤ ‖g‖‖s‖ per step, every step straight downhill),
    relative to the loss."""
    s_g, g = record.series("GradNorm")
    s_u, u = record.series("UpdateSize")
    _, loss = record.series("Loss")
    common = np.intersect1d(s_g, s_u)
    loss = loss[np.isfinite(loss)]
    if common.size < T.MIN_STEPS or loss.size == 0:
        return None
    prod = g[np.searchsorted(s_g, common)] * u[np.searchsorted(s_u, common)]
    prod = prod[np.isfinite(prod)]
    scale = float(np.mean(np.abs(loss)))
    if scale == 0:
        return None
    return float(prod.sum()) / scale, float(common.size)


def check_too_small(record: RunRecord) -> list[Finding]:
    change = _loss_change(record)
    reach = first_order_reach(record)
    if change is None or reach is None:
        return []
    rel, s_l, loss = change
    if rel < -T.LOSS_PROGRESS or reach[0] >= T.LR_SMALL_REACH:
        return []
    _, alpha = record.series("Alpha")
    alpha = alpha[np.isfinite(alpha)]
    if alpha.size and float(np.median(alpha)) > T.LR_SMALL_ALPHA:
        return []  # the steps reach the valley floor: not too short
    evidence = [
        Evidence("GradNorm × UpdateSize", (), (),
                 f"Σ‖g_B‖·‖s‖ over {int(reach[1])} steps is {reach[0]:.2g} of the loss: even "
                 "straight downhill the steps could barely change it"),
        Evidence("Loss", *pick(s_l, loss), f"loss changed by only {rel:+.1%} over the run"),
    ]
    if alpha.size:
        evidence.append(Evidence("Alpha", (), (), f"median α {float(np.median(alpha)):.2f} "
                                 "(−1: the step ends where it started on the fit)"))
    return [Finding(
        code="lr_too_small", severity="warning",
        message="The steps are far too short: the learning rate looks too small, the loss "
                "barely moves.",
        evidence=tuple(evidence),
        advice="Raise the learning rate (try a factor 10), or use a learning-rate range test "
               "to find the largest rate at which the loss still falls.",
    )]


RULES = [
    Rule("lr_too_large", (("Alpha",), ("HessMaxEV", "LearningRate")), check_too_large,
         T.MIN_STEPS),
    Rule("lr_too_small", (("Loss", "GradNorm", "UpdateSize"),), check_too_small,
         T.LR_SMALL_MIN_STEPS),
]
