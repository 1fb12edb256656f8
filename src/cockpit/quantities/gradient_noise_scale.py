"""GradientNoiseScale: the simple noise scale B_simple of McCandlish et al. (2018, "An Empirical
Model of Large-Batch Training"; App. A for its estimation),

    B_simple = tr(Σ) / ‖G‖²,

the batch size beyond which a larger batch mostly averages away noise (the critical batch
size is of its order). Σ is the covariance of the individual gradients g_n and G their
expectation. Both are estimated without bias from one batch B with the statistics NormTest
reads (S = Σ_n ‖g_n‖², ‖ḡ‖² with ḡ = g_B = (1/|B|) Σ_n g_n):

    tr(Σ)^ = Σ_n ‖g_n − ḡ‖² / (|B| − 1) = (S − |B| ‖ḡ‖²) / (|B| − 1),
    ‖G‖²^  = ‖ḡ‖² − tr(Σ)^ / |B|          (E‖ḡ‖² = ‖G‖² + tr(Σ)/|B|).

The two-batch-size estimator of McCandlish et al. (App. A) forms the same two unbiased
estimates from ‖g_B‖² at two batch sizes, because it lacks individual gradients.

One batch gives a noisy ‖G‖²^, which can be ≤ 0 when the noise dominates; the paper
therefore smooths numerator and denominator separately by exponential moving averages over
the tracked steps and reports their ratio (a ratio of averages, not an average of ratios):

    N_t = β N_{t−1} + (1 − β) tr(Σ)^_t,   D_t = β D_{t−1} + (1 − β) ‖G‖²^_t,
    B_simple,EMA = N_t / D_t      (β = ``smoothing``; N, D start at the first step's values).

Values: ``GradientNoiseScale`` (this step's ratio) and ``GradientNoiseScaleEMA`` (the
smoothed one), total and per parameter tensor (``.../<parameter>``; a parameter's own
tr(Σ) and ‖G‖²). A ratio whose ‖G‖² estimate is ≤ 0 is NaN with a note (no finite noise
scale fits the batch); |B| = 1 gives None (no variance). Like every statistic of the engine,
S and ‖ḡ‖² describe the whole batch of a step under gradient accumulation and over
processes, so the values do not depend on how the batch was split.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cockpit.engine.readout import Later, Noted
from cockpit.engine.statistics import NORMS
from cockpit.quantities.base import Quantity, StepData, Value, Values
from cockpit.quantities.descriptor import BLUE, Descriptor, Panel
from cockpit.quantities.gradient_tests import batch_gradient_norms, sample_norms
from cockpit.schedules import Schedule

TOTAL = ""  # key of the sums over all parameters in the moving averages


def noise_and_signal(n: int, S: float, G: float) -> tuple[float, float]:
    """Unbiased estimates (tr(Σ), ‖G‖²) from |B| = n ≥ 2, S = Σ_n ‖g_n‖² and G = ‖ḡ‖²."""
    trace = (S - n * G) / (n - 1)
    return trace, G - trace / n


class GradientNoiseScale(Quantity):
    descriptor = Descriptor(
        panel=Panel("GradientNoiseScale", "gradients",
                    "Gradient noise scale B_simple = tr(Σ)/‖G‖²: the batch worth having",
                    order=2, readout=("GradientNoiseScale", "GradientNoiseScaleEMA",
                                      "BatchSize")),
        color=BLUE, records=("GradientNoiseScaleEMA",), per_parameter=True,
        reads_gradient=True)
    needs = frozenset({NORMS})
    needs_losses = False

    def __init__(self, schedule: Schedule | int | None = None, *, smoothing: float = 0.9):
        super().__init__(schedule)
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}: it is β in "
                             "N_t = β N_(t−1) + (1 − β) tr(Σ)_t (0: no smoothing)")
        self.smoothing = smoothing
        self._averages: dict[str, tuple[float, float]] = {}  # key → (N_t, D_t)

    def state_dict(self) -> dict[str, Any]:
        """The moving averages (N_t, D_t) per parameter key ("" for the whole network)."""
        return {"averages": {k: list(v) for k, v in self._averages.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._averages = {k: (float(v[0]), float(v[1]))
                          for k, v in state.get("averages", {}).items()}

    def compute(self, data: StepData) -> Values:
        name = self.name
        stats = data.stats
        assert stats is not None
        n = stats.num_samples
        if n < 2:
            data.notes[name] = "undefined for a batch of one sample (tr(Σ) divides by |B| − 1)"
            return {name: None}
        # NormTest's S_k and ‖ḡ_k‖² (the same tensors), read with the step's other values
        names, rows, G_norms = batch_gradient_norms(data, stats.norms)
        S_all = (sample_norms(data, names) if names
                 else torch.zeros(0, dtype=torch.float64))
        return Later(lambda S_host, G_host: self._values(n, names, rows, S_host, G_host),
                     S_all, G_norms, name=name)

    def _values(self, n: int, names: list[str], rows: list[int], S_host, G_norms) -> Noted:
        """The step's ratios and the moving averages (updated here, in step order)."""
        name = self.name
        S = [float(v) ** 2 for v in S_host]
        G = [float(G_norms[i]) ** 2 for i in rows]
        per_key = {k: noise_and_signal(n, s, g) for k, s, g in zip(names, S, G, strict=True)}
        per_key[TOTAL] = noise_and_signal(n, sum(S), sum(G))

        out: dict[str, Value] = {}
        for key, (trace, signal) in per_key.items():
            suffix = f"/{key}" if key else ""
            out[name + suffix] = _ratio(trace, signal)
            previous = self._averages.get(key)
            if not (math.isfinite(trace) and math.isfinite(signal)):
                # (left out of the averages, which go on from the last finite step; the
                # step itself has no noise scale, smoothed or not)
                out[f"{name}EMA{suffix}"] = math.nan
                continue
            beta = self.smoothing
            smoothed = ((trace, signal) if previous is None else
                        (beta * previous[0] + (1 - beta) * trace,
                         beta * previous[1] + (1 - beta) * signal))
            self._averages[key] = smoothed
            out[f"{name}EMA{suffix}"] = _ratio(*smoothed)
        total_trace, total_signal = per_key[TOTAL]
        notes: dict[str, str] = {}
        if sum(S) == 0.0:
            notes[name] = "every individual gradient is zero: tr(Σ)/‖G‖² is 0/0"
        elif total_signal <= 0.0:
            notes[name] = (
                f"the estimate of ‖G‖² is {total_signal:.3g} ≤ 0: the batch's gradient noise "
                "hides its signal, so no finite noise scale fits this batch (NaN); the "
                "moving average GradientNoiseScaleEMA smooths over steps")
        elif not math.isfinite(total_trace):
            notes[name] = "non-finite individual gradients"
        if not (math.isfinite(total_trace) and math.isfinite(total_signal)):
            notes[name + "EMA"] = ("non-finite individual gradients at this step: NaN, and "
                                   "left out of the moving averages")
        return Noted(out, notes)


def _ratio(trace: float, signal: float) -> float:
    """tr(Σ)/‖G‖², NaN where the estimate of ‖G‖² is not positive (or not finite)."""
    return trace / signal if signal > 0.0 and math.isfinite(trace) else math.nan
