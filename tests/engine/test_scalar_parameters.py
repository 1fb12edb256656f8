"""Parameters of shape [] (a learned scale, DeepOBS's 2-D test functions): every per-sample
instrument exact against individual gradients by one backward pass per sample."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from cockpit import Cockpit, quantities
from tests.reference import gradient_tests, per_sample_backward, rel_close


class ScaledLinear(nn.Module):
    """A scalar parameter around a Linear layer: the fallback rule differentiates the scale
    while the Linear rule owns the weight."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.lin = nn.Linear(3, 4)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_zero_dim_parameters_get_exact_per_sample_instruments():
    torch.manual_seed(0)
    model = ScaledLinear().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 4, (6,))
    G = per_sample_backward(model, x, y)  # [N, D], parameters in model order
    expected = gradient_tests(G)
    chosen = [quantities.NormTest(), quantities.InnerTest(), quantities.OrthoTest(),
              quantities.GradHist1d(), quantities.Alpha(), quantities.MeanGSNR()]
    cockpit = Cockpit(model, chosen, optimizer=opt, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "tensor with requires_grad" from Cockpit's values
        for step in range(2):
            opt.zero_grad()
            losses = nn.functional.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
    cockpit.close()
    out = cockpit.get_output()[0]
    for name in ("NormTest", "InnerTest", "OrthoTest"):
        assert rel_close(out[name], expected[name], 1e-9), name
    scale_only = gradient_tests(G[:, :1])  # the scale is the model's first parameter
    assert rel_close(out["NormTest/scale"], scale_only["NormTest"], 1e-9)
    assert out["GradHist1d"]["counts"].sum() == G.numel()
    assert out["Alpha"] is not None and out["MeanGSNR"] is not None
