"""The recorded values a diagnosis reads, gathered step by step.

A :class:`RunRecord` is fed ``{step: {name: value}}`` (``Cockpit.get_output()``'s layout, also
what :meth:`cockpit.store.RunLogReader.output` returns), in pieces if training is still
running. Floats are kept as per-name series; a histogram ``{"counts", "edges"}`` is reduced
on arrival to the numbers the rules read (its total count and the share of elements that
fell outside its range, i.e. were clamped into an edge bin), and the last one is kept.
Nothing here touches a model: diagnosis reads recorded values only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

HIST_TOTAL = ".total"  # derived series: number of individual-gradient elements counted
HIST_EDGE = ".edge_share"  # derived series: share of them clamped into the two edge bins


class RunRecord:
    """Per-name float series of a run, appended to as steps arrive."""

    def __init__(self) -> None:
        self._series: dict[str, tuple[list[int], list[float]]] = {}
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.last_hist: dict[str, dict[str, np.ndarray]] = {}
        self.names: set[str] = set()
        self.notes: dict[str, str] = {}
        self.steps: list[int] = []
        self.last_step: int | None = None

    def add(self, output: Mapping[int, Mapping[str, Any]]) -> list[int]:
        """Append the steps of ``output`` after the last one seen; returns the new steps.
        A step already seen is updated in place (Alpha arrives one step late)."""
        new = []
        for step in sorted(output):
            values = output[step]
            if self.last_step is None or step > self.last_step:
                self.steps.append(step)
                self.last_step = step
                new.append(step)
            for name, value in values.items():
                self._add_value(step, name, value)
        if output:
            self._arrays.clear()
        return new

    def _add_value(self, step: int, name: str, value: Any) -> None:
        self.names.add(name)
        if isinstance(value, Mapping):
            counts = value.get("counts")
            if counts is not None and np.ndim(counts) == 1:
                counts = np.asarray(counts, dtype=np.float64)
                total = float(counts.sum())
                self._put(name + HIST_TOTAL, step, total)
                edge = (counts[0] + counts[-1]) / total if total > 0 else math.nan
                self._put(name + HIST_EDGE, step, float(edge))
                self.last_hist[name] = {"counts": counts,
                                        "edges": np.asarray(value.get("edges"))}
            return
        if value is None:
            return
        try:
            x = float(value)
        except (TypeError, ValueError):
            return
        self._put(name, step, x)

    def _put(self, name: str, step: int, x: float) -> None:
        steps, values = self._series.setdefault(name, ([], []))
        if steps and steps[-1] == step:
            values[-1] = x
            return
        if steps and steps[-1] > step:  # a late value for an earlier step
            i = int(np.searchsorted(steps, step))
            if i < len(steps) and steps[i] == step:
                values[i] = x
            else:
                steps.insert(i, step)
                values.insert(i, x)
            return
        steps.append(step)
        values.append(x)

    def add_notes(self, notes: Mapping[int, Mapping[str, str]]) -> None:
        """Why values were None (``{step: {name: reason}}``); the last reason per name."""
        for step in sorted(notes):
            for name, reason in notes[step].items():
                self.notes[name] = reason

    # ------------------------------------------------------------------ reading
    def has(self, name: str) -> bool:
        """Whether ``name`` was recorded (as a value, None included) at some step."""
        return name in self.names

    def value_steps(self, name: str) -> int:
        """Number of steps at which ``name`` holds a value (a float, NaN included, or a
        histogram), not None."""
        steps, _ = self._series.get(name, self._series.get(name + HIST_TOTAL, ([], [])))
        return len(steps)

    def why_empty(self, names: list[str]) -> str:
        """Why the instruments ``names`` hold no value, in words (the first sentence of the
        recorded reason; instruments with the same reason named together)."""
        groups: dict[str, list[str]] = {}
        for name in names:
            if name not in self.names:
                groups.setdefault("not recorded", []).append(name)
                continue
            reason = self.notes.get(name, "")
            reason = reason.removeprefix("not computed: ").split(". ")[0].rstrip(".")
            groups.setdefault("None at every step" + (f": {reason}" if reason else ""),
                              []).append(name)
        return "; ".join(f"{', '.join(group)} {why}" for why, group in groups.items())

    def series(self, name: str, since: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of a float series (None skipped; NaN/±inf kept), steps > since."""
        if name not in self._arrays:
            steps, values = self._series.get(name, ([], []))
            self._arrays[name] = (np.asarray(steps, dtype=np.int64),
                                  np.asarray(values, dtype=np.float64))
        steps, values = self._arrays[name]
        if since is not None:
            keep = steps > since
            return steps[keep], values[keep]
        return steps, values

    def parameters(self, instrument: str) -> list[str]:
        """Parameter names recorded as ``"<instrument>/<parameter>"``, in recorded order."""
        prefix = instrument + "/"
        found = [n[len(prefix):] for n in self._series if n.startswith(prefix)
                 and not n.endswith((HIST_TOTAL, HIST_EDGE))]
        return found
