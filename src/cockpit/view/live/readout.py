"""What the live page reads out beside the image: where each panel of a drawn cockpit view
is, with the recorded values of its instruments (:func:`hover_data`), and the diagnosis of
the run log as plain data (:func:`findings_data`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from cockpit.diagnose.finding import CHECKS_SKIPPED
from cockpit.view import _style as S
from cockpit.view._data import is_tracked, normalize_output, per_param_names, scalar_series
from cockpit.view._hist import histogram_at
from cockpit.view._source import run_status
from cockpit.view.findings_panel import run_diagnosis

__all__ = ["findings_data", "hover_data", "panel_readouts", "readout_names"]


def panel_readouts() -> dict[str, tuple[str, ...]]:
    """Panel key → the recorded names read out when the pointer is over it (panels with a
    step axis), from the instruments' descriptors (``Panel.readout``)."""
    return {key: panel.readout for key, (panel, _) in S.panels().items() if panel.readout}


def readout_names(output: Mapping, readout: tuple[str, ...]) -> list[str]:
    """The recorded names of a panel's read-out: ``"<name>/*"`` stands for every
    ``"<name>/<parameter>"`` recorded."""
    names: list[str] = []
    for name in readout:
        if name.endswith("/*"):
            prefix = name[:-2]
            names += [f"{prefix}/{p}" for p in per_param_names(output, prefix)]
        elif is_tracked(output, name):
            names.append(name)
    return names


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)  # "nan", "inf": JSON has no such numbers


def hover_data(fig: Figure, output: Mapping) -> dict[str, Any]:
    """Where the panels of a drawn cockpit view are and what to read out under the pointer.

    ``panels``: ``{key, title, box: [left, top, right, bottom]}`` as fractions of the image
    (origin top left), with ``xlim`` and ``instruments`` for panels over steps, or
    ``hist: {step, edges, counts}`` for the gradient-element histogram. ``series``: the
    recorded values of those instruments (steps with a number; non-finite as strings).
    """
    out = normalize_output(output)
    keys = {title: key for key, title in S.PANEL_TITLES.items()}
    readouts = panel_readouts()
    panels, names = [], set()
    for ax in fig.axes:
        key = keys.get(ax.get_title(loc="left"))
        if key is None:
            continue
        pos = ax.get_position()
        entry: dict[str, Any] = {"key": key, "title": S.PANEL_TITLES[key],
                                 "box": [pos.x0, 1 - pos.y1, pos.x1, 1 - pos.y0]}
        if key in readouts:
            shown = readout_names(out, readouts[key])
            entry.update(xlim=list(ax.get_xlim()), instruments=shown)
            names.update(shown)
        elif key == "GradHist1d":
            hist = histogram_at(out, "GradHist1d")
            if hist is not None and hist.total > 0:
                entry.update(xlim=list(ax.get_xlim()), hist={
                    "step": hist.step, "edges": hist.edges.tolist(),
                    "counts": [int(c) for c in hist.counts]})
        panels.append(entry)
    series = {}
    for name in sorted(names):
        steps, vals = scalar_series(out, name)
        series[name] = {"steps": steps.tolist(), "values": [_json_float(v) for v in vals]}
    return {"panels": panels, "series": series}


def findings_data(logdir: str | Path) -> dict[str, Any]:
    """``{"findings": [...], "error", "all_clear"}``: the diagnosis of the run log as plain
    data. A run log without steps (or none yet) is diagnosed as the empty run it is: every
    check skipped. ``all_clear`` is whether the page may say that diagnose() named no
    problem: the diagnosis ran, found no problem and skipped no check."""
    source: Any = logdir if run_status(logdir)["num_steps"] else {}
    findings, error = run_diagnosis(source)
    return {"findings": [{"code": f.code, "severity": f.severity, "message": f.message,
                          "advice": f.advice, "parameters": list(f.parameters),
                          "evidence": [str(e) for e in f.evidence]} for f in findings],
            "error": error, "all_clear": error is None and _all_clear(findings)}


def _all_clear(findings: list[Any]) -> bool:
    """No finding names a problem and no check was skipped (informational findings may
    stand beside an all-clear)."""
    return not any(f.is_problem or f.code == CHECKS_SKIPPED for f in findings)
