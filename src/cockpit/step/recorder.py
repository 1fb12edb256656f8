"""Where a step's values go: Cockpit's memory (the last ``memory_steps`` steps), the run
log and the sinks (each step whole, :mod:`cockpit.store.outbox`).

Values still on the device (:class:`~cockpit.engine.readout.Later`) are sent to the host
when recorded and received, with every record made after them, at the next read (one wait
for all): records keep their order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from cockpit.engine.readout import Failed, Later, Noted, Readout
from cockpit.engine.statistics import PER_SAMPLE_STATS
from cockpit.quantities.base import Quantity, Value
from cockpit.step.hist_range import HistogramRange
from cockpit.step.instrument_traits import pending_reason, scheduled
from cockpit.step.warn_once import WarnOnce
from cockpit.store.arena import ArrayArena
from cockpit.store.outbox import StepOutbox


class Recorder:
    """Records ``(step, values, notes)``: :meth:`record` is the one way in.

    Args:
        quantities: every instrument (a step is complete when each scheduled one has its
            value or its reason).
        sinks: objects with ``write_step``, ``close`` (a run log writer first, if any).
        log: the run log writer among ``sinks`` (older steps are read back from it).
        memory_steps: recorded steps kept in memory (None: all).
        resumed: the run log held steps already (they are read back from it).
    """

    def __init__(self, quantities: list[Quantity], warn: WarnOnce, hist_range: HistogramRange,
                 sinks: list[Any], log: Any, memory_steps: int | None, resumed: bool):
        self.quantities = quantities
        self.warn = warn
        self.hist_range = hist_range
        self.sinks = sinks
        self.log = log
        self.memory_steps = memory_steps
        self.output: dict[int, dict[str, Value]] = {}
        self.notes: dict[int, dict[str, str]] = {}
        # records whose numbers are still on their way from the device (see engine.readout)
        self._readout = Readout()
        self._unread: list[tuple[int, dict[str, Value], dict[str, str], list[int]]] = []
        # recorded arrays, packed (see cockpit.store.arena); small blocks under a bounded
        # window, so that the blocks of dropped steps are freed soon
        self._arena = ArrayArena() if memory_steps is None else ArrayArena(256 << 10)
        self.dropped = resumed  # steps dropped from memory (read back from the run log)
        # each step goes to the sinks whole, once all its instruments have a value or reason
        self._outbox = StepOutbox(self._step_complete, self._write_sinks)
        # the instruments scheduled at the last few steps (asked once per step, not at each
        # record of it)
        self._expected: dict[int, tuple[str, ...]] = {}
        # recent steps whose individual gradients are an approximation → its label
        self._approximated: dict[int, str] = {}
        # steps whose pipeline failed → the reason, for the instruments that get no value
        self._failed: dict[int, str] = {}
        # sees every record (the live diagnosis)
        self.on_record: Callable[[int, dict[str, Value]], None] | None = None

    # ------------------------------------------------------------------ in
    def record(self, step: int, values: dict[str, Value], notes: dict[str, str],
               laters: Sequence[Later] = (), send: bool = True) -> None:
        """Record a step's values; those still on the device (``laters``) are sent to the
        host now and recorded, with every record after them, at the next read. With
        ``send=False`` the caller sends them (:meth:`send`) with its next records, before
        any of their tensors changes: one copy for all."""
        if not laters and not self._unread:
            self._record_now(step, values, notes)
            return
        indices = [self._readout.later(later) for later in laters]
        if send:
            self._readout.send()
        self._unread.append((step, dict(values), dict(notes), indices))

    def send(self) -> None:
        """Start the copy of what the records made with ``send=False`` hold on the device."""
        self._readout.send()

    def approximated(self, step: int, label: str) -> None:
        """The individual gradients of ``step`` are an approximation: its per-sample values
        say so (``label``) in their notes."""
        self._approximated[step] = label
        for old in list(self._approximated)[:-4]:  # Alpha's value comes a step later
            del self._approximated[old]

    def failed(self, step: int, reason: str) -> None:
        """Cockpit's work for ``step`` failed: once the values it did form are read back,
        its instruments without a value are recorded as None with ``reason``."""
        self._failed[step] = reason

    def read_back(self) -> None:
        """Receive the values of the records made since the last read (one wait) and record
        them in order (then the failed steps' missing instruments)."""
        self._read_unread()
        for step, reason in list(self._failed.items()):
            del self._failed[step]
            self._record_missing(step, f"not computed: {reason}")

    def _read_unread(self) -> None:
        if not self._unread:
            return
        unread, self._unread = self._unread, []
        results = self._readout.receive()
        for step, values, notes, indices in unread:
            warned: list[tuple[str, str]] = []
            for index in indices:
                result = results[index]
                if isinstance(result, Failed):
                    if self.warn.strict:
                        raise result.error
                    name = result.name or "Cockpit"
                    notes[name] = f"failed: {result.error}"
                    values[name] = None
                    warned.append((f"{name} failed at step {step}: {result.error}", name))
                elif isinstance(result, Noted):
                    values.update(result.values)
                    notes.update(result.notes)
                    warned.extend(result.warnings)
                else:
                    values.update(result)
            self._record_now(step, values, notes)
            for message, key in warned:
                self.warn(message, key=key)

    def finish(self) -> None:
        """At close: everything read back, the instruments that never got their value at a
        recorded step recorded as None with the reason, every step written."""
        self.read_back()
        self._record_unfinished()
        self._outbox.flush()

    def close_sinks(self) -> None:
        for sink in self.sinks:
            self.warn.guard(sink.close)

    def _record_unfinished(self) -> None:
        """An instrument scheduled at a recorded step that never got its value (Alpha at the
        last step needs the next one) is recorded as None with the reason."""
        for step in sorted(self.output):
            self._record_missing(step, None)

    def _record_missing(self, step: int, reason: str | None) -> None:
        """The instruments scheduled at ``step`` without a value or a note, recorded as None
        with ``reason`` (None: what each was waiting for, and that the run ended)."""
        values = self.output.get(step, {})
        missing = {q.name: reason or f"not computed: {pending_reason(q.name)}; no such "
                   "step came before the run ended" for q in self.quantities
                   if scheduled(q, step) and not has_value(values, q.name)
                   and q.name not in self.notes.get(step, {})}
        if missing:
            self.record(step, dict.fromkeys(missing), missing)

    def _record_now(self, step: int, values: dict[str, Value], notes: dict[str, str]) -> None:
        self.hist_range.narrow(values.get("GradHist1d"))
        approximation = self._approximated.get(step)
        if approximation is not None:  # the per-sample instruments' values say so
            for quantity in self.quantities:
                if (quantity.needs & PER_SAMPLE_STATS
                        and values.get(quantity.name) is not None):
                    notes.setdefault(quantity.name, approximation)
        values = self._arena.keep_values(values)
        recorded = self.output.get(step)
        if recorded is None:
            last = next(reversed(self.output), step)
            recorded = self.output[step] = {}
            if step < last:
                self._keep_in_order()
        recorded.update(values)
        if notes:
            self.notes.setdefault(step, {}).update(notes)
        if self.memory_steps is not None and len(self.output) > self.memory_steps:
            self._drop_oldest()
        if self.sinks:
            self._outbox.add(step, values, notes)
        if self.on_record is not None:
            self.on_record(step, values)

    def _keep_in_order(self) -> None:
        """Sort the recorded steps in place (a step recorded after a later one: rare, e.g.
        a late value for a step already dropped from memory)."""
        steps = sorted(self.output.items())
        self.output.clear()
        self.output.update(steps)

    def _drop_oldest(self) -> None:
        """Forget the oldest recorded step (memory stays flat; the run log keeps it)."""
        oldest = next(iter(self.output))  # (kept in step order)
        del self.output[oldest]
        self.notes.pop(oldest, None)
        if not self.dropped and self.log is None:
            self.warn(
                f"Cockpit keeps the last {self.memory_steps} recorded steps in memory, so "
                "get_output() no longer returns the first steps of this run: pass "
                "Cockpit(..., logdir=DIR) to keep every step (get_output() then reads them "
                "back from the run log), or memory_steps=None to keep all in memory (memory "
                "grows with the run)", key="memory-steps")
        self.dropped = True

    def _step_complete(self, step: int, values: dict[str, Value], notes: dict[str, str]
                       ) -> bool:
        """Whether every instrument scheduled at ``step`` has its value or its reason."""
        expected = self._expected.get(step)
        if expected is None:
            expected = tuple(q.name for q in self.quantities if scheduled(q, step))
            if len(self._expected) >= 4:
                del self._expected[next(iter(self._expected))]
            self._expected[step] = expected
        return all(has_value(values, name) or name in notes for name in expected)

    def _write_sinks(self, step: int, values: dict[str, Value], notes: dict[str, str]) -> None:
        for sink in self.sinks:
            self.warn.guard(sink.write_step, step, values, dict(notes))

    # ------------------------------------------------------------------ out
    def all_output(self) -> dict[int, dict[str, Value]]:
        """Every recorded step's values, older steps read back from the run log."""
        output = self._read_log("output")
        for step, values in self.output.items():
            output.setdefault(step, {}).update(values)
        return {step: dict(values) for step, values in sorted(output.items())}

    def all_notes(self) -> dict[int, dict[str, str]]:
        """Every recorded step's reasons; an instrument without a value at a recorded step
        is "not scheduled at this step: <schedule>" or why it is still pending."""
        notes = self._read_log("notes")
        for step, recorded in self.notes.items():
            if recorded:
                notes.setdefault(step, {}).update(recorded)
        output = self._read_log("output") if self.dropped else {}
        for step, values in self.output.items():
            output.setdefault(step, {}).update(values)
        for step, values in output.items():
            for quantity in self.quantities:
                name = quantity.name
                if name in notes.get(step, {}) or has_value(values, name):
                    continue
                reason = (f"pending: {pending_reason(name)}"
                          if scheduled(quantity, step)
                          else f"not scheduled at this step: {quantity.schedule!r}")
                notes.setdefault(step, {})[name] = reason
        return dict(sorted(notes.items()))

    def _read_log(self, what: str) -> dict[int, dict]:
        """The run log's ``output`` or ``notes`` when steps were dropped from memory (and a
        run log holds them), else nothing."""
        if not self.dropped or self.log is None:
            return {}
        from cockpit.store import RunLogReader

        try:
            with RunLogReader(self.log.logdir) as reader:
                return reader.output() if what == "output" else reader.notes()
        except Exception as error:  # reading back never stops training
            if self.warn.strict:
                raise
            self.warn(f"Cockpit could not read the run log back: {error}", key="read-back")
            return {}


def has_value(values: dict[str, Value], name: str) -> bool:
    """Whether ``values`` hold instrument ``name`` (or only its per-parameter entries)."""
    if name in values:
        return True
    # (no generator: called per instrument and step, over every per-parameter key)
    return any(map(str.startswith, values, itertools.repeat(name + "/")))
