"""The per-layer loop hands every requested statistic the same individual gradients: a
factored layer (Linear on sequences) is materialized once per parameter, not once per
statistic, and the values are exactly those of statistics that materialize on their own."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn

from cockpit import Cockpit, quantities
from cockpit.engine import processing
from cockpit.engine.rules.sample_grads import SequenceOuterSampleGrads


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
