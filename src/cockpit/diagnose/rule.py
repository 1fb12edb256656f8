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
    """

    code: str
    requires: tuple[tuple[str, ...], ...]
    check: Callable[[RunRecord], list[Finding]]

    def enabled(self, record: RunRecord) -> bool:
        return any(all(record.has(n) for n in group) for group in self.requires)

    def missing(self) -> str:
        """The instruments that would enable the check, in words."""
        return " or ".join(" + ".join(group) for group in self.requires)
