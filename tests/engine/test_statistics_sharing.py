"""The per-layer loop hands every requested statistic the same individual gradients: a
factored layer (Linear on sequences) is materialized once per parameter, not once per
statistic, and the values are exactly those of statistics that materialize on their own."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from cockpit import Cockpit, quantities
from cockpit.engine import processing, stacked
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.rules.sample_grads import SequenceOuterSampleGrads
from cockpit.engine.statistics import NORMS, REGISTRY, SQ_NORMS, LayerContext
from tests.models import Problem, train


class SequenceModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 9), nn.Linear(9, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).mean(1)


def tracked_run(steps: int = 2):
    torch.manual_seed(0)
    model = SequenceModel().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # sq_norms (materialized: T(I+J) ≥ IJ), var_sum and both histograms
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.MeanGSNR(),
                              quantities.GradHist1d(), quantities.GradHist2d()],
                      optimizer=opt, strict=True)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 5, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=generator)
        opt.zero_grad()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    return cockpit.get_output()


def test_a_factored_layer_is_materialized_once_for_all_its_statistics(monkeypatch):
    formed = []
    original = SequenceOuterSampleGrads.chunks
    monkeypatch.setattr(SequenceOuterSampleGrads, "chunks",
                        lambda self: (formed.append(1), original(self))[1])
    shared = tracked_run()
    assert len(formed) == 2 * 2  # per step, once per weight (two Linear layers)
    formed.clear()
    monkeypatch.setattr(processing, "shared_chunks", lambda sg, layer: contextlib.nullcontext())
    alone = tracked_run()
    # each statistic forms them again: sq_norms, var_sum, hist2d (and from the second step
    # on, with the histogram's range settled, hist1d)
    assert len(formed) == 2 * 3 + 2 * 4

    def same(a, b):
        if isinstance(a, dict):
            assert set(a) == set(b)
            for key in a:
                same(a[key], b[key])
        elif isinstance(a, float):
            assert a == b or (np.isnan(a) and np.isnan(b))
        elif isinstance(a, np.ndarray):
            assert np.array_equal(a, b)
        else:
            assert a == b

    same(shared, alone)
    assert "GradHist2d" in shared[1] and shared[1]["MeanGSNR"] is not None


def norm_test_run(with_histogram: bool, monkeypatch) -> tuple[list, list]:
    """NormTest on the accelerators' path (forced) over three steps, with or without
    GradHist1d; the values and how often the Gram matrices of ‖g_n‖² were formed."""
    grams: list[bool] = []
    original = SequenceOuterSampleGrads.sq_norms
    with monkeypatch.context() as patch:
        patch.setattr(SequenceOuterSampleGrads, "sq_norms",
                      lambda self: (grams.append(self._by_grams()), original(self))[1])
        return _norm_test_values(with_histogram), grams


def _norm_test_values(with_histogram: bool) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 9)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    instruments = [quantities.NormTest()] + ([quantities.GradHist1d()] if with_histogram else [])
    generator = torch.Generator().manual_seed(1)
    # T = 2 positions: T(I + J) < IJ, the closed form's Gram matrices are the cheaper
    x = torch.randn(8, 2, 9, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 9, (8,), generator=generator)
    problem = Problem("sequence", model, x, y, lambda out, target: nn.functional.cross_entropy(
        out.mean(1), target, reduction="none"))
    with histogram_device.forced():
        cockpit = Cockpit(model, instruments, optimizer=opt, strict=True)
        train(problem, cockpit, 3, opt)
        cockpit.close()
    return [cockpit.get_output()[step]["NormTest"] for step in range(3)]


def test_norms_are_read_from_the_chunks_a_histogram_materialized(monkeypatch):
    """Where the histogram materialized a sequence layer's individual gradients (its range
    settled after the first step), ‖g_n‖ is read from them, not formed again from Gram
    matrices: the same NormTest to rounding (the weights one by one, not stacked)."""
    monkeypatch.setattr(stacked, "capacity", lambda sg, budget: 0)
    alone, grams_alone = norm_test_run(False, monkeypatch)
    shared, grams_shared = norm_test_run(True, monkeypatch)
    assert grams_alone == [True] * 2 * 3  # two weights, three steps
    assert grams_shared == [True] * 2  # the first step only (the range undecided)
    assert all(value is not None for value in alone)
    np.testing.assert_allclose(shared, alone, rtol=1e-12)


@pytest.mark.cpu_path
def test_norms_and_squares_from_materialized_chunks_match_the_brute_force(monkeypatch):
    """On accelerators both statistics read the chunks a statistic formed before them (one
    norm each); a CPU keeps the closed form (the Gram matrices' fewer FLOPs)."""
    generator = torch.Generator().manual_seed(2)
    delta = torch.randn(5, 2, 7, generator=generator, dtype=torch.float64)
    a = torch.randn(5, 2, 6, generator=generator, dtype=torch.float64)
    sg = SequenceOuterSampleGrads(delta, a)
    assert sg._by_grams()
    flat = torch.einsum("nti,ntj->nij", delta, a).reshape(5, -1)
    layer = LayerContext("w", SimpleNamespace())
    layer.chunks = sg.chunks()
    grams = []
    original = SequenceOuterSampleGrads.sq_norms
    monkeypatch.setattr(SequenceOuterSampleGrads, "sq_norms",
                        lambda self: (grams.append(1), original(self))[1])
    for accelerator in (True, False):
        grams.clear()
        with histogram_device.forced() if accelerator else contextlib.nullcontext():
            torch.testing.assert_close(REGISTRY[NORMS].form(sg, layer), flat.norm(dim=1))
            torch.testing.assert_close(REGISTRY[SQ_NORMS].form(sg, layer), flat.pow(2).sum(1))
        assert len(grams) == (0 if accelerator else 2)
