"""The parameters instruments read at a step are aliases of the model's data, kept from step
to step (no detach per tensor and step): they must follow the model when a loop replaces a
parameter's data (``p.data = …``, a reload, a cast) and never show stale values."""

from __future__ import annotations

import math

import torch

from cockpit import Cockpit
from cockpit.quantities import Distance, ParamNorm
from tests.models import make_problem


def _norms(model: torch.nn.Module) -> float:
    return math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in model.parameters()))


def test_instruments_follow_replaced_parameter_data():
    """ParamNorm and Distance at every step equal the norms of the model's current
    parameters, also after ``p.data`` was replaced by a new tensor (another memory) and after
    an in-place edit; untouched parameters keep their alias (no fresh detach)."""
    problem = make_problem("mlp_relu", 6)
    model = problem.model
    initial = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [ParamNorm(), Distance()], optimizer=opt)
    expected, aliases = {}, {}
    first = next(model.parameters())
    for step in range(4):
        if step == 2:
            first.data = first.data.clone() * 0.5  # new memory
        if step == 3:
            with torch.no_grad():
                first.mul_(3.0)  # the same memory, new values
        opt.zero_grad()
        losses = problem.losses()
        expected[step] = (_norms(model), math.sqrt(sum(
            float((p.detach().double() - p0.double()).pow(2).sum())
            for p, p0 in zip(model.parameters(), initial, strict=True))))
        with cockpit(step, losses=losses):
            losses.mean().backward()
        aliases[step] = dict(cockpit._run.detached_params())
        opt.step()
    output = cockpit.get_output()
    cockpit.close()
    for step, (param_norm, distance) in expected.items():
        assert abs(output[step]["ParamNorm"] - param_norm) <= 1e-6 * param_norm, step
        assert abs(output[step]["Distance"] - distance) <= 1e-6 * distance, step
    names = list(aliases[0])
    assert all(aliases[1][k] is aliases[0][k] for k in names)
    assert aliases[2][names[0]] is not aliases[1][names[0]]
    assert all(aliases[2][k] is aliases[1][k] for k in names[1:])
    assert aliases[3][names[0]] is aliases[2][names[0]]
    assert aliases[2][names[0]].data_ptr() == first.data_ptr()
