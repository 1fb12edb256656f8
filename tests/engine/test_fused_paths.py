"""The accelerator path (fused multi-tensor kernels, device histograms: what a GPU runs)
against the CPU path (per-tensor BLAS products, NumPy histograms), which the instrument
tests check against brute force: every value of every configuration's instruments agrees,
histograms exactly, the rest to float32 rounding, over steps of SGD with momentum (Alpha's
fit of the update, Distance from θ_0, UpdateSize) and with an edited gradient (a positive
GradientMismatch)."""

from __future__ import annotations

import math

import pytest
import torch

from cockpit import Cockpit, configuration
from cockpit.engine.histograms import device as histogram_device
from tests.models import make_problem


def run(config: str, accelerator_path: bool, monkeypatch, clip: bool, adam: bool = False
        ) -> dict:
    monkeypatch.setattr(histogram_device, "_forced", accelerator_path)
    problem = make_problem("cnn", 8, torch.float32, seed=3)
    model = problem.model
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1) if adam else
           torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    cockpit = Cockpit(model, configuration(config), optimizer=opt, strict=True)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        x = problem.x + 0.1 * torch.randn(problem.x.shape, generator=gen)
        opt.zero_grad()
        losses = problem.loss_fn(model(x), problem.y)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        if clip:  # the optimizer steps on an edited gradient
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        opt.step()
    cockpit.close()
    return cockpit.get_output()


def flat_values(output: dict) -> dict:
    values = {}
    for step, record in output.items():
        for key, value in record.items():
            values[(step, key)] = value
    return values


def assert_close(a, b, where) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_close(a[k], b[k], (where, k))
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close(x, y, (where, i))
    elif isinstance(a, torch.Tensor) or hasattr(a, "shape"):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        if a.is_floating_point():
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-7,
                                       msg=str(where))
        else:
            assert torch.equal(a, b), where  # counts: exactly
    elif isinstance(a, float):
        assert isinstance(b, float), where
        if math.isnan(a):
            assert math.isnan(b), where
        else:
            assert b == pytest.approx(a, rel=1e-4, abs=1e-7), where
    else:
        assert a == b, where


@pytest.mark.parametrize(("clip", "adam"), [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("config", ["economy", "business"])
def test_the_accelerator_path_gives_the_cpu_paths_values(config, clip, adam, monkeypatch,
                                                         one_thread):
    """(The biases go side by side on the accelerator path: their statistics at the end of
    the backward pass, AdamW's update of all of them predicted at once.)"""
    cpu = flat_values(run(config, False, monkeypatch, clip, adam))
    accelerator = flat_values(run(config, True, monkeypatch, clip, adam))
    assert cpu.keys() == accelerator.keys()
    assert any(k[1] == "Alpha" and v is not None for k, v in cpu.items())
    assert any(k[1] == "GradientMismatch" and v is not None for k, v in cpu.items())
    if clip:
        assert max(v for k, v in cpu.items() if k[1] == "GradientMismatch"
                   and v is not None) > 1e-3
    for key, value in cpu.items():
        assert_close(value, accelerator[key], key)


@pytest.mark.parametrize("accelerator_path", [False, True])
def test_sums_of_squares_of_large_parameters(accelerator_path, monkeypatch):
    """Σ_n g_n⊙g_n and Σ_n (g_n − ḡ)⊙(g_n − ḡ) of a parameter above 2^14 elements (row by
    row on a CPU, by whole chunks on an accelerator) against float64."""
    from cockpit.engine.rules.sample_grads import DenseSampleGrads

    monkeypatch.setattr(histogram_device, "_forced", accelerator_path)
    gen = torch.Generator().manual_seed(1)
    grads = 0.3 + torch.randn(9, 5, 2**12, generator=gen)  # a mean far from 0
    sg = DenseSampleGrads(grads)
    g64 = grads.double()
    torch.testing.assert_close(sg.sum_sq(), (g64 * g64).sum(0), rtol=1e-6, atol=0)
    centered = (g64 - g64.mean(0)).pow(2).sum(0)
    torch.testing.assert_close(sg.centered_sum_sq(), centered, rtol=1e-5, atol=1e-9)
