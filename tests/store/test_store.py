"""Tests of the SQLite run log: round trips, upserts, concurrency, crashes, failures."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from cockpit.store import (
    RunLogReader,
    RunLogWarning,
    RunLogWriter,
    read_meta,
    read_output,
    read_scalars,
)

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def assert_same_value(got, want, where=""):
    """Exact equality with NaN == NaN, None is None, arrays by dtype, shape and value."""
    if want is None:
        assert got is None, where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            assert_same_value(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        assert isinstance(got, float), where
        assert (math.isnan(got) and math.isnan(want)) or got == want, (where, got, want)


def assert_same_output(got, want):
    assert sorted(got) == sorted(want)
    for step in want:
        assert sorted(got[step]) == sorted(want[step]), step
        for name in want[step]:
            assert_same_value(got[step][name], want[step][name], f"{step}/{name}")


def make_step(rng: np.random.Generator, step: int) -> dict:
    """A step with every value type of the data contract, from real random numbers."""
    grads = rng.standard_normal(1000)
    params = rng.standard_normal(1000).astype(np.float32)
    counts1d, edges1d = np.histogram(grads, bins=100)
    counts2d, eg, ep = np.histogram2d(grads, params, bins=(40, 50))
    return {
        "Loss": float(rng.random()),
        "GradNorm": float(np.linalg.norm(grads)),
        "GradNorm/conv1.weight": float(rng.standard_normal()),
        "NormTest": math.nan,
        "HessMaxEV": math.inf,
        "TICTrace": -math.inf,
        "CABS": None,
        "GradHist1d": {"counts": counts1d.astype(np.int64), "edges": edges1d},
        "GradHist1d/fc.bias": {"counts": counts1d[:10].astype(np.int64), "edges": edges1d[:11]},
        "GradHist2d": {"counts": counts2d.astype(np.int64), "edges_grad": eg, "edges_param": ep},
        "Parameters/fc.weight": {"values": params.reshape(10, 10, 10)},
        "Mixed": {
            "value": float(step),
            "nan": math.nan,
            "missing": None,
            "zero_d": np.array(2.5),
            "empty": np.zeros((0, 3), dtype=np.float32),
            "flags": grads[:7] > 0,
            "with_nan": np.array([1.0, np.nan, np.inf, -np.inf]),
        },
    }


def test_round_trip_of_every_value_type(tmp_path):
    rng = np.random.default_rng(0)
    written = {step: make_step(rng, step) for step in range(4)}
    with RunLogWriter(tmp_path, meta={"optimizer": "SGD", "lr": 0.1}) as writer:
        for step, values in written.items():
            writer.write_step(step, values)
        writer.write_step(7, {})  # a tracked step without values
    written[7] = {}
    with RunLogReader(tmp_path) as reader:
        assert_same_output(reader.output(), written)
        assert reader.steps() == [0, 1, 2, 3, 7]
        assert reader.last_step() == 7
        assert reader.names() == sorted(written[0])
        for step in range(4):
            np.testing.assert_array_equal(
                reader.array("GradHist2d", "counts")[step], written[step]["GradHist2d"]["counts"]
            )
        assert reader.array("Mixed", "value") == {s: np.asarray(float(s)) for s in range(4)}
        assert set(reader.output(since=2)) == {3, 7}
    assert read_meta(tmp_path) == {"optimizer": "SGD", "lr": 0.1}
    assert_same_output(read_output(tmp_path), written)
    assert_same_output(read_output(tmp_path / "cockpit.sqlite"), written)


def test_torch_tensors_numpy_scalars_and_bare_arrays_are_accepted(tmp_path):
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    with RunLogWriter(tmp_path) as writer:
        writer.write_step(
            0,
            {
                "Loss": torch.tensor(0.25),
                "Count": np.int64(3),
                "Half": np.float32(0.5),
                "Hist": {"counts": torch.tensor([1, 2]), "edges": [0.0, 0.5, 1.0]},
                "Raw": t,
            },
        )
    out = read_output(tmp_path)[0]
    assert out["Loss"] == 0.25 and out["Count"] == 3.0 and out["Half"] == 0.5
    np.testing.assert_array_equal(out["Hist"]["counts"], np.array([1, 2]))
    np.testing.assert_array_equal(out["Hist"]["edges"], np.array([0.0, 0.5, 1.0]))
    np.testing.assert_array_equal(out["Raw"], t.numpy())


def test_nan_inf_none_scalars_frame_kinds_and_notes(tmp_path):
    values = {
        0: {"A": 1.0, "B": math.nan, "C": None},
        1: {"A": math.inf, "B": -math.inf, "C": 3.0},
        2: {"A": -2.0},
    }
    with RunLogWriter(tmp_path) as writer:
        writer.write_step(0, values[0], notes={"C": "needs business config"})
        writer.write_step(1, values[1])
        writer.write_step(2, values[2], notes={"D": "skipped: batch size 1"})
    reader = RunLogReader(tmp_path)
    frame = reader.scalars()
    assert list(frame.columns) == ["A", "B", "C", "D"]
    assert frame.index.name == "step" and list(frame.index) == [0, 1, 2]
    for step, vals in values.items():
        for name in "ABCD":
            x = vals.get(name)
            got = frame.loc[step, name]
            if x is None or math.isnan(x):
                assert math.isnan(got)
            else:
                assert got == x
    kinds = reader.scalar_kinds()
    assert kinds.loc[0, ["A", "B", "C"]].tolist() == ["value", "nan", "none"]
    assert pd.isna(kinds.loc[0, "D"])
    assert kinds.loc[1, ["A", "B", "C"]].tolist() == ["+inf", "-inf", "value"]
    assert kinds.loc[2, "D"] == "none"
    assert reader.notes() == {0: {"C": "needs business config"}, 2: {"D": "skipped: batch size 1"}}
    assert read_output(tmp_path)[2] == {"A": -2.0, "D": None}
    assert list(read_scalars(tmp_path, ["B"]).columns) == ["B"]
    reader.close()


def test_upsert_adds_late_names_and_replaces_values(tmp_path):
    with RunLogWriter(tmp_path) as writer:
        writer.write_step(0, {"Loss": 2.0, "Alpha": None}, notes={"Alpha": "needs step 1"})
        writer.write_step(1, {"Loss": 1.0, "Hist": {"counts": np.arange(3)}})
        writer.write_step(0, {"Alpha": -0.4})  # late value of an earlier step
        writer.write_step(1, {"Hist": 5.0})  # a dict value replaced by a float
        writer.write_step(1, {"Loss": 0.5})
    reader = RunLogReader(tmp_path)
    assert reader.output() == {0: {"Alpha": -0.4, "Loss": 2.0}, 1: {"Hist": 5.0, "Loss": 0.5}}
    assert reader.notes() == {}
    assert reader.array("Hist", "counts") == {}


def test_meta_merges_and_survives_non_json_values(tmp_path):
    with RunLogWriter(tmp_path, meta={"a": 1, "b": {"x": [1, 2]}}) as writer:
        writer.write_meta({"b": "replaced", "device": torch.device("cpu"), "n": np.int64(5)})
    assert read_meta(tmp_path) == {"a": 1, "b": "replaced", "device": "cpu", "n": 5}


def test_missing_run_log_names_the_expected_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cockpit\.sqlite"):
        RunLogReader(tmp_path / "nowhere")


def test_empty_file_reads_as_empty_run(tmp_path):
    (tmp_path / "cockpit.sqlite").touch()
    reader = RunLogReader(tmp_path)
    assert reader.steps() == [] and reader.output() == {} and reader.last_step() is None
    assert reader.scalars().empty


def test_write_failures_warn_and_never_raise(tmp_path):
    writer = RunLogWriter(tmp_path)
    writer.write_step(0, {"Loss": 1.0})
    # An unstorable value warns; the rest of the step is written.
    with pytest.warns(RunLogWarning, match="'Bad' of step 1 was not stored"):
        writer.write_step(1, {"Loss": 2.0, "Bad": {"x": np.array([object()])}})
    # I/O failure: the connection vanishes underneath the writer.
    writer._conn.close()
    with pytest.warns(RunLogWarning, match="step 2 was not written"):
        writer.write_step(2, {"Loss": 3.0})
    with warnings_as_list() as caught:  # same episode: counted, not repeated
        writer.write_step(3, {"Loss": 4.0})
        writer.write_meta({"x": 1})
    assert caught == [] and writer.failed_writes == 3
    writer.close()
    with pytest.warns(RunLogWarning, match="closed"):
        writer.write_step(4, {"Loss": 5.0})
    assert read_output(tmp_path) == {0: {"Loss": 1.0}, 1: {"Loss": 2.0}}


class warnings_as_list:  # noqa: N801 - used like warnings.catch_warnings
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self.caught = self._cm.__enter__()
        warnings.simplefilter("always")
        return self.caught

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)


def test_writes_from_several_threads(tmp_path):
    writer = RunLogWriter(tmp_path)

    def work(offset: int) -> None:
        for i in range(50):
            writer.write_step(offset + i, {"Loss": float(offset + i), "Alpha": float(i)})

    def late(name: str) -> None:  # different names into the same steps, concurrently
        for i in range(50):
            writer.write_step(5000 + i, {name: float(i)})

    threads = [threading.Thread(target=work, args=(k * 1000,)) for k in range(3)]
    threads += [threading.Thread(target=late, args=(name,)) for name in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    assert writer.failed_writes == 0
    out = read_output(tmp_path)
    assert len(out) == 200
    for step, vals in out.items():
        if step >= 5000:
            assert vals == {"A": float(step - 5000), "B": float(step - 5000)}
        else:
            assert vals == {"Alpha": float(step % 1000), "Loss": float(step)}


# Subprocesses load cockpit.store without running cockpit/__init__ (which imports torch):
# that keeps their start-up short on a busy machine.
PRELUDE = f"""
import sys, types
_pkg = types.ModuleType("cockpit")
_pkg.__path__ = [{str(Path(SRC) / "cockpit")!r}]
sys.modules["cockpit"] = _pkg
"""

READER_SCRIPT = (
    PRELUDE
    + """
import sys, time
from cockpit.store import RunLogReader
logdir, n = sys.argv[1], int(sys.argv[2])
reader = RunLogReader(logdir)
seen, partial, t0 = {len(reader.output())}, 0, time.time()
print("ready", flush=True)
while time.time() - t0 < 30:
    out = reader.output()
    for step, vals in out.items():
        ok = (set(vals) == {"Loss", "Hist"} and vals["Loss"] == step / 2
              and vals["Hist"]["counts"].sum() == 100 + step)
        partial += not ok
    seen.add(len(out))
    if len(out) == n:
        break
print(len(seen), partial, len(out))
"""
)


STEP_VALUES_SRC = """
def _step_values(step):
    counts = np.full(100, 1, dtype=np.int64)
    counts[0] += step
    return {"Loss": step / 2, "Hist": {"counts": counts, "edges": np.linspace(-1, 1, 101)}}
"""
_namespace: dict = {"np": np}
exec(STEP_VALUES_SRC, _namespace)  # the same values here and in the writer subprocess
_step_values = _namespace["_step_values"]


def test_reader_in_another_process_while_writing(tmp_path):
    n = 200
    writer = RunLogWriter(tmp_path)
    writer.write_step(0, _step_values(0))
    proc = subprocess.Popen(
        [sys.executable, "-c", READER_SCRIPT, str(tmp_path), str(n)],
        stdout=subprocess.PIPE,
        env=_env(),
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    for step in range(1, n):
        writer.write_step(step, _step_values(step))
        time.sleep(0.002)
    writer.close()
    out, _ = proc.communicate(timeout=60)
    n_snapshots, n_partial, n_final = map(int, out.split())
    assert n_partial == 0 and n_final == n
    assert n_snapshots > 2  # the reader really saw the log grow


WRITER_SCRIPT = (
    PRELUDE
    + """
import sys, time
import numpy as np
from cockpit.store import RunLogWriter
"""
    + STEP_VALUES_SRC
    + """
writer = RunLogWriter(sys.argv[1], meta={"pid": 1})
step = 0
while True:
    writer.write_step(step, _step_values(step))
    print(step, flush=True)
    step += 1
    time.sleep(float(sys.argv[2]))
"""
)


def _start_writer(logdir: Path, pause: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER_SCRIPT, str(logdir), str(pause)],
        stdout=subprocess.PIPE,
        env=_env(),
        text=True,
    )


def _check_complete(out: dict, steps) -> None:
    for step in steps:
        assert_same_output({step: out[step]}, {step: _step_values(step)})


def test_live_reader_here_while_another_process_writes(tmp_path):
    proc = _start_writer(tmp_path, 0.005)
    try:
        assert proc.stdout.readline()  # the first step is committed
        reader = RunLogReader(tmp_path)
        sizes = []
        for _ in range(20):
            out = reader.output()
            _check_complete(out, out)
            sizes.append(len(out))
            time.sleep(0.02)
        assert sizes[-1] > sizes[0] >= 1
    finally:
        proc.kill()
        proc.wait()


def test_kill_9_keeps_every_committed_step(tmp_path):
    proc = _start_writer(tmp_path, 0.0)
    committed = []
    try:
        while len(committed) < 20:
            line = proc.stdout.readline()
            assert line, "writer process died"
            committed.append(int(line))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    committed += [int(s) for s in proc.stdout.read().split()]
    assert proc.returncode == -signal.SIGKILL
    reader = RunLogReader(tmp_path)
    out = reader.output()
    assert set(committed) <= set(out)
    _check_complete(out, out)  # also a step committed but not yet printed is complete
    assert reader.meta() == {"pid": 1}
