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
empty histogram, and a step whose gradients were partly NaN a smaller one that looks
finite. Which steps counted *every* element is read off the gradient norm recorded with
the histogram (:func:`complete_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cockpit.view._data import Output, as_float, structured_steps

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


def norm_of(name: str) -> str | None:
    """The gradient norm recorded with histogram ``name``: ``GradNorm`` for ``GradHist1d``,
    ``GradNorm/<p>`` for ``GradHist1d/<p>``; None for other histograms."""
    head, sep, param = name.partition("/")
    return "GradNorm" + sep + param if head == "GradHist1d" else None


def completeness(output: Output, name: str) -> Callable[[int], bool]:
    """``complete(step)``: whether the histogram ``name`` at ``step`` counted every
    gradient element, none of them NaN or ±inf.

    Exact where the matching gradient norm (:func:`norm_of`) is a number at that step: the
    batch gradient sums the individual gradients, so it is finite exactly when each of
    their elements is (short of a sum of finite elements overflowing), and so is its norm.
    Where the norm was not recorded, the histogram
    must hold as many elements as the fullest one of the run (exact for a constant batch
    size; a step with a smaller batch then counts as incomplete).
    """
    norm = norm_of(name)
    fullest: list[int] = []  # the largest total, found when first needed

    def complete(step: int) -> bool:
        hist = _recorded(output, name, step)
        if hist is None or hist.total == 0:
            return False
        grad_norm = as_float(output[step].get(norm)) if norm is not None else None
        if grad_norm is not None:
            return math.isfinite(grad_norm)
        if not fullest:
            fullest.append(max(_total(output, name, s) for s in output))
        return hist.total == fullest[0]

    return complete


def _recorded(output: Output, name: str, step: int) -> Histogram | None:
    """The histogram ``name`` as recorded at ``step``; None where there is none."""
    value = output.get(step, {}).get(name)
    if not isinstance(value, Mapping) or any(f not in value for f in FIELDS):
        return None
    return _as_hist(step, value)


def _total(output: Output, name: str, step: int) -> int:
    hist = _recorded(output, name, step)
    return 0 if hist is None else hist.total


def last_complete_step(output: Output, names: Iterable[str]) -> int | None:
    """The last step at which every histogram of ``names`` recorded there counted every
    element (at least one recorded): one step at which all of them can be shown."""
    names = list(names)
    checks = {name: completeness(output, name) for name in names}
    steps = sorted({s for name in names for s in structured_steps(output, name, FIELDS)})
    for step in reversed(steps):
        here = [n for n in names if _recorded(output, n, step) is not None]
        if here and all(checks[n](step) for n in here):
            return step
    return None


def histogram_at(output: Output, name: str, step: int | None = None) -> Histogram | None:
    """The histogram ``name`` at ``step`` (as recorded), or (default) at the last step
    whose histogram counted every element: a run whose gradients became NaN, in part or
    all, shows its last finite step; None where there is no such step."""
    if step is None:
        step = last_complete_step(output, [name])
    return None if step is None else _recorded(output, name, step)


def ever_counted(output: Output, name: str) -> bool:
    """Whether some recorded histogram ``name`` holds an element (a finite one)."""
    return any(_total(output, name, s) > 0 for s in output)


def last_recorded_step(output: Output, name: str) -> int | None:
    """Last step at which ``name`` was recorded as a histogram (empty or not)."""
    steps = structured_steps(output, name, FIELDS)
    return steps[-1] if steps else None
