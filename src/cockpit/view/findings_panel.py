"""The diagnosis panel: what :func:`cockpit.diagnose.diagnose` finds in the recorded values,
in plain words, with what to try. The view never judges a run itself; it only shows the
findings of ``diagnose()``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec

from cockpit.view import _style as S
from cockpit.view._data import Output

__all__ = ["SEVERITY_COLORS", "draw_findings", "run_diagnosis"]

SEVERITY_COLORS = {"error": S.RED, "warning": S.ORANGE, "info": S.GRAY}
SEVERITY_MARKS = {"error": "✖", "warning": "▲", "info": "·"}


def run_diagnosis(source: Any, notes: Any = None) -> tuple[list[Any], str | None]:
    """``(findings, None)`` from :func:`cockpit.diagnose.diagnose` (``notes``: why values
    of an output dict are None), or ``([], message)`` if the diagnosis is unavailable or
    failed: a view must draw even then."""
    try:
        from cockpit.diagnose import diagnose

        return list(diagnose(source, notes=notes)), None
    except Exception as error:  # the figure stands without the diagnosis
        return [], f"diagnosis unavailable: {type(error).__name__}: {error}"


def finding_lines(findings: Sequence[Any], width: int) -> list[tuple[str, str, bool]]:
    """``(text, color, bold)`` lines of the panel: problems first with their advice, then
    informational findings, the list of skipped checks last and short."""
    problems = sorted((f for f in findings if f.severity in ("error", "warning")),
                      key=lambda f: f.severity != "error")  # stable: errors first
    infos = [f for f in findings if f.severity == "info"]
    skipped = [f for f in infos if f.code == "checks_skipped"]
    lines: list[tuple[str, str, bool]] = []
    if not problems and skipped:  # no pass: some checks could not run
        lines += [(part, S.ORANGE, k == 0) for k, part in enumerate(textwrap.wrap(
            f"○ {skipped[0].message}", width, subsequent_indent="   "))]
        for e in skipped[0].evidence:
            lines += [(part, S.GRAY, False) for part in textwrap.wrap(
                f"{e.instrument}: {e.summary}", width, initial_indent="   ",
                subsequent_indent="     ")]
        infos = [f for f in infos if f.code != "checks_skipped"]
    elif not problems:
        lines.append(("✓ no problem named by diagnose() in the recorded instruments", S.GREEN,
                      True))
    for f in problems:
        where = f" ({', '.join(f.parameters[:3])}{' …' if len(f.parameters) > 3 else ''})" \
            if f.parameters else ""
        head = f"{SEVERITY_MARKS[f.severity]} {f.code}{where}: {f.message}"
        for k, part in enumerate(textwrap.wrap(head, width, subsequent_indent="   ")):
            lines.append((part, SEVERITY_COLORS[f.severity], k == 0))
        if f.advice:
            lines += [(part, S.GRAY, False) for part in
                      textwrap.wrap("try: " + f.advice, width, initial_indent="   ",
                                    subsequent_indent="   ")]
    for f in infos:
        lines += [(part, S.GRAY, False) for part in
                  textwrap.wrap(f"{SEVERITY_MARKS['info']} {f.message}", width,
                                subsequent_indent="   ")]
    return lines


def draw_findings(fig: Figure, spec: SubplotSpec, output: Output, *,
                  findings: Sequence[Any] | None = None, diagnosis_error: str | None = None,
                  **_: Any) -> Axes:
    """The findings as text, most severe first; lines that do not fit end in a count of
    the findings left out and the command that prints them all."""
    ax = fig.add_subplot(spec)
    ax.set_title(S.PANEL_TITLES["Findings"], fontsize=S.FONT_SIZES["title"], loc="left")
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_edgecolor("#cccccc")
    bbox = ax.get_position()
    width_in = bbox.width * fig.get_figwidth()
    height_in = bbox.height * fig.get_figheight()
    font = S.FONT_SIZES["small"] + 0.5
    chars = max(30, int(width_in * 72 / (font * 0.56)))
    rows = max(3, int(height_in * 72 / (font * 1.45)))
    if diagnosis_error:
        lines = [(part, S.GRAY, False) for part in textwrap.wrap(diagnosis_error, chars)]
    else:
        lines = finding_lines(findings or [], chars)
    if len(lines) > rows:
        left = len(lines) - rows + 1
        lines = [*lines[: rows - 1],
                 (f"… {left} more lines: run `cockpit diagnose RUN_DIR`", S.GRAY, False)]
    for k, (text, color, bold) in enumerate(lines):
        ax.text(0.015, 0.97 - k / rows * 0.95, text, transform=ax.transAxes, ha="left",
                va="top", color=color, fontsize=font, fontweight="bold" if bold else "normal",
                clip_on=True)
    return ax
