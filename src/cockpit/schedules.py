"""Schedules: which steps an instrument is computed at.

A schedule is any callable ``step -> bool``. ``every(k)`` tracks steps 0, k, 2k, …;
``logspaced(...)`` tracks steps spaced evenly on a log scale (dense early in training, sparse
later, as in the paper's Section 4 experiments); ``at(steps)`` tracks an explicit list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

Schedule = Callable[[int], bool]


class every:  # noqa: N801  (reads like the English it stands for: every(4))
    """Track every ``k``-th step, starting at ``offset``."""

    def __init__(self, k: int = 1, offset: int = 0):
        if int(k) != k or k < 1:
            raise ValueError(f"every(k) needs a positive integer k, got {k!r}")
        self.k, self.offset = int(k), int(offset)

    def __call__(self, step: int) -> bool:
        return step >= self.offset and (step - self.offset) % self.k == 0

    def __repr__(self) -> str:
        return f"every({self.k}" + (f", offset={self.offset})" if self.offset else ")")


class at:  # noqa: N801
    """Track exactly the given steps."""

    def __init__(self, steps: Iterable[int]):
        self.steps = frozenset(int(s) for s in steps)

    def __call__(self, step: int) -> bool:
        return step in self.steps

    def __repr__(self) -> str:
        return f"at({sorted(self.steps)})"


def logspaced(end: int, num: int = 300, start: int = 0) -> at:
    """``num`` steps spaced evenly on a log scale between ``start`` and ``end`` (inclusive).

    Steps are rounded to integers and duplicates merged, so early steps are all tracked and
    the spacing grows geometrically later on.
    """
    if end < start or num < 1:
        raise ValueError("logspaced needs end >= start and num >= 1")
    points = np.logspace(np.log10(start + 1), np.log10(end + 1), num) - 1
    return at(round(p) for p in points)


def as_schedule(schedule: Schedule | int | None) -> Schedule:
    """Accept a callable, an int k (every k steps) or None (every step)."""
    if schedule is None:
        return every(1)
    if isinstance(schedule, int):
        return every(schedule)
    if not callable(schedule):
        raise TypeError(
            f"a schedule must be callable step -> bool or an int, got {type(schedule).__name__}"
        )
    return schedule
