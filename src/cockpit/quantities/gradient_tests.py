"""Shared geometry of the gradient tests (paper Appendix B.6).

From the per-sample statistics collected in the backward pass, for a set of parameters
(all of them, or one tensor):

    S  = Σ_n ‖g_n‖²,   G = ‖g_B‖²,   d_n = g_nᵀ g_B   (g_B = (1/|B|) Σ_n g_n).

All three are sums over parameter tensors, which is why the tests can be aggregated layer by
layer during backpropagation. The tests are undefined for |B| = 1 (division by |B|−1) and
for a zero mini-batch gradient (division by ‖g_B‖); both give NaN with a note.

Where the individual gradients do not sum to the batch gradient (BatchNorm with frozen
statistics), g_B is their own mean (1/|B|) Σ_n g_n, so that S, G and d_n describe one set of
vectors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from cockpit.engine.tracker import GRAM_MEAN, SAMPLE_GRAD_SUM, SQ_NORMS
from cockpit.quantities.base import Quantity, StepData, Value, sq_norm, to_float


class GradientTest(Quantity):
    """A gradient test; ``needs`` lists the per-sample statistics its formula reads (S needs
    ‖g_n‖², D2 needs g_nᵀg_B; a statistic not needed is passed as NaN)."""

    needs = frozenset({SQ_NORMS, GRAM_MEAN})

    def formula(self, n: int, S: float, G: float, D2: float) -> float:
        """The test's value from |B|, S, G and D2 = Σ_n d_n²."""
        raise NotImplementedError

    def compute(self, data: StepData) -> dict[str, Value]:
        return compute_test(self.name, data, self.formula, self.needs)


def compute_test(
    name: str, data: StepData, formula: Callable[[int, float, float, float], float],
    needs: frozenset[str],
) -> dict[str, Value]:
    stats = data.stats
    assert stats is not None
    n = stats.num_samples
    if n < 2:
        data.notes[name] = "undefined for a batch of one sample (divides by |B| − 1)"
        return {name: None}

    own_sums = stats.sample_sums.get(SAMPLE_GRAD_SUM)

    def g_sq_norm(k: str) -> float:
        return data.grad_sq_norm(k) if own_sums is None else sq_norm(own_sums[k]) / n**2

    def value(names: list[str]) -> float:
        G = sum(g_sq_norm(k) for k in names)
        if G == 0.0:
            return math.nan
        S = D2 = math.nan
        if SQ_NORMS in needs:
            S = sum(to_float(stats.sq_norms[k].double().sum()) for k in names)
        if GRAM_MEAN in needs:
            d = sum(stats.gram_mean[k].double() for k in names)
            D2 = to_float(torch.as_tensor(d).pow(2).sum())
        return formula(n, S, G, D2)

    per_sample = stats.sq_norms if SQ_NORMS in needs else stats.gram_mean
    names = [k for k in per_sample if k in data.batch_grads
             and (own_sums is None or k in own_sums)]
    out: dict[str, Value] = {name: value(names)}
    if sum(g_sq_norm(k) for k in names) == 0.0:
        data.notes[name] = "mini-batch gradient is zero: the test divides by ‖g_B‖"
    for k in names:
        out[f"{name}/{k}"] = value([k])
    return out


def sqrt_nonneg(x: float) -> float:
    """√x for an x that is ≥ 0 in exact arithmetic (a tiny negative from rounding → 0)."""
    if math.isnan(x):
        return math.nan
    return math.sqrt(max(x, 0.0))
