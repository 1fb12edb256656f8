"""Small parameters side by side (``cockpit.engine.side_by_side``): each statistic of G =
[G_1 | … | G_P] against the same statistic of each parameter alone (per-parameter norms, dot
products, exact histogram counts at and beside the edges), the grouping, and a tracked
step whose small parameters cost the same few ops however many there are, and their dot
products recorded for all of them at once as one by one."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from cockpit import Cockpit, configuration
from cockpit.engine import side_by_side, stacked
from cockpit.engine.float_sums import sample_sum_sq
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.histograms.exact import BinSpec, histogram_dense_counts
from cockpit.engine.processing import CallProcessor, _DotPlan
from cockpit.engine.side_by_side import SideBySide
from cockpit.engine.statistics.backward import BackwardStatistics, GradientDots
from cockpit.quantities import Quantity
from tests.engine.test_host_syncs import Count
from tests.reference import individual_gradients

SHAPES = [(5,), (3, 2), (), (7,), (1,)]


def grads(dtype: torch.dtype, n: int = 6, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, *shape, generator=gen) * (1 + i)).to(dtype)
            for i, shape in enumerate(SHAPES)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_norms_and_dots_are_each_parameters_own(dtype):
    gs = grads(dtype)
    side = SideBySide(gs)
    assert side.sizes == (5, 6, 1, 7, 1)
    tol = {torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2},
           torch.float32: {"rtol": 1e-5, "atol": 1e-5}}.get(dtype, {})
    for norm, g in zip(side.norms(), gs, strict=True):
        torch.testing.assert_close(norm.double(), g.double().reshape(len(g), -1).norm(dim=1),
                                   **tol)
    gen = torch.Generator().manual_seed(1)
    directions = [[torch.randn(g.shape[1:], generator=gen, dtype=torch.float32)
                   for _ in range(3)] for g in gs]
    # rounding bound: a few units of the dtype's precision times Σ_j |g_nj u_j|
    unit = {torch.bfloat16: 2.0**-6, torch.float32: 2.0**-20, torch.float64: 2.0**-48}[dtype]
    for dots, g, us in zip(side.dots(directions).unbind(2), gs, directions, strict=True):
        assert dots.shape == (3, len(g))
        flat = g.double().reshape(len(g), -1)
        rows = [u.to(dtype).double().reshape(-1) for u in us]
        expected = torch.stack([flat @ u for u in rows])
        magnitude = torch.stack([flat.abs() @ u.abs() for u in rows])
        assert ((dots.double() - expected).abs() <= unit * magnitude).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("scales", [None, [4.0] * 5, [1.0, 3.0, 0.3, 1.0, 7.1]])
def test_sums_of_squares_are_each_parameters_own(dtype, scales):
    """Σ_n g_{n,p} ⊙ g_{n,p} (TICDiag) of each parameter side by side: float64 of its own
    shape (a scalar parameter too), the same numbers as the parameter alone — its scaled
    gradients squared in their dtype and summed over the samples (``sample_sum_sq``)."""
    gs = grads(dtype)
    factors = scales or [1.0] * len(gs)
    sums = SideBySide(gs, scales).sum_sq()
    for total, g, scale in zip(sums, gs, factors, strict=True):
        assert total.dtype == torch.float64 and total.shape == g.shape[1:]
        scaled = g * scale if scale != 1.0 else g
        torch.testing.assert_close(total, sample_sum_sq(scaled), rtol=1e-12, atol=0.0)
        tol = {"rtol": 2e-2 if dtype == torch.bfloat16 else 1e-6, "atol": 0.0}
        torch.testing.assert_close(total, (g.double() * scale).pow(2).sum(0), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("spec", [BinSpec(-1.0, 1.0, 8), BinSpec(-0.3, 0.7, 5)])
def test_histograms_are_each_parameters_exact_counts(dtype, spec):
    """Every element at an edge, just beside it, far outside the range, ±∞ and NaN: the
    counts equal those of each parameter alone (the CPU's exact counts)."""
    edges = torch.linspace(spec.lo, spec.hi, spec.bins + 1, dtype=torch.float64)
    beside = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges,
                                                                            edges - 1)])
    special = torch.tensor([1e30, -1e30, float("inf"), -float("inf"), float("nan"), 0.0,
                            -0.0], dtype=torch.float64)
    pool = torch.cat([beside, special]).to(dtype)
    gs = []
    for i, shape in enumerate(SHAPES):
        numel = 6 * max(1, int(torch.Size(shape).numel()))
        index = (torch.arange(numel) * (i + 3)) % len(pool)
        gs.append(pool[index].reshape(6, *shape))
    counts = SideBySide(gs).histograms(spec)
    for c, g in zip(counts, gs, strict=True):
        assert c.dtype == torch.int64
        assert torch.equal(c, histogram_dense_counts([g], spec)), (c, g)


def test_groups_keep_a_key_together_and_within_the_limits(monkeypatch):
    cpu = torch.device("cpu")
    f32, f64 = torch.float32, torch.float64
    shapes = [(8, f32, cpu, 10), (8, f64, cpu, 10), (8, f32, cpu, 20), (4, f32, cpu, 5),
              (8, f32, cpu, 30)]
    assert side_by_side.groups(shapes, bins=10) == [[0, 2, 4], [1], [3]]
    monkeypatch.setattr(side_by_side, "MOST_ELEMENTS", 8 * 35)  # 0 and 2 fit, 4 does not
    assert side_by_side.groups(shapes, bins=10) == [[0, 2], [1], [3], [4]]
    monkeypatch.setattr(side_by_side, "MOST_ELEMENTS", 2**24)
    assert side_by_side.groups(shapes, bins=2**21) == [[0], [1], [2], [3], [4]]


def tracked_step_ops(depth: int) -> collections.Counter:
    """The ops of the third step of economy on an MLP of ``depth`` blocks (Linear,
    LayerNorm) trained by AdamW, on the accelerators' path."""
    torch.manual_seed(0)
    blocks = [m for _ in range(depth) for m in (nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh())]
    model = nn.Sequential(*blocks, nn.Linear(6, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt, strict=True)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    counted = Count()
    for step in range(3):
        opt.zero_grad()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        with counted if step == 2 else Count(), cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    assert all(v is not None for k, v in cockpit.get_output()[1].items()
               if k in ("Alpha", "NormTest", "InnerTest", "GradHist1d"))
    return counted.ops


def test_small_parameters_cost_the_same_ops_however_many(monkeypatch):
    """Three small parameters per block (bias, LayerNorm weight and bias): the histogram
    searches, norms, Adam's predicted update and the dot products of all of them are the
    same few ops for 2 blocks as for 6; what grows is per weight (and the hooks' views,
    and the check of each update after the step)."""
    monkeypatch.setattr(histogram_device, "_forced", True)
    monkeypatch.setattr(stacked, "capacity", lambda sg, budget: 0)  # weights one by one
    few, many = tracked_step_ops(2), tracked_step_ops(6)
    # (Adam's update by the fused kernel: one launch per weight, one for all small ones)
    # (and the concatenation of a weight's directions for its dot products)
    for op in ("bucketize", "histc", "_fused_adamw_", "cat"):
        assert many[op] - few[op] == 4, op  # one per added weight (4 Linear weights)
    assert few["cat"] > 3  # the small parameters' besides the three weights' ones


def _recorded(plans, block, together: bool) -> BackwardStatistics:
    stats = BackwardStatistics(num_samples=block.shape[1], gradient_dots=GradientDots({}))
    processor = CallProcessor(SimpleNamespace(stats=stats))
    if together:
        processor._record_dots_together(plans, block)
    else:
        for plan, dots in zip(plans, block.unbind(2), strict=True):
            processor._record_dots(plan, dots)
    return stats


@pytest.mark.parametrize("w_n", [None, 1.0, 4.0])
def test_plans_with_the_same_rows_are_recorded_together_as_one_by_one(w_n):
    """The gram, synced and projection rows of parameters side by side, taken for all of
    them by one view and one unbind, are each parameter's own rows (÷ w_n for the gram)."""
    block = torch.randn(3, 5, 4, dtype=torch.float64)
    vectors = [torch.zeros(1)] * 3
    plans = [_DotPlan(f"p{i}", vectors=list(vectors), gram_row=0, synced_row=1, w_n=w_n,
                      projections=[("all", [0, 1, 2]), ("tail", [1, 2]), ("last", [2])])
             for i in range(4)]
    assert len({plan.rows_read() for plan in plans}) == 1
    one_by_one, together = _recorded(plans, block, False), _recorded(plans, block, True)
    for name in ("p0", "p1", "p2", "p3"):
        p = int(name[1])
        gram = block[0, :, p] / (w_n if w_n else 1.0)
        assert torch.equal(together.gram_mean[name], gram)
        assert torch.equal(one_by_one.gram_mean[name], gram)
        assert torch.equal(together.gradient_dots.dots[name], block[1, :, p])
        for key, rows in (("all", block[:, :, p]), ("tail", block[1:, :, p]),
                          ("last", block[2:, :, p])):
            assert torch.equal(together.projections[key][name], rows)
            assert torch.equal(one_by_one.projections[key][name], rows)


def test_scattered_or_ready_rows_are_not_recorded_together():
    plan = _DotPlan("p", vectors=[torch.zeros(1)] * 3, projections=[("k", [0, 2])])
    assert plan.rows_read() is None
    plan.projections = [("k", [0, torch.zeros(5)])]
    assert plan.rows_read() is None
    plan.projections = [("k", [1, 2])]
    assert plan.rows_read() == (3, None, None, None, (("k", 1, 2),))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("scales", [[4.0] * 5, [1.0, 3.0, 0.3, 1.0, 7.1]])
def test_scaled_gradients_side_by_side_are_each_parameters_product(dtype, scales):
    """The loss weight's 1/w, multiplied into G once (one scale, or one per parameter's
    columns), gives the same numbers as each parameter's own product s·G_p."""
    gs = grads(dtype)
    side = SideBySide(gs, scales)
    expected = torch.cat([(g * s).reshape(len(g), -1) for g, s in zip(gs, scales,
                                                                       strict=True)], dim=1)
    assert torch.equal(side.rows, expected)


class SumsOfSquares(Quantity):
    """Σ_n g_n ⊙ g_n of every parameter as the engine formed it (test only)."""

    needs = frozenset({"sum_sq"})

    def compute(self, data):
        return {"SumsOfSquares": {k: v.double().clone() for k, v in data.stats.sum_sq.items()}}


def test_a_tracked_step_sums_each_parameters_squares_side_by_side_and_stacked(monkeypatch):
    """On the accelerator path the biases and LayerNorm parameters are summed side by side
    and the three Linear(6, 6) weights stacked: every parameter's Σ_n g_n ⊙ g_n is its own,
    torch.func's in float64."""
    monkeypatch.setattr(histogram_device, "_forced", True)
    torch.manual_seed(0)
    blocks = [m for _ in range(3) for m in (nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh())]
    model = nn.Sequential(*blocks, nn.Linear(6, 3)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    sides, stacks = collections.Counter(), collections.Counter()
    for module, counter in ((side_by_side.SideBySide, sides), (stacked.StackedGrads, stacks)):
        original = module.sum_sq

        def spy(self, _original=original, _counter=counter):
            _counter["members"] += len(self.sizes if hasattr(self, "sizes") else self.rows)
            return _original(self)

        monkeypatch.setattr(module, "sum_sq", spy)
    cockpit = Cockpit(model, [SumsOfSquares()], strict=True)
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    got = cockpit.get_output()[0]["SumsOfSquares"]
    expected = individual_gradients(model, lambda out, t: nn.functional.cross_entropy(
        out, t, reduction="none"), x, y)
    assert set(got) == set(expected)
    for name, g in expected.items():
        torch.testing.assert_close(torch.as_tensor(got[name]), g.pow(2).sum(0),
                                   rtol=1e-10, atol=1e-14, msg=name)
    assert sides["members"] == 10 and stacks["members"] == 3  # (the last weight alone)
