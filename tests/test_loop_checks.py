"""Checks of the training loop around Cockpit (cockpit/loop_checks.py): GradientMismatch
against 1 − cos computed here from the gradients, definite misuse warned about, legitimate
gradient edits never."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from cockpit import Cockpit, quantities
from tests.models import make_problem


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def one_minus_cos(a: dict, b: dict) -> float:
    x = torch.cat([a[k].reshape(-1) for k in sorted(a)]).double()
    y = torch.cat([b[k].reshape(-1) for k in sorted(a)]).double()
    return float(1 - x @ y / (x.norm() * y.norm()))


def whole_batch_gradient(problem) -> dict:
    params = dict(problem.model.named_parameters())
    grads = torch.autograd.grad(problem.losses().mean(), list(params.values()))
    return dict(zip(params, grads, strict=True))


EDITS = {
    "clip_grad_value_": lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.01),
    "clip_grad_norm_": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01),
    "gradient noise": lambda m: [p.grad.add_(0.05 * torch.randn_like(p)) for p in
                                 m.parameters()],
    "manual weight decay": lambda m: [p.grad.add_(p.detach(), alpha=0.1) for p in
                                      m.parameters()],
    "per-parameter clipping": lambda m: [p.grad.mul_(min(1.0, 0.05 / float(p.grad.norm())))
                                         for p in m.parameters()],
    None: lambda m: None,
}


@pytest.mark.parametrize("edit", list(EDITS), ids=lambda e: str(e))
def test_gradient_mismatch_is_recorded_and_legitimate_edits_raise_no_warning(edit):
    problem = make_problem("cnn", 12)
    opt = sgd(problem.model)
    cockpit = Cockpit(problem.model, [quantities.GradNorm(), quantities.NormTest()],
                      optimizer=opt)
    expected = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            opt.zero_grad()
            reference = whole_batch_gradient(problem)
            losses = problem.losses()
            with cockpit(step, losses=losses):
                losses.mean().backward()
            EDITS[edit](problem.model)
            stepped = {k: p.grad.clone() for k, p in problem.model.named_parameters()}
            expected.append(one_minus_cos(stepped, reference))
            opt.step()
        output = cockpit.get_output()
    cockpit.close()
    for step in range(3):
        got = output[step]["GradientMismatch"]
        if edit in (None, "clip_grad_norm_"):  # a global factor: 0 up to rounding
            assert 0.0 <= got < 1e-12 and expected[step] < 1e-12
        else:
            assert expected[step] > 1e-4  # the edit changed the direction
            assert got == pytest.approx(expected[step], rel=1e-6)


@pytest.mark.parametrize("strict", [False, True])
def test_a_failing_gradient_check_is_recorded_not_raised_into_the_step(strict, monkeypatch):
    """The check runs inside ``optimizer.step()``: an error there is GradientMismatch's
    recorded failure (None, the error in its note, a warning), the step and the other
    instruments go on; ``strict=True`` raises it."""
    from cockpit.step import tracked_step

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel this device refused")

    monkeypatch.setattr(tracked_step, "gradient_mismatch", broken)
    problem = make_problem("mlp_relu", 8)
    opt = sgd(problem.model)
    cockpit = Cockpit(problem.model, [quantities.GradNorm()], optimizer=opt, strict=strict)
    before = [p.detach().clone() for p in problem.model.parameters()]
    opt.zero_grad()
    losses = problem.losses()
    with cockpit(0, losses=losses):
        losses.mean().backward()
    if strict:
        with pytest.raises(RuntimeError, match="refused"):
            opt.step()
        return
    with pytest.warns(RuntimeWarning, match="GradientMismatch failed at step 0"):
        opt.step()
        cockpit.close()
    assert any(not torch.equal(a, p) for a, p in zip(before, problem.model.parameters(),
                                                     strict=True))  # (the step was taken)
    assert cockpit.get_output()[0]["GradientMismatch"] is None
    assert cockpit.get_notes()[0]["GradientMismatch"] == "failed: a kernel this device refused"
    assert cockpit.get_output()[0]["GradNorm"] > 0


def test_sam_second_backward_after_zero_grad_is_no_misuse():
    """SAM: the gradient at θ + ρ·g/‖g‖ is backpropagated after zero_grad, outside the
    block; the optimizer steps on it. Recorded as GradientMismatch, never warned about."""
    problem = make_problem("mlp_relu", 16)
    opt = sgd(problem.model)
    cockpit = Cockpit(problem.model, [quantities.GradNorm(), quantities.NormTest()],
                      optimizer=opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            opt.zero_grad()
            losses = problem.losses()
            with cockpit(step, losses=losses):
                losses.mean().backward()
            params = list(problem.model.parameters())
            norm = torch.sqrt(sum((p.grad ** 2).sum() for p in params))
            shifts = [0.05 * p.grad / norm for p in params]
            with torch.no_grad():
                for p, e in zip(params, shifts, strict=True):
                    p.add_(e)
            opt.zero_grad()
            problem.losses().mean().backward()
            with torch.no_grad():
                for p, e in zip(params, shifts, strict=True):
                    p.sub_(e)
            opt.step()
        output = cockpit.get_output()
    cockpit.close()
    assert all(output[s]["GradientMismatch"] > 1e-6 for s in range(3))


def test_equal_micro_batches_match_and_unequal_weights_are_not_checked():
    problem = make_problem("mlp_relu", 16)
    opt = sgd(problem.model)
    cockpit = Cockpit(problem.model, [quantities.GradNorm()], optimizer=opt,
                      grad_accumulation=True)
    for step, weighting in enumerate(["mean/k", "sum/part"]):
        opt.zero_grad()
        for part in (slice(0, 8), slice(8, 16)):
            losses = problem.loss_fn(problem.model(problem.x[part]), problem.y[part])
            with cockpit(step, losses=losses):
                (losses.mean() / 2 if weighting == "mean/k" else losses.sum() / (
                    3 if part.start == 0 else 1)).backward()
        opt.step()
    output = cockpit.get_output()
    cockpit.close()
    assert output[0]["GradientMismatch"] < 1e-12
    assert "GradientMismatch" not in output[1]  # p.grad is not a multiple of the mean


def run_misused(misuse: str, steps: int = 2):
    problem = make_problem("mlp_relu", 16)
    opt = sgd(problem.model)
    cockpit = Cockpit(problem.model, [quantities.Loss(), quantities.GradNorm(),
                                      quantities.NormTest(), quantities.Alpha()],
                      optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            if misuse != "no zero_grad" or step == 0:
                opt.zero_grad()
            losses = problem.losses()
            if misuse == "backward before the block":
                losses.mean().backward()
            with cockpit(step, losses=losses):
                if misuse in ("micro-batch outside", "no zero_grad"):
                    losses.mean().backward()
            if misuse == "backward after the block":
                losses.mean().backward()
            if misuse == "micro-batch outside":
                problem.loss_fn(problem.model(problem.x[:4]), problem.y[:4]).mean().backward()
            opt.step()
    cockpit.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return cockpit.get_output(), cockpit.get_notes(), messages


@pytest.mark.parametrize("misuse", ["backward after the block", "backward before the block"])
def test_backward_outside_the_block_records_no_gradient_numbers(misuse):
    output, notes, messages = run_misused(misuse)
    assert any("call backward inside `with cockpit(step, ...)`" in m for m in messages)
    if misuse == "backward before the block":
        assert any("already hold a gradient" in m for m in messages)
    for step in range(2):
        assert output[step]["Loss"] is not None  # the losses were seen
        for name in ("GradNorm", "NormTest", "Alpha"):
            assert output[step][name] is None, (step, name)
            assert "call backward inside `with cockpit(step, ...)`" in notes[step][name]
        assert not any(k.startswith("GradNorm/") for k in output[step])


def test_a_micro_batch_outside_the_block_is_reported():
    output, _, messages = run_misused("micro-batch outside")
    assert any("outside `with cockpit(0, ...)` added to the gradient" in m for m in messages)
    assert output[0]["GradientMismatch"] > 1e-3


def test_gradients_not_zeroed_are_reported_at_the_next_block():
    output, _, messages = run_misused("no zero_grad", steps=3)
    assert sum("already hold a gradient" in m for m in messages) == 1  # once per run
    assert "step 1:" in next(m for m in messages if "already hold a gradient" in m)
    assert output[0]["GradientMismatch"] < 1e-12 < output[2]["GradientMismatch"]


def test_a_correct_loop_with_zeroed_tensors_raises_no_warning():
    problem = make_problem("cnn", 8)
    opt = sgd(problem.model)
    cockpit = Cockpit(problem.model, "economy", optimizer=opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            opt.zero_grad(set_to_none=False)  # zero tensors, not None
            losses = problem.losses()
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()


def _tree():
    """Nested containers, a module shared by two parents, a None submodule, a frozen
    parameter and a parameter slot set to None."""
    torch.manual_seed(0)
    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Linear(2, 3), shared),
        torch.nn.ModuleDict({"a": shared, "b": torch.nn.LayerNorm(3)}),
        torch.nn.Linear(3, 2, bias=False))
    model[0].register_module("absent", None)
    model[1]["b"].bias = None
    model[2].weight.requires_grad_(False)
    return model


CHANGES = {
    "none": lambda m: None,
    "appended deep down": lambda m: m[0].append(torch.nn.Linear(3, 3)),
    "replaced": lambda m: m[1].__setitem__("b", torch.nn.LayerNorm(3)),
    "parameter replaced": lambda m: setattr(m[2], "weight", torch.nn.Parameter(
        torch.ones(2, 3))),
    "unfrozen": lambda m: m[2].weight.requires_grad_(True),
    "tracked one frozen": lambda m: m[0][0].weight.requires_grad_(False),
    "slot filled": lambda m: setattr(m[1]["b"], "bias", torch.nn.Parameter(torch.zeros(3))),
}


@pytest.mark.parametrize("change", CHANGES)
def test_the_quick_parameter_walk_agrees_with_named_parameters(change):
    """``parameters_changed`` answers None from one walk over the modules' dictionaries
    where every parameter is known and no untracked one requires a gradient; the reason
    it gives otherwise names what ``named_parameters`` shows changed."""
    from cockpit.loop_checks.problems import _as_known, parameters_changed

    model = _tree()
    known = {id(p): name for name, p in model.named_parameters()}
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert _as_known(model, known, trainable)
    CHANGES[change](model)
    reason = parameters_changed(model, known, trainable)
    unchanged = change in ("none", "tracked one frozen")
    assert _as_known(model, known, trainable) is unchanged
    assert (reason is None) is unchanged
    expected = {"appended deep down": "added: 0.3.weight", "replaced": "replaced: 1.b.weight",
                "parameter replaced": "replaced: 2.weight", "unfrozen": "made trainable: 2.weight",
                "slot filled": "added: 1.b.bias"}.get(change)
    if expected is not None:
        assert expected in reason.replace("'", "")


@pytest.mark.parametrize("accelerator", [False, True])
def test_grad_norm_reads_the_norms_the_gradient_check_formed(accelerator, monkeypatch):
    """‖g_B‖ of every parameter is formed once per step (by the gradient check, which
    GradNorm then reads) and equals the whole batch's gradient norm."""
    from cockpit.engine.histograms import device as histogram_device
    from cockpit.loop_checks import gradient
    from cockpit.quantities import base

    problem = make_problem("cnn", 12)
    opt = sgd(problem.model)
    cockpit = Cockpit(problem.model, [quantities.GradNorm()], optimizer=opt)
    formed: list[list] = []
    original = base.norms

    def spied(tensors):
        formed.append(list(tensors))
        return original(tensors)

    monkeypatch.setattr(base, "norms", spied)
    monkeypatch.setattr(gradient, "norms", spied)
    monkeypatch.setattr(histogram_device, "_forced", accelerator)
    expected = []
    for step in range(2):
        opt.zero_grad()
        expected.append(torch.cat([g.reshape(-1) for g in whole_batch_gradient(
            problem).values()]).norm().item())
        formed.clear()
        losses = problem.losses()
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
        # [p.grad…, g_B…] for the check, and nothing more (GradNorm formed none)
        assert [len(f) for f in formed] == [2 * len(list(problem.model.parameters()))]
    output = cockpit.get_output()
    cockpit.close()
    for step in range(2):
        assert output[step]["GradNorm"] == pytest.approx(expected[step], rel=1e-10)


def test_norms_of_batch_gradients_changed_since_are_formed_again():
    """The check's norms are reused only for the very tensors it measured, unchanged: a
    batch gradient replaced or modified in place since gets its norm formed afresh."""
    from cockpit.engine.histograms.exact import BinSpec
    from cockpit.quantities.base import FormedNorms, StepData

    def data(grads):
        return StepData(step=0, losses=None, stats=None, batch_grads=grads, params={},
                        initial_params=None, learning_rate=None, hist_spec=BinSpec(-1, 1, 4),
                        hist2d_specs=(BinSpec(-1, 1, 4), BinSpec(-1, 1, 4)), time=0.0)

    grads = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0])}
    measured = torch.tensor([5.0, 1.0], dtype=torch.float64)
    formed = FormedNorms.of(measured, list(grads.values()))
    reused = data(dict(grads))
    reused.reuse_grad_norms(formed)
    assert reused.grad_norms() is measured
    replaced = data({"a": grads["a"].clone(), "b": grads["b"]})
    replaced.reuse_grad_norms(formed)
    grads["b"].mul_(2)  # (in place, after the check)
    edited = data(dict(grads))
    edited.reuse_grad_norms(formed)
    assert replaced.grad_norms().tolist() == [5.0, 2.0]  # (b's norm formed now: 2)
    assert edited.grad_norms().tolist() == [5.0, 2.0]


def _economy_run(loop: str, optimizer: str, steps: int = 4):
    """Economy on a CNN with ``optimizer`` ("sgd": momentum; "adam"), the loop written as
    ``loop`` says: the optimizer step after the block (the README's loop) or inside it,
    with zero_grad before the block or inside it (set to None, or zeroed in place)."""
    problem = make_problem("cnn", 8)
    model = problem.model
    opt = (sgd(model) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.01))
    cockpit = Cockpit(model, "economy", optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            if loop in ("after", "step inside"):
                opt.zero_grad()
            losses = problem.losses()
            with cockpit(step, losses=losses):
                if loop.startswith("zero_grad"):
                    opt.zero_grad(set_to_none=loop.endswith("to None"))
                losses.mean().backward()
                if loop != "after":
                    opt.step()
            if loop == "after":
                opt.step()
        cockpit.close()
    return cockpit.get_output(), [str(w.message) for w in caught]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("loop", ["step inside", "zero_grad and step inside, to None",
                                  "zero_grad and step inside, in place"])
def test_optimizer_step_inside_the_block_records_what_a_step_after_it_does(loop, optimizer):
    expected, _ = _economy_run("after", optimizer)
    output, messages = _economy_run(loop, optimizer)
    assert messages == []  # (no "not followed by optimizer.step()", no held gradient)
    assert expected[1]["UpdateSize"] > 0 and expected[2]["Alpha"] is not None
    for step in range(4):
        assert output[step]["GradientHeld"] == 0.0
        assert output[step].keys() == expected[step].keys()
        for name, value in expected[step].items():
            got = output[step][name]
            if isinstance(value, float) and not math.isnan(value):
                assert got == pytest.approx(value, rel=1e-12, abs=1e-15), (step, name)
            elif isinstance(value, dict):
                for key, array in value.items():
                    np.testing.assert_allclose(got[key], array, rtol=1e-12)
            else:
                assert got == value or (got != got and value != value), (step, name)


def test_gradients_zeroed_inside_the_block_are_not_held_but_stale_ones_are():
    problem = make_problem("mlp_relu", 8)
    opt = sgd(problem.model)
    cockpit = Cockpit(problem.model, [quantities.GradNorm()], optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, zero in enumerate(["to None", "in place", "none"]):
            losses = problem.losses()
            with cockpit(step, losses=losses):
                if zero != "none":
                    opt.zero_grad(set_to_none=zero == "to None")
                losses.mean().backward()
            opt.step()
        cockpit.close()
    held = [cockpit.get_output()[step]["GradientHeld"] for step in range(3)]
    assert held == [0.0, 0.0, 1.0]
    assert sum("already hold a gradient" in str(w.message) for w in caught) == 1


def test_a_block_around_a_closure_optimizers_step_records_none_with_the_reason():
    """``with cockpit(step): opt.step(closure)`` (the backward passes in the closure): θ
    moves before the block's backward pass, so no value describes the step."""
    problem = make_problem("mlp_relu", 8)
    model = problem.model
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    cockpit = Cockpit(model, "economy", optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            losses = problem.losses()

            def closure():
                opt.zero_grad()
                own = problem.losses()
                own.mean().backward()
                return own.mean()

            with cockpit(step, losses=losses):
                opt.step(closure)
        cockpit.close()
    output, notes = cockpit.get_output(), cockpit.get_notes()
    messages = [str(w.message) for w in caught]
    assert not any("was not followed by optimizer.step()" in m for m in messages)
    for step in range(2):
        for name in ("UpdateSize", "Distance", "GradNorm", "NormTest", "Alpha"):
            assert output[step][name] is None, (step, name)
        assert "before the block's backward pass" in notes[step]["UpdateSize"]
