"""Parameters the loss reaches outside the calls of their layer (a tied output layer written
``F.linear(h, emb.weight)``, a weight used without calling its layer): the per-sample
instruments are None with a note naming them, never a value that misses that use; models
whose parameters are used only inside their layers' calls (also through nested modules,
recurrent layers, autocast's rounded inputs, checkpointing) are not flagged."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cockpit import Cockpit, quantities
from tests.models import make_problem

PER_SAMPLE = ["NormTest", "InnerTest", "OrthoTest", "GradHist1d"]


class TiedByFunction(nn.Module):
    def __init__(self, tied: str):
        super().__init__()
        self.emb, self.mid, self.tied = nn.Embedding(7, 4), nn.Linear(4, 4), tied

    def forward(self, tokens):
        h = torch.tanh(self.mid(self.emb(tokens).mean(1)))
        return F.linear(h, self.emb.weight) if self.tied == "F.linear" else h @ self.emb.weight.T


class TiedByModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mid = nn.Embedding(7, 4), nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.emb(tokens).mean(1))))


class LinearNeverCalled(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.unused_call = nn.Linear(4, 5), nn.Linear(5, 7)

    def forward(self, x):
        return torch.tanh(self.first(x)) @ self.unused_call.weight.T + self.unused_call.bias


class ScaledChild(nn.Module):
    """A custom layer (the torch.func fallback) whose own parameter feeds a child layer
    it calls: the child's nodes are made inside its call."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(4) + 0.5)
        self.child = nn.Linear(4, 7)

    def forward(self, x):
        return self.child(x * self.scale) + 0


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.RNNBase]):
        super().__init__()
        self.emb, self.out = nn.Embedding(7, 4), nn.Linear(5, 7)
        self.rnn = cell(4, 5, batch_first=True)

    def forward(self, tokens):
        return self.out(self.rnn(self.emb(tokens))[0][:, -1])


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.a, self.b, self.reentrant = nn.Linear(4, 6), nn.Linear(6, 7), reentrant

    def forward(self, x):
        h = checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=self.reentrant)
        return self.b(h)


def _run(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, steps: int = 2,
         autocast: bool = False):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    instruments = [quantities.GradNorm(), quantities.NormTest(), quantities.InnerTest(),
                   quantities.OrthoTest(), quantities.GradHist1d()]
    cockpit = Cockpit(model, instruments, optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                losses = F.cross_entropy(model(inputs).float(), targets, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()
    return cockpit.get_output(), cockpit.get_notes(), [str(w.message) for w in caught]


def _tokens(n: int = 6):
    torch.manual_seed(0)
    return torch.randint(0, 7, (n, 3)), torch.randint(0, 7, (n,))


@pytest.mark.parametrize("model, used", [
    (lambda: TiedByFunction("F.linear"), ["emb.weight"]),
    (lambda: TiedByFunction("matmul"), ["emb.weight"]),
    (LinearNeverCalled, ["unused_call.bias", "unused_call.weight"]),
], ids=["F.linear(h, emb.weight)", "h @ emb.weight.T", "a Linear never called"])
def test_a_parameter_used_outside_its_layer_gives_none_with_a_note(model, used):
    torch.manual_seed(0)
    net = model().double()
    if isinstance(net, LinearNeverCalled):
        inputs, targets = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 7, (6,))
    else:
        inputs, targets = _tokens()
    output, notes, messages = _run(net, inputs, targets)
    for step in range(2):
        assert output[step]["GradNorm"] > 0  # (the batch gradient is the loss's own)
        for name in PER_SAMPLE:
            assert output[step][name] is None, (step, name)
            note = notes[step][name]
            assert all(u in note for u in used) and "outside the calls of the layer" in note
    assert any("outside the calls of the layer" in m for m in messages)


def _models():
    yield "tied by module", TiedByModule().double(), *_tokens()
    yield "custom layer calling a child", ScaledChild().double(), *_inputs(4)
    for cell in (nn.LSTM, nn.GRU):
        yield cell.__name__, Recurrent(cell).double(), *_tokens()
    for reentrant in (False, True):
        yield f"checkpoint reentrant={reentrant}", Checkpointed(reentrant).double(), *_inputs(4)
    for name in ("cnn", "residual", "transformer", "custom", "mlp_deep"):
        problem = make_problem(name, 6)
        yield name, problem.model, problem.x, problem.y


def _inputs(features: int, n: int = 6):
    torch.manual_seed(1)
    return torch.randn(n, features, dtype=torch.float64), torch.randint(0, 7, (n,))


@pytest.mark.parametrize("case", list(_models()), ids=lambda case: case[0])
def test_parameters_used_inside_their_layers_are_not_flagged(case):
    _, model, inputs, targets = case
    if targets.dtype != torch.int64:
        pytest.skip("a classification loss")
    output, notes, messages = _run(model, inputs, targets)
    assert not any("outside the calls" in m for m in messages)
    for step in range(2):
        assert output[step]["NormTest"] is not None, notes[step].get("NormTest")


def test_rounded_inputs_under_autocast_are_not_flagged():
    """Under bfloat16 autocast a Linear layer's float32 input is held rounded (outside
    autograd): the newest node of its inputs is read before, so the walk stops there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(),
                          nn.Linear(8, 7))
    inputs, targets = _inputs(4)
    output, notes, messages = _run(model, inputs.float(), targets, autocast=True)
    assert not any("outside the calls" in m for m in messages)
    assert output[1]["NormTest"] is not None, notes[1].get("NormTest")


def test_a_parameter_reached_without_individual_gradients_voids_the_totals(monkeypatch):
    """Should a layer's rule leave a parameter out (no individual gradients although the
    backward pass reached it), the totals would silently leave it out: None instead, with
    a note naming it."""
    from cockpit.engine.processing import CallProcessor

    original = CallProcessor.rule

    def without_the_last_bias(self, call, grads, scale=1.0):
        return {k: v for k, v in original(self, call, grads, scale).items() if k != "4.bias"}

    monkeypatch.setattr(CallProcessor, "rule", without_the_last_bias)
    problem = make_problem("mlp_relu", 6)
    output, notes, _ = _run(problem.model, problem.x, problem.y)
    for name in PER_SAMPLE:
        assert output[0][name] is None
        assert "4.bias" in notes[0][name] and "formed no individual gradients" in notes[0][name]
    assert output[0]["GradNorm"] > 0
