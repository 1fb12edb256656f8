"""``benchmarks/capture_audit.py``: what stands between a tracked step's ops and a CUDA graph
(the same ops every step, no host number that changes, inputs by where they live)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from cockpit.engine.histograms import device as histogram_device
from cockpit.step import tracked_step

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from capture_audit import Op, StepOps, audit, compare, copy_in_seconds
from gpu_overhead import Clock
from replay_bound import OUTSIDE_BACKWARD


def _op(name: str, constants: list, inputs: list, phase: str = "step end") -> Op:
    return Op(name, phase, "quantities/x.py:1", constants, inputs, host_read=False)


def test_compare_finds_changed_numbers_other_memory_and_diverging_ops():
    first = StepOps([_op("mul", [0.1], [("parameter", 8), ("other", 16)]),
                     _op("sum", [[0]], [("gradient", 24)]),
                     _op("add", [1], [], phase="hooks")])
    second = StepOps([_op("mul", [0.2], [("parameter", 8), ("other", 32)]),
                      _op("sum", [[0]], [("gradient", 40)]),
                      _op("sub", [1], [], phase="hooks")])
    rows = compare(first, second)
    end = rows["step end"]
    assert end["same ops"] and end["ops"] == (2, 2)
    assert end["changed"] == [("quantities/x.py:1", "mul", [0.1], [0.2])]
    assert end["inputs"] == {"parameter": {"same memory": 1, "other memory": 0},
                             "other": {"same memory": 0, "other memory": 1},
                             "gradient": {"same memory": 0, "other memory": 1}}
    assert not rows["hooks"]["same ops"]
    assert rows["hooks"]["first difference"] == (0, "add", "sub", "quantities/x.py:1")
    # an int and a float of equal value are different arguments to an op
    assert compare(StepOps([_op("mul", [1], [])]),
                   StepOps([_op("mul", [1.0], [])]))["step end"]["changed"]


def test_3c3d_steps_outside_the_backward_pass_repeat_and_a_planted_rate_is_found(
        monkeypatch):
    """3C3D in economy with a decaying learning rate: outside the backward pass both steps
    issue the same ops with the same numbers, read the parameters in place and the
    gradients from wherever ``zero_grad`` left them. An op that takes the learning rate as
    a number (planted after θ_t's copy) is reported with Cockpit's line that led to it."""
    with histogram_device.forced():
        ((_, rows),) = audit("3c3d", "economy", 1)
    outside = {phase: row for phase, row in rows.items() if phase in OUTSIDE_BACKWARD}
    assert {"gradient check", "step end (before the optimizer)",
            "update's instruments (after it)"} <= set(outside)
    for row in outside.values():
        assert row["same ops"] and row["changed"] == [] and row["host reads"] == 0
    end = outside["step end (before the optimizer)"]["inputs"]
    assert end["parameter"]["same memory"] > 0 and end["parameter"]["other memory"] == 0
    assert outside["gradient check"]["inputs"]["gradient"]["other memory"] == 12
    # what a graph of the check would copy in first: the 12 gradients and the 12 means
    copy_in = outside["gradient check"]["copy in"]
    assert len(copy_in) == 24 and len({t.untyped_storage().data_ptr() for t in copy_in}) == 24
    assert copy_in_seconds(copy_in, Clock(torch.device("cpu")), repeats=3) > 0

    snapshot = tracked_step.TrackedStep._snapshot

    def planted(self, data, stats):
        copies = snapshot(self, data, stats)
        torch.mul(next(iter(copies.values())), self.run.learning_rate())
        return copies

    monkeypatch.setattr(tracked_step.TrackedStep, "_snapshot", planted)
    with histogram_device.forced():
        ((_, rows),) = audit("3c3d", "economy", 1)
    changed = rows["step end (before the optimizer)"]["changed"]
    assert len(changed) == 1
    site, name, before, after = changed[0]
    assert name == "mul" and site.startswith("step/tracked_step.py:")
    assert after[0] == before[0] * 0.99
