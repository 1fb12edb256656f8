"""``noise_dominated``: the gradient tests say the batch is too small for the step size.

NormTest (eq. 19c) is θ with θ² = tr Σ̂ / (|B| ‖g_B‖²): the share of the mini-batch
gradient's squared norm that is sampling noise (tr Σ̂/|B| is the variance of g_B). Because
E‖g_B‖² = ‖∇L‖² + tr Σ/|B|, the signal ‖∇L‖² is estimated without bias by ‖g_B‖²(1 − θ²);
θ ≥ 1 says the batch gradient is indistinguishable from noise.

θ ≈ 1 also holds on a plateau where there is nothing left to learn, whatever the batch
size. InnerTest (eq. 22c) tells the two apart: it is the spread of the projections
g_nᵀg_B / ‖g_B‖² around 1. For pure noise in D ≫ |B| dimensions g_nᵀg_B ≈ ‖g_n‖²/|B| and
‖g_B‖² ≈ Σ_m‖g_m‖²/|B|², so every projection is ≈ 1 and InnerTest ≈ 0 (the zoo's plateaus:
0.02–0.10). With a too-small batch the samples still pull along different directions with
different strength (InnerTest 0.14–0.3 at |B| = 2–4). A third sign guards small models
(D not ≫ |B|) and full-batch loops: a too-small batch makes the mini-batch loss itself jump
from step to step (mean |Δloss| ≥ LOSS_JITTER of the loss). So: θ ≥ NORM_TEST_NOISE at most
steps, InnerTest ≥ INNER_TEST_SIGNAL (median) and a jumping loss — that does not fall
through the noise anyway (NOISY_LOSS_PROGRESS): late in a healthy run the gradient is small and
mostly noise, and the small loss jumps by a large share of itself, while training goes on.
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
    _, inner = record.series("InnerTest")
    inner = inner[np.isfinite(inner)]
    if inner.size < T.MIN_STEPS:
        return []
    spread = float(np.median(inner))
    if spread < T.INNER_TEST_SIGNAL:
        return []
    evidence = [Evidence("NormTest", *pick(steps, theta),
                         f"θ ≥ {T.NORM_TEST_NOISE:g} at {noisy:.0%} of the steps: the batch "
                         "gradient is mostly sampling noise"),
                Evidence("InnerTest", (), (), f"median {spread:.2f}: the samples still pull "
                         "along the gradient with different strength (not a plateau)")]
    s_l, loss = record.series("Loss")
    finite = np.isfinite(loss)
    s_l, loss = s_l[finite], loss[finite]
    if loss.size < T.MIN_STEPS:
        return []
    jitter = float(np.mean(np.abs(np.diff(loss))) / max(np.mean(np.abs(loss)), 1e-300))
    if jitter < T.LOSS_JITTER or makes_progress(s_l, loss, steps):
        return []
    evidence.append(Evidence("Loss", *pick(s_l, loss),
                             f"the mini-batch loss jumps by {jitter:.0%} of itself per step"))
    _, b = record.series("BatchSize")
    size = f" of {int(np.median(b))}" if b.size else ""
    evidence += noise_scale_evidence(record)
    return [Finding(
        code="noise_dominated", severity="warning",
        message=f"The batch{size} is too small for the step size: the gradient tests say each "
                "step follows sampling noise rather than the gradient.",
        evidence=tuple(evidence),
        advice="Use a larger batch (NormTest suggests about |B|·θ² / 0.5² samples), or lower "
               "the learning rate; gradient accumulation gives a larger batch without memory.",
    )]


def makes_progress(loss_steps: np.ndarray, loss: np.ndarray, noisy_steps: np.ndarray) -> bool:
    """Whether the loss over the steps the gradient tests judged still falls to at most
    :data:`~cockpit.diagnose.thresholds.NOISY_LOSS_PROGRESS` of itself (median of the last third
    against the first third): training goes on through the noise."""
    window = loss[(loss_steps >= noisy_steps[0]) & (loss_steps <= noisy_steps[-1])]
    third = window.size // 3
    if third < 2:
        return False
    first, last = float(np.median(window[:third])), float(np.median(window[-third:]))
    return first > 0 and last <= T.NOISY_LOSS_PROGRESS * first


def noise_scale_evidence(record: RunRecord) -> list[Evidence]:
    """GradientNoiseScale's moving average B_simple = tr(Σ)/‖G‖² over the last steps, where
    it was recorded: the batch size below which a step mostly follows noise (McCandlish et
    al. 2018: the critical batch size is of its order). Evidence only: the check rests on
    the gradient tests."""
    steps, scale = record.series("GradientNoiseScaleEMA")
    keep = np.isfinite(scale) & (scale > 0)
    steps, scale = steps[keep], scale[keep]
    if steps.size == 0:
        return []
    last = scale[-max(1, steps.size // 10):]
    return [Evidence("GradientNoiseScale", *pick(steps, scale),
                     f"B_simple ≈ {float(np.median(last)):.3g} samples over the last steps "
                     "(moving average): batches of about that size average most of the "
                     "noise away")]


RULE = Rule("noise_dominated", (("NormTest", "InnerTest", "Loss"),), check, T.MIN_STEPS)
