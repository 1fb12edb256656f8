"""``benchmarks/replay_bound.py``: the ops Cockpit issues in a tracked step, recorded and
replayed without its Python."""

from __future__ import annotations

import sys
from pathlib import Path

from cockpit.engine.histograms import device as histogram_device

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import replay_bound
from host_overhead import _registered
from op_count import CountOps, make_step


def test_the_recorder_leaves_the_users_ops_to_the_user_and_the_tape_replays():
    """The ops the recorder does not count as Cockpit's are exactly an untracked step's
    (the model, the loss, the optimizer); Cockpit's make no host read of the device on the
    accelerators' path, and its tape replays (twice, and without the ops outside the
    backward pass) on the recorded tensors."""
    with histogram_device.forced():
        plain, _ = make_step(_registered("3c3d"), None, 2)
        tracked, watcher = make_step(_registered("3c3d"), "economy", 2)
        for i in range(4):
            plain(i)
            tracked(i)
        counter = CountOps()
        with counter:
            plain(4)
        recorder = replay_bound.Recorder()
        with replay_bound.innermost_phases(recorder.phases), recorder:
            tracked(4)
        tape = recorder.tape
        plain_ops = sum(counter.ops.values())
        assert recorder.users == plain_ops > 0
        assert len(tape.ops) > plain_ops  # (economy: norms, dots, histograms, the fit)
        assert tape.host_reads() == 0
        tape.replay()
        tape.replay()
        # the first capture's estimate: the ops outside the backward pass left out, their
        # outputs read as the step made them
        outside = {i for i, label in enumerate(tape.phases)
                   if label in replay_bound.OUTSIDE_BACKWARD}
        assert 0 < len(outside) < len(tape.ops)
        assert "layers' hooks" in tape.phases
        tape.replay(frozenset(outside))
        assert tape.host_ops() == frozenset(range(len(tape.ops)))  # (on a CPU: all of them)
        tracked(5)  # (the training goes on)
        watcher.close()
    assert watcher.get_output()[5]["Loss"] is not None
