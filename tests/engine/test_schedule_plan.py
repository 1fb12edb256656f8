"""Which instruments a step tracks: the schedule plan asks each (schedule, offset) once and
answers as every instrument's own ``should_track`` would; a run with the plan records the
same steps as the instruments' schedules say."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch

import cockpit
from cockpit import Cockpit, configuration
from cockpit.quantities import Alpha, GradNorm, Loss, UpdateSize
from cockpit.quantities.base import Quantity
from cockpit.schedules import at, every
from cockpit.step.schedule_plan import SchedulePlan
from tests.models import make_problem, train


class _Counting:
    """A schedule that counts how often it is asked (every 4th step)."""

    def __init__(self):
        self.asked = 0

    def __call__(self, step: int) -> bool:
        self.asked += 1
        return step % 4 == 0


class _OddSteps(Quantity):
    """An instrument with a rule of its own instead of a schedule."""

    def should_track(self, step: int) -> bool:
        return step % 2 == 1


def test_the_plan_answers_as_each_instruments_should_track():
    shared = every(3)
    quantities = [Loss(shared), GradNorm(shared), Alpha(shared), UpdateSize(at([2, 7])),
                  _OddSteps(), Alpha(every(5)), Loss(at([]))]
    plan = SchedulePlan(quantities)
    # every(3) at offsets 0 and 1, at([2, 7]), every(5) at 0 and 1, at([]): 6 questions
    assert len(plan.questions) == 6
    for step in range(-1, 30):
        expected = [q for q in quantities if q.should_track(step)]
        assert plan.tracked(step) == expected, step
    assert plan.tracked(1)[0] is quantities[2]  # Alpha observes θ_{t+1} at t + 1


def test_a_shared_schedule_is_asked_once_per_question():
    schedule = _Counting()
    plan = SchedulePlan([q(schedule) for q in (Loss, GradNorm, UpdateSize, Alpha)])
    assert plan.tracked(4) == plan.quantities  # (Alpha at its start)
    assert schedule.asked == 2  # step 4 and, for Alpha's θ_{t+1}, step 3
    assert [type(q) for q in plan.tracked(5)] == [Alpha]
    assert plan.tracked(6) == []
    assert schedule.asked == 6


def test_a_run_records_the_steps_the_schedules_pick():
    """A configuration with every(3), Alpha among it (its θ_{t+1} steps tracked after
    each): the values land at the schedule's steps, α at every one of them."""
    problem = make_problem("mlp_relu", 6)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.1)
    cockpit = Cockpit(problem.model, configuration("economy", every(3)), optimizer=opt)
    train(problem, cockpit, 8, opt)
    output = cockpit.get_output()
    cockpit.close()
    assert sorted(s for s in output if "Loss" in output[s]) == [0, 3, 6]
    assert all(output[s]["Loss"] is not None for s in (0, 3, 6))
    assert all(output[s]["Alpha"] is not None for s in (0, 3, 6))  # (θ_{t+1} seen at 7)
    # the steps after them: Alpha's observations of θ_{t+1}, with the loop's checks only
    assert sorted(output) == [0, 1, 3, 4, 6, 7]
    assert all("Alpha" not in output[s] and "GradNorm" not in output[s] for s in (1, 4, 7))


def test_a_step_no_instrument_tracks_calls_few_of_cockpits_functions():
    """Inside a training step each of Cockpit's objects touched is a memory read (the step's
    tensors pushed them out of the caches), so the steps no instrument tracks do little: one
    such step of economy every(10), from its block's start to the optimizer's hooks, calls
    30 of Cockpit's Python functions (57 when every instrument asked its schedule itself).
    A regression bound a little above today's."""
    package = str(Path(cockpit.__file__).parent)
    problem = make_problem("mlp_relu", 8)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.1)
    watcher = Cockpit(problem.model, configuration("economy", every(10)), optimizer=opt)
    calls = collections.Counter()

    def event(frame, kind, arg):
        if kind == "call" and frame.f_code.co_filename.startswith(package):
            calls[frame.f_code.co_name] += 1

    for step in range(6):
        opt.zero_grad()
        losses = problem.losses()
        if step == 5:  # (neither tracked, nor after a tracked step, nor before one)
            sys.setprofile(event)
        try:
            with watcher(step, losses=losses):
                losses.mean().backward()
            opt.step()
        finally:
            sys.setprofile(None)
    watcher.close()
    assert 0 < sum(calls.values()) <= 34, calls
    assert "should_track" not in calls  # (the plan asked the one shared schedule)
