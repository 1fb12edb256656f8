"""The range of GradHist1d: fixed by the user, or chosen automatically at the first tracked
step and narrowed later (:mod:`cockpit.engine.histograms.exact`)."""

from __future__ import annotations

from typing import Any

import torch

from cockpit.engine.histograms.auto_range import (
    AutoRange,
    DecidedRange,
    choose_auto_spec,
    narrower_range,
    regroup,
)
from cockpit.engine.histograms.exact import BinSpec
from cockpit.engine.statistics import BackwardStatistics
from cockpit.quantities.base import Value


class HistogramRange:
    """The current bins of GradHist1d (``spec``), shared with the tracker that counts."""

    def __init__(self, spec: BinSpec | AutoRange, tracker: Any):
        self.spec = spec
        self.tracker = tracker

    def _set(self, spec: BinSpec | AutoRange) -> None:
        self.spec = self.tracker.hist_spec = spec

    def settle(self, stats: BackwardStatistics) -> None:
        """At the first tracked step with histograms of every layer, the automatic range is
        chosen from their magnitude counts (summed over micro-batches and processes, so
        every process chooses the same) and the step's counts regrouped into it; later it
        narrows when the elements have shrunk into a quarter (:meth:`narrow`)."""
        if not isinstance(self.spec, AutoRange) or not stats.hist1d:
            return
        if not stats.valid:
            stats.hist1d = {}
            return
        total = torch.stack([c.double().cpu() for c in stats.hist1d.values()]).sum(0)
        spec = choose_auto_spec(total.numpy(), self.spec.outside)
        stats.hist1d = {name: regroup(c, spec) for name, c in stats.hist1d.items()}
        self._set(spec)

    def state_dict(self) -> dict[str, Any]:
        """The automatic range settled on (empty before, or where the bins were given)."""
        spec = self.spec
        if not isinstance(spec, DecidedRange):
            return {}
        return {"lo": spec.lo, "hi": spec.hi, "bins": spec.bins}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue with a saved automatic range (where the range is automatic here too)."""
        if state and isinstance(self.spec, AutoRange | DecidedRange):
            self._set(DecidedRange(float(state["lo"]), float(state["hi"]), int(state["bins"])))

    def narrow(self, hist: Value) -> None:
        """From the next step on, the automatic range narrows by 4 when this step's
        whole-network counts (global, the same in every process) fit into a quarter."""
        if isinstance(self.spec, DecidedRange) and isinstance(hist, dict):
            narrower = narrower_range(hist["counts"], self.spec)
            if narrower is not None:
                self._set(narrower)
