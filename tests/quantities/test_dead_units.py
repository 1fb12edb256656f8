"""DeadUnits' per-unit sums Σ_j |ḡ_i,j| on both paths: a norm per weight on the CPU, one copy
of all weights and a segmented sum on accelerators (forced here)."""

import warnings

import pytest
import torch

from cockpit.engine.histograms import device as histogram_device
from cockpit.quantities.dead_units import unit_sums
from tests.models import Problem, train
from tests.reference import individual_gradients


def _weights(dtype):
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 5), (3, 2, 3, 3), (6, 1), (2, 7, 2)]
    weights = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    weights[0][1] = 0.0  # dead units
    weights[1][0] = 0.0
    weights[1][2, 1, 2, 0] = 0.0  # a zero element of a living unit
    weights[2][5] = 0.0
    weights[3][0, 3, 1] = 2.0**-140 if dtype != torch.bfloat16 else 2.0**-130  # tiny, alive
    weights[3][0, :3] = 0.0
    weights[3][0, 4:] = 0.0
    weights[3][0, 3, 0] = 0.0
    return weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_unit_sums_against_row_sums(dtype, path):
    weights = _weights(dtype)
    expected = torch.cat([w.double().abs().reshape(len(w), -1).sum(1) for w in weights])
    with histogram_device.forced() if path == "accelerator" else torch.no_grad():
        sums = unit_sums(weights)
    assert sums.shape == (sum(len(w) for w in weights),)
    assert torch.equal(sums == 0, expected == 0)  # exactly the dead units
    assert (sums == 0).sum() == 3
    torch.testing.assert_close(sums.double(), expected,
                               rtol={torch.bfloat16: 1e-2}.get(dtype, 1e-6), atol=0.0)


@pytest.mark.parametrize("odd", ["dtypes", "empty"])
def test_unit_sums_of_mixed_dtypes_or_empty_rows_on_the_accelerator_path(odd):
    """Weights of different dtypes (or one without inputs: its units are dead) cannot share
    one copy: a norm per weight instead."""
    weights = _weights(torch.float32)
    if odd == "dtypes":
        weights[2] = weights[2].double()
    else:
        weights.append(torch.zeros(4, 0))
    with histogram_device.forced():
        sums = unit_sums(weights)
    expected = torch.cat([w.double().abs().reshape(len(w), -1).sum(1) for w in weights])
    assert torch.equal(sums == 0, expected == 0)
    torch.testing.assert_close(sums.double(), expected)


def test_non_finite_units_are_alive():
    weights = [torch.tensor([[0.0, float("nan")], [0.0, 0.0], [float("inf"), 0.0]])]
    for forced in (False, True):
        with histogram_device.forced() if forced else torch.no_grad():
            sums = unit_sums(weights)
        assert (sums == 0).tolist() == [False, True, False]


def _dead_units_step(model, x, y):
    """DeadUnits at one tracked step of ``model`` on (x, y), and the individual gradients
    (torch.func) it is checked against."""
    import torch.nn.functional as F

    from cockpit import Cockpit, quantities

    problem = Problem("dead", model, x, y,
                      lambda out, target: F.cross_entropy(out, target, reduction="none"))
    grads = individual_gradients(model, problem.loss_fn, x, y)
    cockpit = Cockpit(model, [quantities.DeadUnits()], strict=True)
    train(problem, cockpit, 1, torch.optim.SGD(model.parameters(), lr=0.0))
    cockpit.close()
    return cockpit.get_output()[0], grads


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_dead_fractions_of_several_weights_and_a_weight_without_units(path, monkeypatch):
    """Each weight's dead fraction and the total #dead / #units against the individual
    gradients (torch.func); a weight with no units (Linear(·, 0)) is left out, not a 0/0."""
    from torch import nn

    monkeypatch.setattr(histogram_device, "_forced", path == "accelerator")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 4)
            with warnings.catch_warnings():  # ("initializing zero-element tensors")
                warnings.simplefilter("ignore", UserWarning)
                self.empty = nn.Linear(6, 0)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.b(h) + self.empty(h).sum(1, keepdim=True)

    torch.manual_seed(0)
    model = Net().double()
    with torch.no_grad():  # units 1 and 4 of ``a`` never fire: their rows get no gradient
        model.a.bias[[1, 4]] = -1e3
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randint(0, 4, (7,))
    out, grads = _dead_units_step(model, x, y)
    dead = {w: int((grads[w].abs().amax(dim=(0, 2)) == 0).sum())
            for w in ("a.weight", "b.weight")}
    assert dead["a.weight"] == 2
    assert sorted(k for k in out if k.startswith("DeadUnits/")) == [
        "DeadUnits/a.weight", "DeadUnits/b.weight"]
    assert out["DeadUnits/a.weight"] == dead["a.weight"] / 6
    assert out["DeadUnits/b.weight"] == dead["b.weight"] / 4
    assert out["DeadUnits"] == (dead["a.weight"] + dead["b.weight"]) / 10


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_a_layer_after_dead_units_is_not_dead_itself(path, monkeypatch):
    """Every hidden ReLU unit dead: the output layer's rows are zero (its input is), but its
    units still get a gradient (their bias's); the dead units are those whose row and bias
    gradient both vanish (against the individual gradients), a layer without a bias by its
    rows alone."""
    from torch import nn

    monkeypatch.setattr(histogram_device, "_forced", path == "accelerator")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4),
                          nn.Linear(4, 3, bias=False)).double()
    with torch.no_grad():
        model[0].bias.fill_(-1e3)  # (no hidden unit fires)
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randint(0, 3, (7,))
    out, grads = _dead_units_step(model, x, y)
    assert (grads["2.weight"] == 0).all() and (grads["2.bias"] != 0).any()
    assert out["DeadUnits/0.weight"] == 1.0
    assert out["DeadUnits/2.weight"] == float((grads["2.bias"].abs().amax(0) == 0).float().mean())
    assert out["DeadUnits/2.weight"] == 0.0
    assert out["DeadUnits/3.weight"] == 0.0  # (its input, the 2nd layer's output, is not 0)
