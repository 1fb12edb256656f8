"""ParamNorm and UpdateRatio against parameters copied around a plain loop's optimizer step
(float64), for optimizers whose updates differ (SGD with momentum, Adam). Exactness under
accumulation and over processes: tests/split_reference.py lists both instruments."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cockpit import Cockpit, quantities
from tests.models import make_problem
from tests.reference import rel_close


@pytest.mark.parametrize("make_optimizer", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    lambda p: torch.optim.Adam(p, lr=1e-2),
])
@pytest.mark.parametrize("name", ["mlp_relu", "cnn"])
def test_norms_and_ratios_match_the_parameters_before_and_after_each_step(name,
                                                                          make_optimizer):
    problem = make_problem(name, 6)
    model = problem.model
    opt = make_optimizer(model.parameters())
    cockpit = Cockpit(model, [quantities.ParamNorm(), quantities.UpdateRatio()],
                      optimizer=opt, strict=True)
    for step in range(3):
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        opt.zero_grad()
        losses = problem.losses()
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
        out = cockpit.get_output()[step]
        update = {k: p.detach() - before[k] for k, p in model.named_parameters()}
        for k in before:
            assert rel_close(out[f"ParamNorm/{k}"], before[k].norm().item(), 1e-10)
            assert rel_close(out[f"UpdateRatio/{k}"],
                             (update[k].norm() / before[k].norm()).item(), 1e-8)
        theta = torch.cat([t.flatten() for t in before.values()])
        s = torch.cat([t.flatten() for t in update.values()])
        assert rel_close(out["ParamNorm"], theta.norm().item(), 1e-10)
        assert rel_close(out["UpdateRatio"], (s.norm() / theta.norm()).item(), 1e-8)
    cockpit.close()


def test_a_zero_parameter_has_no_ratio_and_says_why():
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [quantities.UpdateRatio()], optimizer=opt, strict=True)
    losses = model(torch.randn(4, 3)).pow(2).sum(1)
    with cockpit(0, losses=losses):
        losses.mean().backward()
    opt.step()
    cockpit.close()
    out, notes = cockpit.get_output()[0], cockpit.get_notes()[0]
    assert math.isnan(out["UpdateRatio/bias"]) and "bias" in notes["UpdateRatio"]
    assert math.isfinite(out["UpdateRatio/weight"]) and out["UpdateRatio/weight"] > 0


def test_the_new_economy_instruments_reach_the_run_log(tmp_path):
    from cockpit import configuration
    from cockpit.store.reader import read_output

    problem = make_problem("mlp_relu", 8)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.1)
    cockpit = Cockpit(problem.model, configuration("economy"), optimizer=opt,
                      logdir=tmp_path)
    for step in range(2):
        opt.zero_grad()
        losses = problem.losses()
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    memory, disk = cockpit.get_output(), read_output(tmp_path)
    for step in memory:
        names = [k for k in memory[step]
                 if k.split("/")[0] in ("GradientNoiseScale", "GradientNoiseScaleEMA",
                                        "ParamNorm", "UpdateRatio")]
        assert len(names) == 4 * (1 + len(dict(problem.model.named_parameters())))
        for name in names:
            assert disk[step][name] == pytest.approx(memory[step][name], nan_ok=True), name
