"""``cockpit diagnose RUN``: say what is wrong with a run, in plain words."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from cockpit.diagnose.finding import CHECKS_SKIPPED, Finding


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cockpit diagnose",
        description="Name likely training bugs in a Cockpit run log, with the evidence they "
                    "rest on and what to try. Exit status: 0 when nothing is wrong, 1 when "
                    "a warning or error is found, 2 for a bad argument or a missing run.")
    p.add_argument("run", help="run directory (holding cockpit.sqlite) or the .sqlite file")
    p.add_argument("--since", type=int, default=None, metavar="STEP",
                   help="read only the steps after STEP")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    return p


def format_findings(findings: list[Finding], run: str = "") -> str:
    """The findings as plain text, problems first."""
    problems = [f for f in findings if f.is_problem]
    skipped = [f for f in findings if f.code == CHECKS_SKIPPED]
    head = f"Cockpit diagnosis of {run}" if run else "Cockpit diagnosis"
    lines = [head, "=" * len(head)]
    if not problems and skipped:
        everything = skipped[0].message.startswith("Nothing")
        lines.append(skipped[0].message + "." if everything else
                     "The checks that ran named no problem, but "
                     f"{skipped[0].message[0].lower()}{skipped[0].message[1:]} (below).")
    elif not problems:
        lines.append("No problem found in the recorded instruments.")
    for finding in problems:
        lines += ["", str(finding)]
    for finding in findings:
        if not finding.is_problem and finding.code != CHECKS_SKIPPED:
            lines += ["", str(finding)]
    for finding in skipped:
        lines += ["", f"Not checked — {finding.message}:" if problems else "Not checked:"]
        lines += [f"  - {e.instrument}: {e.summary}" for e in finding.evidence]
        lines += [f"  {finding.advice}"]
    return "\n".join(lines)


def main_diagnose(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from cockpit.diagnose.diagnoser import diagnose

    path = Path(args.run)
    if not path.exists():
        print(f"cockpit diagnose: no such run directory: {args.run}", file=sys.stderr)
        return 2
    try:
        findings = diagnose(path, since_step=args.since)
    except FileNotFoundError as error:
        print(f"cockpit diagnose: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        print(format_findings(findings, str(path)))
    return 1 if any(f.is_problem for f in findings) else 0
