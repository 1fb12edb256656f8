"""A check: which instruments it reads, and the findings it draws from a :class:`RunRecord`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cockpit.diagnose.finding import Finding
from cockpit.diagnose.record import RunRecord


@dataclass(frozen=True)
class Rule:
    """One check of the vocabulary.

    Attributes:
        code: the finding code it can raise.
        requires: instruments of which at least one group must have been recorded; each
            inner tuple is one sufficient set (e.g. ``(("Alpha",), ("Loss",))``: Alpha, or
            the loss alone, enables the check).
        check: ``record -> findings``; reads the record only.
        min_steps: the tracked steps with values of a group's instruments the check needs;
            with fewer it is skipped (and says so) rather than judging from too little.
    """

    code: str
    requires: tuple[tuple[str, ...], ...]
    check: Callable[[RunRecord], list[Finding]]
    min_steps: int = 1

    def enabled(self, record: RunRecord) -> bool:
        return self.skip_reason(record) is None

    def skip_reason(self, record: RunRecord) -> str | None:
        """Why the check cannot run on ``record`` (None: it can): the instruments of every
        group that hold no value — not recorded, or None at every step with the recorded
        reason — or too few steps with values."""
        reasons = []
        for group in self.requires:
            empty = [n for n in group if record.value_steps(n) == 0]
            if empty:
                reasons.append(record.why_empty(empty))
                continue
            have = min(record.value_steps(n) for n in group)
            if have >= self.min_steps:
                return None
            reasons.append(f"{' + '.join(group)} at {have} tracked step{'s' * (have != 1)}, "
                           f"the check needs {self.min_steps}")
        return ", or ".join(dict.fromkeys(reasons))

    def missing(self) -> str:
        """The instruments that would enable the check, in words."""
        return " or ".join(" + ".join(group) for group in self.requires)
