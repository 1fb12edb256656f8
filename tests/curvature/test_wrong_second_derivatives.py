"""Models whose graph holds an op whose second derivative PyTorch gets wrong
(``torch._weight_norm``, behind ``nn.utils.parametrizations.weight_norm``): the Hessian
instruments are None with the reason, never an eigenvalue of a wrong operator; the same
normalization written with plain operations gives the exact λ_max."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from cockpit import Cockpit, quantities


class PlainWeightNorm(nn.Module):
    """W = g · v / ‖v‖ (rows), a parametrization from plain operations."""

    def forward(self, g, v):
        return g * v / v.norm(dim=1, keepdim=True)

    def right_inverse(self, weight):
        return weight.norm(dim=1, keepdim=True), weight


def _model(normalization: str) -> nn.Module:
    torch.manual_seed(0)
    first = nn.Linear(4, 6)
    if normalization == "torch":
        first = weight_norm(first)
    elif normalization == "plain":
        parametrize.register_parametrization(first, "weight", PlainWeightNorm(),
                                             unsafe=True)
    return nn.Sequential(first, nn.Tanh(), nn.Linear(6, 3)).double()


def _data():
    torch.manual_seed(1)
    return torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))


def _exact_hessian(model: nn.Module, x, y) -> torch.Tensor:
    """∇²L by finite differences of the gradient (central, step 1e-5), symmetrized: no
    second derivative of PyTorch's involved."""
    params = [p for p in model.parameters() if p.requires_grad]
    theta = torch.cat([p.detach().reshape(-1) for p in params])

    def gradient(at: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for p, part in zip(params, at.split([p.numel() for p in params]), strict=True):
                p.copy_(part.reshape(p.shape))
        loss = F.cross_entropy(model(x), y)
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])

    eye = torch.eye(theta.numel(), dtype=theta.dtype)
    columns = [(gradient(theta + 1e-5 * e) - gradient(theta - 1e-5 * e)) / 2e-5 for e in eye]
    gradient(theta)  # (θ back)
    hessian = torch.stack(columns, 1)
    return (hessian + hessian.T) / 2


def _hess_max_ev(model: nn.Module, x, y):
    cockpit = Cockpit(model, [quantities.HessMaxEV(), quantities.HessTrace()])
    losses = F.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    return cockpit.get_output()[0], cockpit.get_notes()[0]


def test_pytorchs_weight_norm_double_backward_is_still_wrong():
    """The reason for the refusal: autograd's Hessian through torch._weight_norm is not
    even symmetric. Should PyTorch fix it, this fails: drop the refusal then."""
    model = _model("torch")
    x, y = _data()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), params, create_graph=True)
    columns = []
    for i, p in enumerate(params):
        for j in range(p.numel()):
            e = [torch.zeros_like(q) for q in params]
            e[i].view(-1)[j] = 1.0
            hv = torch.autograd.grad(grads, params, grad_outputs=e, retain_graph=True)
            columns.append(torch.cat([h.reshape(-1) for h in hv]))
    autograd_hessian = torch.stack(columns, 1)
    assert (autograd_hessian - autograd_hessian.T).abs().max() > 1e-2


def test_hessian_instruments_through_torchs_weight_norm_are_none_with_the_reason():
    output, notes = _hess_max_ev(_model("torch"), *_data())
    for name in ("HessMaxEV", "HessTrace"):
        assert output[name] is None
        assert "torch._weight_norm" in notes[name] and "plain operations" in notes[name]


def test_the_same_normalization_from_plain_operations_gives_the_exact_lambda_max():
    model = _model("plain")
    x, y = _data()
    output, notes = _hess_max_ev(model, x, y)
    expected = torch.linalg.eigvalsh(_exact_hessian(model, x, y)).max().item()
    assert output["HessMaxEV"] is not None, notes.get("HessMaxEV")
    assert expected <= output["HessMaxEV"] * (1 + 1e-3) + 1e-6
    assert abs(output["HessMaxEV"] - expected) <= 2e-3 * expected


class _Bag(nn.Module):
    def __init__(self, scale_grad_by_freq: bool):
        super().__init__()
        self.emb = nn.Embedding(7, 3, scale_grad_by_freq=scale_grad_by_freq)
        self.head = nn.Linear(3, 3)

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens)).mean(1))


def test_an_embedding_scaling_gradients_by_frequency_is_refused_a_plain_one_is_exact():
    torch.manual_seed(0)
    tokens, y = torch.randint(0, 7, (16, 4)), torch.randint(0, 3, (16,))
    for scaled in (True, False):
        torch.manual_seed(0)
        model = _Bag(scaled).double()
        output, notes = _hess_max_ev(model, tokens, y)
        if scaled:
            assert output["HessMaxEV"] is None
            assert "scale_grad_by_freq=True" in notes["HessMaxEV"]
        else:
            expected = torch.linalg.eigvalsh(_exact_hessian(model, tokens, y)).max().item()
            assert abs(output["HessMaxEV"] - expected) <= 2e-3 * expected
