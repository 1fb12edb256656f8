"""Reading a recorded gradient-element histogram ``{"counts", "edges"}`` (paper eq. 15).

The engine counts every finite element g_n,j in one of the bins [e_k, e_k+1) and *clamps*
values below e_0 into the first and values at or above e_K into the last bin (the paper's
convention). So from the record alone

* an element beyond the recorded range can only be in an edge bin: the number of elements
  outside [e_0, e_K] is at most ``counts[0] + counts[-1]`` and exactly 0 when both are
  empty;
* elements outside a narrower *displayed* range [lo, hi] are exactly the counts of the bins
  lying wholly outside it (bins cut by lo or hi are counted as shown);
* the data's own range is known to one bin width: the span of the non-empty bins.

A histogram whose range Cockpit set from the data (the default) also records ``"range"``: its
edge bins hold *exactly* the elements beyond ±range (:attr:`Histogram.inner`).

Non-finite elements are counted in no bin, so a step whose gradients were all NaN has an
empty histogram.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cockpit.view._data import Output, structured_steps

FIELDS = ("counts", "edges")


@dataclass(frozen=True)
class Histogram:
    """One recorded histogram, as float64 arrays, with what can be read off it."""

    step: int
    counts: np.ndarray
    edges: np.ndarray
    inner: float | None = None  # the edge bins hold exactly the elements beyond ±inner

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @property
    def bin_width(self) -> float:
        return float(self.edges[1] - self.edges[0])

    def edge_bins(self) -> int:
        """Elements in the two edge bins: an upper bound of those beyond the range."""
        return int(self.counts[0] + self.counts[-1])

    def occupied(self) -> tuple[float, float, int]:
        """``(lo, hi, n)``: the span [lo, hi) of the non-empty bins and their number n."""
        nz = np.flatnonzero(self.counts > 0)
        if nz.size == 0:
            return float(self.edges[0]), float(self.edges[-1]), 0
        return float(self.edges[nz[0]]), float(self.edges[nz[-1] + 1]), int(nz.size)

    def outside(self, lo: float, hi: float) -> int:
        """Elements in bins wholly outside the displayed range [lo, hi]."""
        mask = (self.edges[1:] <= lo) | (self.edges[:-1] >= hi)
        return int(self.counts[mask].sum())

    def central(self, fraction: float = 0.99) -> float:
        """Smallest r (a bin edge's |value|) with at least ``fraction`` of the elements
        in bins inside [−r, r]: the histogram's spread, to one bin width."""
        reach = np.maximum(np.abs(self.edges[:-1]), np.abs(self.edges[1:]))
        order = np.argsort(reach, kind="stable")
        cum = np.cumsum(self.counts[order])
        k = int(np.searchsorted(cum, fraction * cum[-1] - 1e-9))
        return float(reach[order][min(k, order.size - 1)])


def _as_hist(step: int, value: Mapping[str, Any]) -> Histogram | None:
    counts = np.asarray(value["counts"], dtype=np.float64).ravel()
    edges = np.asarray(value["edges"], dtype=np.float64).ravel()
    if counts.size == 0 or counts.size + 1 != edges.size:
        return None
    inner = value.get("range")
    return Histogram(step, counts, edges, None if inner is None else float(inner))


def histogram_at(output: Output, name: str, step: int | None = None) -> Histogram | None:
    """The histogram ``name`` at ``step``, or (default) at the last step whose histogram
    holds any element: a run whose gradients became NaN shows its last finite step."""
    steps = structured_steps(output, name, FIELDS)
    if step is not None:
        steps = [s for s in steps if s == step]
    for s in reversed(steps):
        hist = _as_hist(s, output[s][name])
        if hist is not None and (step is not None or hist.total > 0):
            return hist
    return None


def last_recorded_step(output: Output, name: str) -> int | None:
    """Last step at which ``name`` was recorded as a histogram (empty or not)."""
    steps = structured_steps(output, name, FIELDS)
    return steps[-1] if steps else None
