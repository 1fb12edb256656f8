"""Gradient scale across layers: ``unscaled_inputs`` (paper §3.1), ``vanishing_gradients``
(§3.2) and ``exploding_gradients``.

``unscaled_inputs`` reads the first layer's individual gradients against those of its own
bias. For a Linear layer y = Wx + b the individual gradients are g_n(W) = δ_n x_nᵀ and
g_n(b) = δ_n, so

    Σ_n ‖g_n(W)‖² / Σ_n ‖g_n(b)‖² = Σ_n ‖δ_n‖² ‖x_n‖² / Σ_n ‖δ_n‖²,

a weighted mean of the squared input norms ‖x_n‖²; divided by the fan-in D_W / D_b it is the
mean square of one input element. Its root (the "input RMS") is ≈ 1 for standardized data and
≈ the pixel scale for raw data; a convolution gives the same up to how its positions
correlate. Both sums come from recorded values (NormTest and GradNorm per parameter,
eq. 19c). This is why the first layer's individual gradients spread far beyond the others'
in the paper's Fig. 3: they carry a factor ‖x_n‖ no other layer carries.
"""

from __future__ import annotations

import numpy as np

from cockpit.diagnose import thresholds as T
from cockpit.diagnose.finding import Evidence, Finding
from cockpit.diagnose.record import RunRecord
from cockpit.diagnose.rule import Rule
from cockpit.diagnose.rules._common import (
    after_warmup,
    batch_rms,
    layer_order,
    parameter_size,
    pick,
    share,
    sum_sq_individual,
    weight_tensors,
)


def _first_layer(record: RunRecord) -> tuple[str, str] | None:
    """(weight, bias) of the first layer, if it has a bias recorded."""
    order = layer_order(record)
    weights = weight_tensors(record)
    if not weights:
        return None
    weight = weights[0]
    prefix = weight.rsplit(".", 1)[0] + "." if "." in weight else ""
    bias = prefix + "bias"
    return (weight, bias) if bias in order else None


def input_rms(record: RunRecord) -> tuple[str, np.ndarray, np.ndarray] | None:
    """(first weight, steps, RMS of one input element seen by the first layer)."""
    pair = _first_layer(record)
    if pair is None:
        return None
    weight, bias = pair
    d_w, d_b = parameter_size(record, weight), parameter_size(record, bias)
    if not d_w or not d_b:
        return None
    s_w, sw = sum_sq_individual(record, weight)
    s_b, sb = sum_sq_individual(record, bias)
    common = np.intersect1d(s_w, s_b)
    sw, sb = sw[np.searchsorted(s_w, common)], sb[np.searchsorted(s_b, common)]
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.sqrt(sw / sb / (d_w / d_b))
    keep = np.isfinite(rms)
    return weight, common[keep], rms[keep]


def check_unscaled(record: RunRecord) -> list[Finding]:
    found = input_rms(record)
    if found is None:
        return []
    weight, steps, rms = found
    if len(steps) < T.MIN_STEPS:
        return []
    level = float(np.median(rms))
    if level < T.INPUT_RMS:
        return []
    s, v = pick(steps, rms)
    evidence = [Evidence(
        f"NormTest/{weight} + GradNorm/{weight} and of its bias", s, v,
        f"root-mean-square of one input element seen by {weight}, median {level:.3g} "
        "(≈ 1 for standardized inputs)")]
    steps_e, edge = record.series("GradHist1d.edge_share")
    if steps_e.size:
        s, v = pick(steps_e, edge)
        evidence.append(Evidence("GradHist1d", s, v, "share of individual gradient elements "
                                 "in the histogram's edge bins (at most this share lies beyond "
                                 "its range)"))
    return [Finding(
        code="unscaled_inputs", severity="warning", parameters=(weight,),
        message=f"The input data seem not normalised: the first layer ({weight}) sees input "
                f"elements of root-mean-square {level:.3g}, so its individual gradients are "
                f"about that much wider than for standardized inputs.",
        evidence=tuple(evidence),
        advice="Standardize the inputs (subtract the mean, divide by the standard deviation "
               "per feature or channel, computed on the training set); e.g. divide raw pixels "
               "by 255 and normalise.",
    )]


def check_vanishing(record: RunRecord) -> list[Finding]:
    weights = weight_tensors(record)
    if len(weights) < 2:
        return []
    levels = {}
    for w in weights:
        steps, rms = batch_rms(record, w)
        steps, rms = after_warmup(steps, rms, T.WARMUP_SHARE)
        rms = rms[np.isfinite(rms)]
        if rms.size >= T.MIN_STEPS:
            levels[w] = float(np.median(rms))
    if len(levels) < 2:
        return []
    top = max(levels.values())
    if not top > 0:
        return []
    small = [w for w, v in levels.items() if v < top / T.VANISHING_RATIO]
    if not small:
        return []
    top_name = max(levels, key=levels.get)
    evidence = tuple(Evidence(f"GradNorm/{w}", (), (), f"{w}: gradient element RMS "
                              f"{levels[w]:.2g}, {top / max(levels[w], 1e-300):,.0f}× below "
                              f"{top_name} ({top:.2g})") for w in small[:4])
    ratio = top / max(min(levels[w] for w in small), 1e-300)
    return [Finding(
        code="vanishing_gradients", severity="warning", parameters=tuple(small),
        message=f"The gradients of {len(small)} layer(s) ({', '.join(small[:3])}"
                f"{' …' if len(small) > 3 else ''}) are up to {ratio:,.0f} times smaller than "
                f"those of {top_name}: they barely learn.",
        evidence=evidence,
        advice="Use activations that do not saturate (ReLU, GELU) instead of sigmoid/tanh in "
               "deep stacks, a variance-preserving initialisation (Kaiming/Xavier), "
               "normalisation layers or residual connections.",
    )]


def check_exploding(record: RunRecord) -> list[Finding]:
    steps, g = record.series("GradNorm")
    finite = np.isfinite(g)
    steps, g = steps[finite], g[finite]
    if len(steps) < T.MIN_STEPS:
        return []
    _, late = after_warmup(steps, g, T.WARMUP_SHARE)
    huge = share(late > T.GRADNORM_HUGE) >= T.PERSISTENT_SHARE
    head = max(float(np.median(g[: max(len(g) // 10, 1)])), 1e-300)
    growth = float(np.max(g)) / head
    grows = growth >= T.GRADNORM_GROWTH
    if not (huge or grows):
        return []
    s, v = pick(steps, g)
    why = (f"the gradient norm stays above {T.GRADNORM_HUGE:g}" if huge else
           f"the gradient norm grew {growth:.2g}-fold")
    order = layer_order(record)
    largest = sorted(order, key=lambda p: -float(np.nanmax(record.series(f"GradNorm/{p}")[1],
                                                            initial=0.0)))[:3]
    return [Finding(
        code="exploding_gradients", severity="warning",
        parameters=tuple(largest),
        message=f"The gradients are exploding: {why} (median {float(np.median(late)):.3g}).",
        evidence=(Evidence("GradNorm", s, v, why),),
        advice="Lower the initial weight scale (Kaiming/Xavier), add normalisation layers, "
               "clip gradients (torch.nn.utils.clip_grad_norm_), or lower the learning rate.",
    )]


_NEEDS_RMS = ("GradNorm", "NormTest", "BatchSize")
RULES = [
    Rule("unscaled_inputs", (_NEEDS_RMS,), check_unscaled, T.MIN_STEPS),
    Rule("vanishing_gradients", (("GradNorm",),), check_vanishing, T.MIN_STEPS),
    Rule("exploding_gradients", (("GradNorm",),), check_exploding, T.MIN_STEPS),
]
