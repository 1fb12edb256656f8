"""``diagnose(source)`` and the incremental :class:`Diagnoser`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from cockpit.diagnose.finding import CHECKS_SKIPPED, CODES, Evidence, Finding
from cockpit.diagnose.record import RunRecord
from cockpit.diagnose.rule import Rule


@runtime_checkable
class RecordedRun(Protocol):
    """What :func:`diagnose` reads of a running :class:`~cockpit.Cockpit`."""

    def get_output(self) -> Mapping[int, Mapping[str, Any]]: ...

    def get_notes(self) -> Mapping[int, Mapping[str, str]]: ...

    def parameter_shapes(self) -> dict[str, list[int]]: ...


def all_rules() -> list[Rule]:
    """The checks, one per code of the vocabulary (order of :data:`CODES`)."""
    from cockpit.diagnose.rules import RULES

    return sorted(RULES, key=lambda r: CODES.index(r.code))


class Diagnoser:
    """Incremental diagnosis: feed it new steps while training runs.

    ``update(output)`` appends the steps of ``output`` (``{step: {name: value}}``; steps
    already seen may come again with late values) and re-evaluates every check on the
    record so far. The checks work on per-name float series (histograms are reduced to two
    numbers on arrival), so one evaluation costs a few numpy passes over the steps.

    ``findings`` is the current list; :meth:`update` returns the findings that are new
    (a code and set of parameters not reported before).
    """

    def __init__(self, rules: list[Rule] | None = None, *, since_step: int | None = None,
                 meta: Mapping[str, Any] | None = None) -> None:
        self.rules = all_rules() if rules is None else list(rules)
        self.record = RunRecord()
        self.record.meta = dict(meta or {})
        self.since_step = since_step
        self.findings: list[Finding] = []
        self.skipped: dict[str, str] = {}  # code → why its check could not run
        self._reported: set[tuple[str, tuple[str, ...]]] = set()

    def update(self, output: Mapping[int, Mapping[str, Any]],
               notes: Mapping[int, Mapping[str, str]] | None = None) -> list[Finding]:
        """Add recorded steps (and the reasons of their None values) and re-evaluate;
        returns the findings not reported before."""
        if self.since_step is not None:
            output = {s: v for s, v in output.items() if s > self.since_step}
        self.record.add(output)
        self.record.add_notes(notes or {})
        return self.evaluate()

    def evaluate(self) -> list[Finding]:
        """Run every enabled check on the record; returns the new findings."""
        findings: list[Finding] = []
        self.skipped = {}
        no_steps = self._no_steps_reason()
        for rule in self.rules:
            reason = no_steps or rule.skip_reason(self.record)
            if reason is not None:
                self.skipped[rule.code] = reason
                continue
            findings.extend(rule.check(self.record))
        if self.skipped:
            findings.append(_skipped_finding(self.skipped))
        self.findings = findings
        new = []
        for finding in findings:
            key = (finding.code, finding.parameters)
            if finding.code != CHECKS_SKIPPED and key not in self._reported:
                self._reported.add(key)
                new.append(finding)
        return new

    def _no_steps_reason(self) -> str | None:
        """Why no check can run on a record without steps (a run that has not written
        one yet, or ``since_step`` past its last step); None when there are steps.
        Without steps every check is skipped, so no diagnosis reads as an all-clear."""
        if self.record.steps:
            return None
        if self.since_step is not None:
            return f"no tracked step recorded after step {self.since_step}"
        return "no tracked step recorded"


def _skipped_finding(skipped: dict[str, str]) -> Finding:
    """The checks that could not run, each with why (instruments without values and the
    reason recorded for them, or too few steps) and what it needs."""
    rules = {rule.code: rule for rule in all_rules()}
    total = len(rules)
    everything = len(skipped) >= total
    return Finding(
        code=CHECKS_SKIPPED,
        severity="info",
        message=(f"Nothing could be checked: all {total} checks were skipped"
                 if everything else
                 f"{len(skipped)} of {total} checks could not run: {', '.join(skipped)}"),
        evidence=tuple(Evidence(instrument=code, summary=reason)
                       for code, reason in skipped.items()),
        advice="Record the instruments each skipped check reads, with values (the notes say "
               "why a value is None), over enough tracked steps: "
               + "; ".join(f"{code} reads {rules[code].missing()}" +
                           (f" at ≥ {rules[code].min_steps} steps"
                            if rules[code].min_steps > 1 else "")
                           for code in skipped if code in rules) + ".",
    )


def diagnose(source: Any, *, since_step: int | None = None,
             notes: Mapping[int, Mapping[str, str]] | None = None) -> list[Finding]:
    """Name likely training bugs from the recorded instruments of a run.

    Args:
        source: a :class:`~cockpit.Cockpit`, a run-log directory (``str`` or ``Path``), or
            ``Cockpit.get_output()``'s dict ``{step: {name: value}}``.
        since_step: read only steps after this one (None: all).
        notes: ``{step: {name: reason}}`` for an output dict (a Cockpit and a run directory
            bring their own): why values are None, quoted when a check is skipped.

    Returns:
        The findings, most severe first. A check whose instruments hold no value (not
        recorded, or None at every step: the evidence quotes the recorded reason) or hold
        values at fewer steps than it needs is skipped; the skipped checks are listed in one
        ``info`` finding with code ``"checks_skipped"``, one evidence item per check saying
        why, and its advice names what each check reads.
    """
    output, meta, own_notes = _read_source(source)
    diagnoser = Diagnoser(since_step=since_step, meta=meta)
    diagnoser.update(output, notes if notes is not None else own_notes)
    return sort_findings(diagnoser.findings)


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Errors first, then warnings, then info; within a severity, the vocabulary's order."""
    from cockpit.diagnose.finding import SEVERITY_RANK

    def key(f: Finding) -> tuple[int, int]:
        order = CODES.index(f.code) if f.code in CODES else len(CODES)
        return (-SEVERITY_RANK[f.severity], order)

    return sorted(findings, key=key)


def _read_source(source: Any) -> tuple[Mapping[int, Mapping[str, Any]], dict[str, Any],
                                       Mapping[int, Mapping[str, str]]]:
    """(output, metadata, notes) of a Cockpit, a run directory or an output dict."""
    if isinstance(source, RecordedRun):
        return source.get_output(), {"parameters": source.parameter_shapes()}, source.get_notes()
    if isinstance(source, str | Path):
        from cockpit.store import RunLogReader

        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"no such run directory: {str(source)!r}")
        with RunLogReader(path) as reader:
            return reader.output(), reader.meta(), reader.notes()
    if isinstance(source, Mapping):
        bad = [k for k in list(source)[:3] if not isinstance(k, int)]
        if bad:
            raise TypeError(
                "diagnose() expects get_output()'s dict {step: {name: value}} with integer "
                f"steps, got key {bad[0]!r}"
            )
        return source, {}, {}
    raise TypeError(
        "diagnose() reads a Cockpit, a run-log directory or get_output()'s dict, got "
        f"{type(source).__name__}"
    )
