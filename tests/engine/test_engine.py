"""Engine behaviour: hooks, schedules, untouched user state, errors and degenerate input."""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import pytest
import torch
from torch import nn

from cockpit import Cockpit, at, configuration, every, logspaced, quantities
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.processing import CallProcessor
from tests.models import make_problem, train
from tests.reference import (
    flat,
    gradient_tests,
    histogram,
    individual_gradients,
    per_sample_backward,
    rel_close,
)


def test_untracked_steps_do_no_per_sample_work(monkeypatch):
    calls = []
    original = CallProcessor.process
    monkeypatch.setattr(CallProcessor, "process",
                        lambda self, call: (calls.append(self.engine.stats), original(self, call)))
    hooks_registered = []
    original_hook = torch.Tensor.register_hook
    monkeypatch.setattr(torch.Tensor, "register_hook",
                        lambda t, fn: (hooks_registered.append(1), original_hook(t, fn))[1])
    problem = make_problem("cnn", 4)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.01)
    cockpit = Cockpit(problem.model, [quantities.NormTest(every(3))], optimizer=opt)
    hooks_after_setup = len(hooks_registered)
    for step in range(7):
        before_calls, before_hooks = len(calls), len(hooks_registered)
        train_step(problem, cockpit, opt, step)
        tracked = step % 3 == 0
        assert (len(calls) > before_calls) == tracked
        # forward passes of steps followed by an untracked step register no tensor hooks
        # (only the per-sample losses hook at tracked steps)
        if not tracked and step % 3 != 2:
            assert len(hooks_registered) == before_hooks
    assert hooks_after_setup == len(list(problem.model.parameters()))
    cockpit.close()
    assert sorted(cockpit.get_output()) == [0, 3, 6]


def train_step(problem, cockpit, opt, step):
    opt.zero_grad()
    losses = problem.losses()
    with cockpit(step, losses=losses):
        losses.mean().backward()
    opt.step()


def all_hooks(model: nn.Module, opt) -> int:
    count = 0
    for module in model.modules():
        count += len(module._forward_hooks) + len(module._forward_pre_hooks)
        count += len(module._backward_hooks)
    for p in model.parameters():
        count += len(p._backward_hooks or {})
    count += len(opt._optimizer_step_post_hooks) + len(opt._optimizer_step_pre_hooks)
    return count


@pytest.mark.parametrize("name", ["cnn", "transformer", "custom"])
def test_close_removes_every_hook(name):
    problem = make_problem(name, 3)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.01)
    assert all_hooks(problem.model, opt) == 0
    cockpit = Cockpit(problem.model, configuration("economy"), optimizer=opt)
    assert all_hooks(problem.model, opt) > 0
    train(problem, cockpit, 2, opt)
    cockpit.close()
    assert all_hooks(problem.model, opt) == 0
    cockpit.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        cockpit(5)


@pytest.mark.parametrize("name", ["cnn", "residual", "transformer", "custom"])
def test_user_gradients_and_parameters_are_bit_identical(name):
    problem = make_problem(name, 5, torch.float32)
    twin = copy.deepcopy(problem)
    opt = torch.optim.Adam(problem.model.parameters(), lr=0.01)
    twin_opt = torch.optim.Adam(twin.model.parameters(), lr=0.01)
    economy = [*configuration("economy"), quantities.MeanGSNR(), quantities.EarlyStopping()]
    cockpit = Cockpit(problem.model, economy, optimizer=opt)
    for step in range(3):
        train_step(problem, cockpit, opt, step)
        twin_opt.zero_grad()
        twin.losses().mean().backward()
        for p, q in zip(problem.model.parameters(), twin.model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        twin_opt.step()
        for p, q in zip(problem.model.parameters(), twin.model.parameters(), strict=True):
            assert torch.equal(p, q)
    cockpit.close()
    assert type(problem.model) is type(twin.model)


def test_non_finite_loss_is_recorded_as_nan_with_a_warning():
    problem = make_problem("mlp_relu", 4)
    problem.x[1, 0] = float("nan")
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.01)
    cockpit = Cockpit(problem.model, configuration("economy"), optimizer=opt)
    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        train(problem, cockpit, 1, opt)
        out = cockpit.get_output()[0]  # the step's numbers are read (and checked) here
    for name in ("Loss", "GradNorm", "NormTest", "InnerTest", "OrthoTest"):
        assert math.isnan(out[name]), name
    cockpit.close()


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_a_single_non_finite_loss_warns(bad):
    """One sample's loss ±∞ or NaN (the rest finite) makes the step's losses non-finite."""
    problem = make_problem("mlp_relu", 4)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.01)
    cockpit = Cockpit(problem.model, [quantities.Loss()], optimizer=opt)
    losses = problem.losses() * torch.tensor([1.0, bad, 1.0, 1.0])
    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        with cockpit(0, losses=losses):
            losses.mean().backward()
        cockpit.get_output()
    cockpit.close()


def test_cockpit_adds_no_warnings_of_its_own_on_a_transformer():
    """torch.func.vmap notes that CPU flash attention has no batching rule; that concerns
    Cockpit's fallback rule, not the user, and must not reach the user's warnings."""
    problem = make_problem("transformer", 6, dtype=torch.float32)
    opt = torch.optim.SGD(problem.model.parameters(), lr=1e-2)
    cockpit = Cockpit(problem.model, configuration("economy"), optimizer=opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(problem, cockpit, 3, opt)
    cockpit.close()
    assert cockpit.get_output()[0]["NormTest"] is not None


@pytest.mark.parametrize(("dtype", "loss_scale"), [(torch.bfloat16, 1.0),
                                                   (torch.float16, 2.0**8)])
def test_mixed_precision_autocast_matches_per_sample_backward_passes(dtype, loss_scale):
    """Under torch.autocast a convolution receives float32 inputs but computes in half
    precision, the following Linear layer gets half-precision inputs, LayerNorm computes in
    float32. The gradient tests must be computed (not fail on the mixed dtypes) and agree
    with individual gradients from one autocast backward pass per sample (loss scaled as by
    a GradScaler), to half-precision accuracy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(6 * 5 * 5, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    x, y = torch.randn(12, 3, 5, 5), torch.randint(0, 4, (12,))

    def losses_of(inputs, targets):
        with torch.autocast("cpu", dtype=dtype):
            out = model(inputs)
        return nn.functional.cross_entropy(out.float(), targets, reduction="none")

    expected = gradient_tests(per_sample_backward(model, x, y, losses_of, loss_scale))
    instruments = [quantities.NormTest(), quantities.InnerTest(), quantities.OrthoTest()]
    cockpit = Cockpit(model, instruments)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = losses_of(x, y)
        with cockpit(0, losses=losses):
            (loss_scale * losses.mean()).backward()
    cockpit.close()
    result = cockpit.get_output()[0]
    for name, value in expected.items():
        assert rel_close(result[name], value, rtol=3e-2), (name, result[name], value)


@pytest.mark.parametrize(("optimizer", "accelerator_path"),
                         [("sgd", False), ("adam", False), ("adam", True),
                          ("adagrad", True)])
def test_alpha_under_float16_autocast_with_a_grad_scaler(optimizer, accelerator_path,
                                                          monkeypatch):
    """A GradScaler multiplies the loss by 2^16 and unscales the gradients before the step.
    Projections of float16 individual gradients on the scaled gradient overflowed (α NaN at
    every step); statistics are formed in float32, so α equals that of the unscaled run.
    Adam's and Adagrad's updates are predicted from the unscaled gradient when Cockpit
    knows the scaler (else Adagrad's prediction fails and Alpha takes the general path) —
    also for the biases predicted side by side at the end of the backward pass (the
    accelerators' path)."""
    monkeypatch.setattr(histogram_device, "_forced", accelerator_path)

    def alphas(scaled: bool) -> list[float]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                              nn.Linear(8 * 8 * 8, 5))
        opt = {"sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
               "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
               # (its update depends on the gradient's scale: S_0 = 0.1 + g²)
               "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2,
                                                        initial_accumulator_value=0.1),
               }[optimizer](model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=scaled)
        alpha = quantities.Alpha()
        cockpit = Cockpit(model, [alpha], optimizer=opt, grad_scaler=scaler)
        gen = torch.Generator().manual_seed(1)
        for step in range(4):
            x = torch.randn(16, 3, 8, 8, generator=gen)
            y = torch.randint(0, 5, (16,), generator=gen)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            losses = nn.functional.cross_entropy(out.float(), y, reduction="none")
            with cockpit(step, losses=losses):
                scaler.scale(losses.mean()).backward()
            scaler.step(opt)
            scaler.update()
        cockpit.close()
        assert alpha.predict
        return [cockpit.get_output()[s]["Alpha"] for s in range(3)]

    scaled, plain = alphas(True), alphas(False)
    assert all(math.isfinite(a) for a in scaled), scaled
    for a, b in zip(scaled, plain, strict=True):
        assert rel_close(a, b, rtol=5e-2, atol=1e-3), (scaled, plain)


def test_sum_reduction_gives_the_same_instruments_as_mean():
    results = []
    for reduction in ("mean", "sum"):
        problem = make_problem("mlp_relu", 6)
        opt = torch.optim.SGD(problem.model.parameters(), lr=0.0)
        cockpit = Cockpit(problem.model, configuration("economy"), optimizer=opt)
        train(problem, cockpit, 1, opt, reduction)
        cockpit.close()
        results.append(cockpit.get_output()[0])
    for name in ("GradNorm", "NormTest", "InnerTest", "OrthoTest"):
        assert rel_close(results[0][name], results[1][name], 1e-10), name
    assert (results[0]["GradHist1d"]["counts"] == results[1]["GradHist1d"]["counts"]).all()


def test_frozen_parameters_are_skipped():
    problem = make_problem("mlp_relu", 5)
    problem.model[0].weight.requires_grad_(False)
    grads = individual_gradients(problem.model, problem.loss_fn, problem.x, problem.y)
    assert "0.weight" not in grads
    opt = torch.optim.SGD([p for p in problem.model.parameters() if p.requires_grad], lr=0.1)
    cockpit = Cockpit(problem.model, configuration("economy"), optimizer=opt)
    train(problem, cockpit, 1, opt)
    out = cockpit.get_output()[0]
    assert "GradNorm/0.weight" not in out
    expected = gradient_tests(flat(grads))
    assert rel_close(out["NormTest"], expected["NormTest"], 1e-8)
    cockpit.close()


def test_batchnorm_in_training_mode_is_watched_with_the_other_instruments():
    """BatchNorm in training mode: one warning naming the way out, the per-sample instruments
    None with the reason, every other instrument computed — the run is never stopped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)).double()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    loss_fn = make_problem("mlp_relu", 1).loss_fn
    with pytest.warns(RuntimeWarning, match=r"BatchNorm1d '1'.*GroupNorm") as caught:
        cockpit = Cockpit(model, [quantities.Loss(), quantities.GradNorm(),
                                  quantities.NormTest(), quantities.GradHist1d()], strict=True)
        losses = loss_fn(model(x), y)
        with cockpit(0, losses=losses):
            losses.mean().backward()
        output, notes = cockpit.get_output()[0], cockpit.get_notes()[0]
    assert len([w for w in caught if "BatchNorm1d" in str(w.message)]) == 1  # said once
    cockpit.close()
    reference = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()
    assert rel_close(output["GradNorm"], reference, 1e-12)
    assert rel_close(output["Loss"], losses.mean().item(), 1e-12)
    assert output["NormTest"] is None and output["GradHist1d"] is None
    assert "BatchNorm1d" in notes["NormTest"] and "BatchNorm1d" in notes["GradHist1d"]
    model.zero_grad()
    Cockpit(model, [quantities.Loss(), quantities.GradNorm()]).close()  # no per-sample needs
    model.train()
    for _ in range(3):  # give the running statistics some values
        model(torch.randn(8, 4, dtype=torch.float64))
    model.eval()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    loss_fn = make_problem("mlp_relu", 1).loss_fn
    grads = individual_gradients(model, loss_fn, x, y)
    cockpit = Cockpit(model, [quantities.NormTest()], strict=True)
    losses = loss_fn(model(x), y)
    with cockpit(0, losses=losses):
        losses.mean().backward()
    assert rel_close(cockpit.get_output()[0]["NormTest"],
                     gradient_tests(flat(grads))["NormTest"], 1e-8)
    # switched back to training mode later: not computed, with the reason, no exception
    model.train()
    losses = loss_fn(model(x), y)
    with pytest.warns(RuntimeWarning, match="BatchNorm1d"):
        with cockpit(1, losses=losses):
            losses.mean().backward()
        assert cockpit.get_output()[1]["NormTest"] is None  # recorded when the step is complete
    assert "BatchNorm1d" in cockpit.get_notes()[1]["NormTest"]
    cockpit.close()


def test_missing_or_malformed_losses_give_clear_errors():
    problem = make_problem("mlp_relu", 4)
    cockpit = Cockpit(problem.model, configuration("economy"))
    with pytest.raises(ValueError, match="reduction='none'"), cockpit(0):
        pass
    with pytest.raises(ValueError, match="1-d tensor"), cockpit(0, losses=problem.losses()[None]):
        pass
    cockpit.close()
    with pytest.raises(TypeError, match="Quantity instances"):
        Cockpit(problem.model, ["NormTest"])
    with pytest.raises(TypeError, match=r"nn\.Module"):
        Cockpit(object())
    with pytest.raises(TypeError, match="GradScaler"):
        Cockpit(problem.model, [quantities.Alpha()], grad_scaler=2.0**16)


def test_forward_pass_not_seen_is_reported_not_silent():
    problem = make_problem("mlp_relu", 4)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.01)
    cockpit = Cockpit(problem.model, [quantities.NormTest(at([0, 2]))], optimizer=opt)
    train_step(problem, cockpit, opt, 0)  # step 1 predicted untracked: forward not recorded
    opt.zero_grad()
    losses = problem.losses()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cockpit(2, losses=losses):  # jumps to step 2, which is tracked
            losses.mean().backward()
        opt.step()  # the step is complete: recorded
    assert cockpit.get_output()[2]["NormTest"] is None
    assert "forward pass" in cockpit.get_notes()[2]["NormTest"]
    assert any("forward pass" in str(w.message) for w in caught)
    # from now on steps are not consecutive, so every forward pass is recorded
    train_step(problem, cockpit, opt, 5)
    cockpit.close()


def test_compiled_model_is_reported_not_a_zero_gradient():
    """torch.compile runs the layers inside one compiled graph: the forward hooks fire while
    tracing, the output-gradient hooks never do. That must be reported with the way out,
    not as statistics of a 'zero' gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.GradNorm()])
    compiled = torch.compile(model, backend="eager")
    x, y = torch.randn(8, 10), torch.randint(0, 3, (8,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            model.zero_grad()
            losses = nn.functional.cross_entropy(compiled(x), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
    cockpit.close()
    output, notes = cockpit.get_output()[1], cockpit.get_notes()[1]
    assert output["NormTest"] is None and "torch.compile" in notes["NormTest"]
    assert output["GradNorm"] > 0  # the batch gradient itself is fine
    assert any("torch.compile" in str(w.message) for w in caught)


class _Attention(nn.Module):
    """nn.MultiheadAttention with its default need_weights=True; the attention weights
    (always [batch, L, S]) optionally enter the loss."""

    def __init__(self, batch_first: bool, use_weights: bool):
        super().__init__()
        self.batch_first, self.use_weights = batch_first, use_weights
        self.attention = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.out = nn.Linear(8, 3)

    def forward(self, x):  # x: [batch, L, 8]
        x = x if self.batch_first else x.transpose(0, 1)
        h, weights = self.attention(x, x, x)
        h = h if self.batch_first else h.transpose(0, 1)
        z = self.out(h.mean(1))
        return z + weights.mean((1, 2))[:, None] if self.use_weights else z


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("use_weights", [False, True])
def test_multihead_attention_with_weights_and_sequence_first(batch_first, use_weights):
    """Sequence-first attention returned its batch-first attention weights, and Cockpit
    took dim 1 as their batch dimension (a shape error, NormTest not computed)."""
    torch.manual_seed(0)
    model = _Attention(batch_first, use_weights).double()
    x, y = torch.randn(6, 4, 8, dtype=torch.float64), torch.randint(0, 3, (6,))
    expected = gradient_tests(per_sample_backward(model, x, y))
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.InnerTest()])
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    for name in ("NormTest", "InnerTest"):
        assert rel_close(cockpit.get_output()[0][name], expected[name], rtol=1e-6)


class _NestedOutput(nn.Module):
    """A custom layer (torch.func fallback) returning ``(y, (extra, aux))``: extra needs no
    gradient, aux is computed from the output y itself, or separately."""

    def __init__(self, dependent: bool):
        super().__init__()
        self.dependent = dependent
        self.weight = nn.Parameter(torch.randn(5, 4, dtype=torch.float64))

    def forward(self, x):
        y = torch.tanh(x @ self.weight.T)
        inner = y if self.dependent else torch.tanh(x @ self.weight.T)
        return y, (x.sum(1), inner.pow(2) @ self.weight)


class _NestedNet(nn.Module):
    def __init__(self, dependent: bool):
        super().__init__()
        self.layer, self.out = _NestedOutput(dependent), nn.Linear(5, 3).double()

    def forward(self, x):
        y, (_, aux) = self.layer(x)
        return self.out(y) + aux[:, :3]


@pytest.mark.parametrize("dependent", [False, True])
def test_nested_outputs_of_a_custom_layer_are_all_followed(dependent):
    """Outputs nested in tuples (an LSTM's (output, (h_n, c_n))) were dropped: the gradient
    through them was missing from the individual gradients, silently. An output computed
    from another output would be counted twice by the hooks: that is reported instead."""
    torch.manual_seed(0)
    model = _NestedNet(dependent)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    expected = gradient_tests(per_sample_backward(model, x, y))
    cockpit = Cockpit(model, [quantities.NormTest()])
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, losses=losses):
            losses.mean().backward()
    cockpit.close()
    if dependent:
        assert cockpit.get_output()[0]["NormTest"] is None
        assert "computed from another of its outputs" in cockpit.get_notes()[0]["NormTest"]
    else:
        assert rel_close(cockpit.get_output()[0]["NormTest"], expected["NormTest"], rtol=1e-6)


def test_sparse_embedding_gradients():
    """nn.Embedding(sparse=True) makes p.grad sparse; the instruments failed on it
    ('reshape is not implemented for sparse tensors'). The user's gradient stays sparse."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6, sparse=True), nn.Flatten(), nn.Linear(18, 3))
    x, y = torch.randint(0, 11, (8, 3)), torch.randint(0, 3, (8,))
    expected = gradient_tests(per_sample_backward(model, x, y))
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.InnerTest(),
                              quantities.OrthoTest(), quantities.GradNorm()])
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    assert model[0].weight.grad.is_sparse
    for name, value in expected.items():
        assert rel_close(cockpit.get_output()[0][name], value, rtol=1e-5)


def test_per_token_losses_get_a_clear_message():
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))
    x, y = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))
    cockpit = Cockpit(model, [quantities.NormTest()])
    losses = nn.functional.cross_entropy(model(x).reshape(-1, 11), y.reshape(-1),
                                         reduction="none")  # 20 per-token losses
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, losses=losses):
            losses.mean().backward()
    cockpit.close()
    note = cockpit.get_notes()[0]["NormTest"]
    assert note.startswith("1: this layer (Linear) has 4 rows along the dimension Cockpit "
                           "reads as the batch")
    assert "20 entries" in note and "mean(1)" in note


def test_schedules():
    assert [s for s in range(10) if every(3)(s)] == [0, 3, 6, 9]
    assert [s for s in range(10) if every(4, offset=1)(s)] == [1, 5, 9]
    steps = [s for s in range(1001) if logspaced(1000, 20)(s)]
    assert steps[0] == 0 and steps[-1] == 1000 and len(steps) <= 20
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    assert gaps[-1] > gaps[0]
    with pytest.raises(ValueError):
        every(0)
    problem = make_problem("mlp_relu", 3)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.01)
    cockpit = Cockpit(problem.model, [quantities.Loss(lambda s: s in (1, 4))], optimizer=opt)
    train(problem, cockpit, 6, opt)
    cockpit.close()
    assert sorted(cockpit.get_output()) == [1, 4]


def test_configurations():
    names = [q.name for q in configuration("economy")]
    assert names == ["Loss", "Distance", "UpdateSize", "GradNorm", "GradHist1d", "NormTest",
                     "InnerTest", "OrthoTest", "Alpha", "DeadUnits", "GradientNoiseScale",
                     "ParamNorm", "UpdateRatio"]
    business = [q.name for q in configuration("business")]
    assert business == [*names, "HessTrace", "TICDiag"]
    assert [q.name for q in configuration("full")] == [*business, "HessMaxEV", "GradHist2d"]
    assert all(q.schedule(4) and not q.schedule(5) for q in configuration("full", 2))
    with pytest.raises(ValueError, match="economy"):
        configuration("first-class")


def test_zero_gradient_gives_nan_with_a_note():
    problem = make_problem("mlp_sigmoid", 4)
    problem.y = problem.model(problem.x).detach()  # perfect fit: every g_n is exactly zero
    cockpit = Cockpit(problem.model, configuration("economy"), strict=True)
    losses = problem.losses()
    with cockpit(0, losses=losses):
        losses.mean().backward()
    out, notes = cockpit.get_output()[0], cockpit.get_notes()[0]
    assert out["GradNorm"] == 0.0
    for name in ("NormTest", "InnerTest", "OrthoTest", "GradientNoiseScale"):
        assert math.isnan(out[name]) and "zero" in notes[name]
    cockpit.close()


def test_forward_passes_outside_cockpit_are_not_mixed_into_a_tracked_step():
    """A loop that calls the Cockpit only at some steps (and evaluation forwards with
    gradients on) leaves recorded calls of dead graphs; they must not make parameters look
    used twice (which would be slower) nor keep old activations alive."""
    problem = make_problem("cnn", 5)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.01)
    cockpit = Cockpit(problem.model, [quantities.NormTest()], optimizer=opt)
    for _ in range(2):  # steps the Cockpit does not see
        opt.zero_grad()
        problem.losses().mean().backward()
        opt.step()
    problem.model(problem.x)  # an evaluation forward with autograd on
    opt.zero_grad()
    losses = problem.losses()
    with cockpit(7, losses=losses):
        assert cockpit.tracker.num_calls == 3  # only this forward's three layers
        losses.mean().backward()
    assert cockpit.tracker.state.multi_use == set()
    G = flat(individual_gradients(problem.model, problem.loss_fn, problem.x, problem.y))
    assert rel_close(cockpit.get_output()[7]["NormTest"], gradient_tests(G)["NormTest"], 1e-6)
    cockpit.close()


def test_scratch_buffers_shared_by_layers_give_the_same_statistics_as_fresh_memory():
    """Layers reuse one scratch buffer (cockpit.engine.workspace); a convolution applied
    twice (its individual gradients accumulated over both calls) and a second convolution
    in between must not see each other's numbers."""
    torch.manual_seed(0)
    conv, other = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1)
    model = nn.Sequential(conv, nn.Tanh(), other, nn.Tanh(), conv, nn.Flatten(),
                          nn.Linear(3 * 6 * 6, 4)).double()
    x, y = torch.randn(6, 3, 6, 6, dtype=torch.float64), torch.randint(0, 4, (6,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    instruments = [quantities.NormTest(), quantities.InnerTest(), quantities.GradHist1d()]
    cockpit = Cockpit(model, instruments, optimizer=opt)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    for step in range(2):
        opt.zero_grad()
        losses = loss_fn(model(x), y)
        G = flat(individual_gradients(model, lambda o, t: loss_fn(o, t), x, y))
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
        out = cockpit.get_output()[step]
        expected = gradient_tests(G)
        for name in ("NormTest", "InnerTest"):
            assert rel_close(out[name], expected[name], 1e-6)
        counts = torch.as_tensor(out["GradHist1d"]["counts"])
        edges = out["GradHist1d"]["edges"]
        assert torch.equal(counts.long(), histogram(G, edges[0], edges[-1], 100).long())
    cockpit.close()


def test_scratch_memory_is_released_when_the_cockpit_closes():
    from cockpit.engine.workspace import workspace

    problem = make_problem("cnn", 6, dtype=torch.float32)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.01)
    cockpit = Cockpit(problem.model, [quantities.GradHist1d()], optimizer=opt)
    train(problem, cockpit, 2, opt)
    assert workspace().nbytes > 0  # conv individual gradients were formed in scratch memory
    cockpit.close()
    assert workspace().nbytes == 0


def test_scratch_memory_of_other_threads_is_released_too():
    """On CUDA the backward hooks run in autograd's device threads: close() must free the
    scratch buffers those threads allocated, not only the calling thread's."""
    import threading

    from cockpit.engine.workspace import release_workspace, workspace

    taken = []
    worker = threading.Thread(target=lambda: taken.append(
        (workspace(), *workspace().take("patches", (1000,), torch.float32, torch.device("cpu")))))
    worker.start()
    worker.join()
    other, view, ticket = taken[0]
    assert other is not workspace() and other.nbytes == 4000
    release_workspace()
    assert other.nbytes == 0 and not other.valid(ticket)
    assert view.numel() == 1000  # a view taken before stays usable


def test_a_tracked_step_frees_the_scratch_memory_off_the_cpu_at_its_end(monkeypatch):
    """A GPU's scratch buffers (a ``meta`` buffer stands in for one) are freed when a tracked
    step ends, so they never add to the next step's peak; the CPU's are kept (fresh pages
    cost page faults there)."""
    from cockpit.engine.workspace import release_workspace, workspace

    _, ticket = workspace().take("patches", (1000,), torch.float32, torch.device("meta"))
    workspace().take("patches", (10,), torch.float32, torch.device("cpu"))
    release_workspace(off_cpu_only=True)
    assert not workspace().valid(ticket) and workspace().nbytes == 40
    view, ticket = workspace().take("patches", (1000,), torch.float32, torch.device("meta"))
    assert view.shape == (1000,) and workspace().valid(ticket)

    problem = make_problem("cnn", 6, dtype=torch.float32)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.01)
    cockpit = Cockpit(problem.model, [quantities.GradHist1d(), quantities.Distance()],
                      optimizer=opt)
    train(problem, cockpit, 1, opt)
    assert workspace().nbytes > 40  # the CPU's buffers of the step are kept
    assert not workspace().valid(ticket)  # the step's end freed the meta buffer
    cockpit.close()


class _GraphNet(nn.Module):
    """A convolution with GroupNorm, a Linear layer with LayerNorm, a Linear layer over a
    sequence dimension: every rule that takes its inputs out of autograd."""

    def __init__(self):
        super().__init__()
        self.conv, self.gn = nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.lin, self.ln = nn.Linear(16, 6), nn.LayerNorm(6)
        self.seq, self.out = nn.Linear(3, 5), nn.Linear(10, 3)

    def forward(self, x):
        h = self.ln(self.lin(torch.tanh(self.gn(self.conv(x))).flatten(1)))
        return self.out(self.seq(h.view(-1, 2, 3)).flatten(1))


def test_a_backward_pass_that_creates_a_graph_gives_the_same_values():
    """``backward(create_graph=True)`` (a gradient penalty, a higher-order method) runs
    Cockpit's hooks with grad mode on: the rules take their inputs out of autograd there
    (in an ordinary backward pass grad mode is off and they need no op for it); every value
    of economy equals the ordinary backward pass's."""

    def run(create_graph: bool) -> dict:
        torch.manual_seed(0)
        model = _GraphNet().double()
        x, y = torch.randn(5, 2, 2, 2, dtype=torch.float64), torch.randint(0, 3, (5,))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        cockpit = Cockpit(model, configuration("economy"), optimizer=opt, strict=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch: create_graph with .grad leaves)
            for step in range(3):
                opt.zero_grad()
                losses = nn.functional.cross_entropy(model(x), y, reduction="none")
                with cockpit(step, losses=losses):
                    losses.mean().backward(create_graph=create_graph)
                opt.step()
        cockpit.close()
        return {(s, k): v for s, record in cockpit.get_output().items()
                for k, v in record.items()}

    plain, graphed = run(False), run(True)
    assert plain.keys() == graphed.keys()
    compared = 0
    for key, value in plain.items():
        if isinstance(value, float):
            assert graphed[key] == pytest.approx(value, rel=1e-10, nan_ok=True), key
            compared += 1
    assert compared > 100
