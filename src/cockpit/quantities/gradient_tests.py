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

import numpy as np
import torch
from torch import Tensor

from cockpit.engine.readout import Later, Noted
from cockpit.engine.statistics import GRAM_MEAN, NORMS, SAMPLE_GRAD_SUM
from cockpit.quantities.base import Quantity, StepData, Value, Values, norms
from cockpit.quantities.descriptor import Panel

# the panel the three tests share (paper Fig. 9b)
GRADIENT_TESTS = Panel("GradientTests", "gradients", "Gradient tests: how noisy is the batch?",
                       order=1, readout=("NormTest", "InnerTest", "OrthoTest"))


class GradientTest(Quantity):
    """A gradient test; ``needs`` lists the per-sample statistics its formula reads (S needs
    ‖g_n‖, D2 needs g_nᵀg_B; a statistic not needed is passed as NaN)."""

    needs = frozenset({NORMS, GRAM_MEAN})

    def formula(self, n: int, S: float, G: float, D2: float) -> float:
        """The test's value from |B|, S, G and D2 = Σ_n d_n² (numbers, or arrays of one
        entry per parameter: elementwise)."""
        raise NotImplementedError

    def compute(self, data: StepData) -> Values:
        return compute_test(self.name, data, self.formula, self.needs)


def compute_test(
    name: str, data: StepData, formula: Callable[[int, float, float, float], float],
    needs: frozenset[str],
) -> Values:
    """The test over all parameters (``name``) and per parameter tensor (``name/<k>``): S,
    D2 and G are formed on the device per parameter (S_k, D2_k = Σ_n d_{n,k}², and
    D2 = Σ_n (Σ_k d_{n,k})² for the whole network), the formula on the host."""
    stats = data.stats
    assert stats is not None
    n = stats.num_samples
    if n < 2:
        data.notes[name] = "undefined for a batch of one sample (divides by |B| − 1)"
        return {name: None}
    per_sample = stats.norms if NORMS in needs else stats.gram_mean
    names, rows, G_norms = batch_gradient_norms(data, per_sample)
    tensors = [G_norms]
    if NORMS in needs:
        tensors.append(sample_norms(data, names))
    if GRAM_MEAN in needs:
        tensors.extend(data.once(("D2", *names), lambda: _d2(stats.gram_mean, names)))

    def values(G_norms, *host) -> Noted:
        # per parameter as arrays (the formula's operations elementwise, as on numbers),
        # the whole network's sums added in the parameters' order
        G_k = np.square(G_norms[rows]) if rows else np.zeros(0)
        missing = np.full(len(names), math.nan)
        S_k = np.square(host[0]) if NORMS in needs else missing
        if GRAM_MEAN in needs:
            D2_k, D2 = np.square(host[-2]), float(np.dot(host[-1], host[-1]))
        else:
            D2_k, D2 = missing, math.nan
        G = sum(G_k.tolist())
        out: dict[str, Value] = {
            name: math.nan if G == 0.0 else float(formula(n, sum(S_k.tolist()), G, D2))}
        out.update(zip((f"{name}/{k}" for k in names),
                       _per_parameter(formula, n, S_k, G_k, D2_k), strict=True))
        notes = ({name: "mini-batch gradient is zero: the test divides by ‖g_B‖"}
                 if G == 0.0 else {})
        return Noted(out, notes)

    return Later(values, *tensors, name=name)


def _per_parameter(formula: Callable, n: int, S_k: np.ndarray, G_k: np.ndarray,
                   D2_k: np.ndarray) -> list[float]:
    """The formula of every parameter's S, G, D2 (NaN where G = 0): elementwise on the
    arrays, or one call per parameter for a formula written for numbers only."""
    with np.errstate(divide="ignore", invalid="ignore"):
        try:
            values = np.asarray(formula(n, S_k, G_k, D2_k), dtype=np.float64)
        except (TypeError, ValueError):  # (math.* on an array)
            values = None
        if values is None or values.shape != G_k.shape:
            values = np.array([formula(n, S, G, D2) if G != 0.0 else math.nan
                               for S, G, D2 in zip(S_k.tolist(), G_k.tolist(), D2_k.tolist(),
                                                   strict=True)], dtype=np.float64)
    return np.where(G_k == 0.0, math.nan, values).tolist()


def batch_gradient_norms(data: StepData, per_sample: dict[str, Tensor]
                         ) -> tuple[list[str], list[int], Tensor]:
    """The parameters with individual statistics in ``per_sample`` and a batch gradient,
    and ‖g_B,k‖ on the device: ``(names, rows, norms)`` with G_k = ``norms[rows[i]]``².
    g_B is the batch gradient, or with BatchNorm's statistics frozen the mean of those
    individual gradients (so that S, G and d_n describe one set of vectors)."""
    stats = data.stats
    assert stats is not None
    own_sums = stats.sample_sums.get(SAMPLE_GRAD_SUM)
    names = [k for k in per_sample if k in data.batch_grads
             and (own_sums is None or k in own_sums)]
    if own_sums is None:
        position = {k: i for i, k in enumerate(data.batch_grads)}
        return names, [position[k] for k in names], data.grad_norms()
    n = stats.num_samples
    return (names, list(range(len(names))),
            norms([own_sums[k] for k in names]) / n)


def sample_norms(data: StepData, names: list[str]) -> Tensor:
    """√S_k = (Σ_n ‖g_{n,k}‖²)^½ per parameter in ``names`` (the norm of its [N] vector of
    individual gradient norms), float64 on the device (formed once per step for every
    instrument that reads it; they square it on the host)."""
    stats = data.stats
    assert stats is not None
    return data.once(("S", *names), lambda: torch.linalg.vector_norm(
        torch.stack([stats.norms[k] for k in names]), dim=1, dtype=torch.float64))


def sample_sq_norm_total(data: StepData) -> float:
    """S = Σ_k Σ_n ‖g_{n,k}‖² over every parameter with individual gradients, read from the
    device at once (for instruments outside the configurations; from :func:`sample_norms`,
    which the gradient tests share)."""
    stats = data.stats
    assert stats is not None
    names = list(stats.norms)
    return float(sample_norms(data, names).square().sum()) if names else 0.0


def _d2(gram_mean: dict[str, Tensor], names: list[str]) -> tuple[Tensor, Tensor]:
    """√D2_k = (Σ_n d_{n,k}²)^½ per parameter (squared on the host) and the whole network's
    d_n = Σ_k d_{n,k}, accumulated in float64 (its D2 = Σ_n d_n² is summed on the host:
    |B| numbers)."""
    d = torch.stack([gram_mean[k] for k in names])
    return (torch.linalg.vector_norm(d, dim=1, dtype=torch.float64),
            d.sum(0, dtype=torch.float64))


def sqrt_nonneg(x: float | np.ndarray) -> float | np.ndarray:
    """√x for an x that is ≥ 0 in exact arithmetic (a tiny negative from rounding → 0; NaN
    stays NaN), of a number or elementwise of an array."""
    if isinstance(x, np.ndarray):
        return np.sqrt(np.maximum(x, 0.0))  # (np.maximum keeps NaN)
    if math.isnan(x):
        return math.nan
    return math.sqrt(max(x, 0.0))
