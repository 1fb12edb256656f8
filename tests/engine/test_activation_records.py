"""The recorded forward pass keeps the smooth activations' inputs and outputs only for steps
whose instruments read them (the diagonal curvature): an activation's output is often a
temporary the forward pass frees at once, which holding would add to the step's peak. The
curvature's values at its steps do not change when other steps skip the records."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from cockpit import Cockpit, quantities
from cockpit.schedules import every
from tests.models import make_problem


def _run(qs, steps: int = 4):
    problem = make_problem("mlp_sigmoid", 6, torch.float64)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.1)
    cockpit = Cockpit(problem.model, qs, optimizer=opt, strict=True)
    recorded = []
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = problem.x + 0.1 * torch.randn(problem.x.shape, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        losses = problem.loss_fn(problem.model(x), problem.y)
        recorded.append(len(cockpit.tracker.activation_calls))
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    return cockpit.get_output(), recorded


def test_activations_are_recorded_only_for_steps_that_read_them():
    _, economy = _run([quantities.GradNorm(), quantities.Alpha()])
    assert economy == [0, 0, 0, 0]
    _, every_step = _run([quantities.HessTrace(curvature="diag_hessian")])
    assert all(n > 0 for n in every_step)
    _, mixed = _run([quantities.GradNorm(), quantities.HessTrace(every(2),
                                                                  curvature="diag_hessian")])
    assert [n > 0 for n in mixed] == [True, False, True, False]


def test_the_curvature_at_its_steps_equals_the_curvature_tracked_every_step():
    always, _ = _run([quantities.HessTrace(curvature="diag_hessian")])
    mixed, _ = _run([quantities.GradNorm(), quantities.HessTrace(every(2),
                                                                  curvature="diag_hessian")])
    for step in (0, 2):
        assert math.isclose(mixed[step]["HessTrace"], always[step]["HessTrace"],
                            rel_tol=1e-12)
    assert "HessTrace" not in mixed[1] and "GradNorm" in mixed[1]


class _Upcast(torch.nn.Module):
    def forward(self, x):
        return x.float()


def _autocast_run(monkeypatch, rounded: bool, steps: int = 3, activation=torch.nn.GELU,
                  batchnorm: str | None = None):
    from cockpit import configuration
    from cockpit.engine.capture import hooks

    if not rounded:
        monkeypatch.setattr(hooks, "as_computed_inputs", lambda args, kwargs, *_:
                            (args, kwargs))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), _Upcast(), activation(),
                                torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt, strict=True,
                      batchnorm=batchnorm)
    gen = torch.Generator().manual_seed(1)
    held = []
    for step in range(steps):
        x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        losses = torch.nn.functional.cross_entropy(out.float(), y, reduction="none")
        last = [c for c in cockpit.tracker.capture.calls if c.unit.module is model[3]]
        held.append(last[0].args[0].dtype)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    return cockpit.get_output(), held


def test_under_autocast_a_layer_input_is_held_rounded_with_the_same_values(monkeypatch):
    """The float32 input of a Linear layer computing in bfloat16 (a GELU's output, which
    the forward pass would free) is held rounded to bfloat16 (half the memory), and every
    economy value is the same bit for bit."""
    rounded, held = _autocast_run(monkeypatch, rounded=True)
    assert held == [torch.bfloat16] * 3
    with monkeypatch.context() as patch:
        given, held_given = _autocast_run(patch, rounded=False)
    assert held_given == [torch.float32] * 3
    compared = 0
    for step, values in given.items():
        assert set(values) == set(rounded[step])
        for name, value in values.items():
            other = rounded[step][name]
            if isinstance(value, dict):
                for key in value:
                    assert (torch.as_tensor(other[key]) == torch.as_tensor(value[key])).all()
            elif isinstance(value, float) and math.isnan(value):
                assert math.isnan(other)
            else:
                assert other == value, (step, name)
            compared += 1
    assert compared > 50


@pytest.mark.parametrize("activation,batchnorm,dtype", [
    (torch.nn.Tanh, None, torch.float32),
    (functools.partial(torch.nn.LayerNorm, 8), None, torch.bfloat16),
    (functools.partial(torch.nn.LayerNorm, 8), "frozen_statistics", torch.float32)])
def test_an_input_kept_anyway_is_held_as_it_is(monkeypatch, activation, batchnorm, dtype):
    """tanh's backward reads its output: the float32 input of the next layer stays in
    memory anyway, and a rounded copy would only add to it. A LayerNorm's float32 output is
    freed by autograd once the next layer rounded it (held rounded), unless its recorded
    call keeps it (the frozen-BatchNorm pass backpropagates from the layers' outputs)."""
    _, held = _autocast_run(monkeypatch, rounded=True, activation=activation,
                            batchnorm=batchnorm)
    assert held == [dtype] * 3


def test_a_layer_output_autograd_frees_is_not_held_where_no_instrument_reads_it():
    """A Linear layer's output before a ReLU (which keeps its own output for the backward
    pass) is freed during the forward pass at an economy step; kept where the diagonal
    curvature backpropagates from the layers' outputs."""
    import weakref

    def outputs_alive(qs) -> list[bool]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cockpit = Cockpit(model, qs, optimizer=opt, strict=True)
        refs = []
        model[0].register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out)))
        alive = []
        for step in range(2):
            x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
            opt.zero_grad()
            losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            alive.append(refs[-1]() is not None)
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()
        assert all(v is not None for v in cockpit.get_output()[0].values())
        return alive

    assert outputs_alive([quantities.GradNorm(), quantities.Alpha(),
                          quantities.GradHist1d()]) == [False, False]
    assert outputs_alive([quantities.HessTrace(curvature="diag_ggn_exact")]) == [True, True]
