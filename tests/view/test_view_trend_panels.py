"""The panels of GradientNoiseScale, ParamNorm, UpdateRatio and HessTopEV: drawn from a run
log that holds their values (the drawn lines are the recorded numbers), absent where they
were not tracked, read out by the live page; and a user-defined instrument whose descriptor
names a panel is drawn with no code in the view."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from cockpit.quantities import Quantity
from cockpit.quantities.descriptor import Descriptor, Panel
from cockpit.store import RunLogWriter
from cockpit.view import _style as S
from cockpit.view import plot_run
from cockpit.view.cockpit_view import active_panels, plot_cockpit
from cockpit.view.live import hover_data

PARAMS = ["conv.weight", "conv.bias", "fc.weight", "fc.bias"]
STEPS = [0, 5, 10, 15, 20, 25]


def recorded_output() -> dict[int, dict]:
    """Values as Cockpit records them (NaN where ‖G‖² ≤ 0, a zero-initialized bias)."""
    rng = np.random.default_rng(3)
    out: dict[int, dict] = {}
    for i, step in enumerate(STEPS):
        values: dict = {"Loss": 2.0 / (1 + i), "BatchSize": 32.0}
        values["GradientNoiseScale"] = math.nan if step == 10 else float(rng.uniform(5, 500))
        values["GradientNoiseScaleEMA"] = float(40.0 + 3 * i)
        for p in PARAMS:
            values[f"GradientNoiseScale/{p}"] = float(rng.uniform(1, 100))
        norms = {p: float(rng.uniform(0.5, 20.0)) for p in PARAMS}
        norms["conv.bias"] = 0.0 if step == 0 else 0.01 * i
        values["ParamNorm"] = math.sqrt(sum(v * v for v in norms.values()))
        values.update({f"ParamNorm/{p}": v for p, v in norms.items()})
        ratios = {p: float(10 ** rng.uniform(-4, -2)) for p in PARAMS}
        ratios["conv.bias"] = math.nan if step == 0 else ratios["conv.bias"]
        values["UpdateRatio"] = float(10 ** rng.uniform(-3.5, -2.5))
        values.update({f"UpdateRatio/{p}": v for p, v in ratios.items()})
        values["HessTopEV"] = {"values": np.array([9.0, 4.0, 1.5]) * (1 + 0.1 * i),
                               "upper": np.array([9.2, 4.1, 1.6]) * (1 + 0.1 * i)}
        out[step] = values
    return out


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("trend") / "run"
    output = recorded_output()
    writer = RunLogWriter(logdir, meta={"parameters": {p: [1] for p in PARAMS}})
    for step, values in output.items():
        writer.write_step(step, values)
    writer.close()
    return plot_run(logdir, diagnosis=False), output


def axes_of(fig, key: str):
    (ax,) = [a for a in fig.axes if a.get_title(loc="left") == S.PANEL_TITLES[key]]
    return ax


def finite(output, name) -> tuple[list[int], list[float]]:
    pairs = [(s, v[name]) for s, v in output.items()
             if name in v and v[name] is not None and math.isfinite(v[name])]
    return [s for s, _ in pairs], [x for _, x in pairs]


def line_labelled(ax, label: str):
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
    return line


def test_gradient_noise_scale_panel_draws_the_recorded_values(drawn) -> None:
    fig, output = drawn
    ax = axes_of(fig, "GradientNoiseScale")
    assert ax.get_yscale() == "log"
    for label, name in (("B_simple, each step", "GradientNoiseScale"),
                        ("ratio of moving averages", "GradientNoiseScaleEMA"),
                        ("batch size |B|", "BatchSize")):
        line = line_labelled(ax, label)
        steps, values = finite(output, name)
        np.testing.assert_array_equal(line.get_xdata(), steps)
        np.testing.assert_array_equal(line.get_ydata(), values)
    assert 10 not in line_labelled(ax, "B_simple, each step").get_xdata()  # NaN: a cross
    crosses = [ln for ln in ax.get_lines() if ln.get_marker() == "x"]
    assert [list(c.get_xdata()) for c in crosses] == [[10]]
    assert crosses[0].get_color() == S.GRAY  # not an error: the noise hides the signal


@pytest.mark.parametrize("name", ["ParamNorm", "UpdateRatio"])
def test_per_parameter_panels_draw_one_line_per_tensor(drawn, name) -> None:
    fig, output = drawn
    ax = axes_of(fig, name)
    assert ax.get_yscale() == "log"
    by_gid = {ln.get_gid(): ln for ln in ax.get_lines() if ln.get_gid()}
    assert sorted(by_gid) == sorted(f"{name}/{p}" for p in PARAMS)
    for gid, line in by_gid.items():
        steps, values = finite(output, gid)
        keep = [i for i, v in enumerate(values) if v > 0]  # zeros are off the log axis
        np.testing.assert_array_equal(line.get_xdata(), [steps[i] for i in keep])
        np.testing.assert_array_equal(line.get_ydata(), [values[i] for i in keep])
    assert by_gid[f"{name}/conv.bias"].get_xdata()[0] == 5  # step 0: zero norm, NaN ratio
    total = line_labelled(ax, "all parameters")
    np.testing.assert_array_equal(total.get_ydata(), finite(output, name)[1])
    # the tensors run from the first layer (dark) to the last (light), the model's order
    colors = [by_gid[f"{name}/{p}"].get_color() for p in PARAMS]
    assert len({tuple(c) for c in colors}) == len(PARAMS)


def test_update_ratio_panel_draws_the_rule_of_thumb(drawn) -> None:
    fig, _ = drawn
    line = line_labelled(axes_of(fig, "UpdateRatio"), "rule of thumb 0.001")
    assert list(line.get_ydata()) == [1e-3, 1e-3]


def test_top_eigenvalues_panel_draws_each_eigenvalue(drawn) -> None:
    fig, output = drawn
    ax = axes_of(fig, "HessTopEV")
    for i in range(3):
        (line,) = [ln for ln in ax.get_lines() if ln.get_gid() == f"HessTopEV/{i}"]
        np.testing.assert_array_equal(line.get_xdata(), STEPS)
        np.testing.assert_allclose(line.get_ydata(),
                                   [output[s]["HessTopEV"]["values"][i] for s in STEPS])


def test_panels_sit_in_their_columns(drawn) -> None:
    _, output = drawn
    panels = active_panels(output, diagnosis=False)
    assert panels["step size"] == ["UpdateRatio"]
    assert panels["gradients"] == ["GradientNoiseScale"]
    assert panels["curvature"] == ["HessTopEV"]
    assert panels["gray"] == ["Loss", "ParamNorm"]  # a constant batch size: no panel


def test_absent_instruments_draw_no_panel() -> None:
    output = {s: {k: v for k, v in values.items() if k in ("Loss", "BatchSize")}
              for s, values in recorded_output().items()}
    fig = plot_cockpit(output, diagnosis=False)
    titles = {a.get_title(loc="left") for a in fig.axes}
    for key in ("GradientNoiseScale", "ParamNorm", "UpdateRatio", "HessTopEV"):
        assert S.PANEL_TITLES[key] not in titles
    assert titles == {S.PANEL_TITLES["Loss"]}


def test_panels_without_values_say_why() -> None:
    output = {s: {"Loss": 1.0, "GradientNoiseScale": None, "UpdateRatio": None}
              for s in STEPS}
    notes = {s: {"GradientNoiseScale": "undefined for a batch of one sample"}
             for s in STEPS}
    fig = plot_cockpit(output, diagnosis=False, notes=notes)
    texts = [" ".join(t.get_text().split()) for t in axes_of(fig, "GradientNoiseScale").texts]
    assert any("batch of one sample" in t for t in texts)
    assert any("not computed yet" in t for t in
               [t.get_text() for t in axes_of(fig, "UpdateRatio").texts])


def test_live_page_reads_out_the_new_instruments(drawn) -> None:
    fig, output = drawn
    data = hover_data(fig, output)
    by_key = {p["key"]: p for p in data["panels"]}
    assert by_key["GradientNoiseScale"]["instruments"] == [
        "GradientNoiseScale", "GradientNoiseScaleEMA", "BatchSize"]
    assert by_key["UpdateRatio"]["instruments"] == [
        "UpdateRatio", *(f"UpdateRatio/{p}" for p in PARAMS)]
    assert by_key["ParamNorm"]["instruments"][0] == "ParamNorm"
    assert data["series"]["UpdateRatio/fc.weight"]["values"] == [
        output[s]["UpdateRatio/fc.weight"] for s in STEPS]
    assert data["series"]["GradientNoiseScale"]["values"][2] == "nan"
    assert "HessTopEV" in by_key and "instruments" not in by_key["HessTopEV"]


class Sharpness(Quantity):
    """A user's own instrument: its descriptor alone puts it into the view."""

    descriptor = Descriptor(panel=Panel("Sharpness", "curvature", "My sharpness", order=9,
                                        readout=("Sharpness",)), color="#123456")


def test_a_new_instrument_needs_only_its_descriptor() -> None:
    output = {s: {"Loss": 1.0, "Sharpness": float(s + 1)} for s in STEPS}
    fig = plot_cockpit(output, diagnosis=False)
    (ax,) = [a for a in fig.axes if a.get_title(loc="left") == "My sharpness"]
    (line,) = ax.get_lines()
    np.testing.assert_array_equal(line.get_ydata(), [s + 1.0 for s in STEPS])
    assert line.get_color() == "#123456"
    by_key = {p["key"]: p for p in hover_data(fig, output)["panels"]}
    assert by_key["Sharpness"]["instruments"] == ["Sharpness"]
