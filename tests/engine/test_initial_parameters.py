"""θ_0 kept in the host's memory (as for a large model on a GPU) gives Distance the same
numbers as θ_0 beside the parameters: against ‖θ_t − θ_0‖ formed by hand, per parameter and
in total, on both the CPU's and the accelerators' path, and over a checkpoint's resume."""

from __future__ import annotations

import math

import pytest
import torch

from cockpit import Cockpit, quantities
from cockpit.engine import initial_parameters
from cockpit.engine.histograms import device as histogram_device
from tests.models import make_problem


def _train(problem, cockpit, opt, steps, first=0):
    gen = torch.Generator().manual_seed(first)
    thetas = []
    for step in range(first, first + steps):
        thetas.append({k: p.detach().clone() for k, p in problem.model.named_parameters()})
        x = problem.x + 0.1 * torch.randn(problem.x.shape, generator=gen)
        opt.zero_grad()
        losses = problem.loss_fn(problem.model(x), problem.y)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    return thetas


def _check(out, thetas, theta0, first=0):
    for offset, theta in enumerate(thetas):
        values = out[first + offset]
        total = 0.0
        for name, p in theta.items():
            expected = (p.double() - theta0[name].double()).norm().item()
            assert math.isclose(values[f"Distance/{name}"], expected, rel_tol=1e-5,
                                abs_tol=1e-7), name
            total += expected**2
        assert math.isclose(values["Distance"], math.sqrt(total), rel_tol=1e-5, abs_tol=1e-7)


@pytest.mark.parametrize("accelerator_path", [False, True])
def test_distance_with_theta0_on_the_host_equals_the_hand_formed_distance(
        monkeypatch, accelerator_path):
    monkeypatch.setattr(histogram_device, "_forced", accelerator_path)
    monkeypatch.setattr(initial_parameters, "_forced", True)
    problem = make_problem("cnn", 8, torch.float32, seed=3)
    theta0 = {k: p.detach().clone() for k, p in problem.model.named_parameters()}
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.05, momentum=0.9)
    cockpit = Cockpit(problem.model, [quantities.Distance()], optimizer=opt, strict=True)
    held = cockpit._run.initial
    assert held is not None
    storages = {t.untyped_storage().data_ptr() for t in held.values()}
    assert len(storages) == 1  # one host buffer for the float32 parameters
    thetas = _train(problem, cockpit, opt, 3)
    cockpit.close()
    assert max(thetas[-1][k].sub(theta0[k]).abs().max().item() for k in theta0) > 1e-3
    _check(cockpit.get_output(), thetas, theta0)


def test_a_resumed_run_keeps_theta0_on_the_host_and_measures_from_it(monkeypatch):
    monkeypatch.setattr(initial_parameters, "_forced", True)
    problem = make_problem("cnn", 8, torch.float32, seed=3)
    theta0 = {k: p.detach().clone() for k, p in problem.model.named_parameters()}
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.05)
    first = Cockpit(problem.model, [quantities.Distance()], optimizer=opt)
    _train(problem, first, opt, 2)
    state = first.state_dict()
    first.close()
    resumed = Cockpit(problem.model, [quantities.Distance()], optimizer=opt)
    resumed.load_state_dict(state)
    held = resumed._run.initial
    assert held is not None
    assert len({t.untyped_storage().data_ptr() for t in held.values()}) == 1
    thetas = _train(problem, resumed, opt, 2, first=2)
    resumed.close()
    _check(resumed.get_output(), thetas, theta0, first=2)


def test_brought_copies_each_run_of_adjacent_tensors_at_once(monkeypatch):
    monkeypatch.setattr(initial_parameters, "_forced", True)
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 4, generator=gen), "b": torch.randn(5, generator=gen),
               "c": torch.randn(2, 2, generator=gen, dtype=torch.float64),
               "d": torch.randn(7, generator=gen)}
    held = initial_parameters.host_copies(tensors)
    assert all(torch.equal(held[k], v) for k, v in tensors.items())
    assert held["a"].untyped_storage().data_ptr() == held["d"].untyped_storage().data_ptr()
    order = ["a", "b", "d", "c"]
    copies = initial_parameters.brought([held[k] for k in order], torch.device("cpu"))
    for name, copy in zip(order, copies, strict=True):
        assert copy.shape == tensors[name].shape and torch.equal(copy, tensors[name])
        assert copy.untyped_storage().data_ptr() != held[name].untyped_storage().data_ptr()
    # a, b, d adjacent in the float32 buffer: one copy; c in the float64 one: another
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 2
    # out of order: each a run of its own
    copies = initial_parameters.brought([held["d"], held["a"]], torch.device("cpu"))
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 2


def test_theta0_beside_cpu_parameters_by_default():
    problem = make_problem("cnn", 8, torch.float32, seed=3)
    params = dict(problem.model.named_parameters())
    assert not initial_parameters.kept_on_host(params)
    held = initial_parameters.snapshot(params)
    assert len({t.untyped_storage().data_ptr() for t in held.values()}) == len(params)
