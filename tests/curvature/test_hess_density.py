"""HessDensity (stochastic Lanczos quadrature) against dense float64 Hessians: each probe's
quadrature is exact for low moments, and 16 probes give the first four spectral moments
tr(H^k)/D within 5 %."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cockpit import Cockpit, quantities
from cockpit.quantities.hess_density import density_moments
from tests.curvature.test_curvature_instruments import dense_hessian, one_step
from tests.models import Problem, cross_entropy, make_problem


@pytest.mark.parametrize("name", ["mlp_relu", "cnn"])
def test_each_probe_quadrature_is_exact_for_the_first_four_moments(name):
    """Gauss quadrature with m = 4 nodes integrates degree ≤ 7 exactly: Σ_j τ_j θ_j^k equals
    vᵀH^k v for the probe v itself (replayed from the same seed)."""
    problem = make_problem(name, 4)
    H, _, _ = dense_hessian(problem)
    out = one_step(problem, [quantities.HessDensity(probes=3, steps=4, seed=7)])
    nodes, weights = out["HessDensity"]["nodes"], out["HessDensity"]["weights"]
    assert nodes.shape == weights.shape == (3, 4)
    np.testing.assert_allclose(weights.sum(1), 1.0, rtol=1e-12)
    generator = torch.Generator().manual_seed(7)
    dim = H.shape[0]
    for p in range(3):
        v = (2.0 * torch.randint(0, 2, (dim,), generator=generator) - 1.0).double() / dim**0.5
        for k in range(1, 5):
            exact = (v @ torch.linalg.matrix_power(H, k) @ v).item()
            quadrature = float((weights[p] * nodes[p] ** k).sum())
            assert quadrature == pytest.approx(exact, rel=1e-8, abs=1e-12), (p, k)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sixteen_probes_give_the_first_four_moments_within_five_percent(seed):
    """Softmax regression, 50 features × 10 classes (D = 510), |B| = 2000. The probes'
    average is unbiased; its spread shrinks with the Hessian's effective rank, which is
    high here (on networks of ~100 parameters whose spectrum a few eigenvalues dominate, 16
    probes err by 10–50 % on the higher moments)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(50, 10).double()
    x = torch.randn(2000, 50, dtype=torch.float64)
    y = (x @ torch.randn(50, 10, dtype=torch.float64)).argmax(1)
    problem = Problem("softmax", model, x, y, cross_entropy)
    eigenvalues = torch.linalg.eigvalsh(dense_hessian(problem)[0])
    out = one_step(problem, [quantities.HessDensity(probes=16, steps=16, seed=seed)])
    moments = density_moments(out["HessDensity"])
    for k, moment in enumerate(moments, start=1):
        exact = eigenvalues.pow(k).mean().item()
        assert moment == pytest.approx(exact, rel=0.05), (k, moment, exact)


def test_split_batches_and_non_finite_losses_give_none_with_the_reason():
    problem = make_problem("mlp_relu", 6)
    cockpit = Cockpit(problem.model, [quantities.HessDensity(probes=2, steps=3)], strict=True,
                      grad_accumulation=True)
    for half in (slice(0, 3), slice(3, 6)):
        losses = problem.loss_fn(problem.model(problem.x[half]), problem.y[half])
        with cockpit(0, losses=losses):
            (losses.sum() / 6).backward()
    cockpit.close()
    out, notes = cockpit.get_output(), cockpit.get_notes()
    assert out[0]["HessDensity"] is None and "whole batch" in notes[0]["HessDensity"]
    cockpit = Cockpit(problem.model, [quantities.HessDensity(probes=2, steps=3)], strict=True)
    losses = problem.losses() * math.nan
    with cockpit(1, losses=losses):
        losses.mean().backward()
    cockpit.close()
    out, notes = cockpit.get_output(), cockpit.get_notes()
    assert out[1]["HessDensity"] is None and "non-finite" in notes[1]["HessDensity"]
    with pytest.raises(ValueError, match="probes"):
        quantities.HessDensity(probes=0)


def test_the_panel_draws_the_last_step_s_density_with_its_peaks():
    from cockpit.view import _style as S
    from cockpit.view.cockpit_view import active_panels, plot_cockpit

    nodes = np.array([[0.0, 0.1, 10.0], [0.05, -0.1, 10.0]])
    weights = np.array([[0.5, 0.4, 0.1], [0.6, 0.3, 0.1]])
    out = {0: {"Loss": 1.0, "HessDensity": {"nodes": nodes + 100.0, "weights": weights}},
           1: {"Loss": 0.9, "HessDensity": {"nodes": nodes, "weights": weights}},
           2: {"Loss": 0.8, "HessDensity": None}}
    assert "HessDensity" in active_panels(out, diagnosis=False)["curvature"]
    fig = plot_cockpit(out, diagnosis=False)
    (ax,) = [a for a in fig.axes if a.get_title(loc="left") == S.PANEL_TITLES["HessDensity"]]
    (line,) = ax.get_lines()
    x, y = line.get_data()
    assert x.min() < -0.1 and 10.0 < x.max() < 20.0  # step 1's nodes, not step 0's
    bulk, outlier = y[np.argmin(abs(x))], y[np.argmin(abs(x - 10.0))]
    assert bulk > 5 * outlier > 0  # weight 0.9 near 0, 0.1 at 10
    assert np.trapezoid(y, x) == pytest.approx(1.0, rel=1e-3)
    assert any("step 1" in t.get_text() for t in ax.texts)
