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


def test_demo_gives_the_same_numbers_on_every_run(tmp_path):
    """Seeded initialization, data split and batch order, one thread (whatever the
    caller's): the training is the same on every run (the loss exactly, also under another
    thread count); Cockpit's instruments agree to rounding (it times several exact ways to
    form a convolution's individual gradients and keeps the fastest, which may differ
    between runs in the last bits)."""
    import torch

    runs = []
    threads = torch.get_num_threads()
    for name, count in (("a", 1), ("b", 3)):
        torch.set_num_threads(count)
        try:
            assert main(["demo", "--steps", "8", "--no-plot", "--logdir",
                         str(tmp_path / name)]) == 0
        finally:
            torch.set_num_threads(threads)
        runs.append(read_output(tmp_path / name))
    a, b = runs
    assert sorted(a) == sorted(b) == list(range(8))
    for step in a:
        assert a[step]["Loss"] == b[step]["Loss"]
        for name, value in a[step].items():
            if isinstance(value, float) and math.isnan(value):  # e.g. no noise scale fits
                assert math.isnan(b[step][name]), (step, name, b[step][name])
            elif isinstance(value, float):
                assert math.isclose(value, b[step][name], rel_tol=1e-6, abs_tol=1e-12), (
                    step, name, value, b[step][name])
