"""Cockpit view figure: panels follow the tracked instruments, drawn data equals the data.

Run data is synthesized in the data-contract format (``cockpit.view.synthetic``); the
expected panels and numbers are derived here independently from that data.
"""

from __future__ import annotations

import base64
import io
import json
import math

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
from matplotlib.collections import QuadMesh
from matplotlib.figure import Figure
from matplotlib.patches import StepPatch

from cockpit.view import _style as S
from cockpit.view.cockpit_view import (
    active_panels,
    describe_run,
    plot_cockpit,
    plot_layer_histograms,
    save_figure,
)
from cockpit.view.synthetic import PARAMS_3C3D, synthetic_meta, synthetic_output

# The synthetic run's learning rate changes (a panel), its batch size does not (written in
# the loss panel); per-layer histograms give the per-layer panel; the diagnosis panel is on.
ECONOMY_PANELS = {"Alpha", "Distances", "GradNorm", "GradientTests", "GradHist1d", "Layers",
                  "Loss", "LearningRate", "Findings", "GradientNoiseScale", "ParamNorm",
                  "UpdateRatio"}
BUSINESS_PANELS = ECONOMY_PANELS | {"HessTrace", "TIC"}
FULL_PANELS = BUSINESS_PANELS | {"HessMaxEV", "GradHist2d"}


def stairs_of(ax) -> tuple[np.ndarray, np.ndarray]:
    """Values and edges of the (single) histogram step artist of an axes."""
    (patch,) = [p for p in ax.patches if isinstance(p, StepPatch)]
    data = patch.get_data()
    return np.asarray(data.values), np.asarray(data.edges)


def titles(fig: Figure) -> list[str]:
    """Panel titles (titles of parts of a panel, e.g. the test geometry, left out)."""
    found = []
    for ax in fig.axes:
        for loc in ("left", "center", "right"):
            text = ax.get_title(loc=loc)
            if text and not text.startswith(tuple(S.SUB_TITLES.values())):
                found.append(text)
    return found


def axes_titled(fig: Figure, key: str):
    (ax,) = [a for a in fig.axes if a.get_title(loc="left") == S.PANEL_TITLES[key]]
    return ax


def finite_series(output: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    steps = [s for s in sorted(output) if isinstance(output[s].get(name), float)
             and math.isfinite(output[s][name])]
    return np.array(steps, dtype=float), np.array([output[s][name] for s in steps])


@pytest.fixture(scope="module")
def economy() -> dict:
    return synthetic_output("economy", num_steps=200, every=5, seed=1)


@pytest.mark.parametrize(
    ("config", "expected"),
    [("economy", ECONOMY_PANELS), ("business", BUSINESS_PANELS), ("full", FULL_PANELS)],
)
def test_panel_titles_match_tracked_instruments(config: str, expected: set[str]) -> None:
    output = synthetic_output(config, num_steps=100, every=10, seed=2)
    fig = plot_cockpit(output, synthetic_meta(config))
    got = titles(fig)
    assert sorted(got) == sorted(S.PANEL_TITLES[k] for k in expected)  # each exactly once
    shown = {k for keys in active_panels(output).values() for k in keys}
    assert shown == expected
    assert "SGD(lr=0.05, momentum=0.9)" in fig._suptitle.get_text()


def test_full_view_renders_to_png(tmp_path) -> None:
    output = synthetic_output("full", num_steps=100, every=10, seed=3)
    path = save_figure(plot_cockpit(output, synthetic_meta("full")), tmp_path / "full.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 1500 and height > 1000


def test_series_panels_draw_exactly_the_finite_values(economy: dict) -> None:
    fig = plot_cockpit(economy)
    for key, name in [("Loss", "Loss"), ("GradNorm", "GradNorm")]:
        line = axes_titled(fig, key).get_lines()[0]
        steps, vals = finite_series(economy, name)
        np.testing.assert_array_equal(line.get_xdata(), steps)
        np.testing.assert_allclose(line.get_ydata(), vals, rtol=0, atol=0)
    # every time axis spans the run's step range
    assert axes_titled(fig, "Loss").get_xlim() == (0.0, 200.0)
    assert axes_titled(fig, "GradNorm").get_xlim() == (0.0, 200.0)


def test_gradient_histogram_shows_last_step_counts_on_log_axis(economy: dict) -> None:
    fig = plot_cockpit(economy)
    ax = axes_titled(fig, "GradHist1d")
    last = max(s for s in economy if "GradHist1d" in economy[s])
    counts = economy[last]["GradHist1d"]["counts"]
    edges = economy[last]["GradHist1d"]["edges"]
    heights, drawn_edges = stairs_of(ax)
    np.testing.assert_array_equal(heights, counts)
    np.testing.assert_allclose(drawn_edges, edges)
    assert ax.get_yscale() == "log"
    assert ax.get_xlim() == (-2.0, 2.0)
    assert any(t.get_text().startswith(f"step {last}  ·  ") for t in ax.texts)


def test_alpha_gauge_densities_and_means(economy: dict) -> None:
    fig = plot_cockpit(economy)
    ax = axes_titled(fig, "Alpha")
    steps, alpha = finite_series(economy, "Alpha")
    recent = alpha[steps >= steps.max() - 0.1 * (steps.max() - steps.min())]
    lines = {ln.get_label().split(" (")[0]: ln for ln in ax.get_lines()
             if not ln.get_label().startswith("_")}
    assert set(lines) == {"all steps", "last 10 %"}
    assert (f"n={alpha.size}, median {np.median(alpha):+.2f}, mean {alpha.mean():+.2f}"
            in lines["all steps"].get_label())
    assert (f"n={recent.size}, median {np.median(recent):+.2f}, mean {recent.mean():+.2f}"
            in lines["last 10 %"].get_label())
    for ln, vals in [(lines["all steps"], alpha), (lines["last 10 %"], recent)]:
        x, y = ln.get_xdata(), ln.get_ydata()
        inside = np.mean(np.abs(vals) < 1.2)  # kernel mass leaves [-1.5, 1.5] only at edges
        assert np.trapezoid(y, x) == pytest.approx(1.0, abs=1 - inside + 0.08)
        assert x[np.argmax(y)] == pytest.approx(np.median(np.clip(vals, -1.5, 1.5)), abs=0.6)
    assert ax.get_xlim() == (-1.5, 1.5)
    texts = {t.get_text() for t in ax.texts}
    assert "◀ undershoot" in texts and "overshoot ▶" in texts
    marks = sorted(ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_linestyle() == "--")
    assert marks == [-1, 0, 1]


def test_alpha_outside_range_is_clipped_into_edge_bins() -> None:
    output = {t: {"Alpha": a} for t, a in enumerate([-4.0, -0.2, 0.1, 0.3, 7.0])}
    ax = axes_titled(plot_cockpit(output), "Alpha")
    assert ax.get_xlim() == (-1.5, 1.5)
    assert any("2 beyond ±1.5" in t.get_text() for t in ax.texts)


def test_gradient_histogram_2d_marginals_are_sums_of_counts() -> None:
    output = synthetic_output("full", num_steps=40, every=10, seed=4)
    fig = plot_cockpit(output)
    top = axes_titled(fig, "GradHist2d")
    hist = output[40]["GradHist2d"]
    values, edges = stairs_of(top)
    np.testing.assert_array_equal(values, hist["counts"].sum(axis=0))
    np.testing.assert_allclose(edges, hist["edges_param"])
    (right,) = [a for a in fig.axes if a.get_xscale() == "log"
                and a.get_label() != "<colorbar>"]
    values, edges = stairs_of(right)
    np.testing.assert_array_equal(values, hist["counts"].sum(axis=1))
    np.testing.assert_allclose(edges, hist["edges_grad"])
    (mesh,) = [c for a in fig.axes for c in a.collections if isinstance(c, QuadMesh)
               and a.get_title(loc="left") != S.PANEL_TITLES["Layers"]
               and a.get_label() != "<colorbar>"]
    np.testing.assert_array_equal(np.ma.filled(mesh.get_array(), 0).ravel(),
                                  hist["counts"].ravel())


def test_only_loss_and_grad_norm_gives_two_panels() -> None:
    rng = np.random.default_rng(0)
    output = {t: {"Loss": float(2 * np.exp(-t / 30) + 0.1 * rng.random()),
                  "GradNorm": float(1 + rng.random())} for t in range(0, 100, 2)}
    fig = plot_cockpit(output, {"model": "mlp", "optimizer": "Adam"})
    fig = plot_cockpit(output, {"model": "mlp", "optimizer": "Adam"}, diagnosis=False)
    assert sorted(titles(fig)) == sorted([S.PANEL_TITLES["Loss"], S.PANEL_TITLES["GradNorm"]])
    assert len(fig.axes) == 2  # no empty axes, no twin axes without learning rate
    assert fig._suptitle.get_text() == "Cockpit · mlp · Adam"


def test_none_and_nan_values_are_skipped_and_marked() -> None:
    output = synthetic_output("economy", num_steps=60, every=5, seed=5, per_param=False)
    output[20]["Loss"] = float("nan")
    output[25]["Loss"] = float("inf")
    output[30]["GradNorm"] = None
    output[35]["GradNorm"] = float("nan")
    for t in output:
        output[t]["Alpha"] = None  # tracked but never computed
    fig = plot_cockpit(output)
    loss_ax = axes_titled(fig, "Loss")
    steps, _ = finite_series(output, "Loss")
    np.testing.assert_array_equal(loss_ax.get_lines()[0].get_xdata(), steps)
    crosses = [ln for ln in loss_ax.get_lines() if ln.get_marker() == "x"]
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [20, 25]
    assert crosses[0].get_color() == S.RED
    assert any(t.get_text() == "non-finite loss at step 20 and 1 more" for t in loss_ax.texts)
    gn = axes_titled(fig, "GradNorm")
    assert 30 not in gn.get_lines()[0].get_xdata() and 35 not in gn.get_lines()[0].get_xdata()
    assert [list(ln.get_xdata()) for ln in gn.get_lines() if ln.get_marker() == "x"] == [[35]]
    alpha_ax = axes_titled(fig, "Alpha")
    assert any("not computed yet" in t.get_text() for t in alpha_ax.texts)
    fig.savefig(io.BytesIO(), format="png", dpi=40)  # drawing with NaN/None must not raise


def test_json_layout_and_empty_outputs() -> None:
    output = synthetic_output("economy", num_steps=30, every=10, seed=6, per_param=False)
    as_json = json.loads(json.dumps(
        {str(s): {k: ({f: np.asarray(x).tolist() for f, x in v.items()}
                      if isinstance(v, dict) else v) for k, v in vals.items()}
         for s, vals in output.items()}))
    assert sorted(titles(plot_cockpit(as_json))) == sorted(titles(plot_cockpit(output)))
    empty = plot_cockpit({})
    assert empty.axes == []  # no steps: not even the diagnosis panel
    single = plot_cockpit({7: {"Loss": 1.0, "Alpha": None}})
    assert axes_titled(single, "Loss").get_xlim() == (6.5, 7.5)


def test_layer_histograms_one_panel_per_parameter(economy: dict) -> None:
    fig = plot_layer_histograms(economy)
    assert titles(fig) == list(PARAMS_3C3D)
    last = max(economy)
    for ax in fig.axes:
        counts = economy[last][f"GradHist1d/{ax.get_title(loc='left')}"]["counts"]
        np.testing.assert_array_equal(stairs_of(ax)[0], counts)
        assert ax.get_yscale() == "log"
    at_step = plot_layer_histograms(economy, step=100)
    ax = at_step.axes[0]
    np.testing.assert_array_equal(stairs_of(ax)[0],
                                  economy[100]["GradHist1d/conv1.weight"]["counts"])
    assert plot_layer_histograms({0: {"Loss": 1.0}}).axes == []


@pytest.mark.parametrize(("suffix", "magic"), [(".png", b"\x89PNG"), (".pdf", b"%PDF"),
                                               (".svg", b"<?xml")])
def test_save_figure_formats(tmp_path, suffix: str, magic: bytes) -> None:
    output = {t: {"Loss": 1.0 / (t + 1), "GradNorm": 0.5} for t in range(10)}
    path = save_figure(plot_cockpit(output), tmp_path / f"sub/view{suffix}")
    assert path.read_bytes()[: len(magic)] == magic
    if suffix == ".svg":
        assert b"<svg" in path.read_bytes()[:2000]


def test_save_figure_rejects_unknown_extension(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"\.png, \.pdf, \.svg"):
        save_figure(plot_cockpit({0: {"Loss": 1.0}}), tmp_path / "view.jpg")


def test_describe_run_variants() -> None:
    assert describe_run(None) == ""
    meta = {"model_summary": "Sequential(\n  Linear...)", "optimizer": {"class": "AdamW",
            "hyperparameters": {"lr": 1e-3, "weight_decay": 0.01}}, "num_parameters": 1234}
    expected = "Sequential( · AdamW(lr=0.001, weight_decay=0.01) · 1,234 parameters"
    assert describe_run(meta) == expected
    cockpit_meta = {"model": "Net(\n  (fc): Linear()\n)", "model_class": "Net",
                    "optimizer": "SGD", "num_parameters": 10,
                    "optimizer_hyperparameters": [{"lr": 0.1, "momentum": 0.0}, {"lr": 1}]}
    assert describe_run(cockpit_meta) == "Net · SGD(lr=0.1, momentum=0) · 10 parameters"


def test_show_displays_inline_in_ipython() -> None:
    interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
    from cockpit.view.cockpit_view import show

    shell = interactiveshell.InteractiveShell.instance()
    try:
        fig = show({t: {"Loss": 1.0 / (t + 1)} for t in range(5)}, {"model": "m"})
        data, _ = shell.display_formatter.format(fig)
        png = data["image/png"]
        png = base64.b64decode(png) if isinstance(png, str) else png
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        interactiveshell.InteractiveShell.clear_instance()
