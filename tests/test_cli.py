"""The ``cockpit`` command: demo, plot, export."""

from __future__ import annotations

import json
import math

from cockpit.cli import main
from cockpit.store import read_output


def test_help_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["fly"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_demo_writes_run_log_figure_and_summary(tmp_path, capsys):
    logdir = tmp_path / "demo"
    assert main(["demo", "--steps", "12", "--logdir", str(logdir)]) == 0
    printed = capsys.readouterr().out
    assert "Cockpit summary" in printed and "test accuracy" in printed
    assert "cockpit view" in printed
    assert (logdir / "cockpit_view.png").stat().st_size > 10_000
    output = read_output(logdir)
    assert sorted(output) == list(range(12))
    assert all(math.isfinite(output[s]["NormTest"]) for s in output)
    assert all(isinstance(output[s]["Alpha"], float) for s in range(11))
    for s in (0, 11):  # the headline instrument shows a shape, not a spike in 2 bins
        assert int((output[s]["GradHist1d"]["counts"] > 0).sum()) >= 20

    assert main(["export", str(logdir), "--format", "json", "-o", str(tmp_path / "r.json")]) == 0
    exported = json.loads((tmp_path / "r.json").read_text())
    assert exported["steps"]["3"]["Loss"] == output[3]["Loss"]
    assert main(["plot", str(logdir), "-o", str(tmp_path / "v.svg")]) == 0
    assert (tmp_path / "v.svg").read_text().lstrip().startswith("<?xml")


def test_example_training_loop_runs(tmp_path):
    import runpy
    from pathlib import Path

    example = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "training_loop.py"))
    output = example["main"](["--steps", "26", "--logdir", str(tmp_path / "run")])
    assert math.isfinite(output[25]["HessTrace"]) and math.isfinite(output[25]["HessMaxEV"])
    assert output[24]["Alpha"] is not None
    assert read_output(tmp_path / "run")[25]["MeanGSNR"] == output[25]["MeanGSNR"]
