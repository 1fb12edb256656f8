"""Alpha against brute force: individual gradients by torch.func at both ends of every step,
the real update from parameter snapshots, and an independent weighted least-squares fit."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from cockpit import Cockpit, at, every, logspaced, quantities
from cockpit.engine import update_fit
from cockpit.engine import update_prediction as up
from cockpit.engine.histograms import device as histogram_device
from tests.models import make_problem, train
from tests.reference import flat, individual_gradients


def reference_alpha(loss0, g0, loss1, g1, s) -> float:
    """α from eq. (9)–(10) with τ = 0 and τ = ‖s‖, written out independently."""
    t = s.norm().item()
    d0, d1 = (g0 @ s / t).numpy(), (g1 @ s / t).numpy()
    l0, l1 = loss0.numpy(), loss1.numpy()
    f = np.array([l0.mean(), l1.mean(), d0.mean(), d1.mean()])
    var = np.array([l0.var(), l1.var(), d0.var(), d1.var()])
    phi = np.array([[1, 1, 0, 0], [0, t, 1, 1], [0, t**2, 0, 2 * t]], dtype=float)
    w = np.linalg.lstsq(phi.T / np.sqrt(var)[:, None], f / np.sqrt(var), rcond=None)[0]
    if w[2] <= 0:
        return -1.0
    return 2 * t / (-w[1] / w[2]) - 1


class Recorder:
    """Trains with Cockpit and keeps what the reference needs: θ_t and the batch of each step."""

    def __init__(self, problem, optimizer_fn, schedule, steps, clip=None, seed=0,
                 before_step=None, after_step=None):
        torch.manual_seed(seed)
        self.problem = problem
        model = problem.model
        self.opt = optimizer_fn(model.parameters())
        self.cockpit = Cockpit(model, [quantities.Alpha(schedule)], optimizer=self.opt,
                               strict=True)
        self.thetas, self.batches = [], []
        n = problem.x.shape[0]
        generator = torch.Generator().manual_seed(seed)
        for step in range(steps):
            idx = torch.randint(0, n, (n,), generator=generator)
            x, y = problem.x[idx], problem.y[idx]
            self.thetas.append(copy.deepcopy(model.state_dict()))
            self.batches.append((x, y))
            self.opt.zero_grad()
            losses = problem.loss_fn(model(x), y)
            with self.cockpit(step, losses=losses):
                losses.mean().backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            if before_step is not None:  # the user's code between backward and step
                before_step(step, self.opt)
            self.opt.step()
            if after_step is not None:
                after_step(step, self.opt)
        self.thetas.append(copy.deepcopy(model.state_dict()))
        self.cockpit.close()

    def reference(self, step: int) -> float:
        model = copy.deepcopy(self.problem.model)
        names = [k for k, p in model.named_parameters() if p.requires_grad]
        ends = []
        for k in (step, step + 1):
            model.load_state_dict(self.thetas[k])
            x, y = self.batches[k]
            grads = individual_gradients(model, self.problem.loss_fn, x, y)
            losses = self.problem.loss_fn(model(x), y).detach()
            ends.append((losses, flat(grads, names)))
        s = torch.cat([(self.thetas[step + 1][k] - self.thetas[step][k]).flatten().double()
                       for k in names])
        return reference_alpha(ends[0][0], ends[0][1], ends[1][0], ends[1][1], s)


class CustomSGD(torch.optim.Optimizer):
    """A user's optimizer Cockpit cannot predict: sign-SGD with a decaying step."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["k"] = state.get("k", 0) + 1
                    p.add_(torch.sign(p.grad) + 0.3 * p.grad, alpha=-group["lr"] / state["k"])


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum_nesterov_wd": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd_dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, dampening=0.3),
    "sgd_momentum_wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adam_amsgrad_wd": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, fused=True),
    "rmsprop_centered_momentum": lambda p: torch.optim.RMSprop(
        p, lr=0.005, centered=True, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01),
    "custom": lambda p: CustomSGD(p, lr=0.01),
}


def check(recorder: Recorder, steps: list[int], tol=1e-6):
    out = recorder.cockpit.get_output()
    notes = recorder.cockpit.get_notes()
    for step in steps:
        expected = recorder.reference(step)
        actual = out[step]["Alpha"]
        assert actual is not None, notes.get(step)
        assert math.isclose(actual, expected, rel_tol=tol, abs_tol=tol), (step, actual, expected)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("name", ["mlp_relu", "cnn"])
def test_alpha_matches_brute_force(name, opt):
    problem = make_problem(name, 6)
    rec = Recorder(problem, OPTIMIZERS[opt], every(1), 4)
    check(rec, [0, 1, 2])


@pytest.mark.parametrize("name", ["transformer", "custom"])
def test_alpha_after_the_step_reads_the_layers_at_the_steps_start(name):
    """The general path projects the kept layer calls on s_t after the optimizer step: layers
    whose individual gradients depend on their own parameters (attention, a custom layer:
    the torch.func fallback) are evaluated at θ_t, not at the θ_{t+1} the step wrote."""
    problem = make_problem(name, 6)
    rec = Recorder(problem, OPTIMIZERS["custom"], every(1), 4)
    check(rec, [0, 1, 2])


@pytest.mark.parametrize("opt", ["sgd", "sgd_momentum_nesterov_wd", "sgd_momentum_wd", "custom"])
def test_alpha_with_gradient_clipping(opt):
    problem = make_problem("mlp_relu", 6)
    rec = Recorder(problem, OPTIMIZERS[opt], every(1), 4, clip=0.05)
    check(rec, [0, 1, 2])


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("opt", [k for k in OPTIMIZERS if k.startswith("sgd")])
def test_alpha_on_the_accelerators_path(opt, clip, monkeypatch):
    """As on a GPU: SGD's basis rows kept as they are in the hooks and copied at the end of
    the backward pass, all parameters' at once, into the rows of the batched fit, before
    the user's code (clipping edits the gradient in place) and the optimizer step (which
    changes θ and the momentum buffer in place); α equals brute force, and every fit took
    that path."""
    monkeypatch.setattr(histogram_device, "_forced", True)
    packed = []
    fit_in_blocks = update_fit._fit_in_blocks

    def spy(problems, device, packed_bases=None):
        packed.append(packed_bases is not None)
        return fit_in_blocks(problems, device, packed_bases)

    monkeypatch.setattr(update_fit, "_fit_in_blocks", spy)
    rec = Recorder(make_problem("mlp_relu", 6), OPTIMIZERS[opt], every(1), 4, clip=clip)
    check(rec, [0, 1, 2])
    assert len(packed) == 4 and all(packed), packed


def test_a_failed_copy_of_the_basis_leaves_alpha_not_computed(monkeypatch):
    """The copy at the end of the backward pass runs inside autograd: should it fail, the
    user's backward pass goes on and α of that step is not computed, with the reason."""
    monkeypatch.setattr(histogram_device, "_forced", True)

    def broken(*args, **kwargs):
        raise RuntimeError("no memory left")

    monkeypatch.setattr(update_fit, "PackedBases", broken)
    problem = make_problem("mlp_relu", 6)
    opt = OPTIMIZERS["sgd_momentum_wd"](problem.model.parameters())
    cockpit = Cockpit(problem.model, [quantities.Alpha(every(1))], optimizer=opt)
    with pytest.warns(RuntimeWarning, match="could not be copied"):
        train(problem, cockpit, 2, opt)
        cockpit.close()
    assert cockpit.get_output()[0]["Alpha"] is None
    assert "could not be copied: no memory left" in cockpit.get_notes()[0]["Alpha"]


@pytest.mark.parametrize("opt", ["adam_amsgrad_wd", "adamw", "rmsprop_centered_momentum"])
def test_small_parameters_are_predicted_together_at_the_end_of_the_backward_pass(
        opt, monkeypatch):
    """On the accelerators' path the biases' individual gradients wait for the end of the
    backward pass, where one call predicts all their updates (Adam: multi-tensor kernels);
    the weights are predicted in their hooks. α equals brute force, as before."""
    monkeypatch.setattr(histogram_device, "_forced", True)
    batched, single = [], []
    many, one = up.predict_updates, up.predict_update

    def spy_many(optimizer, params, grads, **options):
        batched.append(len(params))
        return many(optimizer, params, grads, **options)

    def spy_one(optimizer, param, grad, **options):
        single.append(param.dim())
        return one(optimizer, param, grad, **options)

    monkeypatch.setattr(up, "predict_updates", spy_many)
    monkeypatch.setattr(up, "predict_update", spy_one)
    problem = make_problem("cnn", 6)
    biases = sum(1 for k, _ in problem.model.named_parameters() if k.endswith("bias"))
    rec = Recorder(problem, OPTIMIZERS[opt], every(1), 4)
    check(rec, [0, 1, 2])
    assert batched == [biases] * 4  # one call per step (4 tracked backward passes)
    if opt.startswith("adam"):  # (the others predict one parameter at a time inside)
        assert 1 not in single  # no bias predicted alone


def test_a_failed_batched_prediction_leaves_alpha_not_computed(monkeypatch):
    """The batched prediction runs inside autograd, at the end of the backward pass: should
    it fail, the user's training goes on and α of that step is not computed, with the
    reason."""

    def broken(*args, **kwargs):
        raise RuntimeError("no memory left")

    monkeypatch.setattr(histogram_device, "_forced", True)
    monkeypatch.setattr(up, "predict_updates", broken)
    problem = make_problem("mlp_relu", 6)
    opt = OPTIMIZERS["adam"](problem.model.parameters())
    cockpit = Cockpit(problem.model, [quantities.Alpha(every(1))], optimizer=opt)
    before = copy.deepcopy(problem.model.state_dict())
    train(problem, cockpit, 2, opt)
    cockpit.close()
    assert any(not torch.equal(before[k], v) for k, v in problem.model.state_dict().items())
    assert cockpit.get_output()[0]["Alpha"] is None
    assert "no memory left" in cockpit.get_notes()[0]["Alpha"]


@pytest.mark.parametrize("schedule,steps", [(every(3), [0, 3, 6]),
                                            (logspaced(8, 5), [0, 1, 2, 4, 8])])
def test_alpha_with_sparse_schedules(schedule, steps):
    problem = make_problem("mlp_sigmoid", 5)
    rec = Recorder(problem, OPTIMIZERS["adam"], schedule, 10)
    output = rec.cockpit.get_output()
    assert sorted(s for s, v in output.items() if v.get("Alpha") is not None) == steps
    # a scheduled step without the next one (the last) is None with the reason
    assert all(output[s]["Alpha"] is None and "next step" in rec.cockpit.get_notes()[s]["Alpha"]
               for s, v in output.items() if "Alpha" in v and s not in steps)
    check(rec, steps)


@pytest.mark.parametrize("optimizer", ["sgd_momentum_wd", "adam"])
def test_the_step_that_only_observes_theta_next_copies_no_parameters(optimizer, monkeypatch):
    """α_t's second observation (step t + 1, not a start) reads no update: θ is copied before
    the optimizer step only where α starts; α stays the brute-force value."""
    from cockpit.step import tracked_step

    snapshots: list[int] = []
    original = tracked_step.TrackedStep._snapshot

    def counted(self, data, stats):
        snapshots.append(self.step)
        return original(self, data, stats)

    monkeypatch.setattr(tracked_step.TrackedStep, "_snapshot", counted)
    problem = make_problem("mlp_sigmoid", 5)
    rec = Recorder(problem, OPTIMIZERS[optimizer], every(3), 8)
    assert snapshots == [0, 3, 6]  # (before: [0, 1, 3, 4, 6, 7])
    check(rec, [0, 3, 6])


def test_adam_with_clipping_is_detected_and_falls_back_to_the_general_path():
    problem = make_problem("mlp_relu", 6)
    with pytest.warns(RuntimeWarning, match="general path"):
        rec = Recorder(problem, OPTIMIZERS["adam"], every(1), 5, clip=1e-3)
    out, notes = rec.cockpit.get_output(), rec.cockpit.get_notes()
    failed = [s for s in range(4) if out[s].get("Alpha") is None]
    assert failed, "clipping changed Adam's update; the prediction must not be trusted"
    assert "does not match" in notes[failed[0]]["Alpha"]
    later = [s for s in range(failed[0] + 1, 4)]
    check(rec, later)


def test_state_edited_behind_the_optimizers_back_is_detected():
    """Adam: the prediction no longer matches the real update → None, note, warning."""
    problem = make_problem("mlp_relu", 6)
    model = problem.model
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cockpit = Cockpit(model, [quantities.Alpha(at([2]))], optimizer=opt)
    with pytest.warns(RuntimeWarning, match="Alpha at step 2"):
        for step in range(4):
            opt.zero_grad()
            losses = problem.losses()
            with cockpit(step, losses=losses):
                losses.mean().backward()
            if step == 2:  # edit a moment estimate between backward and step
                first = next(iter(model.parameters()))
                opt.state[first]["exp_avg"].mul_(3.0)
            opt.step()
    assert cockpit.get_output()[2]["Alpha"] is None
    assert "does not match" in cockpit.get_notes()[2]["Alpha"]
    cockpit.close()


def test_sgd_momentum_buffer_edited_is_still_exact():
    """SGD updates lie in span(gradient, parameter, old buffer) whatever the buffer holds, so
    a rescaled buffer is handled exactly rather than rejected (on the predicted path)."""
    problem = make_problem("mlp_relu", 6)

    def rescale(step, opt):
        for state in opt.state.values():
            state["momentum_buffer"].mul_(3.0)

    rec = Recorder(problem, OPTIMIZERS["sgd_dampening"], every(1), 5, before_step=rescale,
                   after_step=rescale)
    assert rec.cockpit.quantities[0].predict
    check(rec, [0, 1, 2, 3])


@pytest.mark.parametrize("opt,expected", [("sgd_dampening", 1), ("sgd_momentum_wd", 2)])
@pytest.mark.cpu_path
def test_sgd_momentum_projects_on_the_previous_update_once(monkeypatch, opt, expected):
    """Tracked every step with momentum SGD, s_{t−1} = −lr·b_old spans the buffer's part of the
    next update: each Linear weight gets one projection per step for s_{t−1} and the buffer
    (plus one for θ with weight decay; the gradient's is the Gram closed form), and α stays
    exact."""
    from cockpit.engine.rules.sample_grads import OuterSampleGrads

    directions: list[int] = []
    original = OuterSampleGrads.dots_many

    def counting(self, us):
        directions.append(len(us))
        return original(self, us)

    monkeypatch.setattr(OuterSampleGrads, "dots_many", counting)
    problem = make_problem("mlp_relu", 6)
    rec = Recorder(problem, OPTIMIZERS[opt], every(1), 4)
    assert directions and max(directions) == expected, directions
    check(rec, [0, 1, 2])


def test_sgd_momentum_buffer_edited_between_steps_is_detected():
    """The buffer's row is s_{t−1}; a buffer edited after the step (not a rescaling) puts the
    next update outside the span: that step is not computed, later ones are exact."""
    problem = make_problem("mlp_relu", 6)

    def reset_half(step, opt):
        if step == 1:
            buffer = next(iter(opt.state.values()))["momentum_buffer"]
            buffer.view(-1)[: buffer.numel() // 2].zero_()

    with pytest.warns(RuntimeWarning, match="Alpha at step 2"):
        rec = Recorder(problem, OPTIMIZERS["sgd_dampening"], every(1), 5, after_step=reset_half)
    out, notes = rec.cockpit.get_output(), rec.cockpit.get_notes()
    assert out[2]["Alpha"] is None
    assert "not an SGD step of the predicted form" in notes[2]["Alpha"]
    check(rec, [0, 1, 3])


def test_learning_rate_change_between_backward_and_step_is_corrected():
    problem = make_problem("mlp_relu", 6)
    rec_model = problem.model
    opt = torch.optim.Adam(rec_model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    class Wrapped:
        pass

    thetas, batches = [], []
    cockpit = Cockpit(rec_model, [quantities.Alpha()], optimizer=opt, strict=True)
    for step in range(3):
        thetas.append(copy.deepcopy(rec_model.state_dict()))
        batches.append((problem.x, problem.y))
        opt.zero_grad()
        losses = problem.losses()
        with cockpit(step, losses=losses):
            losses.mean().backward()
        for group in opt.param_groups:  # scheduler-like change after the backward pass
            group["lr"] *= 0.7
        opt.step()
        sched.step()
    thetas.append(copy.deepcopy(rec_model.state_dict()))
    cockpit.close()
    rec = Wrapped()
    rec.problem, rec.thetas, rec.batches, rec.cockpit = problem, thetas, batches, cockpit
    for step in (0, 1):
        expected = Recorder.reference(rec, step)
        assert math.isclose(cockpit.get_output()[step]["Alpha"], expected, rel_tol=1e-6)


def predicted_steps(monkeypatch) -> list[int]:
    """The steps whose α takes the predicted path (Alpha registers its provider of the
    update's directions), filled in as they begin."""
    provided: list[int] = []
    provider = quantities.Alpha._provider

    def spy(self, optimizer, state, *args):
        provided.append(state.step)
        return provider(self, optimizer, state, *args)

    monkeypatch.setattr(quantities.Alpha, "_provider", spy)
    return provided


@pytest.mark.parametrize("accelerator_path", [False, True])
def test_fused_adamw_stays_on_the_predicted_path(accelerator_path, monkeypatch):
    """AdamW(fused=True), common on GPUs, is predicted by its own kernel (biases together
    on the accelerators' path): α from the projections formed in the backward pass, equal
    to brute force, without keeping the layers' calls for the general path."""
    monkeypatch.setattr(histogram_device, "_forced", accelerator_path)
    provided = predicted_steps(monkeypatch)
    rec = Recorder(make_problem("cnn", 6), OPTIMIZERS["adamw_fused"], every(1), 4)
    check(rec, [0, 1, 2])
    assert provided == [0, 1, 2, 3]  # every step on the predicted path


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_tiny_steps_in_float32_stay_on_the_predicted_path(opt):
    """With a small learning rate, θ_{t+1} − θ_t carries the float32 rounding of θ_{t+1}
    (relative error ≈ ε|θ|/|s|, here far above rtol); the check must allow for it instead of
    declaring every step a mismatch."""
    problem = make_problem("cnn", 8, dtype=torch.float32)
    model = problem.model
    with torch.no_grad():
        for p in model.parameters():
            p.add_(3.0)  # large |θ| against the update
    optimizer = (torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9) if opt == "sgd"
                 else torch.optim.Adam(model.parameters(), lr=1e-7))
    alpha = quantities.Alpha()
    cockpit = Cockpit(model, [alpha], optimizer=optimizer)
    train(problem, cockpit, 4, optimizer)
    cockpit.close()
    assert alpha.predict
    assert all(cockpit.get_output()[s]["Alpha"] is not None for s in range(3))


def test_fixed_batch_momentum_sgd_stays_on_the_predicted_path():
    """Full-batch momentum SGD: consecutive gradients (and so the gradient and the previous
    update) are nearly parallel. The update fit must not mistake this for a mismatch
    (float32 normal equations did, for a few parameters, and Alpha left the fast path)."""
    failures = 0
    for seed in range(20):
        torch.manual_seed(seed)
        model = nn.Linear(16, 4)
        x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        alpha = quantities.Alpha()
        cockpit = Cockpit(model, [alpha], optimizer=optimizer)
        for step in range(8):
            optimizer.zero_grad()
            losses = nn.functional.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            optimizer.step()
        cockpit.close()
        failures += not alpha.predict
        assert all(cockpit.get_output()[s]["Alpha"] is not None for s in range(7))
    assert failures == 0


def test_a_skipped_step_number_leaves_alpha_none_with_the_step_that_came():
    """Step numbers 0, 1, 3, 4 (a batch left out): α_1 needs θ_2, which no step observed;
    recorded as None with that reason when step 3 comes, the other steps' α as usual."""
    problem = make_problem("mlp_relu", 8)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.1)
    cockpit = Cockpit(problem.model, [quantities.Alpha()], optimizer=opt)
    for step in (0, 1, 3, 4):
        opt.zero_grad()
        losses = problem.losses()
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
        if step == 3:  # (decided at step 3, not at the run's end)
            note = cockpit.get_notes()[1]["Alpha"]
            assert "no step 2 observed θ_(t+1) (the next step described was 3" in note
    cockpit.close()
    output, notes = cockpit.get_output(), cockpit.get_notes()
    assert output[1]["Alpha"] is None
    assert math.isfinite(output[0]["Alpha"]) and math.isfinite(output[3]["Alpha"])
    assert output[4]["Alpha"] is None and "no such step came before the run ended" in notes[4][
        "Alpha"]


def test_an_optimizer_step_under_a_repeated_step_number_leaves_alpha_none():
    """Step numbers 0, 1, 1, 2 with an optimizer step after each block: the second "1" is
    not recorded, but its optimizer step moves θ, so step 2 observes θ after two updates,
    not θ_1 + s_1. α_1 is None with the reason (it was the fit at the wrong point: −0.895
    for −0.945); α_0 and α_2 are those of the same trajectory numbered 0, 1, 2, 3, 4."""
    def run(numbers):
        problem = make_problem("mlp_relu", 16)
        opt = torch.optim.SGD(problem.model.parameters(), lr=0.1)
        cockpit = Cockpit(problem.model, [quantities.Alpha()], optimizer=opt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the repeated number is warned)
            for i, step in enumerate(numbers):
                opt.zero_grad()
                part = slice(4 * (i % 4), 4 * (i % 4) + 4)
                x, y = problem.x[part], problem.y[part]
                losses = problem.loss_fn(problem.model(x), y)
                with cockpit(step, losses=losses):
                    losses.mean().backward()
                opt.step()
        cockpit.close()
        return cockpit.get_output(), cockpit.get_notes()

    output, notes = run([0, 1, 1, 2, 3])
    plain, _ = run([0, 1, 2, 3, 4])
    assert output[1]["Alpha"] is None
    assert "stepped 2 times" in notes[1]["Alpha"]
    assert output[0]["Alpha"] == pytest.approx(plain[0]["Alpha"], rel=1e-12)
    assert output[2]["Alpha"] == pytest.approx(plain[3]["Alpha"], rel=1e-12)


class OwnSGD(torch.optim.SGD):
    """An optimizer of its own whose step() calls SGD's."""

    def step(self, closure=None):
        return super().step(closure)


def test_a_subclass_calling_its_parents_step_is_one_optimizer_step():
    """torch wraps the step() of every optimizer class it has built for its hooks, so a
    subclass calling super().step() runs them twice (nested) once an SGD was built: still
    one optimizer step (α was None: "stepped 2 times")."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # (SGD.step wrapped)
    problem = make_problem("mlp_relu", 8)
    opt = OwnSGD(problem.model.parameters(), lr=0.1)
    cockpit = Cockpit(problem.model, [quantities.Alpha()], optimizer=opt)
    train(problem, cockpit, 3, opt)
    cockpit.close()
    output = cockpit.get_output()
    assert all(math.isfinite(output[step]["Alpha"]) for step in range(2))


@pytest.mark.parametrize("order", ["other first", "watched first"])
def test_a_second_optimizer_on_some_parameters_is_measured_after_both_steps(order):
    """Weights on SGD (passed to Cockpit), biases on Adam: θ_t is taken before the first
    optimizer's step and θ_{t+1} after both, in either order, so Distance, UpdateSize and
    α describe the update the model made (α by projecting the layers' calls on it)."""
    problem = make_problem("mlp_relu", 8)
    model = problem.model
    named = dict(model.named_parameters())
    weights = [p for k, p in named.items() if k.endswith("weight")]
    biases = [p for k, p in named.items() if k.endswith("bias")]
    sgd, adam = torch.optim.SGD(weights, lr=0.1), torch.optim.Adam(biases, lr=0.05)
    with pytest.warns(RuntimeWarning, match="does not own 3 of the model's 6"):
        cockpit = Cockpit(model, [quantities.Distance(), quantities.UpdateSize(),
                                  quantities.Alpha()], optimizer=sgd, strict=True)
    theta0 = copy.deepcopy(model.state_dict())
    thetas, batches = [], []
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        idx = torch.randint(0, 8, (8,), generator=generator)
        x, y = problem.x[idx], problem.y[idx]
        thetas.append(copy.deepcopy(model.state_dict()))
        batches.append((x, y))
        sgd.zero_grad()
        adam.zero_grad()
        losses = problem.loss_fn(model(x), y)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        for opt in (adam, sgd) if order == "other first" else (sgd, adam):
            opt.step()
    thetas.append(copy.deepcopy(model.state_dict()))
    cockpit.close()
    out = cockpit.get_output()

    def distance(a, b, keys=named):
        return math.sqrt(sum(float(((a[k] - b[k]) ** 2).sum()) for k in keys))

    for step in range(4):
        assert out[step]["Distance"] == pytest.approx(distance(thetas[step], theta0), rel=1e-10,
                                                       abs=1e-12)
        assert out[step]["UpdateSize"] == pytest.approx(distance(thetas[step + 1], thetas[step]),
                                                         rel=1e-10)
        assert out[step]["UpdateSize/0.bias"] == pytest.approx(
            distance(thetas[step + 1], thetas[step], ["0.bias"]), rel=1e-10)
    for step in range(3):
        ends = []
        for k in (step, step + 1):
            reference = copy.deepcopy(model)
            reference.load_state_dict(thetas[k])
            x, y = batches[k]
            grads = individual_gradients(reference, problem.loss_fn, x, y)
            ends.append((problem.loss_fn(reference(x), y).detach(), flat(grads, list(named))))
        s = torch.cat([(thetas[step + 1][k] - thetas[step][k]).flatten() for k in named])
        expected = reference_alpha(ends[0][0], ends[0][1], ends[1][0], ends[1][1], s)
        assert out[step]["Alpha"] == pytest.approx(expected, rel=1e-6, abs=1e-9), step


@pytest.mark.parametrize("watched", ["every evaluation", "the first evaluation"])
def test_a_closure_optimizer_describes_the_closures_first_evaluation(watched):
    """LBFGS evaluates its closure several times inside one ``optimizer.step(closure)``;
    the block sits in the closure. The step is the first evaluation (at θ_t): GradNorm
    its gradient, UpdateSize θ_{t+1} − θ_t after the optimizer step, α from the first
    evaluations at θ_t and θ_{t+1}; the further evaluations are the optimizer's own."""
    problem = make_problem("mlp_relu", 8)
    model = problem.model
    names = [k for k, _ in model.named_parameters()]
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    cockpit = Cockpit(model, [quantities.GradNorm(), quantities.UpdateSize(),
                              quantities.Alpha()], optimizer=opt, strict=True)
    thetas, batches = [], []
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            idx = torch.randint(0, 8, (8,), generator=generator)
            x, y = problem.x[idx], problem.y[idx]
            thetas.append(copy.deepcopy(model.state_dict()))
            batches.append((x, y))
            evaluations = []

            def closure(step=step, x=x, y=y, evaluations=evaluations):
                opt.zero_grad()
                losses = problem.loss_fn(model(x), y)
                if watched == "every evaluation" or not evaluations:
                    with cockpit(step, losses=losses):
                        losses.mean().backward()
                else:
                    losses.mean().backward()
                evaluations.append(step)
                return losses.mean()

            opt.step(closure)
            assert len(evaluations) > 1  # (the optimizer evaluated again)
        thetas.append(copy.deepcopy(model.state_dict()))
        cockpit.close()
    out = cockpit.get_output()
    ends = []
    for step in range(3):
        reference = copy.deepcopy(model)
        reference.load_state_dict(thetas[step])
        x, y = batches[step]
        grads = individual_gradients(reference, problem.loss_fn, x, y)
        ends.append((problem.loss_fn(reference(x), y).detach(), flat(grads, names)))
        assert out[step]["GradNorm"] == pytest.approx(float(ends[-1][1].mean(0).norm()),
                                                       rel=1e-10)
        update = torch.cat([(thetas[step + 1][k] - thetas[step][k]).flatten() for k in names])
        assert out[step]["UpdateSize"] == pytest.approx(float(update.norm()), rel=1e-10)
    for step in range(2):
        s = torch.cat([(thetas[step + 1][k] - thetas[step][k]).flatten() for k in names])
        expected = reference_alpha(*ends[step], *ends[step + 1], s)
        assert out[step]["Alpha"] == pytest.approx(expected, rel=1e-6, abs=1e-9), step


class _Branchy(nn.Module):
    """A trunk and two heads, the batch going through one of them at each step."""

    def __init__(self):
        super().__init__()
        self.trunk, self.head_a, self.head_b = nn.Linear(5, 6), nn.Linear(6, 3), nn.Linear(6, 3)
        self.use_b = False

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.head_b(h) if self.use_b else self.head_a(h)


@pytest.mark.parametrize("opt", ["sgd_momentum_wd", "adam", "adamw"])
def test_a_head_the_next_batch_does_not_reach_projects_to_zero(opt):
    """α_t with a head unused at t + 1 (its momentum or weight decay still moves it):
    g_n(θ_{t+1}) of that head is zero, so its projections are zero, not missing."""
    torch.manual_seed(0)
    model = _Branchy().double()
    names = [k for k, _ in model.named_parameters()]
    optimizer = OPTIMIZERS[opt](model.parameters())
    cockpit = Cockpit(model, [quantities.Alpha()], optimizer=optimizer, strict=True)
    thetas, batches = [], []
    for step in range(4):
        model.use_b = step % 2 == 1
        x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
        thetas.append(copy.deepcopy(model.state_dict()))
        batches.append((x, y, model.use_b))
        optimizer.zero_grad()
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, losses=losses):
            losses.mean().backward()
        optimizer.step()
    thetas.append(copy.deepcopy(model.state_dict()))
    cockpit.close()
    out = cockpit.get_output()
    loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    for step in range(3):
        ends = []
        for k in (step, step + 1):
            reference = copy.deepcopy(model)
            reference.load_state_dict(thetas[k])
            x, y, reference.use_b = batches[k]
            grads = individual_gradients(reference, loss_fn, x, y)
            grads = {n: grads.get(n, torch.zeros(len(x), *p.shape, dtype=p.dtype))
                     for n, p in reference.named_parameters()}
            ends.append((loss_fn(reference(x), y).detach(), flat(grads, names)))
        s = torch.cat([(thetas[step + 1][k] - thetas[step][k]).flatten() for k in names])
        expected = reference_alpha(*ends[0], *ends[1], s)
        assert out[step]["Alpha"] == pytest.approx(expected, rel=1e-6, abs=1e-9), step
