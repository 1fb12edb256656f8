"""The bin edges GradHist1d/GradHist2d report are formed once per bin specification and
follow every change of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cockpit import Cockpit
from cockpit.engine.histograms.auto_range import DecidedRange
from cockpit.engine.histograms.exact import BinSpec
from cockpit.quantities import GradHist1d
from cockpit.quantities.grad_hist import _edges


def test_edges_are_cached_per_spec_and_follow_a_changed_spec():
    spec = BinSpec(-1.0, 1.0, 4)
    edges = _edges(spec)
    np.testing.assert_array_equal(edges, np.linspace(-1.0, 1.0, 5))
    assert _edges(BinSpec(-1.0, 1.0, 4)) is edges  # an equal spec: the same array
    assert not edges.flags.writeable  # shared between steps: nobody may change it
    for other in (BinSpec(-1.0, 1.0, 5), BinSpec(-2.0, 1.0, 4), BinSpec(-1.0, 3.0, 4)):
        np.testing.assert_array_equal(
            _edges(other), torch.linspace(other.lo, other.hi, other.bins + 1,
                                          dtype=torch.float64).numpy())
    decided = DecidedRange(-1.0, 1.0, 4)
    np.testing.assert_array_equal(_edges(decided), edges)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reported_edges_are_float64_of_each_cockpits_spec(dtype):
    """Two cockpits with different bins (gradients in float32 or float64): each step
    reports the float64 edges of its own spec, and the counts add up to |B|×D."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 3, dtype=dtype), torch.randint(0, 2, (6,))
    for spec in (BinSpec(-1.0, 1.0, 4), BinSpec(-0.5, 0.5, 7)):
        model = torch.nn.Linear(3, 2).to(dtype)
        cockpit = Cockpit(model, [GradHist1d()], hist_bins=spec)
        for step in range(2):
            losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            model.zero_grad()
        cockpit.close()
        for record in cockpit.get_output().values():
            hist = record["GradHist1d"]
            assert hist["edges"].dtype == np.float64
            np.testing.assert_array_equal(hist["edges"], torch.linspace(
                spec.lo, spec.hi, spec.bins + 1, dtype=torch.float64).numpy())
            assert int(hist["counts"].sum()) == 6 * (3 * 2 + 2)
