"""Untracked steps run without Cockpit's hooks on the model, and the tracked steps around
them are still exact: against brute-force individual gradients (torch.func), with the
user's own forward hooks before and after Cockpit's, and at a tracked step the schedule
did not foresee, and after step numbers jumped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cockpit import Cockpit
from cockpit.engine.capture.removed_hooks import forget_removed_hooks
from cockpit.quantities import GradNorm, NormTest
from cockpit.schedules import at, every
from cockpit.step.sequence import CONSECUTIVE_TO_PREDICT
from tests.models import make_problem
from tests.reference import flat, gradient_tests, individual_gradients


def _hook_counts(model: nn.Module) -> tuple[int, int]:
    forward = sum(len(m._forward_hooks) for m in model.modules())
    backward = sum(len(p._backward_hooks or {}) for p in model.parameters())
    return forward, backward


def _step(problem, cockpit, opt, step: int) -> None:
    opt.zero_grad()
    losses = problem.losses()
    with cockpit(step, losses=losses):
        losses.mean().backward()
    opt.step()


def test_untracked_steps_leave_no_hooks_and_tracked_steps_stay_exact():
    """NormTest every 3rd step: between an untracked step and the next untracked one no
    hook of Cockpit's is on the model; a forward hook the user registered before Cockpit
    and one after, the latter doubling a layer's output, keep their order through the hooks
    coming and going, so NormTest at every tracked step equals the brute force's of the
    hooked model."""
    problem = make_problem("mlp_relu", 6)
    model = problem.model
    seen = []
    model[0].register_forward_hook(lambda m, a, out: seen.append("before") or None)
    plain_counts = _hook_counts(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [NormTest(every(3))], optimizer=opt)
    model[0].register_forward_hook(lambda m, a, out: 2 * out)  # after Cockpit's
    expected = {}
    for step in range(7):
        if step % 3 == 0:
            grads = individual_gradients(model, problem.loss_fn, problem.x, problem.y)
            expected[step] = gradient_tests(flat(grads))["NormTest"]
        _step(problem, cockpit, opt, step)
        if step % 3 == 0:  # the next step is untracked: the hooks are off
            assert _hook_counts(model) == (plain_counts[0] + 1, plain_counts[1])
        if step % 3 == 2:  # the next step is tracked: on again
            assert _hook_counts(model)[0] > plain_counts[0] + 1
    output = cockpit.get_output()
    cockpit.close()
    assert _hook_counts(model) == (plain_counts[0] + 1, plain_counts[1])
    for step, value in expected.items():
        assert abs(output[step]["NormTest"] - value) <= 1e-10 * value, step
    assert seen.count("before") == 7 + 3  # (+ the brute force's three forward passes)


def test_a_tracked_step_the_schedule_did_not_foresee_keeps_the_batch_gradient():
    """The steps jump from 3 to 5 (tracked): the forward pass of step 5 ran without hooks
    (step 4 was next and untracked), yet the gradient reaches Cockpit; the per-sample
    instrument says why it is missing."""
    problem = make_problem("mlp_relu", 6)
    model = problem.model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [GradNorm(at([5])), NormTest(at([5]))], optimizer=opt)
    for step in (0, 1, 2, 3):
        _step(problem, cockpit, opt, step)
    expected = torch.cat([g.mean(0).flatten() for g in individual_gradients(
        model, problem.loss_fn, problem.x, problem.y).values()]).norm().item()
    _step(problem, cockpit, opt, 5)
    output, notes = cockpit.get_output(), cockpit.get_notes()
    cockpit.close()
    assert abs(output[5]["GradNorm"] - expected) <= 1e-12 * expected
    assert output[5]["NormTest"] is None and notes[5]["NormTest"]


def test_after_a_jump_forward_passes_are_recorded_until_the_numbers_run_on_again():
    """A skipped step number (a batch left out) makes the next step unknown: every forward
    pass is recorded; once the numbers came consecutively CONSECUTIVE_TO_PREDICT times
    again only the forward passes the schedule needs are (the hooks come off between
    untracked steps), and NormTest at each tracked step, before and after, equals the brute
    force's."""
    problem = make_problem("mlp_relu", 6)
    model = problem.model
    plain_counts = _hook_counts(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [NormTest(every(5))], optimizer=opt)
    steps = [0, 1, 3, *range(4, 4 + CONSECUTIVE_TO_PREDICT + 8)]
    hooked, expected = {}, {}
    for step in steps:
        if step % 5 == 0:
            grads = individual_gradients(model, problem.loss_fn, problem.x, problem.y)
            expected[step] = gradient_tests(flat(grads))["NormTest"]
        _step(problem, cockpit, opt, step)
        hooked[step] = _hook_counts(model) != plain_counts
    output = cockpit.get_output()
    cockpit.close()
    assert not hooked[0]  # step 1 untracked and expected
    again = 3 + CONSECUTIVE_TO_PREDICT  # the step after which step + 1 is expected again
    assert all(hooked[s] for s in steps if 3 <= s < again)
    assert [s for s in steps if s >= again and hooked[s]] == [
        s for s in steps if s >= again and (s + 1) % 5 == 0]
    assert len(expected) == 4
    for step, value in expected.items():
        assert abs(output[step]["NormTest"] - value) <= 1e-10 * value, step


def test_a_jump_onto_an_unrecorded_tracked_step_makes_every_forward_pass_recorded():
    """Steps 0–12 consecutive, then 14 (tracked, its forward pass not recorded: 13 was
    expected): NormTest of step 14 is missing with the reason; from then on every forward
    pass is recorded however consecutive the numbers (the hooks stay on), so a second jump
    onto a tracked step has its value, equal to the brute force's."""
    problem = make_problem("mlp_relu", 6)
    model = problem.model
    plain_counts = _hook_counts(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [NormTest(at([14, 40]))], optimizer=opt)
    for step in range(13):
        _step(problem, cockpit, opt, step)
    with pytest.warns(RuntimeWarning, match="forward pass"):
        _step(problem, cockpit, opt, 14)
        cockpit.get_output()
    for step in range(15, 15 + CONSECUTIVE_TO_PREDICT + 2):
        _step(problem, cockpit, opt, step)
        assert _hook_counts(model) != plain_counts, step
    grads = individual_gradients(model, problem.loss_fn, problem.x, problem.y)
    expected = gradient_tests(flat(grads))["NormTest"]
    _step(problem, cockpit, opt, 40)
    output, notes = cockpit.get_output(), cockpit.get_notes()
    cockpit.close()
    assert output[14]["NormTest"] is None and "forward pass" in notes[14]["NormTest"]
    assert abs(output[40]["NormTest"] - expected) <= 1e-10 * expected


def test_parameters_carry_no_emptied_hook_between_untracked_steps():
    """Between untracked steps no parameter keeps the emptied hook dict of Cockpit's removed
    hooks (autograd would still call into Python for it at every backward pass): unset,
    as before Cockpit; a parameter hook of the user's stays and fires at every step, and
    the tracked steps' GradNorm equals the brute force's."""
    problem = make_problem("mlp_relu", 6)
    model = problem.model
    params = dict(model.named_parameters())
    fired = []
    params["2.bias"].register_hook(lambda g: fired.append(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [GradNorm(every(3)), NormTest(every(3))], optimizer=opt)
    expected = {}
    for step in range(7):
        if step % 3 == 0:
            expected[step] = torch.cat([g.mean(0).flatten() for g in individual_gradients(
                model, problem.loss_fn, problem.x, problem.y).values()]).norm().item()
        _step(problem, cockpit, opt, step)
        if step % 3 in (0, 1):  # the next step is untracked: no hook of Cockpit's is left
            assert {n for n, p in params.items() if p._backward_hooks is not None} == {
                "2.bias"}, step
    output = cockpit.get_output()
    cockpit.close()
    assert len(fired) == 7
    for step, value in expected.items():
        assert abs(output[step]["GradNorm"] - value) <= 1e-12 * value, step


def test_forget_removed_hooks_unsets_only_emptied_dicts():
    """A tensor whose hooks were all removed gets no callback (its dict unset) and a hook
    registered afterwards fires; a tensor with a hook left keeps it."""
    a, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    a.register_hook(lambda g: None).remove()
    seen = []
    b.register_hook(lambda g: seen.append("b"))
    b.register_hook(lambda g: None).remove()
    forget_removed_hooks([a, b])
    assert a._backward_hooks is None and len(b._backward_hooks) == 1
    a.register_hook(lambda g: seen.append("a"))
    (a * b).sum().backward()
    assert sorted(seen) == ["a", "b"]
