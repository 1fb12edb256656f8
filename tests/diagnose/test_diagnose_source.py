"""diagnose() reads a running Cockpit through its public members: get_output, get_notes and
parameter_shapes (any object with the three is read the same way)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, configuration, diagnose


class _Recorded:
    """A finished run's values, notes and parameter shapes, without a Cockpit."""

    def __init__(self, output, notes, shapes):
        self.output, self.notes, self.shapes = output, notes, shapes

    def get_output(self):
        return self.output

    def get_notes(self):
        return self.notes

    def parameter_shapes(self):
        return self.shapes


def test_parameter_shapes_and_a_recorded_run_read_like_the_cockpit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    model[0].bias.requires_grad_(False)  # frozen: not among the watched parameters
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cockpit = Cockpit(model, configuration("economy"), optimizer=opt)
        for step in range(12):
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()
        expected = {"0.weight": [7, 5], "2.weight": [3, 7], "2.bias": [3]}
        assert cockpit.parameter_shapes() == expected
        copy = _Recorded(cockpit.get_output(), cockpit.get_notes(), expected)
        assert [f.to_dict() for f in diagnose(copy)] == [f.to_dict() for f in diagnose(cockpit)]
