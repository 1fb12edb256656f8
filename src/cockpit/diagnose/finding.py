"""What a diagnosis returns: :class:`Finding` (one named bug with its evidence).

Codes are an API: they may be added to, never renamed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "error"]

#: The fixed vocabulary of bugs, in the order reports list them.
CODES: tuple[str, ...] = (
    "non_finite",
    "lr_too_large",
    "lr_too_small",
    "unscaled_inputs",
    "vanishing_gradients",
    "exploding_gradients",
    "dead_units",
    "frozen_parameters",
    "missing_zero_grad",
    "noise_dominated",
    "update_ratio",
)
#: Informational code: checks that could not run, and the instruments that would enable them.
CHECKS_SKIPPED = "checks_skipped"

SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2}


@dataclass(frozen=True)
class Evidence:
    """One recorded instrument a finding rests on: its name, the steps and values read,
    and a short phrase saying what they show."""

    instrument: str
    steps: tuple[int, ...] = ()
    values: tuple[float, ...] = ()
    summary: str = ""

    def __str__(self) -> str:
        shown = ""
        if self.steps:
            pairs = list(zip(self.steps, self.values, strict=False))[:4]
            shown = ", ".join(f"step {s}: {v:.3g}" for s, v in pairs)
            if len(self.steps) > 4:
                shown += f", … ({len(self.steps)} steps)"
        text = f"{self.instrument}"
        if self.summary:
            text += f" — {self.summary}"
        return f"{text} ({shown})" if shown else text


@dataclass(frozen=True)
class Finding:
    """A likely training bug, named from recorded instruments.

    Attributes:
        code: one of :data:`CODES` (or :data:`CHECKS_SKIPPED` for the informational note
            that lists checks whose instruments were not recorded).
        severity: ``"info"``, ``"warning"`` or ``"error"``.
        message: one plain sentence saying what is wrong.
        evidence: the instruments, steps and values the finding rests on.
        advice: what to try.
        parameters: the affected parameter names when the finding is layer-wise, else ().
        step: the first step at which the finding holds (None when not tied to a step).
    """

    code: str
    severity: Severity
    message: str
    evidence: tuple[Evidence, ...] = field(default_factory=tuple)
    advice: str = ""
    parameters: tuple[str, ...] = field(default_factory=tuple)
    step: int | None = None

    def __post_init__(self) -> None:
        if self.severity not in SEVERITY_RANK:
            raise ValueError(
                f"severity must be 'info', 'warning' or 'error', got {self.severity!r}")
        if self.code not in CODES and self.code != CHECKS_SKIPPED:
            raise ValueError(f"unknown finding code {self.code!r}; known: {', '.join(CODES)}")

    @property
    def is_problem(self) -> bool:
        """A warning or an error (what ``cockpit diagnose`` exits with status 1 for)."""
        return SEVERITY_RANK[self.severity] >= SEVERITY_RANK["warning"]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data."""
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"[{self.severity}] {self.code}: {self.message}"]
        if self.parameters:
            lines.append("  parameters: " + ", ".join(self.parameters))
        lines += [f"  evidence: {e}" for e in self.evidence]
        if self.advice:
            lines.append(f"  try: {self.advice}")
        return "\n".join(lines)
