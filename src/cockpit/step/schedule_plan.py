"""Which instruments a step tracks, asking each schedule once per step.

An instrument is tracked at step t when its schedule picks t − k for one of its
``schedule_offsets`` k (Alpha's are 0 and 1: it observes θ_{t+1} at the step after). A
configuration gives one schedule to all its instruments (``configuration(name,
schedule)``), so the questions are few: asked once each instead of once per instrument.
That matters at the steps no instrument tracks, where this is most of Cockpit's work: inside
a training step the instruments' objects are no longer in the processor's caches (the
step's tensors pushed them out), and asking 13 instruments took 14 µs there against ~1.5 µs
in a loop. The plan is made when Cockpit is created: it reads the instruments' schedules
then. An instrument that decides by a ``should_track`` of its own is asked itself. A step is
asked about twice (as the next one, then as the current one): the last few answers are
kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from cockpit.quantities.base import Quantity
from cockpit.schedules import Schedule


class SchedulePlan:
    """The distinct questions (schedule, offset k) of ``quantities`` and which of them
    each instrument's answer is made of."""

    def __init__(self, quantities: Sequence[Quantity]):
        self.quantities = list(quantities)
        self.questions: list[tuple[Schedule, int]] = []
        # per instrument: the indices of its questions; None: it asks itself
        self.asks: list[tuple[int, ...] | None] = []
        index: dict[tuple[int, int], int] = {}
        for q in self.quantities:
            if type(q).should_track is not Quantity.should_track:
                self.asks.append(None)
                continue
            own = []
            for k in q.schedule_offsets:
                key = (id(q.schedule), k)  # (the plan holds the schedule: its id stays)
                if key not in index:
                    index[key] = len(self.questions)
                    self.questions.append((q.schedule, k))
                own.append(index[key])
            self.asks.append(tuple(own))
        self.any_own = any(asks is None for asks in self.asks)
        self._known: dict[int, list[Quantity]] = {}  # the last few steps' answers

    def tracked(self, step: int) -> list[Quantity]:
        """The instruments tracked at ``step``, in their order (a new list: the caller's)."""
        known = self._known.get(step)
        if known is not None:
            return list(known)
        answers = [bool(schedule(step - k)) for schedule, k in self.questions]
        known = []
        if self.any_own or any(answers):
            for q, asks in zip(self.quantities, self.asks, strict=True):
                if asks is None:
                    if q.should_track(step):
                        known.append(q)
                    continue
                for i in asks:
                    if answers[i]:
                        known.append(q)
                        break
        if len(self._known) >= 4:
            del self._known[next(iter(self._known))]
        self._known[step] = known
        return list(known)
