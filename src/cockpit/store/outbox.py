"""Whole steps for the sinks: a step's values are handed on in one write, when complete.

A tracked step's values become known at different times: most when its backward passes are
done, the update's (UpdateSize, Distance) after ``optimizer.step()``, Alpha's at the next
tracked step. Written as they come, a failed write (a full disk) in between leaves a step
with some of its instruments only — which the run log's readers would take for "not
scheduled". The outbox holds each step until every instrument scheduled there has its value
or its reason (``complete``), then writes it in one call, so the run log (one transaction
per call) has each step whole or not at all.

A step that stays incomplete while ``max_waiting`` newer steps wait behind it is written as
it is (values that come later are then added by a second write), so the outbox never
holds more than a few steps; :meth:`flush` writes everything (at ``close``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Write = Callable[[int, dict[str, Any], dict[str, str]], None]


class StepOutbox:
    """Collects ``(step, values, notes)`` and writes each step once, in step order."""

    def __init__(self, complete: Callable[[int, dict[str, Any], dict[str, str]], bool],
                 write: Write, max_waiting: int = 3):
        self.complete = complete
        self.write = write
        self.max_waiting = max_waiting
        self._waiting: dict[int, tuple[dict[str, Any], dict[str, str]]] = {}
        self._last_sent: int | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, step: int, values: dict[str, Any], notes: dict[str, str]) -> None:
        held = self._waiting.get(step)
        if held is None and self._last_sent is not None and step <= self._last_sent:
            self.write(step, dict(values), dict(notes))  # late values of a step written
            return
        if held is None:
            self._waiting[step] = (dict(values), dict(notes))
        else:
            held[0].update(values)
            held[1].update(notes)
        self._send_ready()

    def flush(self) -> None:
        """Write every waiting step as it is."""
        for step in sorted(self._waiting):
            self._send(step)

    def _send_ready(self) -> None:
        """Write the oldest steps while they are complete (or pushed out by newer ones)."""
        for step in sorted(self._waiting):
            values, notes = self._waiting[step]
            if not (self.complete(step, values, notes)
                    or len(self._waiting) > self.max_waiting):
                return
            self._send(step)

    def _send(self, step: int) -> None:
        values, notes = self._waiting.pop(step)
        self._last_sent = step if self._last_sent is None else max(self._last_sent, step)
        self.write(step, values, notes)
