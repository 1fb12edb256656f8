"""Loops Cockpit cannot describe: each is detected, and its instruments are either right or
None with a note naming the cause and the way out (warned once) — never a plausible value
of some other batch, loss or model. References are computed without hooks (torch.func,
a twin run without Cockpit); training itself is never changed."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, configuration
from tests.reference import individual_gradients

N = 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()


def _data(n: int = N, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g))


def _ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _grad_norm_reference(model: nn.Module, x, y) -> float:
    """‖(1/N) Σ_n ∇ℓ_n‖ by torch.func, without hooks."""
    g = individual_gradients(model, _ce, x, y)
    return float(torch.cat([v.mean(0).flatten() for v in g.values()]).norm())


def _run(loop, steps: int = 4, quantities="economy"):
    """Train with Cockpit: ``loop(cockpit, step, model, x, y)`` does one step's blocks.
    Gives output, notes, warning messages, final params and the GradNorm references (ref)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, configuration(quantities) if isinstance(quantities, str)
                      else quantities, optimizer=opt)
    x, y = _data()
    references = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            references[step] = _grad_norm_reference(model, x, y)
            opt.zero_grad()
            loop(cockpit, step, model, x, y)
            opt.step()
        cockpit.close()
    return SimpleNamespace(output=cockpit.get_output(), notes=cockpit.get_notes(),
                           messages=[str(w.message) for w in caught],
                           params=[p.detach().clone() for p in model.parameters()],
                           ref=references)


def _twin(loop, steps: int = 4):
    """The same training without Cockpit: its final parameters."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()

    class _NoCockpit:
        def __call__(self, step, losses=None):
            return _Null()

    for step in range(steps):
        opt.zero_grad()
        loop(_NoCockpit(), step, model, x, y)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _assert_training_unchanged(loop, params):
    for a, b in zip(params, _twin(loop), strict=True):
        assert torch.equal(a, b)


def _plain_loop(cockpit, step, model, x, y):
    """One block per step around one backward pass of the batch's mean loss."""
    losses = _ce(model(x), y)
    with cockpit(step, losses=losses):
        losses.mean().backward()


def _once(messages: list[str], fragment: str) -> None:
    found = [m for m in messages if fragment in m]
    assert len(found) == 1, (fragment, messages)


GRADIENT_READERS = ("GradNorm", "GradHist1d", "NormTest", "InnerTest", "OrthoTest")


def test_a_plain_loop_matches_the_reference():
    """The control: one backward pass per block gives GradNorm = ‖ḡ‖ of torch.func."""
    r = _run(_plain_loop)
    output, _notes, messages, _params, ref = r.output, r.notes, r.messages, r.params, r.ref
    assert messages == []
    for step in range(4):
        assert output[step]["GradNorm"] == pytest.approx(ref[step], rel=1e-10)


def test_two_backward_passes_in_one_block_record_none_with_the_reason():
    def loop(cockpit, step, model, x, y):
        losses = _ce(model(x), y)
        with cockpit(step, losses=losses):
            losses.mean().backward(retain_graph=True)
            (0.5 * losses.mean()).backward()

    r = _run(loop)
    output, notes, messages, params, _ref = r.output, r.notes, r.messages, r.params, r.ref
    _once(messages, "two backward passes inside one")
    for step in range(4):
        for name in GRADIENT_READERS:
            assert output[step][name] is None, (step, name, output[step][name])
            assert "two backward passes" in notes[step][name]
        assert output[step]["Loss"] is not None
    _assert_training_unchanged(loop, params)


def test_a_second_block_through_the_same_forward_pass_is_named():
    def loop(cockpit, step, model, x, y):
        losses = _ce(model(x), y)
        with cockpit(step, losses=losses):
            losses.mean().backward(retain_graph=True)
        with cockpit(step, losses=losses):
            losses.mean().backward()

    r = _run(loop)
    output, notes, messages, _params, _ref = r.output, r.notes, r.messages, r.params, r.ref
    assert not any("did not see this step's forward pass" in m for m in messages), messages
    _once(messages, "a second backward pass through the forward pass")
    for step in range(4):
        for name in GRADIENT_READERS:
            assert output[step][name] is None
            assert "second backward pass" in notes[step][name]


@pytest.mark.parametrize("kind", ["other_batch", "random", "detached", "unconnected"])
def test_losses_that_are_not_backpropagated_record_none(kind):
    def loop(cockpit, step, model, x, y):
        losses = _ce(model(x), y)
        if kind == "other_batch":
            passed = _ce(model(x[:5]), y[:5])
        elif kind == "random":
            passed = torch.randn(N, dtype=torch.float64)
        elif kind == "unconnected":  # a graph of its own, not the model's forward pass
            passed = 2 * torch.randn(N, dtype=torch.float64, requires_grad=True)
        else:
            passed = losses.detach()
        with cockpit(step, losses=passed):
            losses.mean().backward()

    r = _run(loop)
    output, notes, messages, params, _ref = r.output, r.notes, r.messages, r.params, r.ref
    _once(messages, "did not go through the `losses` passed")
    assert not any("torch.compile" in m or "did not see this step's forward pass" in m
                   for m in messages), messages
    for step in range(4):
        for name in (*GRADIENT_READERS, "Loss", "BatchSize"):
            assert output[step][name] is None, (kind, step, name, output[step][name])
            assert "did not go through the `losses`" in notes[step][name]
    _assert_training_unchanged(loop, params)


def test_integer_losses_are_refused():
    model = _model()
    cockpit = Cockpit(model, configuration("economy"))
    x, y = _data()
    loss = _ce(model(x), y).mean()
    with (pytest.raises(TypeError, match="floating-point individual losses"),
          cockpit(0, losses=torch.ones(N, dtype=torch.long))):
        loss.backward()


def test_backpropagating_part_of_the_losses_records_no_gradient_norm():
    """8 losses passed, losses[:5].mean() backpropagated: ‖∇‖ is that of the 5 samples
    (torch.func), which no recorded value may pretend to be (0.347 was recorded)."""

    def loop(cockpit, step, model, x, y):
        losses = _ce(model(x), y)
        with cockpit(step, losses=losses):
            losses[:5].mean().backward()

    r = _run(loop)
    output, notes, messages, _params, _ref = r.output, r.notes, r.messages, r.params, r.ref
    _once(messages, "weights the individual losses unequally")
    for step in range(4):
        for name in GRADIENT_READERS:
            assert output[step][name] is None
            assert "unequally" in notes[step][name]


@pytest.mark.parametrize("config", ["economy", "full"])
def test_an_empty_batch_never_crashes_the_users_backward(config):
    def loop(cockpit, step, model, x, y):
        n = 0 if step == 1 else N
        losses = _ce(model(x[:n]), y[:n])
        with cockpit(step, losses=losses):
            losses.mean().backward()

    r = _run(loop, quantities=config)
    output, notes, messages, params, ref = r.output, r.notes, r.messages, r.params, r.ref
    _once(messages, "the batch is empty")
    assert not any("failed at step 1" in m for m in messages), messages
    for name, value in output[1].items():
        if name.split("/")[0] not in ("Distance", "UpdateSize", "ParamNorm", "UpdateRatio",
                                      "LearningRate", "GradientHeld", "GradientMismatch"):
            assert value is None, (name, value)
    assert "the batch is empty" in notes[1]["GradNorm"]
    assert "the batch is empty" in notes[1]["DeadUnits"]
    for step in (0, 2, 3):
        assert output[step]["GradNorm"] == pytest.approx(ref[step], rel=1e-10)
    _assert_training_unchanged(loop, params)


@pytest.mark.parametrize("change", ["append", "replace", "unfreeze"])
def test_parameters_changed_mid_training_record_none_with_the_reason(change):
    model = _model()
    if change == "unfreeze":
        model[0].weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt)
    x, y = _data()
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            if step == 2:
                if change == "append":
                    model.append(nn.ReLU())
                    model.append(nn.Linear(3, 3).double())
                    opt.add_param_group({"params": model[4].parameters(), "lr": 0.5})
                elif change == "replace":
                    model[2] = nn.Linear(6, 3).double()
                    opt.add_param_group({"params": model[2].parameters()})
                else:
                    model[0].weight.requires_grad_(True)
            opt.zero_grad()
            losses = _ce(model(x), y)
            seen.append(float(losses.detach().mean()))
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()
    messages = [str(w.message) for w in caught]
    _once(messages, "the model's parameters changed after Cockpit was created")
    output, notes = cockpit.get_output(), cockpit.get_notes()
    assert output[1]["GradNorm"] is not None
    for step in (2, 3):
        for name, value in output[step].items():
            if name not in ("Loss", "BatchSize"):
                assert value is None, (change, step, name, value)
        for name in ("GradNorm", "GradHist1d", "UpdateSize", "Distance", "LearningRate"):
            assert "parameters changed" in notes[step][name]
        assert output[step]["Loss"] == pytest.approx(seen[step], rel=1e-12)


def test_a_step_number_that_goes_back_is_not_recorded_over_a_recorded_step():
    """Steps 0,1,2,3,4,2,6,0: step 0 keeps the first iteration's loss (it held the 8th)."""
    order = [0, 1, 2, 3, 4, 2, 6, 0]
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt)
    x, y = _data()
    losses_seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in order:
            opt.zero_grad()
            losses = _ce(model(x), y)
            losses_seen.append(float(losses.detach().mean()))
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()
    messages = [str(w.message) for w in caught]
    _once(messages, "comes after step 4")
    output = cockpit.get_output()
    assert sorted(output) == [0, 1, 2, 3, 4, 6]
    for i, step in enumerate(order[:5]):
        assert output[step]["Loss"] == pytest.approx(losses_seen[i], rel=1e-12)
    assert output[6]["Loss"] == pytest.approx(losses_seen[6], rel=1e-12)


def test_skipping_the_optimizer_step_after_a_non_finite_loss_gives_no_micro_batch_warning():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt)
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            opt.zero_grad()
            xs = x * float("nan") if step == 1 else x
            losses = _ce(model(xs), y)
            with cockpit(step, losses=losses):
                losses.mean().backward()
            if torch.isfinite(losses).all():
                opt.step()
        cockpit.close()
    messages = [str(w.message) for w in caught]
    assert any("non-finite loss" in m for m in messages)
    assert not any("not followed by optimizer.step()" in m for m in messages), messages


@pytest.mark.parametrize("where", ["_snapshot", "finish_update"])
def test_a_failure_of_cockpits_work_in_the_optimizer_step_never_stops_training(where,
                                                                            monkeypatch):
    """Out of memory while Cockpit copies θ_t inside ``optimizer.step()`` (or while it forms
    the update's instruments after it) at step 1: the step goes on, training matches a run
    without Cockpit, step 1's instruments that got no value are None with the error, the
    other steps are recorded as usual."""
    from cockpit.step.tracked_step import TrackedStep

    original = getattr(TrackedStep, where)

    def failing(self, *args):
        if self.step == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return original(self, *args)

    monkeypatch.setattr(TrackedStep, where, failing)
    r = _run(_plain_loop)
    _assert_training_unchanged(_plain_loop, r.params)
    _once(r.messages, "step 1: Cockpit's work")
    assert any("out of memory" in m for m in r.messages if "step 1: Cockpit's work" in m)
    output, notes = r.output, r.notes
    for name in ("UpdateSize", "Alpha"):
        assert output[1][name] is None
        assert "out of memory (simulated)" in notes[1][name]
    for step in (0, 2):
        assert all(output[step][name] is not None for name in ("UpdateSize", "Alpha", "Loss"))
    assert output[3]["UpdateSize"] is not None and output[1]["GradNorm"] is not None


def test_a_failure_of_cockpits_work_is_raised_when_strict(monkeypatch):
    from cockpit.step.tracked_step import TrackedStep

    def failing(self, *args):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(TrackedStep, "_snapshot", failing)
    model = _model()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt, strict=True)
    opt.zero_grad()
    _plain_loop(cockpit, 0, model, x, y)
    with pytest.raises(RuntimeError, match="out of memory"):
        opt.step()
