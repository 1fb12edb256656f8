"""Predicted optimizer updates against the real ``optimizer.step()`` (torch 2.13 rules)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.update_fit import BasisFits, fit_basis_coefficients
from cockpit.engine.update_prediction import (
    UnsupportedOptimizer,
    UpdateMatch,
    _find_group,
    match_update,
    predict_update,
    predict_updates,
    sgd_update_basis,
    supports,
    unsupported_reason,
)
from tests.engine.test_host_syncs import Count

SGD_CASES = [
    {"lr": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.1, "momentum": 0.9, "dampening": 0.3},
    {"lr": 0.1, "momentum": 0.9, "nesterov": True},
    {"lr": 0.1, "weight_decay": 0.05},
    {"lr": 0.1, "momentum": 0.8, "weight_decay": 0.05, "nesterov": True},
    {"lr": 0.1, "maximize": True},
    {"lr": 0.1, "momentum": 0.7, "dampening": 0.1, "weight_decay": 0.02, "maximize": True},
    {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "foreach": True},
]
ADAM_CASES = [
    {"lr": 0.01},
    {"lr": 0.01, "amsgrad": True},
    {"lr": 0.01, "weight_decay": 0.1},
    {"lr": 0.01, "maximize": True},
    {"lr": 0.01, "betas": (0.5, 0.9), "eps": 1e-2},
    {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1, "maximize": True},
    {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True},
    {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1, "foreach": True},
]
ADAMW_CASES = [
    {"lr": 0.01},
    {"lr": 0.01, "amsgrad": True},
    {"lr": 0.01, "maximize": True, "weight_decay": 0.3},
    {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-3, "amsgrad": True, "weight_decay": 0.1},
    {"lr": 0.01, "weight_decay": 0.1, "foreach": True},
]
RMSPROP_CASES = [
    {"lr": 0.01},
    {"lr": 0.01, "centered": True},
    {"lr": 0.01, "momentum": 0.9},
    {"lr": 0.01, "centered": True, "momentum": 0.5, "weight_decay": 0.1},
    {"lr": 0.01, "maximize": True, "alpha": 0.9, "eps": 1e-3},
    {"lr": 0.01, "centered": True, "momentum": 0.5, "foreach": True},
]
ADAGRAD_CASES = [
    {"lr": 0.1},
    {"lr": 0.1, "lr_decay": 0.3},
    {"lr": 0.1, "weight_decay": 0.1},
    {"lr": 0.1, "initial_accumulator_value": 0.5, "eps": 1e-3},
    {"lr": 0.1, "maximize": True},
    {"lr": 0.1, "lr_decay": 0.2, "weight_decay": 0.1, "initial_accumulator_value": 0.1},
    {"lr": 0.1, "lr_decay": 0.2, "foreach": True},
]
ALL_CASES = (
    [(torch.optim.SGD, c) for c in SGD_CASES]
    + [(torch.optim.Adam, c) for c in ADAM_CASES]
    + [(torch.optim.AdamW, c) for c in ADAMW_CASES]
    + [(torch.optim.RMSprop, c) for c in RMSPROP_CASES]
    + [(torch.optim.Adagrad, c) for c in ADAGRAD_CASES]
)


def case_id(case):
    cls, kwargs = case
    return cls.__name__ + "-" + "-".join(f"{k}={v}" for k, v in kwargs.items() if k != "lr")


def make_model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


def make_optimizer(cls, model, kwargs, two_groups=True):
    """Two param groups (the second with half the lr) to exercise the group lookup."""
    params = list(model.parameters())
    if not two_groups:
        return cls(params, **kwargs)
    other = {**kwargs, "lr": kwargs["lr"] * 0.5}
    return cls([{"params": params[:2]}, {"params": params[2:], **other}], **kwargs)


def backward(model, gen, dtype=torch.float64):
    x = torch.randn(8, 4, generator=gen, dtype=dtype)
    y = torch.randn(8, 3, generator=gen, dtype=dtype)
    model.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()


def snapshot_state(optimizer):
    return copy.deepcopy(optimizer.state_dict())


def assert_same_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key, entry in a["state"].items():
        assert entry.keys() == b["state"][key].keys()
        for name, value in entry.items():
            other = b["state"][key][name]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and torch.equal(value, other), name
            else:
                assert value == other


def relative_error(predicted, actual):
    return ((predicted - actual).norm() / actual.norm().clamp_min(1e-300)).item()


def run_steps(optimizer, model, n_steps, gen, between=None, after_backward=None):
    """Predict, (optionally) disturb, step; yield (predicted, actual) lists per step."""
    for _ in range(n_steps):
        backward(model, gen)
        params = list(model.parameters())
        grads = [p.grad.clone() for p in params]
        state_before = snapshot_state(optimizer)
        length_before = len(optimizer.state)
        predicted = [predict_update(optimizer, p, g) for p, g in zip(params, grads, strict=True)]
        assert len(optimizer.state) == length_before
        assert_same_state(state_before, snapshot_state(optimizer))
        assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
        extra = between(optimizer, params, grads) if between else None
        if after_backward:
            after_backward(model)
        old = [p.detach().clone() for p in params]
        optimizer.step()
        actual = [p.detach() - o for p, o in zip(params, old, strict=True)]
        yield predicted, actual, extra


@pytest.mark.parametrize("case", ALL_CASES, ids=case_id)
def test_prediction_equals_real_step(case):
    cls, kwargs = case
    model = make_model()
    optimizer = make_optimizer(cls, model, kwargs)
    assert supports(optimizer)
    gen = torch.Generator().manual_seed(1)
    bitwise = True
    for predicted, actual, _ in run_steps(optimizer, model, 4, gen):
        for p, a in zip(predicted, actual, strict=True):
            assert p is not None
            assert relative_error(p, a) <= 1e-12
            bitwise &= torch.equal(p, a)
        assert match_update(predicted, actual) == pytest.approx(1.0, abs=1e-12)
    if not kwargs.get("foreach") and not histogram_device._forced:
        assert bitwise  # (the single-tensor path replays the same operations)


@pytest.mark.parametrize("case", ALL_CASES, ids=case_id)
def test_learning_rate_change_is_global_rescaling(case):
    """A scheduler-like lr change of all groups between backward and step: κ = new/old."""
    cls, kwargs = case
    if kwargs.get("foreach") and cls is not torch.optim.SGD:
        pytest.skip("same math as the single-tensor case")
    model = make_model()
    optimizer = make_optimizer(cls, model, kwargs)
    gen = torch.Generator().manual_seed(2)

    def change_lr(opt, params, grads):
        for group in opt.param_groups:
            group["lr"] *= 0.7

    for predicted, actual, _ in run_steps(optimizer, model, 3, gen, between=change_lr):
        assert match_update(predicted, actual) == pytest.approx(0.7, rel=1e-10)


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        (torch.optim.AdamW, {"lr": 0.01}),
        (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.1}),
    ],
)
def test_edits_behind_the_optimizers_back_are_detected(cls, kwargs):
    model = make_model()
    optimizer = make_optimizer(cls, model, kwargs)
    gen = torch.Generator().manual_seed(3)
    list(run_steps(optimizer, model, 2, gen))  # build up some state

    def change_one_group(opt, params, grads):
        opt.param_groups[0]["lr"] *= 3.0

    ((predicted, actual, _),) = run_steps(optimizer, model, 1, gen, between=change_one_group)
    assert match_update(predicted, actual) is None

    def scale_state(opt, params, grads):
        for p in params:
            for value in opt.state[p].values():
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    value.mul_(1.5)

    ((predicted, actual, _),) = run_steps(optimizer, model, 1, gen, between=scale_state)
    assert match_update(predicted, actual) is None


def clip(model):
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
    assert total > 0.05  # clipping is active


@pytest.mark.parametrize("kwargs", [{"lr": 0.1}, {"lr": 0.1, "maximize": True}])
def test_clipping_plain_sgd_is_global_rescaling(kwargs):
    model = make_model()
    optimizer = make_optimizer(torch.optim.SGD, model, kwargs)
    gen = torch.Generator().manual_seed(4)

    def grad_norm(opt, params, grads):
        return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()

    for predicted, actual, norm in run_steps(
        optimizer, model, 3, gen, between=grad_norm, after_backward=clip
    ):
        kappa = match_update(predicted, actual)
        assert kappa == pytest.approx(0.05 / (norm + 1e-6), rel=1e-10)


@pytest.mark.parametrize("kwargs", SGD_CASES, ids=lambda k: case_id((torch.optim.SGD, k)))
def test_clipping_momentum_sgd_basis_fit_recovers_update(kwargs):
    model = make_model()
    optimizer = make_optimizer(torch.optim.SGD, model, kwargs)
    gen = torch.Generator().manual_seed(5)

    def bases(opt, params, grads):
        return [sgd_update_basis(opt, p, g) for p, g in zip(params, grads, strict=True)]

    steps = list(run_steps(optimizer, model, 4, gen, between=bases, after_backward=clip))
    plain = kwargs.get("momentum", 0) == 0 and kwargs.get("weight_decay", 0) == 0
    for step, (predicted, actual, basis_list) in enumerate(steps):
        kappa = match_update(predicted, actual)
        if plain or (step == 0 and kwargs.get("weight_decay", 0) == 0):
            assert kappa is not None  # first momentum step: buffer = c·g, still a rescaling
        elif step > 0:
            assert kappa is None  # buffer mixes old (unclipped) and new (clipped) gradients
        for basis, a in zip(basis_list, actual, strict=True):
            coefficients = fit_basis_coefficients(basis, a)
            assert coefficients is not None
            recovered = sum(c.item() * b for c, b in zip(coefficients, basis, strict=True))
            assert relative_error(recovered, a) <= 1e-10


def test_clipping_adam_is_rejected_not_rescaled():
    model = make_model()
    optimizer = make_optimizer(torch.optim.Adam, model, {"lr": 0.01})
    gen = torch.Generator().manual_seed(6)
    steps = list(run_steps(optimizer, model, 3, gen, after_backward=clip))
    assert all(match_update(p, a) is None for p, a, _ in steps[1:])


def test_basis_fit_rejects_a_foreign_update():
    torch.manual_seed(0)
    basis = [torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)]
    assert fit_basis_coefficients(basis, torch.randn(50, dtype=torch.float64)) is None
    inside = 2.0 * basis[0] - 0.5 * basis[1]
    torch.testing.assert_close(
        fit_basis_coefficients(basis, inside), torch.tensor([2.0, -0.5], dtype=torch.float64)
    )


def test_basis_fit_rejects_a_foreign_float32_update_after_one_retry():
    """float32: the float32 normal equations fail, the float64 ones fail too: no fit (None),
    and the fit ends (the clipped gradient of a momentum SGD step is such an update)."""
    torch.manual_seed(0)
    basis = torch.randn(2, 50)
    foreign = torch.randn(50)
    assert fit_basis_coefficients(basis, foreign) is None
    inside = 2.0 * basis[0] - 0.5 * basis[1]
    torch.testing.assert_close(fit_basis_coefficients(basis, inside),
                               torch.tensor([2.0, -0.5], dtype=torch.float64))


def test_basis_fits_are_solved_on_the_device_without_reading_it():
    """Several tensors' fits, one with a zero basis vector (a zero-initialised bias under
    weight decay): the coefficients are the minimum-norm least-squares solution (NumPy's
    SVD on the exact normal equations), the residuals those of the update measured
    directly, and nothing waits for the device (no scalar read, no error check of a
    LAPACK call)."""
    gen = torch.Generator().manual_seed(0)
    bases = [torch.randn(3, 40, generator=gen, dtype=torch.float64),
             torch.randn(2, 7, 5, generator=gen, dtype=torch.float64)]
    bases[0][1] = 0.0
    coefficients = [torch.tensor([0.5, 3.0, -2.0], dtype=torch.float64),
                    torch.tensor([-1.5, 0.25], dtype=torch.float64)]
    noise = 1e-3 * torch.randn(40, generator=gen, dtype=torch.float64)
    actuals = [coefficients[0] @ bases[0] + noise,
               torch.einsum("k,kij->ij", coefficients[1], bases[1])]
    counter = Count()
    with counter:
        fits = BasisFits(bases, actuals)
    waits = {"_local_scalar_dense", "_linalg_check_errors", "nonzero", "item"}
    assert not waits & set(counter.ops), counter.ops
    expected = []
    for basis, actual in zip(bases, actuals, strict=True):
        v = basis.reshape(len(basis), -1).numpy()
        expected.append(np.linalg.lstsq(v @ v.T, v @ actual.reshape(-1).numpy(),
                                        rcond=None)[0])
    np.testing.assert_allclose(fits.coefficients.numpy(), np.concatenate(expected),
                               rtol=1e-12, atol=1e-14)
    assert float(fits.coefficients[1]) == 0.0  # the zero vector's coefficient
    residual0 = actuals[0] - torch.from_numpy(expected[0]) @ bases[0]
    np.testing.assert_allclose(fits.residual_norms.numpy(),
                               [float(residual0.norm()), 0.0], rtol=1e-9, atol=1e-12)


def test_basis_fit_of_parallel_vectors_is_the_minimum_norm_fit():
    """Two equal basis vectors: the normal equations are singular, the solve on the device
    fails (non-finite residual) and the fit from the SVD of the host copy gives the
    minimum-norm coefficients."""
    torch.manual_seed(0)
    v = torch.randn(30, dtype=torch.float64)
    coefficients = fit_basis_coefficients(torch.stack([v, v]), 3.0 * v)
    torch.testing.assert_close(coefficients, torch.tensor([1.5, 1.5], dtype=torch.float64))
    v32 = v.float()
    coefficients = fit_basis_coefficients(torch.stack([v32, v32]), 3.0 * v32)
    torch.testing.assert_close(coefficients, torch.tensor([1.5, 1.5], dtype=torch.float64))


def test_basis_fit_when_consecutive_gradients_agree():
    """Momentum SGD on a fixed batch: the gradient and the previous update (which takes the
    momentum buffer's row, as Alpha uses it) are nearly parallel and differ in scale by
    1/lr. The float32 normal equations then fail for some parameters (3 of 320 fits here;
    the split between two nearly parallel rows is ill-determined); the fit must find every
    real float32 update in the span."""
    fits = 0
    for seed in range(20):
        torch.manual_seed(seed)
        model = nn.Linear(16, 4)
        x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        previous: dict[str, torch.Tensor] = {}
        for _ in range(8):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            params = dict(model.named_parameters())
            bases = {name: sgd_update_basis(optimizer, p, p.grad, previous.get(name))
                     for name, p in params.items()}
            before = {name: p.detach().clone() for name, p in params.items()}
            optimizer.step()
            for name, p in params.items():
                actual = p.detach() - before[name]
                atol = torch.finfo(torch.float32).eps * float(before[name].norm())
                coefficients = fit_basis_coefficients(bases[name], actual, 1e-3, atol)
                assert coefficients is not None, (seed, name)
                basis = bases[name].reshape(len(bases[name]), -1)
                recovered = (coefficients.to(basis) @ basis).reshape(actual.shape)
                assert float((recovered - actual).norm()) <= (
                    1e-3 * float(actual.norm()) + atol)
                previous[name] = actual
                fits += 1
    assert fits == 320


def test_match_update_edge_cases():
    a = [torch.ones(3, dtype=torch.float64)]
    assert match_update([None], a) is None
    assert match_update([], []) == 1.0
    assert match_update([torch.zeros(3, dtype=torch.float64)], a) is None
    assert match_update([torch.zeros(3)], [torch.zeros(3)]) == 1.0
    assert match_update(a, [torch.zeros(3, dtype=torch.float64)]) == 0.0
    assert match_update([torch.full((3,), float("nan"))], a) is None
    assert match_update(a, a + a) is None


def test_update_match_of_many_small_and_some_large_tensors_against_float64():
    """⟨p, a⟩ summed over tensors (small ones of each dtype side by side, large ones one by
    one, a in p's dtype) and the residual norms against float64 sums; κ of a scaled update
    is found, a perturbed small tensor breaks the match."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(5,), (3, 4), (), (300, 300), (7, 1, 2), (2**16,), (2**16 + 1,)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float32, torch.bfloat16,
              torch.float32, torch.float64]
    predicted = [torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes,
                                                                      strict=True)]
    actual = [(0.3 * p.double()).to(d) for p, d in zip(predicted, dtypes, strict=True)]
    actual[0] = actual[0].double()  # an actual wider than its prediction
    match = UpdateMatch(predicted, actual)
    pp = sum(float((p.double() ** 2).sum()) for p in predicted)
    pa = sum(float((p.double() * a.to(p.dtype).double()).sum())
             for p, a in zip(predicted, actual, strict=True))
    checks = match.checks.numpy()
    assert checks[0] == pytest.approx(pp, rel=1e-6)
    assert checks[1] == pytest.approx(pa, rel=1e-6)
    assert match_update(predicted, actual, rtol=1e-2) == pytest.approx(0.3, rel=1e-4)
    actual[1] = actual[1] + 1.0
    assert match_update(predicted, actual, rtol=1e-2) is None


def test_lr_scheduler_wrapper_and_tensor_lr_are_supported():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    assert supports(optimizer)
    gen = torch.Generator().manual_seed(7)
    for predicted, actual, _ in run_steps(optimizer, model, 3, gen):
        for p, a in zip(predicted, actual, strict=True):
            assert relative_error(p, a) <= 1e-12
        scheduler.step()


def test_float32_prediction_is_bitwise():
    model = make_model(dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        backward(model, gen, dtype=torch.float32)
        params = list(model.parameters())
        predicted = [predict_update(optimizer, p, p.grad) for p in params]
        old = [p.detach().clone() for p in params]
        optimizer.step()
        assert all(
            torch.equal(pr, p.detach() - o) for pr, p, o in zip(predicted, params, old, strict=True)
        )


@pytest.mark.parametrize("cls,kwargs", [
    (torch.optim.Adam, {"lr": 1e-2}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True, "maximize": True}),
    (torch.optim.AdamW, {"lr": torch.tensor(1e-2), "amsgrad": True}),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_adam_is_replayed_by_its_own_kernel_bit_for_bit(cls, kwargs, dtype):
    """``fused=True``: one parameter at a time and all at once (two groups, the first step
    from an empty state), the prediction is the real update bit for bit, and the optimizer's
    state (moments, step counts) is untouched."""
    model = make_model(dtype=dtype)
    optimizer = make_optimizer(cls, model, {**kwargs, "fused": True})
    assert supports(optimizer)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        backward(model, gen, dtype=dtype)
        params = list(model.parameters())
        state_before = snapshot_state(optimizer)
        single = [predict_update(optimizer, p, p.grad) for p in params]
        together = predict_updates(optimizer, params, [p.grad for p in params])
        assert_same_state(state_before, snapshot_state(optimizer))
        old = [p.detach().clone() for p in params]
        optimizer.step()
        for one, many, p, o in zip(single, together, params, old, strict=True):
            assert torch.equal(one, p.detach() - o)
            assert torch.equal(many, p.detach() - o)


@pytest.mark.parametrize("cls,kwargs", [
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    (torch.optim.Adam, {"lr": 1e-2, "maximize": True, "foreach": False}),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_accelerators_predict_adam_by_the_fused_kernel(cls, kwargs, dtype, monkeypatch):
    """On the accelerators' path (forced) a non-fused Adam's update is predicted by the
    fused kernel in float32 and float64 (a few units in the last place from the real one,
    accepted by the check with κ = 1) and by the single-tensor replay in bfloat16 (bit for
    bit); the optimizer's state is untouched."""
    monkeypatch.setattr(histogram_device, "_forced", True)
    kernels = []
    fused_adam, fused_adamw = torch._fused_adam_, torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adam_",
                        lambda *a, **k: kernels.append(1) or fused_adam(*a, **k))
    monkeypatch.setattr(torch, "_fused_adamw_",
                        lambda *a, **k: kernels.append(1) or fused_adamw(*a, **k))
    model = make_model(dtype=dtype)
    optimizer = make_optimizer(cls, model, kwargs)
    gen = torch.Generator().manual_seed(5)
    unit = {torch.float32: 2.0**-23, torch.float64: 2.0**-52}.get(dtype)
    for _ in range(3):
        backward(model, gen, dtype=dtype)
        params = list(model.parameters())
        state_before = snapshot_state(optimizer)
        predicted = [predict_update(optimizer, p, p.grad) for p in params]
        assert_same_state(state_before, snapshot_state(optimizer))
        old = [p.detach().clone() for p in params]
        optimizer.step()
        actual = [p.detach() - o for p, o in zip(params, old, strict=True)]
        for pr, a, o in zip(predicted, actual, old, strict=True):
            if unit is None:
                assert torch.equal(pr, a)
            else:  # rounding of θ̂ (|θ| ulps) and of the update's own terms
                bound = 8 * unit * (o.abs() + a.abs()) + 1e-30
                assert ((pr - a).abs() <= bound).all()
        if unit is not None:
            assert match_update(predicted, actual) == pytest.approx(1.0, abs=1e-5)
    assert (len(kernels) > 0) == (unit is not None)


def test_an_optimizer_checked_once_leaves_the_parameters_own_checks():
    """``optimizer_checked``: the walk over the groups' options is skipped (the caller asked
    :func:`supports` already), a parameter's own problems are still found."""
    model = make_model()
    params = list(model.parameters())
    backward(model, torch.Generator().manual_seed(2))
    fused_sgd = torch.optim.SGD(params, lr=0.1, fused=True)
    assert unsupported_reason(fused_sgd, params[0], params[0].grad) == UnsupportedOptimizer.FUSED
    assert unsupported_reason(fused_sgd, params[0], params[0].grad,
                              optimizer_checked=True) is None
    sgd = torch.optim.SGD(params[:1], lr=0.1)
    assert unsupported_reason(sgd, params[1], params[1].grad, optimizer_checked=True) == (
        UnsupportedOptimizer.PARAM_NOT_FOUND)
    assert predict_update(sgd, params[1], params[1].grad, optimizer_checked=True) is None
    expected = predict_update(sgd, params[0], params[0].grad)
    assert torch.equal(predict_update(sgd, params[0], params[0].grad, optimizer_checked=True),
                       expected)


def test_a_group_of_mixed_dtypes_takes_each_dtypes_kernel_on_the_accelerators(monkeypatch):
    """One param group with float32 and bfloat16 tensors, predicted together on the
    accelerators' path: each tensor as it would be alone (the fused kernel for float32, the
    single-tensor replay, bit for bit, for bfloat16), whichever comes first."""
    monkeypatch.setattr(histogram_device, "_forced", True)
    gen = torch.Generator().manual_seed(6)
    for order in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        params = [torch.randn(5, 3, generator=gen).to(d).requires_grad_() for d in order]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        for _ in range(2):
            grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
            together = predict_updates(optimizer, params, grads)
            alone = [predict_update(optimizer, p, g) for p, g in zip(params, grads, strict=True)]
            for many, one in zip(together, alone, strict=True):
                assert torch.equal(many, one)
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            old = [p.detach().clone() for p in params]
            optimizer.step()
            bf16 = order.index(torch.bfloat16)
            assert torch.equal(together[bf16], params[bf16].detach() - old[bf16])


class OverridingSGD(torch.optim.SGD):
    def step(self, closure=None):
        return super().step(closure)


class KeepingSGD(torch.optim.SGD):
    """Subclass that keeps the base step: predicted."""


def test_a_step_replaced_later_is_noticed():
    """The supported base is kept between calls, but not once ``step`` is replaced: on the
    optimizer (a wrapper) or on its class."""
    model = make_model()
    params = list(model.parameters())

    class LaterOverridden(torch.optim.SGD):
        pass

    sgd = LaterOverridden(params, lr=0.1)
    assert supports(sgd)
    original = sgd.step

    def wrapped(*args, **kwargs):  # no functools.wraps: not the base's step any more
        return original(*args, **kwargs)

    sgd.step = wrapped
    assert unsupported_reason(sgd) == UnsupportedOptimizer.STEP_OVERRIDDEN
    del sgd.step
    assert supports(sgd)
    LaterOverridden.step = lambda self, closure=None: None
    assert unsupported_reason(sgd) == UnsupportedOptimizer.STEP_OVERRIDDEN


def test_unsupported_optimizers_return_none():
    model = make_model()
    params = list(model.parameters())
    backward(model, torch.Generator().manual_seed(9))
    p, g = params[0], params[0].grad
    cases = [
        (torch.optim.LBFGS(params), UnsupportedOptimizer.UNKNOWN_CLASS),
        (torch.optim.Adamax(params), UnsupportedOptimizer.UNKNOWN_CLASS),
        (OverridingSGD(params, lr=0.1), UnsupportedOptimizer.STEP_OVERRIDDEN),
        (torch.optim.Adam(params, differentiable=True), UnsupportedOptimizer.DIFFERENTIABLE),
        (torch.optim.Adam(params, capturable=True), UnsupportedOptimizer.CAPTURABLE),
        (torch.optim.SGD(params, lr=0.1, fused=True), UnsupportedOptimizer.FUSED),
        (
            torch.optim.Adam(params, betas=(torch.tensor(0.9), torch.tensor(0.99))),
            UnsupportedOptimizer.TENSOR_HYPERPARAMETER,
        ),
    ]
    for optimizer, reason in cases:
        assert unsupported_reason(optimizer) == reason
        assert not supports(optimizer)
        assert predict_update(optimizer, p, g) is None
    keeping = KeepingSGD(params, lr=0.1)
    assert supports(keeping) and predict_update(keeping, p, g) is not None
    # A parameter that the optimizer does not own, a wrong shape, a sparse gradient.
    sgd = torch.optim.SGD(params[:1], lr=0.1)
    for param, grad, reason in [
        (params[1], params[1].grad, UnsupportedOptimizer.PARAM_NOT_FOUND),
        (p, g.reshape(-1), UnsupportedOptimizer.SHAPE),
        (p, g.to_sparse(), UnsupportedOptimizer.SPARSE),
    ]:
        assert unsupported_reason(sgd, param, grad) == reason
        assert predict_update(sgd, param, grad) is None
        assert sgd_update_basis(sgd, param, grad) is None
    # State that does not fit the options (amsgrad switched on mid-run).
    adam = torch.optim.Adam(params, lr=0.01)
    adam.step()
    adam.param_groups[0]["amsgrad"] = True
    assert predict_update(adam, p, g) is None
    assert sgd_update_basis(adam, p, g) is None


def test_complex_parameters_are_not_predicted():
    z = nn.Parameter(torch.randn(3, dtype=torch.complex128))
    optimizer = torch.optim.Adam([z])
    assert unsupported_reason(optimizer, z) == UnsupportedOptimizer.COMPLEX
    assert predict_update(optimizer, z, torch.ones_like(z)) is None


def test_param_group_lookup_follows_changes_of_the_groups():
    """The group of a parameter comes from a cached index; adding a group or replacing an
    entry of one must not return a stale answer."""
    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    optimizer = torch.optim.SGD([a], lr=0.1)
    assert _find_group(optimizer, a) is optimizer.param_groups[0]
    assert _find_group(optimizer, b) is None
    optimizer.add_param_group({"params": [b], "lr": 0.2})
    assert _find_group(optimizer, b) is optimizer.param_groups[1]
    optimizer.param_groups[1]["params"][0] = c  # same shape of the groups, entry replaced
    assert _find_group(optimizer, c) is optimizer.param_groups[1]
    assert _find_group(optimizer, b) is None


@pytest.mark.parametrize("value", [0.0, 41.0, 2.0**24 - 1, 2.0**24, 2.0**25 + 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_next_step_counts_as_the_optimizer_does(value, dtype):
    """``step_t += 1; step_t.item()`` in the state's dtype: from the host where that is exact,
    the float32 rounding of 2^24 + 1 to 2^24 kept."""
    from cockpit.engine.update_prediction import _next_step

    step = torch.tensor(value, dtype=dtype)
    assert _next_step({"step": step}) == (step + 1).item()
    assert _next_step({"step": int(value)}) == value + 1


BATCHED_CASES = ([(torch.optim.Adam, c) for c in ADAM_CASES]
                 + [(torch.optim.AdamW, c) for c in ADAMW_CASES]
                 + [(torch.optim.SGD, SGD_CASES[5]), (torch.optim.RMSprop, RMSPROP_CASES[3]),
                    (torch.optim.Adagrad, ADAGRAD_CASES[5])])


@pytest.mark.parametrize("case", BATCHED_CASES, ids=case_id)
def test_batched_prediction_equals_one_at_a_time_and_the_real_step(case):
    """``predict_updates`` (multi-tensor kernels for Adam/AdamW, two param groups) gives
    the single-tensor predictions bit for bit, leaves the state alone, and equals the real
    update (bit for bit where the optimizer takes its single-tensor path)."""
    cls, kwargs = case
    model = make_model()
    optimizer = make_optimizer(cls, model, kwargs)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):  # the first step (no state) and two with state
        backward(model, gen)
        params = list(model.parameters())
        grads = [p.grad.clone() for p in params]
        state_before = snapshot_state(optimizer)
        batched = predict_updates(optimizer, params, grads)
        assert_same_state(state_before, snapshot_state(optimizer))
        single = [predict_update(optimizer, p, g) for p, g in zip(params, grads, strict=True)]
        assert all(b is not None and torch.equal(b, s)
                   for b, s in zip(batched, single, strict=True))
        old = [p.detach().clone() for p in params]
        optimizer.step()
        for b, p, o in zip(batched, params, old, strict=True):
            if kwargs.get("foreach") or histogram_device._forced:  # (the fused kernel)
                assert relative_error(b, p.detach() - o) <= 1e-12
            else:
                assert torch.equal(b, p.detach() - o)


@pytest.mark.cpu_path
def test_batched_adam_prediction_is_a_fixed_number_of_kernels():
    """Adam's batched prediction issues the same kernels for 2 parameters as for 40 (one
    multi-tensor kernel per operation, nothing per parameter but the read of its step
    count, a CPU tensor that AdamW reads on the host too)."""

    def ops(count: int) -> Count:
        params = [nn.Parameter(torch.randn(3 + i)) for i in range(count)]
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
        grads = [torch.randn_like(p) for p in params]
        with Count() as counted:
            updates = predict_updates(optimizer, params, grads)
        assert all(u is not None for u in updates)
        assert counted.ops.pop("_local_scalar_dense") == count
        return counted

    few, many = ops(2), ops(40)
    assert few.ops == many.ops
    assert all(name.startswith("_foreach_") for name in many.ops)


def test_batched_prediction_leaves_out_what_it_cannot_predict():
    """A parameter the optimizer does not own, a wrong shape and state that does not fit
    the options give None for that parameter alone; an unsupported optimizer for all."""
    model = make_model()
    params = list(model.parameters())
    backward(model, torch.Generator().manual_seed(2))
    grads = [p.grad for p in params]
    adam = torch.optim.Adam(params[:3], lr=0.01, amsgrad=True)
    adam.step()
    del adam.state[params[1]]["max_exp_avg_sq"]
    wrong = [grads[0], grads[1], grads[2].reshape(-1), grads[3]]
    updates = predict_updates(adam, params, wrong)
    assert [u is None for u in updates] == [False, True, True, True]
    assert torch.equal(updates[0], predict_update(adam, params[0], grads[0]))
    lbfgs = torch.optim.LBFGS(params)
    assert predict_updates(lbfgs, params, grads) == [None] * 4


def test_update_match_of_many_tensors_by_blocks_against_float64(monkeypatch):
    """40 tensors on the accelerators' path: the checks from two blocks (⟨p, p⟩, ⟨p, a⟩
    and one residual norm for all tensors) against float64 sums; κ of a scaled update is
    found, a perturbed tensor breaks the match."""
    from cockpit.engine.histograms import device as histogram_device
    monkeypatch.setattr(histogram_device, "_forced", True)
    gen = torch.Generator().manual_seed(4)
    shapes = [(64, 3, 3, 3), (64,), (128, 64), (7,), (3, 40)]
    predicted = [torch.randn(shapes[k % 5], generator=gen) * (k + 1) for k in range(40)]
    actual = [0.3 * p for p in predicted]
    match = UpdateMatch(predicted, actual)
    checks = match.checks.numpy()
    assert len(checks) == 3  # (one residual: the blocks' difference at once)
    pp = sum(float((p.double() ** 2).sum()) for p in predicted)
    pa = sum(float((p.double() * a.double()).sum()) for p, a in zip(predicted, actual,
                                                                     strict=True))
    assert checks[0] == pytest.approx(pp, rel=1e-7)  # (columns of 32 squares in float32)
    assert checks[1] == pytest.approx(pa, rel=1e-7)
    assert match_update(predicted, actual, rtol=1e-5) == pytest.approx(0.3, rel=1e-6)
    actual[7] = actual[7] + 1e-2
    assert match_update(predicted, actual, rtol=1e-5) is None
