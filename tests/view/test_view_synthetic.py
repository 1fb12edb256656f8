"""The synthetic run (``cockpit.view.synthetic``) holds the instruments that Cockpit computes
from the statistics of others — GradientNoiseScale, ParamNorm, UpdateRatio, HessTopEV,
HessDensity — with the values those instruments would record from the others' synthetic
values (checked against the instruments' own formulas and a plain loop), and the view draws
them: the drawn lines are the synthetic numbers."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from cockpit import quantities as q
from cockpit.quantities.gradient_noise_scale import noise_and_signal
from cockpit.quantities.hess_density import density_moments
from cockpit.view import _style as S
from cockpit.view.cockpit_view import active_panels, plot_cockpit
from cockpit.view.synthetic import (
    OTHER_INSTRUMENTS,
    PARAMS_3C3D,
    instruments_of,
    synthetic_output,
)

NAMES = (*instruments_of("full"), *OTHER_INSTRUMENTS)
BATCH = 128  # the synthetic run's batch size
NUM_PARAMETERS = sum(math.prod(s) for s in PARAMS_3C3D.values())


@pytest.fixture(scope="module")
def output() -> dict:
    return synthetic_output("full", num_steps=200, every=5, seed=3, instruments=NAMES)


@pytest.fixture(scope="module")
def fig(output):
    return plot_cockpit(output, diagnosis=False)


def axes_of(fig, key: str):
    (ax,) = [a for a in fig.axes if a.get_title(loc="left") == S.PANEL_TITLES[key]]
    return ax


def finite(output, name) -> tuple[list[int], list[float]]:
    pairs = [(s, v[name]) for s, v in output.items()
             if isinstance(v.get(name), float) and math.isfinite(v[name])]
    return [s for s, _ in pairs], [x for _, x in pairs]


def test_economy_holds_the_instruments_of_the_economy_configuration() -> None:
    from cockpit.configurations import CONFIGURATIONS

    drawn = {n for n in CONFIGURATIONS["economy"] if S.panels().get(n) or any(
        n in names for _, names in S.panels().values())}
    assert drawn <= set(instruments_of("economy"))
    assert {"GradientNoiseScale", "ParamNorm", "UpdateRatio"} <= drawn


def test_noise_scale_follows_from_the_norm_test_batch_size_and_gradient_norm(output) -> None:
    """θ = NormTest, G = ‖g_B‖², n = |B| give Σ_n‖g_n‖² = G(n + n(n−1)θ²) (NormTest's formula
    solved for it); GradientNoiseScale's own estimates then give B_simple, and its moving
    averages (β = 0.9, started at the first step) the EMA value."""
    norm_test = q.NormTest()
    averages = None
    finite_seen = nan_seen = 0
    for step in sorted(output):
        v = output[step]
        theta, G = v["NormTest"], v["GradNorm"] ** 2
        S_sum = G * (BATCH + BATCH * (BATCH - 1) * theta**2)
        assert norm_test.formula(BATCH, S_sum, G, 0.0) == pytest.approx(theta, rel=1e-12)
        trace, signal = noise_and_signal(BATCH, S_sum, G)
        expected = trace / signal if signal > 0 else math.nan
        averages = ((trace, signal) if averages is None else
                    (0.9 * averages[0] + 0.1 * trace, 0.9 * averages[1] + 0.1 * signal))
        expected_ema = averages[0] / averages[1] if averages[1] > 0 else math.nan
        for name, want in (("GradientNoiseScale", expected),
                           ("GradientNoiseScaleEMA", expected_ema)):
            got = v[name]
            if math.isnan(want):
                assert math.isnan(got), (step, name)
            else:
                assert got == pytest.approx(want, rel=1e-9), (step, name)
        finite_seen += math.isfinite(expected)
        nan_seen += math.isnan(expected)
        assert {f"GradientNoiseScale/{p}" for p in PARAMS_3C3D} <= set(v)
    assert finite_seen and nan_seen  # the run shows both: a noise scale and noise-hidden steps


def test_parameter_norms_and_update_ratios_agree_with_distance_and_update_size(output) -> None:
    for step, v in output.items():
        per_norm = np.array([v[f"ParamNorm/{p}"] for p in PARAMS_3C3D])
        per_ratio = np.array([v[f"UpdateRatio/{p}"] for p in PARAMS_3C3D])
        assert v["ParamNorm"] == pytest.approx(math.sqrt(np.sum(per_norm**2)), rel=1e-12)
        # ‖s‖ = UpdateSize: the total ratio and the per-tensor updates ‖s_p‖ = ratio·‖θ_p‖
        assert v["UpdateRatio"] * v["ParamNorm"] == pytest.approx(v["UpdateSize"], rel=1e-12)
        assert math.sqrt(np.sum((per_ratio * per_norm) ** 2)) == pytest.approx(
            v["UpdateSize"], rel=1e-12)
        # the parameters moved away from θ_0 by Distance: ‖θ_t‖ ≥ | ‖θ_0‖ − Distance |
        first = output[min(output)]["ParamNorm"]
        assert v["ParamNorm"] >= abs(first - v["Distance"]) - 1e-9, step


def test_top_eigenvalues_bracket_lambda_max_and_the_density_has_the_trace(output) -> None:
    for step, v in output.items():
        top = v["HessTopEV"]
        lower, upper = np.asarray(top["values"]), np.asarray(top["upper"])
        assert lower.shape == upper.shape == (3,)
        assert np.all(lower <= upper) and np.all(np.diff(lower) < 0)
        assert lower[0] <= v["HessMaxEV"] <= upper[0], step
        density = v["HessDensity"]
        nodes, weights = np.asarray(density["nodes"]), np.asarray(density["weights"])
        assert nodes.shape == weights.shape and np.all(weights > 0)
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-12)
        # ∫ λ ρ(λ) dλ = Tr(H)/D, the density's first moment as the instrument reads it
        assert density_moments(density, orders=1)[0] == pytest.approx(
            v["HessTrace"] / NUM_PARAMETERS, rel=1e-9)
        assert nodes.max() == pytest.approx(lower[0], rel=1e-12)


def test_the_view_draws_the_synthetic_values(output, fig) -> None:
    shown = {k for keys in active_panels(output, diagnosis=False).values() for k in keys}
    assert {"GradientNoiseScale", "ParamNorm", "UpdateRatio", "HessTopEV",
            "HessDensity"} <= shown
    gns = axes_of(fig, "GradientNoiseScale")
    (raw,) = [ln for ln in gns.get_lines() if ln.get_label() == "B_simple, each step"]
    steps, values = finite(output, "GradientNoiseScale")
    np.testing.assert_array_equal(raw.get_xdata(), steps)
    np.testing.assert_array_equal(raw.get_ydata(), values)
    # gray crosses at the top: first those of B_simple, then those of the moving average
    crosses = [ln for ln in gns.get_lines() if ln.get_marker() == "x"]
    for line, name in zip(crosses, ("GradientNoiseScale", "GradientNoiseScaleEMA"),
                          strict=True):
        assert line.get_color() == S.GRAY
        np.testing.assert_array_equal(line.get_xdata(), [
            s for s in sorted(output) if math.isnan(output[s][name])])
    for name in ("ParamNorm", "UpdateRatio"):
        ax = axes_of(fig, name)
        by_gid = {ln.get_gid(): ln for ln in ax.get_lines() if ln.get_gid()}
        assert sorted(by_gid) == sorted(f"{name}/{p}" for p in PARAMS_3C3D)
        for gid, line in by_gid.items():
            np.testing.assert_array_equal(line.get_ydata(), finite(output, gid)[1])
        (total,) = [ln for ln in ax.get_lines() if ln.get_label() == "all parameters"]
        np.testing.assert_array_equal(total.get_ydata(), finite(output, name)[1])
    top = axes_of(fig, "HessTopEV")
    for i in range(3):
        (line,) = [ln for ln in top.get_lines() if ln.get_gid() == f"HessTopEV/{i}"]
        np.testing.assert_array_equal(line.get_xdata(), sorted(output))
        np.testing.assert_array_equal(
            line.get_ydata(), [output[s]["HessTopEV"]["values"][i] for s in sorted(output)])
    last = max(output)
    nodes = np.asarray(output[last]["HessDensity"]["nodes"])
    (curve,) = axes_of(fig, "HessDensity").get_lines()
    x = curve.get_xdata()
    width = 0.02 * (nodes.max() - nodes.min())
    assert x[0] == pytest.approx(nodes.min() - 5 * width) and x[-1] == pytest.approx(
        nodes.max() + 5 * width)
    assert any(t.get_text() == f"step {last}" for t in axes_of(fig, "HessDensity").texts)


def test_per_param_false_leaves_out_every_per_parameter_value() -> None:
    out = synthetic_output("economy", num_steps=20, every=10, seed=1, per_param=False)
    assert not any("/" in name for values in out.values() for name in values)
    assert all("ParamNorm" in v and "UpdateRatio" in v and "GradientNoiseScaleEMA" in v
               for v in out.values())


def test_the_other_instruments_keep_their_values() -> None:
    """The derived instruments draw their own random numbers: adding them changes none of
    the values the synthetic run held before."""
    derived = {"GradientNoiseScale", "ParamNorm", "UpdateRatio", *OTHER_INSTRUMENTS}
    before = synthetic_output("full", num_steps=30, every=5, seed=2,
                              instruments=tuple(n for n in NAMES if n not in derived))
    after = synthetic_output("full", num_steps=30, every=5, seed=2, instruments=NAMES)
    for step, values in before.items():
        for name, value in values.items():
            if isinstance(value, dict):  # the histograms
                for field, array in value.items():
                    np.testing.assert_array_equal(after[step][name][field], array)
            else:
                assert after[step][name] == value, (step, name)
