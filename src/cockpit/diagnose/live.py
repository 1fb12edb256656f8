"""``Cockpit(..., diagnose=True)``: the diagnosis while training runs, warning once per new
finding."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cockpit.diagnose.diagnoser import Diagnoser


class LiveDiagnosis:
    """Feeds recorded steps to a :class:`~cockpit.diagnose.Diagnoser` and warns once per
    new finding; sinks with ``write_findings`` log them.

    The checks re-run after every step early on, then as the run grows by 10 %.

    Args:
        parameters: the model's parameter shapes by name (the run's metadata).
        warn: ``warn(message, key=...)``, once per key.
        guard: ``guard(fn, *args)`` runs a sink's method, a failure warned about.
        sinks: the sinks.
        strict: a failure of the diagnosis is raised, not warned about (tests).
    """

    def __init__(self, parameters: dict[str, list[int]], warn: Callable[..., None],
                 guard: Callable[..., None], sinks: Sequence[Any], strict: bool = False):
        self.diagnoser = Diagnoser(meta={"parameters": parameters})
        self.warn, self.guard, self.sinks, self.strict = warn, guard, sinks, strict
        self.pending: dict[int, dict[str, Any]] = {}  # recorded since the last feed
        self.evaluated_at = 0  # number of steps at the last evaluation

    def add(self, step: int, values: dict[str, Any]) -> None:
        """Values recorded for ``step`` (also late values of an earlier step: Alpha of step
        t comes at t + 1)."""
        self.pending.setdefault(step, {}).update(values)

    def feed(self, final: bool = False) -> None:
        """Evaluate the checks if the run grew enough (``final``: at its end, always)."""
        try:
            self._feed(final)
        except Exception as error:  # a diagnosis never stops training
            if self.strict:
                raise
            self.warn(f"Cockpit diagnosis failed: {error}", key="diagnosis-failed")

    def _feed(self, final: bool) -> None:
        new, self.pending = self.pending, {}
        if new:
            self.diagnoser.record.add(new)
        n = len(self.diagnoser.record.steps)
        if n == 0:
            return
        if not final and n - self.evaluated_at < max(1, self.evaluated_at // 10):
            return
        self.evaluated_at = n
        findings = self.diagnoser.evaluate()
        if not findings:
            return
        step = self.diagnoser.record.last_step
        for finding in findings:
            self.warn(f"Cockpit diagnosis at step {step}: {finding}",
                      key=f"diagnosis:{finding.code}:{finding.parameters}")
        for sink in self.sinks:
            write = getattr(sink, "write_findings", None)
            if write is not None:
                self.guard(write, step, findings)
