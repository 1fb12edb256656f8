"""Gradient accumulation: several ``with cockpit(step, ...)`` blocks with the same step before
one optimizer step describe the union of their samples, exactly as one backward pass on the
whole batch would (tests/split_reference.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from cockpit import Cockpit, quantities
from tests.models import make_problem
from tests.split_reference import assert_same_values, batches_of, instruments, whole_batch_run

STEPS = 4


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def accumulated_run(problem, batches, sizes, weighting, make_optimizer, hint=True,
                    curvature="diag_ggn_exact", chosen=None):
    """Each step's batch cut into micro-batches of ``sizes``; ``weighting``: how the user
    scales each micro-batch loss ("mean/k", "sum/total"). Returns outputs, notes and the
    gradient the optimizer stepped on at each step."""
    model = problem.model
    opt = make_optimizer(model)
    cockpit = Cockpit(model, instruments(curvature) if chosen is None else chosen,
                      optimizer=opt, strict=True, grad_accumulation=hint)
    stepped = []
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        start = 0
        for size in sizes:
            xb, yb = x[start: start + size], y[start: start + size]
            start += size
            losses = problem.loss_fn(model(xb), yb)
            loss = (losses.mean() / len(sizes) if weighting == "mean/k"
                    else losses.sum() / x.shape[0])
            with cockpit(step, losses=losses):
                loss.backward()
        stepped.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
    cockpit.close()
    return cockpit.get_output(), cockpit.get_notes(), stepped


@pytest.mark.parametrize(("name", "sizes", "weighting", "make_optimizer"), [
    ("mlp_relu", [6, 6, 6, 6], "mean/k", sgd),
    ("mlp_relu", [10, 3, 11], "sum/total", adam),
    ("cnn", [5, 7], "mean/k", sgd),  # unequal sizes, mean ÷ k: a non-uniform step
    ("mlp_sigmoid", [4, 4, 4], "sum/total", sgd),
])
def test_accumulation_equals_one_backward_on_the_union(name, sizes, weighting, make_optimizer):
    problem = make_problem(name, 48)
    batches = batches_of(problem, STEPS, sum(sizes))
    reference = make_problem(name, 48)  # the same initial model
    output, notes, stepped = accumulated_run(problem, batches, sizes, weighting,
                                             make_optimizer)
    uniform = weighting == "sum/total" or len(set(sizes)) == 1
    expected, _ = whole_batch_run(reference, batches, make_optimizer,
                                  gradients=None if uniform else stepped)
    compared = assert_same_values(output, expected, range(STEPS))
    assert compared > 30 * STEPS
    for step in range(STEPS):
        assert output[step]["HessMaxEV"] is None
        assert "whole batch's graph" in notes[step]["HessMaxEV"]
        assert output[step]["BatchSize"] == sum(sizes)
    assert all(output[step]["Alpha"] is not None for step in range(STEPS - 1))


ALONE = ["InnerTest", "OrthoTest", "NormTest", "GradientNoiseScale", "GradHist1d",
         "MeanGSNR", "EarlyStopping", "CABS", "TICDiag", "HessTrace"]


@pytest.mark.parametrize("name", ALONE)
def test_each_per_sample_instrument_alone_equals_one_backward_on_the_union(name):
    """An instrument tracked alone (the statistics it needs formed for it only: InnerTest's
    g_nᵀḡ alone was left unformed and read 0.0 when split over micro-batches)."""
    problem = make_problem("mlp_relu", 48)
    batches = batches_of(problem, 2, 12)
    chosen = [getattr(quantities, name)()]
    output, _, _ = accumulated_run(problem, batches, [5, 7], "sum/total", sgd,
                                   chosen=chosen)
    expected, _ = whole_batch_run(make_problem("mlp_relu", 48), batches, sgd,
                                  chosen=[getattr(quantities, name)()])
    assert assert_same_values(output, expected, range(2)) >= 2


def test_accumulation_is_learned_at_its_first_step_and_exact_afterwards():
    """Without grad_accumulation=True the first accumulated step has no values that need
    the union's mean gradient (with the reason), never a micro-batch's."""
    problem = make_problem("mlp_relu", 48)
    batches = batches_of(problem, STEPS, 12)
    reference = make_problem("mlp_relu", 48)
    with pytest.warns(RuntimeWarning, match="gradient accumulation"):
        output, notes, _ = accumulated_run(problem, batches, [6, 6], "mean/k", sgd, hint=False)
    expected, _ = whole_batch_run(reference, batches, sgd)
    for name in ("InnerTest", "OrthoTest", "Alpha"):
        assert output[0][name] is None
        assert "accumulated over micro-batches" in notes[0][name]
    assert_same_values(output, expected, [0], skip={"InnerTest", "OrthoTest", "Alpha"})
    assert_same_values(output, expected, range(1, STEPS))


def test_a_different_step_number_per_micro_batch_is_reported():
    problem = make_problem("mlp_relu", 12)
    opt = sgd(problem.model)
    cockpit = Cockpit(problem.model, [quantities.NormTest()], optimizer=opt)
    opt.zero_grad()
    with pytest.warns(RuntimeWarning, match="give them the same step number"):
        for micro in range(2):
            losses = problem.loss_fn(problem.model(problem.x[micro::2]), problem.y[micro::2])
            with cockpit(micro, losses=losses):
                (losses.mean() / 2).backward()
    opt.step()
    cockpit.close()


def test_nested_blocks_are_refused_and_training_goes_on():
    problem = make_problem("mlp_relu", 8)
    cockpit = Cockpit(problem.model, [quantities.NormTest()])
    losses = problem.losses()
    with (cockpit(0, losses=losses), pytest.raises(RuntimeError, match="nested"),
          cockpit(0, losses=losses)):
        pass
    cockpit.close()


def test_values_are_recorded_when_the_step_is_complete():
    """A sink sees a step once, with the union's values, when they are read after the
    optimizer step (at the next step, get_output() or close(): the step never waits for the
    device)."""
    problem = make_problem("mlp_relu", 16)
    opt = sgd(problem.model)
    written = []

    class Sink:
        def write_step(self, step, values, notes):
            written.append((step, dict(values)))

        def close(self):
            pass

    cockpit = Cockpit(problem.model, [quantities.Loss()], optimizer=opt, sinks=[Sink()],
                      grad_accumulation=True)
    expected = problem.losses().mean().item()
    opt.zero_grad()
    for micro in range(2):
        losses = problem.loss_fn(problem.model(problem.x[micro::2]), problem.y[micro::2])
        with cockpit(0, losses=losses):
            (losses.mean() / 2).backward()
        assert written == []  # not before the step is complete
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert written == []  # on its way from the device
    cockpit.get_output()
    assert [s for s, _ in written] == [0]
    assert written[0][1]["Loss"] == pytest.approx(expected, rel=1e-12)
    cockpit.close()


def test_reading_values_between_micro_batches_leaves_the_step_whole():
    """A checkpoint (state_dict) or a callback (get_output, get_notes) between two
    micro-batches of a step: the step is not complete there, so it is not cut short (it was
    recorded as its first micro-batch, and the second refused as a step number seen
    before); the values equal those of a run that never looked."""
    problem = make_problem("mlp_relu", 48)
    batches = batches_of(problem, STEPS, 12)

    def run(look: bool):
        model = make_problem("mlp_relu", 48).model
        opt = sgd(model)
        cockpit = Cockpit(model, instruments(), optimizer=opt, strict=True,
                          grad_accumulation=True)
        states = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for step, (x, y) in enumerate(batches):
                opt.zero_grad()
                for part in (slice(0, 5), slice(5, 12)):
                    losses = problem.loss_fn(model(x[part]), y[part])
                    with cockpit(step, losses=losses):
                        (losses.sum() / 12).backward()
                    if look and part.start == 0:
                        states.append(cockpit.state_dict())
                        cockpit.get_output()
                        cockpit.get_notes()
                opt.step()
        cockpit.close()
        return cockpit.get_output(), states

    looked, states = run(look=True)
    expected, _ = run(look=False)
    assert assert_same_values(looked, expected, range(STEPS)) > 30 * STEPS
    assert all(looked[step]["BatchSize"] == 12 for step in range(STEPS))
    assert [state["last_step"] for state in states] == list(range(STEPS))
