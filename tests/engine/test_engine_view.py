"""The engine's surface towards instruments and curvature code (EngineView): data flows one
way (the engine imports neither), instruments and the Cockpit read no private engine
state, and what DeadUnits reads through the view gives the brute-force numbers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, quantities
from cockpit.curvature import diag_hessian
from cockpit.engine.capture import activations
from cockpit.engine.engine_view import EngineView
from cockpit.engine.histograms.exact import BinSpec
from cockpit.engine.tracker import ModuleTracker

SRC = Path(__file__).resolve().parents[2] / "src" / "cockpit"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_engine_imports_neither_curvature_nor_quantities():
    offenders = {
        str(path.relative_to(SRC)): sorted(m for m in imported_modules(path)
                                           if m.startswith(("cockpit.curvature",
                                                            "cockpit.quantities")))
        for path in (SRC / "engine").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_recorded_activations_are_those_the_hessian_diagonal_covers():
    assert set(activations.ELEMENTWISE_ACTIVATIONS) == set(diag_hessian.SECOND_DERIVATIVES)
    assert set(activations.NORMALIZATIONS) == set(diag_hessian.NORMALIZATIONS)


def test_no_private_engine_state_is_read_outside_the_engine():
    """Instruments and curvature code see the engine only through EngineView; the Cockpit
    reads its public members; capture and processing share the backward pass' state through
    ``engine.state``."""
    pattern = re.compile(r"\b(tracker|engine)\._[a-z]")
    files = [SRC / "cockpit.py", *(SRC / "engine" / "capture").glob("*.py"),
             SRC / "engine" / "processing.py",
             *(SRC / "step").glob("*.py"), *(SRC / "loop_checks").glob("*.py"),
             *(SRC / "quantities").glob("*.py"), *(SRC / "curvature").glob("*.py")]
    found = [f"{path.name}: {line.strip()}" for path in files
             for line in path.read_text().splitlines() if pattern.search(line)]
    assert found == []


def test_module_tracker_is_an_engine_view():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    tracker = ModuleTracker(model, BinSpec(-1, 1, 10), (BinSpec(-1, 1, 4), BinSpec(-1, 1, 4)))
    try:
        assert isinstance(tracker, EngineView)
        assert tracker.parameter_owners == {
            "0.weight": (model[0], "weight"), "0.bias": (model[0], "bias"),
            "2.weight": (model[2], "weight"), "2.bias": (model[2], "bias")}
        assert not tracker.in_own_work and not tracker.is_suspended
        with tracker.suspended():
            assert tracker.in_own_work and tracker.is_suspended
        assert not tracker.in_own_work
    finally:
        tracker.remove()


class TiedLanguageModel(nn.Module):
    """An Embedding tied to the output Linear layer (the table is ``embed.weight``), a
    hidden Linear layer with planted dead units."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            self.mid.bias[:2] = -100.0

    def forward(self, tokens):
        return self.head(torch.relu(self.mid(self.embed(tokens))))


@pytest.mark.parametrize("kind", ["tied", "root"])
def test_dead_units_through_the_view_against_brute_force(kind):
    """The weights counted are the Linear/convolution weights under their parameter names
    (a root module's is ``weight``; a table tied to a Linear layer stays the Embedding's and
    is not counted), each with #{i : g_n,i = 0 for every n} / #units."""
    torch.manual_seed(0)
    if kind == "tied":
        model = TiedLanguageModel().double()
        x = torch.randint(0, 7, (9,))
        weights = ["mid.weight"]
    else:
        model = nn.Linear(5, 4).double()
        with torch.no_grad():
            model.weight[1] = 0.0
        x = torch.randn(9, 5, dtype=torch.float64)
        weights = ["weight"]
    y = torch.randint(0, 4, (9,))

    def loss_fn(out, target):
        if kind == "root":  # row 1 gets no gradient: a ReLU in front of the loss kills it
            out = torch.cat([out[:, :1], torch.relu(out[:, 1:2] - 100.0), out[:, 2:]], 1)
        return F.cross_entropy(out, target, reduction="none")

    cockpit = Cockpit(model, [quantities.DeadUnits()], strict=True)
    losses = loss_fn(model(x), y)
    with cockpit(0, losses=losses):
        losses.mean().backward()
    out = cockpit.get_output()[0]
    cockpit.close()

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, xi, yi):
        return loss_fn(torch.func.functional_call(model, p, (xi[None],)), yi[None])[0]

    per_sample = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    assert sorted(k for k in out if k.startswith("DeadUnits/")) == [
        f"DeadUnits/{w}" for w in weights]
    dead = {w: int((per_sample[w].abs().amax(dim=(0, 2)) == 0).sum()) for w in weights}
    assert all(d > 0 for d in dead.values())  # the planted dead units exist
    for w in weights:
        assert out[f"DeadUnits/{w}"] == pytest.approx(dead[w] / params[w].shape[0])
