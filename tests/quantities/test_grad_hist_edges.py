"""The bin edges GradHist1d/GradHist2d report are formed once per bin specification and
follow every change of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cockpit import Cockpit
from cockpit.engine.histograms.auto_range import DecidedRange
from cockpit.engine.histograms.exact import BinSpec
from cockpit.quantities import GradHist1d, GradHist2d
from cockpit.quantities.grad_hist import _edges
from tests.models import make_problem
from tests.split_reference import assert_same_values, sgd, whole_batch_run


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


@pytest.mark.parametrize("hist_bins", [None, BinSpec(-0.5, 0.5, 8)])
def test_samples_that_do_not_reach_a_parameter_count_as_zeros(hist_bins):
    """Micro-batches that each take one of two heads (the other head unreached): every
    sample's individual gradients are counted, 0 for the head it did not take, exactly as
    one backward pass on the whole batch whose samples pick their head per sample (both
    heads called, the other's individual gradients 0). The automatic range is decided at
    the first step (counts in magnitude keys), the user's bins at every step."""
    chosen = [GradHist1d(), GradHist2d()]
    kwargs = {} if hist_bins is None else {"hist_bins": hist_bins}
    problem = make_problem("routed", 12)  # samples 0–5 take head a, 6–11 head b
    batches = [(problem.x, problem.y)] * 2
    reference = make_problem("routed", 12)
    expected, _ = whole_batch_run(reference, batches, sgd, chosen=[GradHist1d(), GradHist2d()],
                                  **kwargs)
    model = problem.model
    opt = sgd(model)
    cockpit = Cockpit(model, chosen, optimizer=opt, strict=True, grad_accumulation=True,
                      **kwargs)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        for part in (slice(0, 4), slice(4, 6), slice(6, 12)):  # a, a, b
            losses = problem.loss_fn(model(x[part]), y[part])
            with cockpit(step, losses=losses):
                (losses.sum() / len(x)).backward()
        opt.step()
    cockpit.close()
    output = cockpit.get_output()
    for step in range(2):
        for name in ("a.weight", "b.bias"):
            assert output[step][f"GradHist1d/{name}"]["counts"].sum() == 12 * dict(
                model.named_parameters())[name].numel()
    assert assert_same_values(output, expected, range(2)) >= 2 * 2 * 7  # (and BatchSize, …)
