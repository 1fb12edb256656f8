"""histogram2d_outer (2-D histogram of Linear-layer individual gradients δ_n a_nᵀ against θ)
against brute force: materialize every product fl(δ·a), bin it exactly (compared with the
rational edges rounded up to float64, tests.reference.bin_indices), count the pairs with the
θ bins."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cockpit import Cockpit, quantities
from cockpit.engine.histograms import outer2d as h2
from cockpit.engine.histograms.exact import BinSpec, histogram2d_dense
from cockpit.engine.histograms.outer2d import histogram2d_outer
from cockpit.engine.rules import sample_grads
from cockpit.engine.rules.sample_grads import OuterSampleGrads, SampleGrads
from tests.models import make_problem
from tests.reference import bin_indices_np as np_bins
from tests.reference import edge_neighbours, host_count, individual_gradients

F32, F64 = torch.float32, torch.float64

SPECS = [
    (BinSpec(-1.0, 1.0, 40), BinSpec(-2.0, 2.0, 50)),  # GradHist2d defaults: 0 is an edge
    (BinSpec(-0.1, 0.1, 7), BinSpec(-1.0, 1.0, 11)),  # odd: 0 inside a bin
    (BinSpec(-0.3, 0.5, 13), BinSpec(-0.5, 1.5, 3)),  # asymmetric, 0 inside a bin
    (BinSpec(0.02, 0.6, 5), BinSpec(0.0, 1.0, 1)),  # 0 clamped into the first bin
]


# --------------------------------------------------------------------------- references


def brute_force(delta, a, theta, spec_g, spec_theta) -> tuple[np.ndarray, int]:
    with np.errstate(over="ignore", invalid="ignore"):
        g = delta.numpy()[:, :, None] * a.numpy()[:, None, :]  # [N, I, J]
    kg = np_bins(g, spec_g)
    kt = np.broadcast_to(np_bins(theta.numpy().reshape(g.shape[1:]), spec_theta), g.shape)
    ok = (kg >= 0) & (kt >= 0)
    flat = kg[ok] * spec_theta.bins + kt[ok]
    counts = np.bincount(flat, minlength=spec_g.bins * spec_theta.bins)
    return counts.reshape(spec_g.bins, spec_theta.bins), int((~ok).sum())


def check(delta, a, theta, spec_g, spec_theta) -> tuple[torch.Tensor, int]:
    before = delta.clone(), a.clone(), theta.clone()
    counts, bad = histogram2d_outer(delta, a, theta, spec_g, spec_theta)
    expected, expected_bad = brute_force(delta, a, theta, spec_g, spec_theta)
    assert counts.dtype == torch.int64 and counts.shape == (spec_g.bins, spec_theta.bins)
    np.testing.assert_array_equal(counts.numpy(), expected)
    bad = host_count(bad)
    assert isinstance(bad, int) and bad == expected_bad
    assert counts.sum().item() + bad == delta.shape[0] * theta.numel()
    for x, y in zip((delta, a, theta), before, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    return counts, bad


def layer(gen, N, I, J, dtype, scale, relu=True):
    """δ ~ scale·N(0, 1) with exact zeros, tiny entries and a zero sample; a with ReLU
    zeros, −0.0, negative entries, a sample of zeros only and one of a single class."""
    delta = scale * torch.randn(N, I, generator=gen, dtype=F64)
    delta[torch.rand(N, I, generator=gen) < 0.08] = 0.0
    delta[:1, : I // 3] *= 1e-6  # tiny products: near-zero ends round into the zero bin
    a = torch.randn(N, J, generator=gen, dtype=F64)
    if relu:
        a = a.clamp_min(0.0)
    a[torch.rand(N, J, generator=gen) < 0.05] = -0.0
    if N > 2:
        a[1] = 0.0
        a[2] = a[2].abs() + 0.5  # one class, far from zero
    if N > 3:
        a[3, : J // 2] *= 1e-5  # many tiny activations
    if N > 4:
        delta[4] = 0.0  # a sample without error signal
    theta = 0.8 * torch.randn(I, J, generator=gen, dtype=F64)
    return delta.to(dtype), a.to(dtype), theta.to(dtype)


@pytest.fixture(params=["factored", "windows_small", "sorted", "scan", "heavy", "default"])
def mode(request, monkeypatch):
    """factored: the factored kernel for every layer (no dense fallback, no class end
    scanned for having few rows); windows_small: tiny tasks; sorted: one sort instead of
    topk; scan: every class end scanned; heavy: every row that moves a product is formed
    whole; default: module settings."""
    if request.param != "default":
        monkeypatch.setattr(h2, "_MIN_PRODUCTS", 0)
        for name in ("_WINDOW_COST", "_HEAVY_COST", "_BASE_COST", "_MATMUL_COST", "_FEW_ROWS"):
            monkeypatch.setattr(h2, name, 0.0)
    if request.param == "windows_small":
        monkeypatch.setattr(h2, "_CHUNK", 256)
    if request.param == "sorted":
        monkeypatch.setattr(h2, "_TOPK_FRACTION", 1e-3)
    if request.param == "scan":
        monkeypatch.setattr(h2, "_FEW_ROWS", 1e9)
    if request.param == "heavy":
        monkeypatch.setattr(h2, "_HEAVY_FRACTION", 0.0)
    return request.param


# --------------------------------------------------------------------------- random layers


@pytest.mark.parametrize("scale", [1e-3, 1e-2, 1e-1, 1.0, 10.0])
@pytest.mark.parametrize("specs", SPECS, ids=["default", "odd", "asym", "clamped"])
def test_matches_brute_force(scale, specs, mode):
    gen = torch.Generator().manual_seed(int(-math.log10(scale) * 10) + 100 + specs[0].bins)
    for dtype in (F32, F64):
        for relu, (N, I, J) in ((True, (9, 23, 41)), (False, (6, 17, 29))):
            delta, a, theta = layer(gen, N, I, J, dtype, scale, relu)
            check(delta, a, theta, *specs)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_many_small_random_shapes(dtype, mode):
    gen = torch.Generator().manual_seed(11 + (dtype == F64))
    for k in range(12):
        N, I, J = (int(x) for x in torch.randint(1, 14, (3,), generator=gen))
        scale = 10 ** float(torch.empty(1).uniform_(-3, 1, generator=gen))
        delta, a, theta = layer(gen, N, I, J, dtype, scale, relu=k % 2 == 0)
        check(delta, a, theta, *SPECS[k % len(SPECS)])


@pytest.mark.parametrize("dtype", [F32, F64])
def test_products_on_and_next_to_edges(dtype, mode):
    """δ = edges with a = 1, δ = 3 with a = edges/3 and a = edges·0.7 with δ = −1/0.7:
    products exactly on, or one rounding from, the gradient bin edges (and 0)."""
    sg, st = BinSpec(-1.0, 1.0, 10), BinSpec(-1.0, 1.0, 4)
    e = edge_neighbours(sg, dtype, steps=3)
    full = torch.full_like(e, 1.0)
    a = torch.stack([full, e / 3, e, e * 0.7, e]).to(dtype)
    delta = torch.stack([e, 3 * full, -full, full * (-1 / 0.7), e * 1e-8]).to(dtype)
    theta = edge_neighbours(st, dtype, steps=3).to(dtype)
    theta = theta[torch.randperm(e.numel() ** 2, generator=torch.Generator().manual_seed(0))
                  % theta.numel()].view(e.numel(), e.numel())
    check(delta, a, theta, sg, st)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_tiny_and_subnormal_products(dtype, mode):
    gen = torch.Generator().manual_seed(3)
    tiny = torch.finfo(dtype).tiny
    delta = (torch.randn(4, 30, generator=gen) * 4).to(dtype) * tiny
    a = torch.randn(4, 25, generator=gen).to(dtype)
    a[:, :5] = 0.0
    theta = torch.randn(30, 25, generator=gen).to(dtype)
    for sg in (BinSpec(-tiny, tiny, 8), BinSpec(0.0, 1e-3, 5), BinSpec(-1.0, 1.0, 40)):
        check(delta, a, theta, sg, BinSpec(-2.0, 2.0, 5))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_nonfinite_entries_and_overflow(dtype, mode):
    gen = torch.Generator().manual_seed(4)
    sg, st = BinSpec(-1.0, 1.0, 16), BinSpec(-1.0, 1.0, 7)
    delta, a, theta = layer(gen, 7, 11, 13, dtype, 0.5)
    delta[0, 0] = math.nan
    a[4, 2] = math.inf  # inf · 0 = NaN and inf · δ = ±inf
    delta[5, 3] = -math.inf
    a[6, 3] = torch.finfo(dtype).max / 2  # finite factors, overflowing products
    delta[6, 1] = 8.0
    assert check(delta, a, theta, sg, st)[1] > 0


@pytest.mark.parametrize("dtype", [F32, F64])
def test_theta_outside_range_and_nonfinite(dtype, mode):
    gen = torch.Generator().manual_seed(5)
    sg, st = BinSpec(-0.5, 0.5, 9), BinSpec(-0.5, 0.5, 6)
    delta, a, theta = layer(gen, 8, 12, 15, dtype, 0.2)
    theta = 10 * theta  # mostly clamped into the edge bins
    theta[0, :3] = torch.tensor([1e30, -1e30, torch.finfo(dtype).max], dtype=dtype)
    check(delta, a, theta, sg, st)
    theta[1, 2], theta[3, 4], theta[5, 0] = math.nan, math.inf, -math.inf
    _, bad = check(delta, a, theta, sg, st)
    assert bad == 3 * delta.shape[0]
    delta[2, 2] = math.nan  # a non-finite product paired with a finite and a non-finite θ
    check(delta, a, theta, sg, st)


@pytest.mark.parametrize("shape", [(1, 20, 30), (7, 1, 30), (7, 20, 1), (1, 1, 1), (0, 5, 6),
                                   (4, 0, 6), (4, 5, 0)])
def test_degenerate_shapes(shape, mode):
    gen = torch.Generator().manual_seed(6)
    delta, a, theta = layer(gen, *shape, F32, 0.3)
    check(delta, a, theta, *SPECS[1])


@pytest.mark.cpu_path
def test_wrong_guesses_are_repaired(monkeypatch):
    """Random searchsorted guesses, and bounds on the kept entries that are too tight: the
    exact verification (bisection, redo with the sorted rows) still gives brute force."""
    for name in ("_MIN_PRODUCTS", "_WINDOW_COST", "_HEAVY_COST", "_BASE_COST", "_MATMUL_COST",
                 "_FEW_ROWS"):
        monkeypatch.setattr(h2, name, 0)
    gen = torch.Generator().manual_seed(7)
    delta, a, theta = layer(gen, 9, 30, 57, F32, 0.05, relu=False)
    real = torch.searchsorted

    def random_guess(keys, query, **kwargs):
        return torch.randint(0, keys.numel() + 1, query.shape, generator=gen)

    monkeypatch.setattr(h2.torch, "searchsorted", random_guess)
    check(delta, a, theta, *SPECS[0])
    monkeypatch.setattr(h2.torch, "searchsorted", real)

    sorts = []
    monkeypatch.setattr(h2, "_SLACK", -0.5)  # K too small: the counts reach K
    real_sort = torch.sort
    monkeypatch.setattr(h2.torch, "sort", lambda *args, **kw: sorts.append(1) or real_sort(
        *args, **kw))
    check(delta, a, theta, *SPECS[0])
    assert sorts


@pytest.mark.parametrize("scale", [1e-3, 1e-2, 0.3, 10.0])
def test_default_settings_on_a_larger_layer(scale):
    """Above the size cut-off with the module's own decisions (factored or dense)."""
    gen = torch.Generator().manual_seed(8)
    delta, a, theta = layer(gen, 16, 256, 300, F32, scale)
    check(delta, a, theta, *SPECS[0])


@pytest.mark.cpu_path
def test_fallback_after_the_exact_counts(monkeypatch):
    """The early estimate says factored, the exact counts say dense: still brute force."""
    monkeypatch.setattr(h2, "_estimate", lambda *args: 0.0)
    monkeypatch.setattr(h2, "_MIN_PRODUCTS", 0)
    gen = torch.Generator().manual_seed(12)
    delta, a, theta = layer(gen, 16, 64, 300, F64, 3.0, relu=False)
    dense = []
    real = h2._dense
    monkeypatch.setattr(h2, "_dense", lambda *args, **kw: dense.append(1) or real(*args, **kw))
    check(delta, a, theta, *SPECS[0])
    assert dense


def test_other_dtypes_and_validation():
    gen = torch.Generator().manual_seed(9)
    delta, a, theta = layer(gen, 5, 6, 7, F32, 0.3)
    sg, st = SPECS[1]
    mixed = histogram2d_outer(delta, a.double(), theta, sg, st)
    g = (delta.double()[:, :, None] * a.double()[:, None, :]).flatten(1)
    expected = histogram2d_dense(g, theta.reshape(-1), sg, st)
    assert torch.equal(mixed[0], expected[0]) and mixed[1] == expected[1]
    half = histogram2d_outer(delta.half(), a.half(), theta.half(), sg, st)
    g = (delta.half()[:, :, None] * a.half()[:, None, :]).flatten(1)
    expected = histogram2d_dense(g, theta.half().reshape(-1), sg, st)
    assert torch.equal(half[0], expected[0]) and half[1] == expected[1]
    with pytest.raises(ValueError):
        histogram2d_outer(delta, a[:3], theta, sg, st)
    with pytest.raises(ValueError):
        histogram2d_outer(delta, a, theta[:, :3], sg, st)


# --------------------------------------------------------------------------- wiring


def test_outer_sample_grads_uses_the_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(10)
    delta, a, theta = layer(gen, 6, 9, 11, F64, 0.1)
    sg, st = SPECS[0]
    grads = OuterSampleGrads(delta, a)
    calls = []
    real = sample_grads.histogram2d_outer_counts
    monkeypatch.setattr(sample_grads, "histogram2d_outer_counts",
                        lambda *args: calls.append(1) or real(*args))
    counts = grads.histogram2d(theta, sg, st)
    assert calls and torch.equal(counts, SampleGrads.histogram2d(grads, theta, sg, st))


def test_grad_hist_2d_instrument_equals_brute_force(monkeypatch):
    """GradHist2d through Cockpit on an MLP (Linear weights take the factored kernel)
    against brute-force individual gradients from torch.func."""
    for name in ("_MIN_PRODUCTS", "_WINDOW_COST", "_HEAVY_COST", "_BASE_COST", "_MATMUL_COST",
                 "_FEW_ROWS"):
        monkeypatch.setattr(h2, name, 0)
    calls = []
    real = sample_grads.histogram2d_outer_lanes  # (the statistic's entry point)
    monkeypatch.setattr(sample_grads, "histogram2d_outer_lanes",
                        lambda *args: calls.append(1) or real(*args))
    problem = make_problem("mlp_relu", 12)
    with torch.no_grad():  # spread the weights over several parameter bins
        for p in problem.model.parameters():
            p.mul_(4.0)
    grads = individual_gradients(problem.model, problem.loss_fn, problem.x, problem.y)
    params = dict(problem.model.named_parameters())
    cockpit = Cockpit(problem.model, [quantities.GradHist2d()])
    losses = problem.losses()
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    out = cockpit.get_output()[0]
    assert len(calls) == 3  # the three Linear weights
    sg, st = BinSpec(-1.0, 1.0, 40), BinSpec(-2.0, 2.0, 50)
    total = np.zeros((40, 50), dtype=np.int64)
    for name, g in grads.items():
        n = g.shape[0]
        counts, bad = brute_force(torch.ones(n, 1, dtype=g.dtype), g.reshape(n, -1),
                                  params[name].detach().reshape(1, -1), sg, st)
        assert bad == 0
        np.testing.assert_array_equal(np.asarray(out[f"GradHist2d/{name}"]["counts"]), counts)
        total += counts
    np.testing.assert_array_equal(np.asarray(out["GradHist2d"]["counts"]), total)
