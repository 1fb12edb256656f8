r"""Alpha: the noise-informed quadratic fit along one optimizer step (paper B.2, eq. 9-10).

Step t moves the parameters by ``s_t = θ_{t+1} − θ_t``; its length is ``t = ‖s_t‖``. Along the
step we observe, at ``τ₁ = 0`` (θ_t, batch B_t) and ``τ₂ = t`` (θ_{t+1}, batch B_{t+1}):

* the mini-batch loss ``L = mean_n ℓ_n`` and its noise ``Var_n[ℓ_n]``,
* the slope ``D = mean_n d_n`` with ``d_n = s_tᵀ g_n / ‖s_t‖`` (g_n = ∇ℓ_n) and ``Var_n[d_n]``.

Variances are the biased sample variances over the batch (divide by |B|, as in B.2). The slope
is per unit length (``s_tᵀ g / ‖s_t‖``), the derivative of ``τ ↦ L(θ_t + τ s_t/‖s_t‖)``.

The fit ``f(τ) = w₀ + w₁τ + w₂τ²`` is the maximum-likelihood solution of eq. (9),

    w = (Φ Λ⁻¹ Φᵀ)⁻¹ Φ Λ⁻¹ f̃                                              (eq. 10)

    Φ = [[1, 1, 0, 0], [τ₁, τ₂, 1, 1], [τ₁², τ₂², 2τ₁, 2τ₂]],  Λ = diag(σ²_L₁, σ²_L₂, σ²_D₁, σ²_D₂),
    f̃ = (L₁, L₂, D₁, D₂).

Normalisation: ``ᾱ = −w₁/w₂`` is twice the distance to the parabola's minimum ``−w₁/(2w₂)``, and

    α = 2t/ᾱ − 1 = −2 t w₂ / w₁ − 1,

so α = −1 for a step of length 0, α = 0 at the minimum, α = +1 where the parabola is back at its
starting height; α < −1 means the step went uphill with the minimum behind the start.

Numerics. The fit is solved in the unit coordinate ``u = τ/t`` (positions 0 and 1, slopes
``t·D`` with variances ``t²·σ²_D``) and mapped back (w₀ = v₀, w₁ = v₁/t, w₂ = v₂/t²). This is an
invertible re-parametrisation of w, so the maximum-likelihood solution is the same as eq. (10)
in τ, but the normal matrix stays well conditioned for tiny or huge steps, and losses and
scaled slopes share one unit, which makes the variance floor below meaningful.

Degenerate cases (all are tested):

* ``t == 0`` (no step): α is undefined → NaN, reason "zero step".
* negative or non-finite ``t``, non-finite observation or variance → NaN with a reason.
* negative variances (rounding in E[x²] − E[x]²) are clamped to 0.
* zero variances (Λ singular): each variance is floored at ``eps · max(variances)`` (weight
  ratios are capped at 1/eps). If all four are zero (e.g. |B| = 1) the fit is the noise-free
  ordinary least-squares fit in the unit coordinate u (all weights equal).
* singular or non-finite normal matrix ``Φ Λ⁻¹ Φᵀ`` (only reachable with ``eps = 0`` or extreme
  variance ratios) → NaN, reason "singular fit matrix".
* concave or flat fit (w₂ ≤ 0): there is no minimum along the step; α = −1 by convention,
  reported with a reason.
* w₁ = 0 with w₂ > 0: the minimum sits exactly at the start, ᾱ = 0 and α = ±∞ with an
  undetermined sign → NaN, reason "minimum at the start point".

``compute_alpha`` returns ``(alpha, reason)``; ``reason is None`` iff α is the regular value of
the formula, otherwise it names the convention (α = −1) or why α is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_VARIANCE_FLOOR = 1e-10
"""Relative floor for the variances: ``σ²_i ≥ eps · max_j σ²_j`` (weight ratio ≤ 1/eps)."""

MAX_CONDITION = 1e13
"""Normal matrices with a larger condition number (Frobenius norm) are treated as singular."""

REASON_ZERO_STEP = "zero step: update length t = 0, alpha undefined"
REASON_BAD_STEP = "invalid step length (negative or non-finite)"
REASON_NON_FINITE = "non-finite loss, slope or variance"
REASON_SINGULAR = "singular fit matrix (Phi Lambda^-1 Phi^T)"
REASON_CONCAVE = "concave or flat fit (w2 <= 0): alpha = -1 by convention"
REASON_MIN_AT_START = "minimum at the start point (w1 = 0, w2 > 0): alpha is unbounded"


class AlphaFitError(ValueError):
    """The quadratic fit cannot be computed; ``str(error)`` is the reason."""


@dataclass(frozen=True)
class Observations:
    """Observations at one end of the step: batch loss, its variance, slope, its variance.

    ``slope`` is the batch mean of ``d_n = s_tᵀ g_n / ‖s_t‖``; both variances are biased
    (1/|B|) sample variances over the batch.
    """

    loss: float
    loss_var: float
    slope: float
    slope_var: float

    def is_finite(self) -> bool:
        return all(math.isfinite(float(x)) for x in self.as_tuple())

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (float(self.loss), float(self.loss_var), float(self.slope), float(self.slope_var))


def _check_inputs(t: float, obs0: Observations, obs1: Observations) -> float:
    t = float(t)
    if not math.isfinite(t) or t < 0.0:
        raise AlphaFitError(REASON_BAD_STEP)
    if t == 0.0:
        raise AlphaFitError(REASON_ZERO_STEP)
    if not (obs0.is_finite() and obs1.is_finite()):
        raise AlphaFitError(REASON_NON_FINITE)
    return t


def floored_variances(variances: Sequence[float], eps: float = DEFAULT_VARIANCE_FLOOR
                      ) -> list[float]:
    """Clamp negatives to 0, then floor at ``eps · max``; all zero → all one (equal weights)."""
    variances = [max(float(v), 0.0) for v in variances]
    largest = max(variances)
    if largest == 0.0:
        return [1.0] * len(variances)
    return [max(v, eps * largest) for v in variances]


def fit_quadratic(
    t: float, obs0: Observations, obs1: Observations, eps: float = DEFAULT_VARIANCE_FLOOR
) -> tuple[float, float, float]:
    """Weights ``(w₀, w₁, w₂)`` of ``f(τ) = w₀ + w₁τ + w₂τ²`` by eq. (10), τ₁ = 0, τ₂ = t.

    Raises ``AlphaFitError`` (reason in the message) for t ≤ 0, non-finite inputs and a
    singular normal matrix. See the module docstring for the variance floor ``eps``.

    In the unit coordinate the columns of Φ are (1, 0, 0), (1, 1, 1), (0, 1, 0), (0, 1, 2),
    so with precisions p = diag(Λ⁻¹) the normal matrix Φ Λ⁻¹ Φᵀ = Σ_i p_i φ_i φ_iᵀ and the
    right-hand side Φ Λ⁻¹ f̃ are written out, and the 3×3 system is solved by Cholesky in
    plain floats (it is symmetric positive definite for finite positive p; numpy's LAPACK
    calls cost ten times as much on a host busy with a training step).
    """
    t = _check_inputs(t, obs0, obs1)
    # Unit coordinate u = τ / t: positions 0 and 1, slopes df/du = t · df/dτ.
    f0, f1, f2, f3 = obs0.loss, obs1.loss, t * obs0.slope, t * obs1.slope
    variances = (obs0.loss_var, obs1.loss_var, t * t * obs0.slope_var, t * t * obs1.slope_var)
    if not all(math.isfinite(x) for x in (f0, f1, f2, f3, *variances)):
        raise AlphaFitError(REASON_NON_FINITE)
    p0, p1, p2, p3 = (math.inf if v == 0.0 else 1.0 / v  # Λ⁻¹ (diagonal)
                      for v in floored_variances(variances, eps))
    normal = ((p0 + p1, p1, p1),
              (p1, p1 + p2 + p3, p1 + 2.0 * p3),
              (p1, p1 + 2.0 * p3, p1 + 4.0 * p3))  # Φ Λ⁻¹ Φᵀ
    rhs = (p0 * f0 + p1 * f1, p1 * f1 + p2 * f2 + p3 * f3, p1 * f1 + 2.0 * p3 * f3)
    if not all(math.isfinite(x) for x in (*normal[0], *normal[1], *normal[2], *rhs)):
        raise AlphaFitError(REASON_SINGULAR)
    factor = _cholesky(normal)
    if factor is None or _condition(normal, factor) > MAX_CONDITION:
        raise AlphaFitError(REASON_SINGULAR)
    v0, v1, v2 = _cholesky_solve(factor, rhs)
    return v0, v1 / t, v2 / (t * t)


_Matrix = tuple[tuple[float, float, float], ...]


def _cholesky(a: _Matrix) -> _Matrix | None:
    """The lower factor L of ``a`` = L Lᵀ (symmetric 3×3), None where a pivot is not
    positive (``a`` is numerically singular or indefinite)."""
    d0 = a[0][0]
    if not d0 > 0.0:
        return None
    l00 = math.sqrt(d0)
    l10, l20 = a[1][0] / l00, a[2][0] / l00
    d1 = a[1][1] - l10 * l10
    if not d1 > 0.0:
        return None
    l11 = math.sqrt(d1)
    l21 = (a[2][1] - l20 * l10) / l11
    d2 = a[2][2] - l20 * l20 - l21 * l21
    if not d2 > 0.0:
        return None
    return ((l00, 0.0, 0.0), (l10, l11, 0.0), (l20, l21, math.sqrt(d2)))


def _cholesky_solve(factor: _Matrix, b: Sequence[float]) -> tuple[float, float, float]:
    """x with L Lᵀ x = b (forward, then backward substitution)."""
    (l00, _, _), (l10, l11, _), (l20, l21, l22) = factor
    y0 = b[0] / l00
    y1 = (b[1] - l10 * y0) / l11
    y2 = (b[2] - l20 * y0 - l21 * y1) / l22
    x2 = y2 / l22
    x1 = (y1 - l21 * x2) / l11
    x0 = (y0 - l10 * x1 - l20 * x2) / l00
    return x0, x1, x2


def _condition(a: _Matrix, factor: _Matrix) -> float:
    """The condition number of ``a`` in the Frobenius norm, ‖a‖_F ‖a⁻¹‖_F (within a factor
    3 of the 2-norm's for a 3×3 matrix), a⁻¹ by three solves with its Cholesky factor."""
    inverse = [_cholesky_solve(factor, e) for e in ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0),
                                                     (0.0, 0.0, 1.0))]
    return (math.sqrt(sum(x * x for row in a for x in row))
            * math.sqrt(sum(x * x for column in inverse for x in column)))


def alpha_from_fit(t: float, w: tuple[float, float, float]) -> float:
    """``α = 2t/ᾱ − 1`` with ``ᾱ = −w₁/w₂``; −1 for w₂ ≤ 0, NaN for w₁ = 0 < w₂ or t = 0.

    Use ``compute_alpha`` to also get the reason for the conventional values.
    """
    return _alpha_and_reason(float(t), w)[0]


def _alpha_and_reason(t: float, w: tuple[float, float, float]) -> tuple[float, str | None]:
    _, w1, w2 = (float(x) for x in w)
    if not (math.isfinite(t) and math.isfinite(w1) and math.isfinite(w2)):
        return math.nan, REASON_NON_FINITE
    if t < 0.0:
        return math.nan, REASON_BAD_STEP
    if t == 0.0:
        return math.nan, REASON_ZERO_STEP
    if w2 <= 0.0:
        return -1.0, REASON_CONCAVE
    if w1 == 0.0:
        return math.nan, REASON_MIN_AT_START
    alpha = -2.0 * t * w2 / w1 - 1.0
    if not math.isfinite(alpha):  # overflow of t·w₂/w₁ for a vanishing w₁
        return math.nan, REASON_MIN_AT_START
    return alpha, None


def compute_alpha(
    t: float, obs0: Observations, obs1: Observations, eps: float = DEFAULT_VARIANCE_FLOOR
) -> tuple[float, str | None]:
    """α for one step and the reason when it is not the regular formula value (else None)."""
    try:
        w = fit_quadratic(t, obs0, obs1, eps=eps)
    except AlphaFitError as error:
        return math.nan, str(error)
    return _alpha_and_reason(float(t), w)
