"""Hutchinson estimators: unbiased for the exact Hessian diagonal / trace (dense float64)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from curvature_reference import (
    dense_hessian,
    flatten,
    functional_loss,
    single_thread,  # noqa: F401  (autouse fixture)
)
from torch import nn

from cockpit.curvature import (
    HessianVectorProduct,
    hutchinson_diagonal,
    hutchinson_trace,
    rademacher_like,
)


def tiny_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 3)).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 3, (5,))
    return model, x, y


def test_rademacher_like():
    t = torch.empty(1000, 3, dtype=torch.float32)
    r = rademacher_like(t, torch.Generator().manual_seed(0))
    assert r.dtype == torch.float32 and r.shape == t.shape
    assert set(r.unique().tolist()) == {-1.0, 1.0}
    assert abs(r.mean().item()) < 0.1


def test_hutchinson_unbiased_within_three_standard_errors():
    model, x, y = tiny_problem()
    params = list(model.parameters())
    H = dense_hessian(functional_loss(model, x, y, "cross_entropy"), params)
    exact_diag, exact_trace = torch.diagonal(H), torch.trace(H).item()

    losses = F.cross_entropy(model(x), y, reduction="none")
    num_seeds = 300
    with HessianVectorProduct(losses.mean(), params) as hvp:
        draws = torch.stack(
            [
                flatten(hutchinson_diagonal(hvp, params, 1, torch.Generator().manual_seed(s)))
                for s in range(num_seeds)
            ]
        )
        # Same seed, same Rademacher draw: the trace estimate is the diagonal estimate's sum.
        for s in range(3):
            trace = hutchinson_trace(hvp, params, 1, torch.Generator().manual_seed(s))
            assert abs(trace.item() - draws[s].sum().item()) < 1e-12
        averaged = flatten(hutchinson_diagonal(hvp, params, 7, torch.Generator()))
    traces = draws.sum(1)
    mean, stderr = draws.mean(0), draws.std(0) / num_seeds**0.5
    assert torch.all((mean - exact_diag).abs() <= 3 * stderr + 1e-12)
    trace_se = traces.std().item() / num_seeds**0.5
    assert abs(traces.mean().item() - exact_trace) <= 3 * trace_se
    assert averaged.shape == exact_diag.shape  # num_samples > 1 works


def test_diagonal_exact_for_diagonal_hessian():
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    loss = (w**4).sum()
    with HessianVectorProduct(loss, [w]) as hvp:
        est = hutchinson_diagonal(hvp, [w], 3, torch.Generator().manual_seed(0))[0]
    assert torch.allclose(est, 12 * w.detach() ** 2, atol=1e-12)
