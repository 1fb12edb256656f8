"""One run per run log, one writer at a time, each step whole or not at all, and memory
that stays flat in a long run (get_output() reads old steps back from the run log)."""

from __future__ import annotations

import copy
import math
import os
import sqlite3
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, configuration, quantities
from cockpit.store import (
    RunLogExistsError,
    RunLogFormatError,
    RunLogLockedError,
    RunLogReader,
    RunLogWriter,
    load_json_export,
    read_meta,
    read_output,
)

ROOT = Path(__file__).resolve().parents[2]


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    return model, opt, torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def _train(cockpit, model, opt, x, y, steps):
    losses_seen = {}
    for step in steps:
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        losses_seen[step] = float(losses.detach().mean())
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    return losses_seen


def test_a_second_run_in_a_used_logdir_is_refused_and_the_first_run_kept(tmp_path):
    model, opt, x, y = _setup()
    first = Cockpit(model, configuration("economy"), optimizer=opt, logdir=str(tmp_path))
    seen = _train(first, model, opt, x, y, range(5))
    first.close()
    before = read_output(tmp_path)
    model2, opt2, _, _ = _setup(seed=3)
    with pytest.raises(RunLogExistsError, match="resume=True"):
        Cockpit(model2, configuration("economy"), optimizer=opt2, logdir=str(tmp_path))
    # the refused Cockpit left no hooks behind
    assert not model2[0]._forward_hooks and not model2._forward_hooks
    assert not opt2._optimizer_step_pre_hooks and not model2[0].weight._backward_hooks
    after = read_output(tmp_path)
    assert sorted(after) == list(range(5))
    for step in range(5):
        assert after[step]["Loss"] == pytest.approx(seen[step], rel=1e-6)
        assert after[step]["Distance"] == before[step]["Distance"]


def test_resume_continues_the_run_and_marks_the_restart(tmp_path):
    """A run restarted from a checkpoint at step 3 while the log holds steps up to 5: the
    logged steps are kept (not overwritten by the re-run), the log goes on after step 5 and
    its metadata says where the run restarted."""
    model, opt, x, y = _setup()
    first = Cockpit(model, configuration("economy"), optimizer=opt, logdir=str(tmp_path))
    seen = _train(first, model, opt, x, y, range(6))
    first.close()
    model2, opt2, x, y = _setup(seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = Cockpit(model2, configuration("economy"), optimizer=opt2,
                         logdir=str(tmp_path), resume=True)
        later = _train(second, model2, opt2, x, y, range(3, 9))
        second.close()
    assert sum("comes after step 5" in str(w.message) for w in caught) == 1
    output = read_output(tmp_path)
    assert sorted(output) == list(range(9))
    for step in range(6):
        assert output[step]["Loss"] == pytest.approx(seen[step], rel=1e-6)
    for step in range(6, 9):
        assert output[step]["Loss"] == pytest.approx(later[step], rel=1e-6)
    assert [r["after_step"] for r in read_meta(tmp_path)["restarts"]] == [5]
    assert sorted(second.get_output()) == list(range(9))  # the whole run, read back


def test_a_second_writer_is_refused_by_the_lock(tmp_path):
    writer = RunLogWriter(tmp_path)
    with pytest.raises(RunLogLockedError, match="another Cockpit"):
        RunLogWriter(tmp_path, resume=True)
    script = textwrap.dedent("""
        import sys
        from cockpit.store import RunLogWriter, RunLogLockedError
        try:
            RunLogWriter(sys.argv[1], resume=True)
        except RunLogLockedError as error:
            print("refused:", error)
    """)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert f"process {os.getpid()}" in result.stdout, result.stdout + result.stderr
    writer.close()
    RunLogWriter(tmp_path, resume=True).close()  # the lock goes with the writer


def test_an_unwritable_logdir_names_the_path(tmp_path):
    """An existing directory Cockpit cannot write to (read-only; /proc/self for root, who
    ignores permissions): an OSError naming the directory, not sqlite's 'unable to open
    database file'."""
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o500)
    try:
        if os.access(target, os.W_OK):
            if not Path("/proc/self").is_dir():
                pytest.skip("no read-only directory for this user")
            target = Path("/proc/self")
        model, opt, _, _ = _setup()
        with pytest.raises(OSError, match=f"{target}.*writable directory"):
            Cockpit(model, configuration("economy"), optimizer=opt, logdir=str(target))
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_a_failed_write_leaves_no_partial_step(tmp_path, monkeypatch):
    """The first write of step 3 fails (a full disk): step 3 is absent, not half there
    (it held only Alpha and UpdateSize); every other step is whole and equals get_output."""
    model, opt, x, y = _setup()
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt, logdir=str(tmp_path))
    writer = cockpit._log
    commit = writer._commit
    failed = []

    def full_disk(body, *, what):
        if what == "step 3" and not failed:
            failed.append(what)

            def fail(cur):
                raise sqlite3.OperationalError("database or disk is full")

            return commit(fail, what=what)
        return commit(body, what=what)

    monkeypatch.setattr(writer, "_commit", full_disk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(cockpit, model, opt, x, y, range(6))
        cockpit.close()
    assert failed
    logged = read_output(tmp_path)
    memory = cockpit.get_output()
    assert 3 not in logged
    assert sorted(logged) == [0, 1, 2, 4, 5]
    for step, values in logged.items():
        assert sorted(values) == sorted(memory[step]), step
        for name, value in values.items():
            if isinstance(value, float) and math.isfinite(value):
                assert value == memory[step][name], (step, name)


def test_get_output_reads_old_steps_back_from_the_run_log(tmp_path):
    model, opt, x, y = _setup()
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt, logdir=str(tmp_path),
                      memory_steps=3)
    seen = _train(cockpit, model, opt, x, y, range(10))
    assert len(cockpit._output) <= 3
    output = cockpit.get_output()
    assert sorted(output) == list(range(10))
    for step in range(10):
        assert output[step]["Loss"] == pytest.approx(seen[step], rel=1e-6)
    cockpit.close()
    with RunLogReader(tmp_path) as reader:
        assert reader.output().keys() == cockpit.get_output().keys()


def test_without_a_logdir_memory_keeps_a_window_and_says_so():
    model, opt, x, y = _setup()
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt, memory_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = _train(cockpit, model, opt, x, y, range(10))
        cockpit.close()
    assert sum("keeps the last 4 recorded steps" in str(w.message) for w in caught) == 1
    output = cockpit.get_output()
    assert sorted(output) == [6, 7, 8, 9]
    for step in output:
        assert output[step]["Loss"] == pytest.approx(seen[step], rel=1e-6)


SOAK = textwrap.dedent(r"""
    import json, os, sys, tempfile
    import torch, torch.nn as nn, torch.nn.functional as F
    from cockpit import Cockpit, configuration
    torch.set_num_threads(1)
    page = os.sysconf("SC_PAGE_SIZE")
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt, logdir=tempfile.mkdtemp(),
                      memory_steps=int(sys.argv[2]))
    x, y = torch.randn(8, 10), torch.randint(0, 4, (8,))
    marks = {}
    steps = int(sys.argv[1])
    for step in range(steps):
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
        if step + 1 in (steps // 3, steps):
            marks[step + 1] = rss()
    cockpit.close()
    print(json.dumps({"marks": marks, "returned": len(cockpit.get_output())}))
""")


def test_memory_stays_flat_over_a_long_run():
    """1,200 tracked steps (~10 s): resident memory grows by less than 1.5 KiB per step from
    step 400 to 1,200 (0.0 measured; all steps in memory grew by ~11 KiB per step), and
    get_output() still returns every step (from the run log). benchmarks/soak.py runs
    10,000."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", SOAK, "1200", "50"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    import json

    report = json.loads(result.stdout.strip().splitlines()[-1])
    marks = {int(k): v for k, v in report["marks"].items()}
    growth = (marks[1200] - marks[400]) / 800
    assert growth < 1.5 * 1024, f"{growth / 1024:.2f} KiB per step"
    assert report["returned"] == 1200


def test_the_cockpit_view_marks_where_a_resumed_run_restarted(tmp_path):
    from cockpit.view import plot_run

    model, opt, x, y = _setup()
    first = Cockpit(model, configuration("economy"), optimizer=opt, logdir=str(tmp_path))
    _train(first, model, opt, x, y, range(6))
    first.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second = Cockpit(model, configuration("economy"), optimizer=opt,
                         logdir=str(tmp_path), resume=True)
        _train(second, model, opt, x, y, range(6, 12))
        second.close()
    fig = plot_run(tmp_path)
    marked = [ax for ax in fig.axes
              if any(list(line.get_xdata()) == [5.5, 5.5] and line.get_linestyle() == ":"
                     for line in ax.get_lines())]
    assert len(marked) >= 3  # every panel over the steps (loss, step size, gradients, …)
    assert any("resumed after step 5" in t.get_text() for t in fig.texts)


def test_a_run_resumed_from_a_checkpoint_continues_the_instruments_state(tmp_path):
    """Stopped after step 4 (model, optimizer and Cockpit's state saved) and resumed in a
    new Cockpit: GradientNoiseScaleEMA's moving averages and GradHist1d's automatic range
    go on as in the run that never stopped (they restarted before)."""
    instruments = [quantities.GradientNoiseScale(), quantities.GradHist1d()]

    def train(cockpit, model, opt, x, y, steps):
        for step in steps:
            opt.zero_grad()
            losses = torch.nn.functional.cross_entropy(model(x[step]), y[step],
                                                       reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()

    torch.manual_seed(0)
    x, y = torch.randn(10, 16, 5), torch.randint(0, 3, (10, 16))
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    start = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    whole = Cockpit(model, instruments, optimizer=opt)
    train(whole, model, opt, x, y, range(10))
    whole.close()
    expected = whole.get_output()

    model.load_state_dict(start)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    first = Cockpit(model, [type(q)() for q in instruments], optimizer=opt,
                    logdir=str(tmp_path))
    train(first, model, opt, x, y, range(5))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), first.state_dict()))
    first.close()
    model.load_state_dict(saved[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    opt.load_state_dict(saved[1])
    second = Cockpit(model, [type(q)() for q in instruments], optimizer=opt,
                     logdir=str(tmp_path), resume=True)
    second.load_state_dict(saved[2])
    train(second, model, opt, x, y, range(5, 10))
    second.close()
    output = read_output(tmp_path)
    for step in range(5, 10):
        assert output[step]["GradientNoiseScaleEMA"] == pytest.approx(
            expected[step]["GradientNoiseScaleEMA"], rel=1e-9)
        np.testing.assert_array_equal(output[step]["GradHist1d"]["edges"],
                                      expected[step]["GradHist1d"]["edges"])


def test_a_run_log_of_a_newer_format_is_refused_with_a_way_out(tmp_path):
    """Not read as if it were this package's format, and not stamped back to it by a resumed
    writer; a JSON export of a newer format neither."""
    model, opt, x, y = _setup()
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt, logdir=str(tmp_path))
    _train(cockpit, model, opt, x, y, range(2))
    cockpit.close()
    path = tmp_path / "cockpit.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 2")
    with pytest.raises(ValueError, match="format 2, newer than this package reads"):
        read_output(tmp_path)
    with pytest.raises(ValueError, match="pip install -U torch-cockpit"):
        Cockpit(model, configuration("economy"), optimizer=opt, logdir=str(tmp_path),
                resume=True)
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (2,)
    export = tmp_path / "run.json"
    export.write_text('{"format": "cockpit-run/99", "meta": {}, "notes": {}, "steps": {}}')
    with pytest.raises(ValueError, match="cockpit-run/99"):
        load_json_export(export)


def test_a_file_that_is_not_a_run_log_gets_a_clear_error_not_a_traceback(tmp_path, capsys):
    from cockpit.cli import main

    (tmp_path / "cockpit.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(RunLogFormatError, match="not a Cockpit run log"):
        read_output(tmp_path)
    for command in (["diagnose", str(tmp_path)], ["plot", str(tmp_path), "-o",
                                                  str(tmp_path / "view.png")]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "not a Cockpit run log" in err and "Traceback" not in err
