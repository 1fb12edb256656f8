"""The layer-wise view (paper Fig. 4): what is drawn equals the recorded per-layer histograms;
the notes on each panel equal brute-force counts from the recorded counts."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
import torch
from matplotlib.patches import StepPatch

from cockpit import Cockpit, configuration
from cockpit.view import plot_layers
from cockpit.view.commands import main_plot


def stairs(ax):
    (patch,) = [p for p in ax.patches if isinstance(p, StepPatch)]
    return np.asarray(patch.get_data().values), np.asarray(patch.get_data().edges)


def _hist(rng, scale, n, edges):
    counts, _ = np.histogram(np.clip(rng.normal(0, scale, n), edges[0], edges[-1]), edges)
    return {"counts": counts, "edges": edges}


@pytest.fixture(scope="module")
def layered() -> dict:
    """Three layers: a wide one that reaches beyond ±2, a medium one, a vanishing one."""
    rng = np.random.default_rng(0)
    edges = np.linspace(-2, 2, 101)
    out = {}
    for step in (0, 10):
        layers = {"wide.weight": _hist(rng, 1.5, 5000, edges),
                  "mid.weight": _hist(rng, 0.3, 3000, edges),
                  "tiny.weight": _hist(rng, 1e-4, 800, edges)}
        total = sum(v["counts"] for v in layers.values())
        out[step] = {"GradHist1d": {"counts": total, "edges": edges},
                     **{f"GradHist1d/{k}": v for k, v in layers.items()}}
    return out


def _brute_central(counts, edges, fraction=0.99):
    for r in sorted({abs(e) for e in edges}):
        inside = counts[(edges[:-1] >= -r) & (edges[1:] <= r)].sum()
        if inside >= fraction * counts.sum() - 1e-9:
            return r
    raise AssertionError


def test_one_panel_per_parameter_with_recorded_counts_and_notes(layered) -> None:
    fig = plot_layers(layered)
    assert [ax.get_title(loc="left") for ax in fig.axes] == [
        "wide.weight", "mid.weight", "tiny.weight"]
    for ax in fig.axes:
        rec = layered[10][f"GradHist1d/{ax.get_title(loc='left')}"]
        values, edges = stairs(ax)
        np.testing.assert_array_equal(values, rec["counts"])
        np.testing.assert_allclose(edges, rec["edges"])
        assert ax.get_xlim() == (-2.0, 2.0) and ax.get_yscale() == "log"
        (note,) = [t.get_text() for t in ax.texts]
        c = rec["counts"]
        assert f"{int(c.sum()):,} elements" in note
        assert f"99 % within ±{_brute_central(c, rec['edges']):.3g}" in note
        edge = int(c[0] + c[-1])
        assert (f"≤{edge:,} beyond ±2 (edge bins)" in note) == (edge > 0)
    # the wide layer reaches beyond the range, the vanishing one is one spike at 0
    assert "beyond ±2" in fig.axes[0].texts[0].get_text()
    assert "99 % within ±0.04" in fig.axes[2].texts[0].get_text()
    assert "step 10" in fig._suptitle.get_text()


def test_data_range_and_step(layered) -> None:
    fig = plot_layers(layered, hist_range="data", step=0)
    spans = []
    for k in ("wide.weight", "mid.weight", "tiny.weight"):
        c, e = layered[0][f"GradHist1d/{k}"].values()
        nz = np.flatnonzero(c)
        spans.append((e[nz[0]], e[nz[-1] + 1]))
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    assert fig.axes[0].get_xlim() == pytest.approx((lo, hi))
    np.testing.assert_array_equal(stairs(fig.axes[1])[0],
                                  layered[0]["GradHist1d/mid.weight"]["counts"])
    with pytest.raises(ValueError, match="hist_range"):
        plot_layers(layered, hist_range="wide")


def test_nan_step_shows_last_finite_step(layered) -> None:
    edges = np.linspace(-2, 2, 101)
    out = dict(layered)
    empty = {"counts": np.zeros(100, dtype=np.int64), "edges": edges}
    out[20] = {"GradHist1d": empty, "GradHist1d/wide.weight": empty,
               "GradHist1d/mid.weight": empty, "GradHist1d/tiny.weight": empty}
    fig = plot_layers(out)
    np.testing.assert_array_equal(stairs(fig.axes[0])[0],
                                  layered[10]["GradHist1d/wide.weight"]["counts"])


def test_real_run_directory_and_cli(tmp_path) -> None:
    """A real run log written by Cockpit: the figure shows its recorded histograms, and
    ``cockpit plot DIR --layers`` writes the layer-wise view (only)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Sigmoid(), torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt, logdir=str(tmp_path))
    for step in range(3):
        x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
        opt.zero_grad()
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    recorded = cockpit.get_output()
    fig = plot_layers(tmp_path, tmp_path / "layers.svg")
    names = [n for n, _ in model.named_parameters()]
    assert [ax.get_title(loc="left") for ax in fig.axes] == names
    for ax, name in zip(fig.axes, names, strict=True):
        np.testing.assert_array_equal(stairs(ax)[0], recorded[2][f"GradHist1d/{name}"]["counts"])
    assert (tmp_path / "layers.svg").read_bytes()[:5] == b"<?xml"
    assert main_plot([str(tmp_path), "--layers"]) == 0
    assert (tmp_path / "cockpit_layers.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "cockpit_view.png").exists()  # only what was asked for
    # the options first: the run directory is not taken for the layers' figure file
    (tmp_path / "cockpit_layers.png").unlink()
    assert main_plot(["--layers", str(tmp_path), "--dpi", "40"]) == 0
    assert (tmp_path / "cockpit_layers.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):  # a figure file and no run: the usual usage error
        main_plot(["--layers", str(tmp_path / "figure.png")])
