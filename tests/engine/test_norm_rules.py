"""The normalization layers' rules against torch.func in float64: x̂ by the layer's own
functional form without affine transform, δ scaled by the uniform loss weight's 1/w."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from cockpit.engine.rules.norms import (
    batch_norm_rule,
    group_norm_rule,
    layer_norm_rule,
    rms_norm_rule,
)


def _bn_eval() -> nn.Module:
    module = nn.BatchNorm2d(4)
    module.running_mean.uniform_(-1, 1)
    module.running_var.uniform_(0.5, 2)
    return module.eval()


LAYERS = {
    "layer_norm": (lambda: nn.LayerNorm((3, 5)), (2, 3, 5), layer_norm_rule),
    "group_norm": (lambda: nn.GroupNorm(2, 4), (4, 3, 3), group_norm_rule),
    "rms_norm": (lambda: nn.RMSNorm(5), (3, 5), rms_norm_rule),
    "batch_norm_eval": (_bn_eval, (4, 3, 2), batch_norm_rule),
}


@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("name", list(LAYERS))
def test_norm_rules_match_torch_func(name, scale):
    torch.manual_seed(0)
    make, shape, rule = LAYERS[name]
    module = make().double()
    for p in module.parameters():
        p.data.uniform_(-1, 1)
    x = torch.randn(6, *shape, dtype=torch.float64) * 3 + 1
    out = module(x)
    v = torch.randn_like(out)
    params = {k: p.detach() for k, p in module.named_parameters()}

    def loss(p, xn, vn):
        return (functional_call(module, p, (xn.unsqueeze(0),)).squeeze(0) * vn).sum()

    expected = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, v * scale)
    grads = rule(module, (x,), {}, out, v, scale=scale)
    assert set(grads) == set(expected)
    for k, sg in grads.items():
        torch.testing.assert_close(sg.materialize(), expected[k], rtol=1e-10, atol=1e-12)
