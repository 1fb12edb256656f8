"""Python's cyclic garbage collector held back while a tracked step's work runs.

A tracked step makes thousands of short-lived containers (the recorded calls, statistics,
closures: about 3,200 more alive at its end than at its start on a GPT-2 of 148 parameter
tensors). Every 700 of them start a collection of the youngest generation, which moves
whatever is alive at that moment — the step's objects, which die when it ends — into the
older generations; once those have grown by a quarter since the last full collection, the
collector traverses every object of the process (≈ 400,000 in a process that imported
``transformers``: ≈ 200 ms each). On that GPT-2 (``benchmarks/gc_pause.py``'s proxy) the
collections took 2.96 ms of each tracked step (4.6 young, 0.4 middle and 0.01 full
collections a step), none of them the training's; held back, 1.16 ms (0.9, 0.08, 0.003).

While a tracked step runs (from its recorded forward pass, or its first block, to the end
of its update's instruments) the youngest generation's threshold is raised to
:data:`HELD_THRESHOLD`, above what a step makes, so that no collection finds the step's
objects alive; it is set back when the step's work ends (or at a block the schedule does
not track), and the first collection after that finds only what outlives the step's work
(what the user's graph still holds until the next step). Cyclic
garbage made meanwhile is collected then, and at the latest after :data:`HELD_THRESHOLD`
allocations even if the step never ends (an exception in ``optimizer.step()``). Nothing is
changed where the collector is disabled, where the threshold was changed by someone else
meanwhile (then it is left as they set it), or with ``COCKPIT_GC_PAUSE=0``.
"""

from __future__ import annotations

import gc
import os

HELD_THRESHOLD = 100_000

_saved: tuple[int, ...] | None = None  # the thresholds before the hold


def hold() -> None:
    """Raise the youngest generation's threshold until :func:`release` (once; nothing
    where the collector is off, or ``COCKPIT_GC_PAUSE=0``)."""
    global _saved
    if _saved is not None or not gc.isenabled() or os.environ.get("COCKPIT_GC_PAUSE") == "0":
        return
    thresholds = gc.get_threshold()
    if thresholds[0] == 0 or thresholds[0] >= HELD_THRESHOLD:  # (0: collections off)
        return
    _saved = thresholds
    gc.set_threshold(HELD_THRESHOLD, *thresholds[1:])


def release() -> None:
    """Set the thresholds back as they were before :func:`hold` (unless changed since)."""
    global _saved
    saved, _saved = _saved, None
    if saved is not None and gc.get_threshold()[0] == HELD_THRESHOLD:
        gc.set_threshold(*saved)


def held() -> bool:
    """Whether the collector is held back now."""
    return _saved is not None
