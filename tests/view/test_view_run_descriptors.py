"""A run log's metadata carries the descriptors of its instruments
(``describe_instruments`` under ``METADATA_KEY``), so the view of the run draws the panel of
an instrument whose class the drawing process never imported: ``cockpit plot`` in a fresh
process draws it with the recorded values; an unreadable entry is left out with a warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from cockpit import quantities as q
from cockpit.quantities import Quantity
from cockpit.quantities.descriptor import (
    METADATA_KEY,
    Descriptor,
    Panel,
    describe_instruments,
    descriptor_from_description,
    registry,
    remember_descriptions,
)
from cockpit.store import RunLogWriter
from cockpit.view.figure_file import PANELS_KEY, read_png_text

SRC = Path(__file__).resolve().parents[2] / "src"
STEPS = [0, 5, 10, 15]


class Curl(Quantity):
    """A user's own instrument, known to this test process only."""

    descriptor = Descriptor(panel=Panel("Curl", "curvature", "Curl of the gradient field",
                                        order=8, readout=("Curl",)), color="#654321")


def write_run(logdir: Path, meta: dict) -> None:
    writer = RunLogWriter(logdir, meta=meta)
    for step in STEPS:
        writer.write_step(step, {"Loss": 1.0 / (1 + step), "Curl": 0.5 * step + 1.0})
    writer.close()


def plot_in_a_fresh_process(logdir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """``cockpit plot`` in a new interpreter, which has not imported the class Curl."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "MPLBACKEND": "Agg"}
    code = ("import sys; from cockpit.cli import main; "
            f"assert 'Curl' not in __import__('cockpit.quantities.descriptor', fromlist=['x'])"
            f".registry(); sys.exit(main(['plot', {str(logdir)!r}, '-o', {str(out)!r}]))"
            + "".join(extra))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)


def test_descriptions_round_trip_through_json() -> None:
    quantities = [q.GradientNoiseScale(), q.UpdateRatio(), q.HessTopEV(), q.Loss(), Curl()]
    described = json.loads(json.dumps(describe_instruments(quantities)))
    assert sorted(described) == sorted(x.name for x in quantities)
    for name, entry in described.items():
        back, original = descriptor_from_description(entry), registry()[name]
        assert back.panel == original.panel and back.color == original.color
        assert back.records == original.records
        assert back.per_parameter == original.per_parameter
    # instruments without a panel of their own carry nothing
    assert describe_instruments([q.DeadUnits()]) == {}


def test_cockpit_plot_draws_an_instrument_known_only_from_the_run_log(tmp_path) -> None:
    logdir, out = tmp_path / "run", tmp_path / "view.png"
    write_run(logdir, {METADATA_KEY: describe_instruments([q.Loss(), Curl()])})
    done = plot_in_a_fresh_process(logdir, out)
    assert done.returncode == 0, done.stderr
    assert read_png_text(out)[PANELS_KEY].split(",") == ["Curl", "Loss", "Findings"]


def test_without_the_descriptors_the_fresh_process_draws_no_panel_for_it(tmp_path) -> None:
    logdir, out = tmp_path / "run", tmp_path / "view.png"
    write_run(logdir, {"model": "m"})
    done = plot_in_a_fresh_process(logdir, out)
    assert done.returncode == 0, done.stderr
    assert read_png_text(out)[PANELS_KEY].split(",") == ["Loss", "Findings"]


def test_the_panel_from_the_run_log_draws_the_recorded_values(tmp_path, monkeypatch) -> None:
    """In this process, with the class Curl hidden from the registry: the panel, its title,
    colour and values come from the metadata alone."""
    import cockpit.quantities.descriptor as d
    from cockpit.view import plot_run

    monkeypatch.setattr(d, "_FROM_RUN_LOGS", {})
    described = describe_instruments([Curl()])
    described["Curl"]["panel"]["title"] = "Curl, as the run log says"
    described["Curl"]["color"] = "#0000aa"
    logdir = tmp_path / "run"
    write_run(logdir, {METADATA_KEY: described})
    monkeypatch.delattr(Curl, "descriptor")  # the class says nothing now
    assert "Curl" not in registry() or registry()["Curl"].panel is None
    fig = plot_run(logdir, diagnosis=False)
    (ax,) = [a for a in fig.axes if a.get_title(loc="left") == "Curl, as the run log says"]
    (line,) = ax.get_lines()
    np.testing.assert_array_equal(line.get_xdata(), STEPS)
    np.testing.assert_array_equal(line.get_ydata(), [0.5 * s + 1.0 for s in STEPS])
    assert line.get_color() == "#0000aa"


def test_imported_classes_win_over_the_run_log(monkeypatch) -> None:
    import cockpit.quantities.descriptor as d

    monkeypatch.setattr(d, "_FROM_RUN_LOGS", {})
    described = describe_instruments([q.Loss(), Curl()])
    described["Loss"]["panel"]["title"] = "not the package's title"
    described["Curl"]["color"] = "#000000"
    remember_descriptions({METADATA_KEY: described})
    assert registry()["Loss"] is q.Loss.descriptor
    assert registry()["Curl"] is Curl.descriptor


@pytest.mark.parametrize("entry", [
    "a string",
    {"panel": {"key": "Bad", "column": "sideways", "title": "t", "order": 1}},
    {"panel": {"key": "Bad", "column": "curvature", "title": "t", "order": "first"}},
    {"panel": {"key": "Bad", "column": "curvature", "title": "t"}},
    {"panel": {"key": "Bad", "column": "curvature", "title": "t", "order": 1, "pos": 3}},
    {"panel": {"key": "Bad", "column": "curvature", "title": "t", "order": 1}, "color": 3},
    {"panel": {"key": "Bad", "column": "curvature", "title": "t", "order": 1},
     "records": "BadEMA"},
    {"panel": {"key": "Bad", "column": "curvature", "title": "t", "order": 1,
               "readout": [1, 2]}},
])
def test_an_unreadable_description_is_left_out_with_a_warning(entry, monkeypatch) -> None:
    import cockpit.quantities.descriptor as d

    monkeypatch.setattr(d, "_FROM_RUN_LOGS", {})
    good = describe_instruments([Curl()])["Curl"]
    with pytest.warns(RuntimeWarning, match="'Bad'.*left out of the view"):
        remember_descriptions({METADATA_KEY: {"Bad": entry, "Good": good}})
    assert "Bad" not in registry() and registry()["Good"].panel.title == Curl.descriptor.panel.title


def test_a_cockpit_run_log_carries_its_instruments_descriptions(tmp_path) -> None:
    """Cockpit itself writes the descriptions: its run log of a custom drawn instrument is
    drawn with that panel by a process that never imported the class."""
    import torch

    from cockpit import Cockpit
    from cockpit.store import read_meta

    class Recorded(Curl):
        name = "Curl"

        def compute(self, data):
            return {"Curl": 2.0}

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logdir, out = tmp_path / "run", tmp_path / "view.png"
    with Cockpit(model, [q.Loss(), Recorded()], optimizer=opt, logdir=str(logdir)) as cockpit:
        for step in range(3):
            x, y = torch.randn(4, 3), torch.randn(4, 2)
            opt.zero_grad()
            losses = ((model(x) - y) ** 2).mean(1)
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
    assert "Curl" in read_meta(logdir)[METADATA_KEY]
    done = plot_in_a_fresh_process(logdir, out)
    assert done.returncode == 0, done.stderr
    assert read_png_text(out)[PANELS_KEY].split(",") == ["Curl", "Loss", "Findings"]
