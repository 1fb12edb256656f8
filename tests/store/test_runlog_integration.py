"""The run log written by a real Cockpit: crash safety, export, figures of real runs."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cockpit import Cockpit, configuration
from cockpit.store import RunLogReader, export_run, load_json_export, read_output
from tests.models import make_problem, train

ROOT = Path(__file__).resolve().parents[2]

TRAINER = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    from cockpit import Cockpit, configuration
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt, logdir=sys.argv[1])
    step = 0
    while True:
        x, y = torch.randn(16, 10), torch.randint(0, 4, (16,))
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
        print(step, flush=True)
        step += 1
    """
)


def test_kill_9_of_a_training_process_keeps_every_completed_step(tmp_path):
    path = f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path / "run")],
                            stdout=subprocess.PIPE, text=True, env=env)
    completed = []
    deadline = time.time() + 120
    try:
        while len(completed) < 15 and time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            completed.append(int(line))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(completed) >= 15, "the trainer did not get going"
    output = read_output(tmp_path / "run")
    # a step's values reach the run log when they are read from the device, at the next
    # step's start, and α of step t is known at t + 1: every step but the last two is whole
    for step in completed[:-2]:
        values = output[step]
        for name in ("Loss", "GradNorm", "NormTest", "UpdateSize", "Distance", "Alpha"):
            assert isinstance(values[name], float) and math.isfinite(values[name]), (step, name)
        assert values["GradHist1d"]["counts"].sum() == 16 * (10 * 32 + 32 + 32 * 4 + 4)


def run_with_logdir(tmp_path, config):
    problem = make_problem("cnn", 6, torch.float32)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.05, momentum=0.9)
    cockpit = Cockpit(problem.model, configuration(config), optimizer=opt,
                      logdir=str(tmp_path / config))
    train(problem, cockpit, 4, opt)
    cockpit.close()
    return cockpit, tmp_path / config


def assert_same_output(actual: dict, expected: dict):
    assert sorted(actual) == sorted(expected)
    for step, values in expected.items():
        assert sorted(actual[step]) == sorted(values), step
        for name, value in values.items():
            got = actual[step][name]
            if isinstance(value, dict):
                for field, array in value.items():
                    assert np.array_equal(np.asarray(got[field]), np.asarray(array)), name
            elif value is None or (isinstance(value, float) and math.isnan(value)):
                assert got is None or math.isnan(got), (step, name)
            else:
                assert got == value, (step, name, got, value)


def test_run_log_and_json_export_match_get_output(tmp_path):
    cockpit, logdir = run_with_logdir(tmp_path, "economy")
    assert_same_output(read_output(logdir), cockpit.get_output())
    path = export_run(logdir, tmp_path / "run.json", "json")
    assert_same_output(load_json_export(path), cockpit.get_output())
    meta = RunLogReader(logdir).meta()
    assert meta["optimizer"] == "SGD" and meta["num_parameters"] > 0
    assert "NormTest" in meta["quantities"]


@pytest.mark.parametrize("config", ["economy", "full"])
def test_cockpit_view_of_real_runs(tmp_path, config):
    from cockpit.view import plot_run

    _, logdir = run_with_logdir(tmp_path, config)
    fig = plot_run(logdir, tmp_path / "view.png")
    titles = " ".join(ax.get_title(loc=loc) for ax in fig.axes
                      for loc in ("left", "center", "right")).lower()
    for word in ("gradient tests", "loss", "histogram", "distance", "α"):
        assert word in titles, (word, titles)
    if config == "full":
        for word in ("λ", "trace", "tic"):
            assert word in titles, (word, titles)
    assert (tmp_path / "view.png").stat().st_size > 10_000


def test_tensorboard_sink_attached_to_a_cockpit(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cockpit.store import TensorBoardSink
    from cockpit.view import plot_cockpit

    problem = make_problem("mlp_relu", 6, torch.float32)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.05)
    holder = {}
    sink = TensorBoardSink(str(tmp_path / "tb"), image_every=2,
                           figure_fn=lambda: plot_cockpit(holder["cockpit"].get_output()),
                           log_per_parameter=True)
    cockpit = Cockpit(problem.model, configuration("economy"), optimizer=opt, sinks=[sink])
    holder["cockpit"] = cockpit
    train(problem, cockpit, 3, opt)
    cockpit.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0,
                                                                    "histograms": 0,
                                                                    "images": 0})
    events.Reload()
    tags = events.Tags()
    assert "cockpit/NormTest" in tags["scalars"] and "cockpit/GradNorm/0.weight" in tags["scalars"]
    norm_test = [e.value for e in events.Scalars("cockpit/NormTest")]
    expected = [cockpit.get_output()[s]["NormTest"] for s in range(3)]
    assert np.allclose(norm_test, expected, rtol=1e-6)
    hist = events.Histograms("cockpit/GradHist1d")[-1].histogram_value
    assert sum(hist.bucket) == cockpit.get_output()[2]["GradHist1d"]["counts"].sum()
    assert "cockpit/view" in tags["images"]
