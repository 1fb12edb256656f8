"""The recorder's bookkeeping: the memory window in step order, each step written whole."""

from __future__ import annotations

import types

from cockpit.quantities import GradNorm, Loss
from cockpit.schedules import every
from cockpit.step.hist_range import HistogramRange
from cockpit.step.recorder import Recorder
from cockpit.step.warn_once import WarnOnce


class _Sink:
    def __init__(self):
        self.writes: list[tuple[int, dict]] = []

    def write_step(self, step, values, notes):
        self.writes.append((step, dict(values)))

    def close(self):
        pass


def _recorder(quantities, sinks=(), memory_steps=None) -> Recorder:
    hist = HistogramRange(None, types.SimpleNamespace(hist_spec=None))
    return Recorder(list(quantities), WarnOnce(), hist, list(sinks), None, memory_steps,
                    resumed=False)


def test_a_step_recorded_late_is_dropped_first_from_the_memory_window():
    recorder = _recorder([Loss(every(1))], memory_steps=3)
    recorder.warn = lambda *args, **kwargs: None
    for step in (5, 6, 3, 7):  # 3 comes late (after 6)
        recorder.record(step, {"Loss": float(step)}, {})
    assert list(recorder.output) == [5, 6, 7]  # the oldest step went, not the first kept
    recorder.record(2, {"Loss": 2.0}, {})  # older than every kept step: in, then out
    assert list(recorder.output) == [5, 6, 7]
    recorder.record(8, {"Loss": 8.0}, {})
    assert list(recorder.output) == [6, 7, 8]
    assert {step: v["Loss"] for step, v in recorder.output.items()} == {6: 6.0, 7: 7.0,
                                                                         8: 8.0}


def test_a_step_goes_to_the_sinks_once_every_scheduled_instrument_has_its_value():
    sink = _Sink()
    quantities = [Loss(every(1)), GradNorm(every(2))]
    recorder = _recorder(quantities, sinks=[sink])
    recorder.record(0, {"Loss": 1.0}, {})
    assert sink.writes == []  # GradNorm is scheduled at step 0 too
    recorder.record(0, {"GradNorm": 2.0}, {})
    assert sink.writes == [(0, {"Loss": 1.0, "GradNorm": 2.0})]
    recorder.record(1, {"Loss": 3.0}, {})  # GradNorm is not scheduled at step 1
    assert sink.writes[1:] == [(1, {"Loss": 3.0})]
    recorder.record(2, {"Loss": 4.0}, {})
    recorder.record(2, {}, {"GradNorm": "failed: why"})  # a reason completes it too
    assert sink.writes[2:] == [(2, {"Loss": 4.0})]
