"""The batch gradient Cockpit keeps of each parameter is this backward pass's gradient,
copied at the end of the pass for all parameters at once: later in-place edits of
``p.grad`` (clipping inside the ``with`` block) do not reach it, a backward pass that fails
half-way leaves no alias of the user's gradients behind, and the user's gradients stay
bit-identical to a loop without Cockpit."""

from __future__ import annotations

import copy

import pytest
import torch

from cockpit import Cockpit
from cockpit.quantities import GradNorm, NormTest
from tests.models import make_problem
from tests.reference import flat, gradient_tests, individual_gradients


def _expected(problem) -> tuple[float, float]:
    G = flat(individual_gradients(problem.model, problem.loss_fn, problem.x, problem.y))
    return float(G.mean(0).norm()), gradient_tests(G)["NormTest"]


def _assert_recorded(cockpit: Cockpit, expected: dict[int, tuple[float, float]]) -> None:
    """Closes ``cockpit``; its GradNorm and NormTest equal ``expected`` (step → values)."""
    output = cockpit.get_output()
    cockpit.close()
    for step, (norm, norm_test) in expected.items():
        assert abs(output[step]["GradNorm"] - norm) <= 1e-10 * norm, step
        assert abs(output[step]["NormTest"] - norm_test) <= 1e-10 * norm_test, step


@pytest.mark.parametrize("set_to_none", [True, False])
def test_edits_of_p_grad_inside_the_block_do_not_reach_the_statistics(set_to_none):
    """``p.grad`` halved in place after the backward pass, inside the ``with`` block:
    GradNorm and NormTest are those of the gradient the backward pass formed."""
    problem = make_problem("mlp_relu", 6)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.1)
    cockpit = Cockpit(problem.model, [GradNorm(), NormTest()], optimizer=opt)
    expected = {}
    for step in range(3):
        expected[step] = _expected(problem)
        opt.zero_grad(set_to_none=set_to_none)
        losses = problem.losses()
        with cockpit(step, losses=losses):
            losses.mean().backward()
            for p in problem.model.parameters():
                p.grad.mul_(0.5)
        opt.step()
    _assert_recorded(cockpit, expected)


def test_a_failed_backward_pass_leaves_the_next_steps_exact():
    """A backward pass that raises half-way (a hook of the user's) ends the step; the next
    steps' values are exact and the user's parameters equal a loop without Cockpit."""
    problem = make_problem("mlp_relu", 6)
    twin = copy.deepcopy(problem.model)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    cockpit = Cockpit(problem.model, [GradNorm(), NormTest()], optimizer=opt)
    expected = {}

    def fail(grad):
        raise RuntimeError("the user's hook failed")

    for step in range(4):
        for model, optimizer in ((problem.model, opt), (twin, twin_opt)):
            optimizer.zero_grad()
            out = model(problem.x)
            losses = problem.loss_fn(out, problem.y)
            if model is twin:
                if step != 1:
                    losses.mean().backward()
                    optimizer.step()
                continue
            if step == 1:  # the last layer's gradients arrive, the rest do not
                handle = model[2].weight.register_hook(fail)
                with (pytest.raises(RuntimeError, match="the user's hook failed"),
                      cockpit(step, losses=losses)):
                    losses.mean().backward()
                handle.remove()
                continue
            expected[step] = _expected(problem)
            with cockpit(step, losses=losses):
                losses.mean().backward()
            optimizer.step()
        for p, q in zip(problem.model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q), step
    _assert_recorded(cockpit, expected)


def test_copies_without_spares_take_one_kernel():
    """Copies with no buffer of the last step to reuse (it holds θ_t for the update by now)
    are made by one fused kernel for all parameters, exactly, not one allocation each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cockpit.engine.capture.batch_gradients import BatchGradientCopies

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    sources = {f"p{i}": torch.randn(3, i + 1) for i in range(5)}
    spare = torch.empty(3, 1)
    copies = BatchGradientCopies()
    copies.waiting, grads = dict(sources), dict(sources)
    with Ops() as ops:
        copies.copy(grads, {"p0": spare})
    assert len(ops.names) == 2, ops.names  # the spare's copy and the others' fused copy
    assert grads["p0"] is spare
    for k, source in sources.items():
        assert grads[k] is not source and torch.equal(grads[k], source)
        assert grads[k].untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
