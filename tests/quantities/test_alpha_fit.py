"""Tests for the quadratic fit behind Alpha (paper B.2, eq. 9-10)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cockpit.quantities.alpha_fit import (
    REASON_BAD_STEP,
    REASON_CONCAVE,
    REASON_MIN_AT_START,
    REASON_NON_FINITE,
    REASON_SINGULAR,
    REASON_ZERO_STEP,
    Observations,
    alpha_from_fit,
    compute_alpha,
    fit_quadratic,
)


def exact_quadratic(a: float, b: float, c: float, t: float) -> tuple[Observations, Observations]:
    """Noise-free observations of f(τ) = a + bτ + cτ² at τ = 0 and τ = t."""
    obs0 = Observations(loss=a, loss_var=0.0, slope=b, slope_var=0.0)
    loss1 = a + b * t + c * t * t
    obs1 = Observations(loss=loss1, loss_var=0.0, slope=b + 2 * c * t, slope_var=0.0)
    return obs0, obs1


def reference_weighted_lstsq(t, obs0, obs1):
    """Independent weighted least squares in τ: rows of Φᵀ and f̃ scaled by 1/σ."""
    design = np.array(
        [[1.0, 0.0, 0.0], [1.0, t, t * t], [0.0, 1.0, 0.0], [0.0, 1.0, 2.0 * t]], dtype=np.float64
    )
    f = np.array([obs0.loss, obs1.loss, obs0.slope, obs1.slope])
    sigma = np.sqrt([obs0.loss_var, obs1.loss_var, obs0.slope_var, obs1.slope_var])
    w, *_ = np.linalg.lstsq(design / sigma[:, None], f / sigma, rcond=None)
    return w


@pytest.mark.parametrize("t", [1e-6, 0.03, 0.7, 1.0, 2.5, 40.0])
@pytest.mark.parametrize("b,c", [(-1.3, 0.8), (-0.02, 5.0), (2.0, 0.5)])
def test_exact_quadratic_zero_noise(t, b, c):
    obs0, obs1 = exact_quadratic(0.7, b, c, t)
    w = fit_quadratic(t, obs0, obs1)
    if t > 1e-3:  # for tiny t the curvature is below the rounding of the loss observations
        np.testing.assert_allclose(w, [0.7, b, c], rtol=1e-9)
    tau_star = -b / (2 * c)
    alpha, reason = compute_alpha(t, obs0, obs1)
    assert reason is None
    assert alpha == pytest.approx(t / tau_star - 1, rel=1e-9, abs=1e-9)


def test_exact_quadratic_with_noise_is_still_exact():
    obs0, obs1 = exact_quadratic(1.0, -2.0, 3.0, 0.5)
    noisy0 = Observations(obs0.loss, 0.3, obs0.slope, 2.0)
    noisy1 = Observations(obs1.loss, 0.1, obs1.slope, 0.05)
    alpha, reason = compute_alpha(0.5, noisy0, noisy1)
    assert reason is None
    assert alpha == pytest.approx(0.5 / (1 / 3) - 1, rel=1e-12)


def test_symmetric_cases():
    # Step exactly to the minimum: α = 0.
    obs0, obs1 = exact_quadratic(2.0, -4.0, 2.0, 1.0)
    assert compute_alpha(1.0, obs0, obs1) == (pytest.approx(0.0, abs=1e-14), None)
    # Step to the mirror point: same loss, opposite slope, any (symmetric) noise: α = +1.
    noise = Observations(0.0, 0.3, 0.0, 0.2)
    obs0 = Observations(1.5, noise.loss_var, -0.8, noise.slope_var)
    obs1 = Observations(1.5, noise.loss_var, 0.8, noise.slope_var)
    assert compute_alpha(0.6, obs0, obs1) == (pytest.approx(1.0, rel=1e-13), None)
    # α → −1 as the step length → 0 on a convex quadratic.
    obs0, obs1 = exact_quadratic(0.0, -1.0, 1.0, 1e-9)
    alpha, reason = compute_alpha(1e-9, obs0, obs1)
    assert reason is None and alpha == pytest.approx(-1.0, abs=1e-8)
    # Stepping uphill on a convex quadratic: minimum behind the start, α < −1.
    obs0, obs1 = exact_quadratic(0.0, 1.0, 1.0, 0.5)
    assert compute_alpha(0.5, obs0, obs1)[0] == pytest.approx(0.5 / -0.5 - 1)


@pytest.mark.parametrize("seed", range(5))
def test_weighted_fit_equals_independent_lstsq(seed):
    rng = np.random.default_rng(seed)
    t = float(rng.uniform(0.2, 3.0))
    values = rng.normal(size=4)
    variances = rng.uniform(0.01, 2.0, size=4)
    obs0 = Observations(values[0], variances[0], values[2], variances[2])
    obs1 = Observations(values[1], variances[1], values[3], variances[3])
    w = np.array(fit_quadratic(t, obs0, obs1))
    ref = reference_weighted_lstsq(t, obs0, obs1)
    np.testing.assert_allclose(w, ref, rtol=1e-12, atol=1e-12)
    _, w1, w2 = ref
    expected = -1.0 if w2 <= 0 else 2 * t / (-w1 / w2) - 1
    assert alpha_from_fit(t, tuple(w)) == pytest.approx(expected, rel=1e-11)


def test_weighted_fit_literal_eq10():
    """Eq. (10) written out in τ coordinates (normal equations) agrees too."""
    t = 1.7
    obs0 = Observations(1.0, 0.2, -0.5, 0.4)
    obs1 = Observations(0.6, 0.5, 0.3, 0.1)
    phi = np.array([[1, 1, 0, 0], [0, t, 1, 1], [0, t * t, 0, 2 * t]], dtype=np.float64)
    lam_inv = np.diag(1 / np.array([0.2, 0.5, 0.4, 0.1]))
    f = np.array([1.0, 0.6, -0.5, 0.3])
    w_ref = np.linalg.solve(phi @ lam_inv @ phi.T, phi @ lam_inv @ f)
    np.testing.assert_allclose(fit_quadratic(t, obs0, obs1), w_ref, rtol=1e-12)


def test_all_zero_variances_is_unweighted_lstsq_in_unit_coordinate():
    t = 0.4
    obs0 = Observations(1.0, 0.0, -2.0, 0.0)
    obs1 = Observations(0.9, 0.0, 0.5, 0.0)  # inconsistent with any quadratic
    design = np.array([[1, 0, 0], [1, 1, 1], [0, 1, 0], [0, 1, 2]], dtype=np.float64)
    v, *_ = np.linalg.lstsq(design, np.array([1.0, 0.9, -2.0 * t, 0.5 * t]), rcond=None)
    np.testing.assert_allclose(
        fit_quadratic(t, obs0, obs1), [v[0], v[1] / t, v[2] / t**2], rtol=1e-12
    )


def test_partially_zero_variance_is_floored_to_near_constraint():
    """A zero-variance observation is (almost) interpolated: the limit σ² → 0."""
    t = 1.0
    obs0 = Observations(1.0, 0.0, -2.0, 1.0)
    obs1 = Observations(0.5, 1.0, 0.5, 1.0)
    w = fit_quadratic(t, obs0, obs1)
    assert w[0] == pytest.approx(1.0, abs=1e-8)
    small = Observations(1.0, 1e-14, -2.0, 1.0)
    np.testing.assert_allclose(w, fit_quadratic(t, small, obs1), rtol=1e-6)
    # Negative variances (cancellation in E[x²] − E[x]²) are treated as 0.
    negative = Observations(1.0, -1e-17, -2.0, 1.0)
    np.testing.assert_allclose(w, fit_quadratic(t, negative, obs1), rtol=1e-12)


def test_degenerate_cases():
    obs0, obs1 = exact_quadratic(1.0, -1.0, 1.0, 0.5)
    assert _nan_with(compute_alpha(0.0, obs0, obs1), REASON_ZERO_STEP)
    assert _nan_with(compute_alpha(-0.1, obs0, obs1), REASON_BAD_STEP)
    assert _nan_with(compute_alpha(math.inf, obs0, obs1), REASON_BAD_STEP)
    for bad in (math.nan, math.inf):
        broken = Observations(bad, 0.0, -1.0, 0.0)
        assert _nan_with(compute_alpha(0.5, broken, obs1), REASON_NON_FINITE)
        broken = Observations(1.0, 0.0, -1.0, bad)
        assert _nan_with(compute_alpha(0.5, obs0, broken), REASON_NON_FINITE)
    # Overflow of t²·σ² is non-finite too.
    huge = Observations(1.0, 0.0, -1.0, 1e300)
    assert _nan_with(compute_alpha(1e10, obs0, huge), REASON_NON_FINITE)
    # eps = 0 and a zero variance: Λ⁻¹ infinite, the fit matrix is singular.
    noisy = Observations(1.0, 0.0, -1.0, 1.0)
    assert _nan_with(compute_alpha(0.5, noisy, obs1, eps=0.0), REASON_SINGULAR)
    # eps = 0 and extreme variance ratios: numerically singular.
    wild0 = Observations(1.0, 1e-150, -1.0, 1e150)
    wild1 = Observations(0.5, 1e-150, -1.0, 1e150)
    assert _nan_with(compute_alpha(0.5, wild0, wild1, eps=0.0), REASON_SINGULAR)
    # ... while the default floor keeps it solvable.
    assert math.isfinite(compute_alpha(0.5, wild0, wild1)[0])


def test_concave_and_flat_fits_give_minus_one():
    obs0, obs1 = exact_quadratic(1.0, -1.0, -0.5, 0.8)  # concave
    assert compute_alpha(0.8, obs0, obs1) == (-1.0, REASON_CONCAVE)
    obs0, obs1 = exact_quadratic(1.0, -1.0, 0.0, 0.8)  # linear (flat curvature)
    alpha, reason = compute_alpha(0.8, obs0, obs1)
    w2 = fit_quadratic(0.8, obs0, obs1)[2]
    if w2 <= 0:
        assert (alpha, reason) == (-1.0, REASON_CONCAVE)
    else:  # rounding made w2 a tiny positive number: α is then ≈ −1 by continuity
        assert reason is None and alpha == pytest.approx(-1.0, abs=1e-12)
    assert alpha_from_fit(0.8, (1.0, -1.0, 0.0)) == -1.0


def test_minimum_at_start_is_nan():
    assert math.isnan(alpha_from_fit(0.5, (1.0, 0.0, 2.0)))
    obs0, obs1 = exact_quadratic(1.0, 0.0, 2.0, 0.5)
    alpha, reason = compute_alpha(0.5, obs0, obs1)
    w1 = fit_quadratic(0.5, obs0, obs1)[1]
    if w1 == 0.0:
        assert _nan_with((alpha, reason), REASON_MIN_AT_START)
    else:
        assert abs(alpha) > 1e10


def _nan_with(result, reason):
    alpha, got = result
    return math.isnan(alpha) and got == reason


def test_alpha_on_a_real_model_same_batch_is_exact():
    """Least squares on one batch: the loss along the step is an exact quadratic.

    Observations from individual losses/gradients (torch.func) in float64; α must equal
    t/τ* − 1 with τ* = −gᵀu / uᵀHu from the dense Hessian.
    """
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(16, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(16, generator=gen, dtype=torch.float64)
    theta0 = torch.randn(5, generator=gen, dtype=torch.float64)

    def individual_losses(theta):
        return 0.5 * (X @ theta - y) ** 2

    def batch_loss(theta):
        return individual_losses(theta).mean()

    step = -0.3 * torch.func.grad(batch_loss)(theta0)
    t = float(step.norm())
    u = step / t
    theta1 = theta0 + step

    def observe(theta):
        losses = individual_losses(theta)
        slopes = torch.func.jacrev(individual_losses)(theta) @ u
        return Observations(
            float(losses.mean()),
            float(losses.var(unbiased=False)),
            float(slopes.mean()),
            float(slopes.var(unbiased=False)),
        )

    alpha, reason = compute_alpha(t, observe(theta0), observe(theta1))
    hessian = torch.func.hessian(batch_loss)(theta0)
    tau_star = float(-(torch.func.grad(batch_loss)(theta0) @ u) / (u @ hessian @ u))
    assert reason is None
    assert alpha == pytest.approx(t / tau_star - 1, rel=1e-10)
