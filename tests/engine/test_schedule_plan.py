"""Which instruments a step tracks: the schedule plan asks each (schedule, offset) once and
answers as every instrument's own ``should_track`` would; a run with the plan records the
same steps as the instruments' schedules say."""

from __future__ import annotations

import torch

from cockpit import Cockpit, configuration
from cockpit.quantities import Alpha, GradNorm, Loss, UpdateSize
from cockpit.quantities.base import Quantity
from cockpit.schedules import at, every
from cockpit.step.schedule_plan import SchedulePlan
from tests.models import make_problem


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
    for step in range(8):
        opt.zero_grad()
        losses = problem.losses()
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    output = cockpit.get_output()
    cockpit.close()
    assert sorted(s for s in output if "Loss" in output[s]) == [0, 3, 6]
    assert all(output[s]["Loss"] is not None for s in (0, 3, 6))
    assert all(output[s]["Alpha"] is not None for s in (0, 3, 6))  # (θ_{t+1} seen at 7)
    # the steps after them: Alpha's observations of θ_{t+1}, with the loop's checks only
    assert sorted(output) == [0, 1, 3, 4, 6, 7]
    assert all("Alpha" not in output[s] and "GradNorm" not in output[s] for s in (1, 4, 7))
