"""What the cockpit view's panels draw: counts beyond the histogram's
range against brute-force counts of the recorded histogram, the zoom on the data's own
range, the last finite step of a NaN run, the recorded reason of a missing value (batch
size 1, from a real run), layout rules (legends off the data, the norm test on top, no
learning-rate line or panel when it is constant), the per-layer and diagnosis panels."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import QuadMesh
from matplotlib.patches import StepPatch

from cockpit import Cockpit, configuration
from cockpit.diagnose import Evidence, Finding
from cockpit.view import _style as S
from cockpit.view import plot_run
from cockpit.view.cockpit_view import active_panels, plot_cockpit
from cockpit.view.findings_panel import SEVERITY_COLORS
from cockpit.view.synthetic import PARAMS_3C3D, synthetic_output

EDGES = np.linspace(-2.0, 2.0, 101)


def panel(fig, key):
    (ax,) = [a for a in fig.axes if a.get_title(loc="left") == S.PANEL_TITLES[key]]
    return ax


def texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def stairs(ax):
    (patch,) = [p for p in ax.patches if isinstance(p, StepPatch)]
    return np.asarray(patch.get_data().values), np.asarray(patch.get_data().edges)


def hist_output(samples_per_step: dict[int, np.ndarray]) -> dict:
    """Histograms as the engine records them: values beyond ±2 clamped into the edge bins."""
    out = {}
    for step, x in samples_per_step.items():
        counts, _ = np.histogram(np.clip(x, -2.0, 2.0 - 1e-12), EDGES)
        out[step] = {"GradHist1d": {"counts": counts, "edges": EDGES}, "Loss": 1.0}
    return out


# ------------------------------------------------------------------ whole-network histogram
def test_count_beyond_the_range_is_the_edge_bins_of_the_record() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 0.5, 20_000), [-7.0, -3.0, 2.5, 9.0, 40.0]])
    out = hist_output({0: x})
    counts = out[0]["GradHist1d"]["counts"]
    ax = panel(plot_cockpit(out, diagnosis=False), "GradHist1d")
    edge = int(counts[0] + counts[-1])  # brute force from the record
    assert edge >= 5  # the five far values are in there (the bound is an upper bound)
    (note,) = [t for t in texts(ax) if "beyond" in t]
    assert f"≤{edge:,} elements ({edge / counts.sum():.2%}) beyond ±2, in the edge bins" in note
    assert f"{int(counts.sum()):,} elements" in note
    assert ax.get_xlim() == (-2.0, 2.0)
    # a narrower view: bins wholly outside it are counted exactly
    ax = panel(plot_cockpit(out, hist_range=(-1.0, 1.0), diagnosis=False), "GradHist1d")
    hidden = int(counts[(EDGES[1:] <= -1.0) | (EDGES[:-1] >= 1.0)].sum())
    assert any(f"{hidden:,} elements ({hidden / counts.sum():.2%}) outside the view" in t
               for t in texts(ax))


def test_no_element_beyond_the_range_and_zoom_on_the_data() -> None:
    rng = np.random.default_rng(1)
    out = hist_output({3: rng.normal(0.1, 0.05, 5000)})
    counts = out[3]["GradHist1d"]["counts"]
    fig = plot_cockpit(out, diagnosis=False)
    ax = panel(fig, "GradHist1d")
    assert any("no element beyond ±2" in t for t in texts(ax))
    (inset,) = [a for a in ax.child_axes if a.get_title(loc="left").startswith(
        S.SUB_TITLES["HistZoom"])]
    nz = np.flatnonzero(counts)
    lo, hi = EDGES[nz[0]], EDGES[nz[-1] + 1]
    assert inset.get_title(loc="left") == f"{S.SUB_TITLES['HistZoom']}: [{lo:.3g}, {hi:.3g})"
    assert inset.get_xlim() == pytest.approx((lo - 0.04, hi + 0.04))
    np.testing.assert_array_equal(stairs(inset)[0], counts)
    assert nz.size > 3 and inset.get_xlabel() == ""


def test_zoom_says_when_the_data_fill_too_few_bins_and_wide_data_get_no_zoom() -> None:
    rng = np.random.default_rng(2)
    spike = hist_output({0: rng.normal(0.0, 1e-4, 3000)})
    ax = panel(plot_cockpit(spike, diagnosis=False), "GradHist1d")
    (inset,) = ax.child_axes
    n_bins = int(np.count_nonzero(spike[0]["GradHist1d"]["counts"]))
    assert n_bins <= 2
    assert inset.get_xlabel().startswith(f"all in {n_bins} bin")
    assert "finer shape not recorded" in inset.get_xlabel()
    lo, hi = min(EDGES[np.flatnonzero(spike[0]["GradHist1d"]["counts"])]), 0.04
    reach = 0.048828125  # ≥ max(|lo|, hi) = 0.04, and bins of an exact width 1/1024
    assert max(abs(lo), hi) == pytest.approx(0.04)
    assert f"hist_bins=cockpit.BinSpec(-{reach}, {reach}, 100)" in inset.get_xlabel()
    wide = hist_output({0: rng.normal(0.0, 1.0, 3000)})
    assert panel(plot_cockpit(wide, diagnosis=False), "GradHist1d").child_axes == []


def test_nan_run_shows_the_last_finite_histogram() -> None:
    rng = np.random.default_rng(3)
    out = hist_output({0: rng.normal(0, 0.3, 1000), 5: rng.normal(0, 0.6, 1000)})
    empty = np.zeros(100, dtype=np.int64)  # all elements NaN: counted in no bin
    out[10] = {"GradHist1d": {"counts": empty, "edges": EDGES}, "Loss": float("nan")}
    out[15] = {"GradHist1d": {"counts": empty, "edges": EDGES}, "Loss": float("nan")}
    ax = panel(plot_cockpit(out, diagnosis=False), "GradHist1d")
    np.testing.assert_array_equal(stairs(ax)[0], out[5]["GradHist1d"]["counts"])
    assert any(t.startswith("step 5  ·  1,000 elements") for t in texts(ax))
    assert any("step 5 is the last with finite gradients" in t and "steps 6–15" in t
               for t in texts(ax))
    only_nan = {k: v for k, v in out.items() if k >= 10}
    ax = panel(plot_cockpit(only_nan, diagnosis=False), "GradHist1d")
    assert any("no finite gradient element recorded (last recorded step 15)"
               in t.replace("\n", " ") for t in texts(ax))


# ------------------------------------------------------------------- reasons from the notes
def test_batch_size_one_shows_the_recorded_reason(tmp_path) -> None:
    """A real run with batch size 1: the gradient tests are None with a note; the panel
    shows that note, read back from the run log."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt, logdir=str(tmp_path))
    for step in range(3):
        opt.zero_grad()
        losses = torch.nn.functional.cross_entropy(model(torch.randn(1, 4)),
                                                   torch.tensor([step % 2]), reduction="none")
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    reason = cockpit.get_notes()[0]["NormTest"]
    assert "one sample" in reason
    ax = panel(plot_run(tmp_path), "GradientTests")
    (shown,) = texts(ax)
    assert shown.replace("\n", " ") == "not computed: " + reason
    assert "tracked, but not computed yet" not in shown


# -------------------------------------------------------------------------------- layout
def test_legends_sit_above_the_data_and_norm_test_is_on_top() -> None:
    out = synthetic_output("economy", num_steps=100, every=5, seed=7)
    fig = plot_cockpit(out, diagnosis=False)
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    for key in ("Distances", "GradientTests", "Alpha"):
        ax = panel(fig, key)
        legend = ax.get_legend()
        assert legend is not None
        assert legend.get_window_extent(renderer).y0 >= ax.get_window_extent(renderer).y1 - 1
        title = ax.title.get_window_extent(renderer)
        assert title.y0 >= legend.get_window_extent(renderer).y1 - 2  # title above legend
    tests = panel(fig, "GradientTests")
    z = {ln.get_label(): ln.get_zorder() for ln in tests.get_lines()}
    assert z["norm"] > max(z["inner product"], z["orthogonality"])
    geometry = [a for a in fig.axes if a.get_title(loc="left").startswith(
        S.SUB_TITLES["TestGeometry"])]
    assert len(geometry) == 1 and geometry[0].get_title(loc="left").endswith("step 100")


def test_constant_learning_rate_and_batch_size_take_no_panel() -> None:
    out = synthetic_output("economy", num_steps=60, every=5, seed=8)
    for values in out.values():
        values["LearningRate"] = 0.05
    panels = active_panels(out)
    assert "LearningRate" not in panels["gray"] and "BatchSize" not in panels["gray"]
    fig = plot_cockpit(out, diagnosis=False)
    assert panel(fig, "Loss").get_xlabel().endswith(
        "learning rate 0.05 · batch size 128 (constant)")
    grad_norm = panel(fig, "GradNorm")
    assert len([a for a in fig.axes if a.bbox.bounds == grad_norm.bbox.bounds]) == 1  # no twin
    # a changing learning rate gets its panel and a solid line on the gradient-norm panel
    varying = synthetic_output("economy", num_steps=60, every=5, seed=8)
    fig = plot_cockpit(varying, diagnosis=False)
    assert "LearningRate" in active_panels(varying)["gray"]
    twins = [a for a in fig.axes if a is not panel(fig, "GradNorm")
             and a.bbox.bounds == panel(fig, "GradNorm").bbox.bounds]
    (lr_line,) = [ln for ln in twins[0].get_lines() if ln.get_xdata().size]
    assert lr_line.get_linestyle() == "-"
    steps = sorted(s for s in varying if "LearningRate" in varying[s])
    np.testing.assert_allclose(lr_line.get_ydata(), [varying[s]["LearningRate"] for s in steps])
    assert "learning rate" not in panel(fig, "Loss").get_xlabel()


# ------------------------------------------------------------------- layers and findings
def test_layers_panel_shows_the_recorded_per_layer_counts() -> None:
    out = synthetic_output("economy", num_steps=20, every=10, seed=9)
    meta = {"parameters": {k: list(v) for k, v in reversed(PARAMS_3C3D.items())}}
    fig = plot_cockpit(out, meta, diagnosis=False)
    ax = panel(fig, "Layers")
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert names == list(meta["parameters"])  # the model's order from the metadata
    (mesh,) = [c for c in ax.collections if isinstance(c, QuadMesh)]
    expected = np.stack([out[20][f"GradHist1d/{p}"]["counts"] for p in names])
    np.testing.assert_array_equal(np.ma.filled(mesh.get_array(), 0).reshape(expected.shape),
                                  expected)
    no_layers = synthetic_output("economy", num_steps=20, every=10, seed=9, per_param=False)
    assert "Layers" not in active_panels(no_layers)["gradients"]


def test_findings_panel_shows_the_given_findings_most_severe_first() -> None:
    out = synthetic_output("economy", num_steps=20, every=10, seed=10)
    findings = [
        Finding("vanishing_gradients", "warning", "The first layers barely receive gradient.",
                (Evidence("GradHist1d/conv1.weight", (20,), (1e-6,)),),
                advice="Use ReLU or a residual connection.", parameters=("conv1.weight",)),
        Finding("non_finite", "error", "The loss became NaN at step 15.",
                advice="Lower the learning rate."),
    ]
    ax = panel(plot_cockpit(out, findings=findings), "Findings")
    shown = texts(ax)
    assert shown[0].startswith("✖ non_finite: The loss became NaN")  # errors first
    first = [t for t in ax.texts if "vanishing_gradients (conv1.weight)" in t.get_text()]
    assert first and first[0].get_color() == SEVERITY_COLORS["warning"]
    assert any("try: Use ReLU or a residual connection." in t for t in shown)
    ok = panel(plot_cockpit(out, findings=[]), "Findings")
    assert texts(ok)[0].startswith("✓ no problem named by diagnose()")
    assert "Findings" not in active_panels(out, diagnosis=False)["gray"]


def test_findings_panel_reads_diagnose() -> None:
    from cockpit.diagnose import diagnose

    out = synthetic_output("economy", num_steps=40, every=5, seed=11)
    findings = diagnose(out)
    expected = [f for f in findings if f.severity != "info"]
    shown = " ".join(texts(panel(plot_cockpit(out), "Findings")))
    for finding in expected:
        assert finding.code in shown
    if not expected:  # (the checks that could not run, else that none named a problem)
        skipped = [f for f in findings if f.code == "checks_skipped"]
        assert ("could not run" in shown if skipped
                else "no problem named by diagnose()" in shown)


def test_findings_that_do_not_fit_end_in_a_count_and_the_command() -> None:
    out = synthetic_output("economy", num_steps=20, every=10, seed=12)
    # messages short enough for one line at any panel width (≥ 30 characters)
    many = [Finding("noise_dominated", "warning", f"Finding {k}.",
                    advice="Use a larger batch.") for k in range(40)]
    shown = texts(panel(plot_cockpit(out, findings=many), "Findings"))
    assert 3 <= len(shown) < 80
    assert shown[-1].startswith("… ") and "cockpit diagnose RUN_DIR" in shown[-1]
    left = int(shown[-1].split()[1])
    assert left + len(shown) - 1 == 80  # two lines per finding: message and advice


def test_gradient_tests_without_any_value_use_the_whole_panel() -> None:
    out = {t: {"NormTest": None, "InnerTest": None, "OrthoTest": None, "Loss": 1.0}
           for t in range(5)}
    notes = {t: {"NormTest": "undefined for a batch of one sample"} for t in range(5)}
    fig = plot_cockpit(out, notes=notes, diagnosis=False)
    ax = panel(fig, "GradientTests")
    assert [t.replace("\n", " ") for t in texts(ax)] == [
        "not computed: undefined for a batch of one sample"]
    assert not any(a.get_title(loc="left").startswith(S.SUB_TITLES["TestGeometry"])
                   for a in fig.axes)
