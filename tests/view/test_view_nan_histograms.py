"""Recorded runs whose gradients turn NaN: the histogram views show the last step whose
gradient elements were all finite (a histogram counts only finite elements, so a partly
NaN step looks like a smaller finite one), every layer at that one step, and say that
there is no such step where gradients were NaN from the first step on."""

from __future__ import annotations

import io
import math
import warnings

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from matplotlib.patches import StepPatch
from torch import nn

from cockpit import Cockpit, configuration, quantities
from cockpit.view import _style as S
from cockpit.view import plot_cockpit, plot_layers
from cockpit.view._hist import histogram_at
from cockpit.view._source import load_run
from cockpit.view.gradient_panels import draw_grad_hist_1d
from cockpit.view.layers import layer_histograms
from cockpit.view.live import hover_data

BATCH, STEPS, NAN_FROM = 12, 8, 5
SHAPES = {"0.weight": (6, 5), "0.bias": (6,), "2.weight": (3, 6), "2.bias": (3,)}
ELEMENTS = {p: BATCH * math.prod(s) for p, s in SHAPES.items()}  # |B| × D per layer


def _record(logdir, insts, *, nan_from: int | None = None, nan_weight: bool = False) -> None:
    """A ReLU MLP trained for ``STEPS`` steps; from step ``nan_from`` on its outputs are
    NaN (the hidden layer's gradients are then NaN where a unit is active and 0 where it is
    not: partly finite), or (``nan_weight``) one first-layer weight is NaN from the start."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    if nan_weight:
        with torch.no_grad():
            model[0].weight[0, 0] = math.nan
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    with warnings.catch_warnings(), Cockpit(model, insts, optimizer=opt,
                                             logdir=str(logdir)) as cockpit:
        warnings.filterwarnings("ignore", "step .*: non-finite loss")
        for step in range(STEPS):
            opt.zero_grad()
            out = model(x)
            if nan_from is not None and step >= nan_from:
                out = out * math.nan
            losses = F.cross_entropy(out, y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()


def _totals(output: dict, name: str) -> dict[int, int]:
    return {s: int(v[name]["counts"].sum()) for s, v in output.items()}


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory, one_thread) -> dict:
    logdir = tmp_path_factory.mktemp("runs") / "nan"
    _record(logdir, configuration("economy"), nan_from=NAN_FROM)
    output, meta = load_run(logdir)
    # what the run recorded: finite gradients (all |B|×D elements counted) before NAN_FROM,
    # NaN gradient norms from it on, and at NAN_FROM a first layer with part of its
    # elements counted and a second layer with none
    for step, values in output.items():
        assert math.isfinite(values["GradNorm"]) == (step < NAN_FROM)
    for param, full in ELEMENTS.items():
        assert all(_totals(output, f"GradHist1d/{param}")[s] == full for s in range(NAN_FROM))
    first = _totals(output, "GradHist1d/0.weight")[NAN_FROM]
    assert 0 < first < ELEMENTS["0.weight"]
    assert _totals(output, "GradHist1d/2.weight")[NAN_FROM] == 0
    return {"dir": logdir, "output": output, "meta": meta}


@pytest.fixture(scope="module")
def nan0_run(tmp_path_factory, one_thread) -> dict:
    logdir = tmp_path_factory.mktemp("runs") / "nan0"
    _record(logdir, configuration("economy"), nan_weight=True)
    output, meta = load_run(logdir)
    assert math.isnan(output[0]["GradNorm"])
    assert 0 < _totals(output, "GradHist1d")[0] < sum(ELEMENTS.values())  # partly finite
    return {"dir": logdir, "output": output, "meta": meta}


def _panel(fig, key):
    (ax,) = [a for a in fig.axes if a.get_title(loc="left") == S.PANEL_TITLES[key]]
    return ax


def _texts(ax) -> str:
    return " ".join(t.get_text().replace("\n", " ") for t in ax.texts)


def _drawn_counts(ax) -> np.ndarray:
    (patch,) = [p for p in ax.patches if isinstance(p, StepPatch)]
    return np.asarray(patch.get_data().values)


def test_the_histogram_shown_is_the_last_with_every_element_finite(nan_run) -> None:
    output, last = nan_run["output"], NAN_FROM - 1
    hist = histogram_at(output, "GradHist1d")
    assert hist.step == last and hist.total == sum(ELEMENTS.values())
    np.testing.assert_array_equal(hist.counts, output[last]["GradHist1d"]["counts"])
    for param in SHAPES:
        assert histogram_at(output, f"GradHist1d/{param}").step == last
    ax = _panel(plot_cockpit(output, nan_run["meta"], diagnosis=False), "GradHist1d")
    np.testing.assert_array_equal(_drawn_counts(ax), output[last]["GradHist1d"]["counts"])
    shown = _texts(ax)
    assert f"step {last}  ·  {sum(ELEMENTS.values()):,} elements" in shown
    assert (f"step {last} is the last with finite gradients: steps {NAN_FROM}–{STEPS - 1} "
            "have non-finite elements") in shown


def test_every_layer_is_shown_at_one_step(nan_run) -> None:
    output, last = nan_run["output"], NAN_FROM - 1
    hists = layer_histograms(output, order=list(SHAPES))
    assert list(hists) == list(SHAPES)
    assert {h.step for h in hists.values()} == {last}
    for param, hist in hists.items():
        assert hist.total == ELEMENTS[param]
        np.testing.assert_array_equal(hist.counts, output[last][f"GradHist1d/{param}"]["counts"])
    fig = plot_layers(nan_run["dir"])
    assert fig.get_suptitle() == f"Individual gradient elements per layer (step {last})"
    assert [ax.get_title(loc="left") for ax in fig.axes] == list(SHAPES)
    for ax in fig.axes:
        counts = output[last][f"GradHist1d/{ax.get_title(loc='left')}"]["counts"]
        np.testing.assert_array_equal(_drawn_counts(ax), counts)
    panel = _panel(plot_cockpit(output, nan_run["meta"], diagnosis=False), "Layers")
    assert _texts(panel) == f"step {last}"


def test_an_explicit_step_shows_that_step_as_recorded(nan_run) -> None:
    output = nan_run["output"]
    hist = histogram_at(output, "GradHist1d/0.weight", NAN_FROM)
    assert hist.step == NAN_FROM
    assert hist.total == _totals(output, "GradHist1d/0.weight")[NAN_FROM]
    fig = Figure()
    ax = draw_grad_hist_1d(fig, fig.add_gridspec(1, 1)[0], output, step=NAN_FROM - 2)
    np.testing.assert_array_equal(_drawn_counts(ax), output[NAN_FROM - 2]["GradHist1d"]["counts"])
    assert "last with finite gradients" not in _texts(ax)  # a chosen step, not a fallback


def test_the_live_readout_reads_the_histogram_shown(nan_run) -> None:
    output, last = nan_run["output"], NAN_FROM - 1
    fig = plot_cockpit(output, nan_run["meta"], diagnosis=False)
    fig.savefig(io.BytesIO(), format="png", dpi=60)
    (entry,) = [p for p in hover_data(fig, output)["panels"] if p["key"] == "GradHist1d"]
    assert entry["hist"]["step"] == last
    assert entry["hist"]["counts"] == output[last]["GradHist1d"]["counts"].tolist()


def test_nan_from_the_first_step_names_no_finite_step(nan0_run) -> None:
    output, last = nan0_run["output"], STEPS - 1
    assert histogram_at(output, "GradHist1d") is None
    assert layer_histograms(output) == {}
    fig = plot_cockpit(output, nan0_run["meta"], diagnosis=False)
    hist_ax = _panel(fig, "GradHist1d")
    assert not [p for p in hist_ax.patches if isinstance(p, StepPatch)]
    assert _texts(hist_ax) == f"no step with finite gradients (last recorded step {last})"
    assert _texts(_panel(fig, "Layers")) == (
        f"no step with finite gradients in every layer (last recorded step {last})")
    layers = plot_layers(nan0_run["dir"])
    assert layers.axes == []
    assert [t.get_text() for t in layers.texts] == [
        "Individual gradient elements per layer",  # (the title: no step to name)
        f"no step with finite gradients in every layer (last recorded step {last})"]


def test_without_a_recorded_gradient_norm_the_full_count_decides(tmp_path, one_thread) -> None:
    """GradHist1d alone (no GradNorm): a step counts as finite where its histogram holds
    as many elements as the fullest one (the batch size is constant here)."""
    _record(tmp_path / "run", [quantities.Loss(), quantities.GradHist1d()], nan_from=NAN_FROM)
    output, _ = load_run(tmp_path / "run")
    assert "GradNorm" not in output[0]
    assert 0 < _totals(output, "GradHist1d/0.weight")[NAN_FROM] < ELEMENTS["0.weight"]
    assert histogram_at(output, "GradHist1d").step == NAN_FROM - 1
    assert {h.step for h in layer_histograms(output).values()} == {NAN_FROM - 1}
    assert {p: h.total for p, h in layer_histograms(output).items()} == ELEMENTS
