"""Every first-order instrument against brute force (individual gradients by torch.func)."""

from __future__ import annotations

import math

import pytest
import torch

from cockpit import BinSpec, Cockpit, quantities
from tests.models import PROBLEMS, make_problem
from tests.reference import (
    cabs,
    early_stopping,
    flat,
    gradient_tests,
    histogram,
    individual_gradients,
    mean_gsnr,
    rel_close,
    same_histogram,
)

ALL = [
    quantities.Loss(), quantities.GradNorm(), quantities.NormTest(), quantities.InnerTest(),
    quantities.OrthoTest(), quantities.GradHist1d(), quantities.MeanGSNR(),
    quantities.EarlyStopping(), quantities.CABS(), quantities.Distance(),
    quantities.UpdateSize(),
]
LR = 0.05


def run_one_step(problem, strict=True, instruments=ALL):
    model = problem.model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    cockpit = Cockpit(model, instruments, optimizer=opt, strict=strict)
    opt.zero_grad()
    losses = problem.losses()
    with cockpit(0, losses=losses):
        losses.mean().backward()
    opt.step()
    cockpit.close()
    return cockpit.get_output()[0], cockpit


@pytest.mark.parametrize("batch_size", [1, 7])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
@pytest.mark.parametrize("name", PROBLEMS)
def test_instruments_match_brute_force(name, batch_size, dtype, rtol):
    problem = make_problem(name, batch_size, dtype)
    model64 = make_problem(name, batch_size, torch.float64).model
    model64.load_state_dict({k: v.double() for k, v in problem.model.state_dict().items()})
    x64 = problem.x.double() if problem.x.is_floating_point() else problem.x
    y64 = problem.y.double() if problem.y.is_floating_point() else problem.y
    grads = individual_gradients(model64, problem.loss_fn, x64, y64)
    names = list(grads)
    G = flat(grads, names)
    losses64 = problem.loss_fn(model64(x64), y64).detach()

    out, _ = run_one_step(problem)

    assert rel_close(out["Loss"], losses64.mean().item(), rtol)
    g = G.mean(0)
    assert rel_close(out["GradNorm"], g.norm().item(), rtol)
    for k in names:
        assert rel_close(out[f"GradNorm/{k}"], grads[k].double().mean(0).norm().item(), rtol,
                         atol=1e-12)
    if batch_size == 1:
        for test in ("NormTest", "InnerTest", "OrthoTest", "MeanGSNR", "EarlyStopping"):
            assert out[test] is None
    else:
        expected = gradient_tests(G)
        for test, value in expected.items():
            assert rel_close(out[test], value, rtol), (test, out[test], value)
        for k in names:
            per = gradient_tests(grads[k].reshape(batch_size, -1).double())
            for test, value in per.items():
                assert rel_close(out[f"{test}/{k}"], value, max(rtol, 1e-5), atol=1e-7), (
                    test, k, out[f"{test}/{k}"], value)
        blocks = [grads[k].reshape(batch_size, -1).double() for k in names]
        assert rel_close(out["MeanGSNR"], mean_gsnr(blocks), rtol * 10)
        assert rel_close(out["EarlyStopping"], early_stopping(blocks), rtol * 10)
    scale = LR * G.pow(2).sum(1).mean().item() / losses64.mean().item()
    assert rel_close(out["CABS"], cabs(G, LR, losses64.mean().item()), rtol, atol=rtol * scale)
    counts = out["GradHist1d"]["counts"]
    assert counts.sum() == G.numel()
    edges = out["GradHist1d"]["edges"]
    spec = (edges[0], edges[-1], len(edges) - 1)  # the range set from this step's elements
    if dtype == torch.float64:
        assert same_histogram(counts, G, *spec)
        for k in names:
            assert same_histogram(out[f"GradHist1d/{k}"]["counts"],
                                  grads[k].reshape(batch_size, -1), *spec)
    # SGD: θ_1 − θ_0 = −η g_B
    assert rel_close(out["UpdateSize"], LR * g.norm().item(), rtol)
    assert out["Distance"] == 0.0


def test_bins_and_edges_follow_the_paper_with_its_bin_spec():
    problem = make_problem("mlp_relu", 4)
    opt = torch.optim.SGD(problem.model.parameters(), lr=LR)
    cockpit = Cockpit(problem.model, [quantities.GradHist1d()], optimizer=opt,
                      hist_bins=BinSpec(-2.0, 2.0, 100))
    losses = problem.losses()
    with cockpit(0, losses=losses):
        losses.mean().backward()
    edges = cockpit.get_output()[0]["GradHist1d"]["edges"]
    assert len(edges) == 101 and edges[0] == -2.0 and edges[-1] == 2.0
    assert "range" not in cockpit.get_output()[0]["GradHist1d"]


def test_float32_histogram_counts_equal_brute_force_of_same_precision():
    problem = make_problem("mlp_relu", 7, torch.float32)
    grads = individual_gradients(problem.model, problem.loss_fn, problem.x, problem.y)
    out, _ = run_one_step(problem)
    edges = out["GradHist1d"]["edges"]
    total = sum(histogram(g, edges[0], edges[-1], len(edges) - 1) for g in grads.values())
    assert (torch.as_tensor(out["GradHist1d"]["counts"]) == total).all()


def test_distance_after_steps():
    problem = make_problem("mlp_relu", 5)
    model = problem.model
    theta0 = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cockpit = Cockpit(model, [quantities.Distance(), quantities.UpdateSize()], optimizer=opt)
    for step in range(3):
        opt.zero_grad()
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        losses = problem.losses()
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        out = cockpit.get_output()[step]
        assert math.isclose(out["Distance"], (before - theta0).norm().item(), rel_tol=1e-9,
                            abs_tol=1e-15)
        assert math.isclose(out["UpdateSize"], (after - before).norm().item(), rel_tol=1e-9)
    cockpit.close()


@pytest.mark.parametrize("test", ["NormTest", "InnerTest", "OrthoTest"])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
@pytest.mark.parametrize("name", PROBLEMS)
def test_each_gradient_test_alone_matches_brute_force(name, dtype, rtol, test):
    """Alone, NormTest asks for ‖g_n‖² only and InnerTest for g_nᵀg_B only (a convolution
    then projects by one convolution instead of building its individual gradients)."""
    problem = make_problem(name, 7, dtype)
    grads = individual_gradients(problem.model, problem.loss_fn, problem.x, problem.y)
    grads = {k: g.double() for k, g in grads.items()}
    names = list(grads)
    out, _ = run_one_step(problem, instruments=[getattr(quantities, test)()])
    assert rel_close(out[test], gradient_tests(flat(grads, names))[test], rtol)
    for k in names:
        expected = gradient_tests(grads[k].reshape(7, -1))[test]
        assert rel_close(out[f"{test}/{k}"], expected, max(rtol, 1e-5), atol=1e-7), (k, test)


@pytest.mark.parametrize("stale", ["random", "zeros"])
@pytest.mark.parametrize("name", ["mlp_relu", "cnn"])
def test_gradient_tests_use_this_batch_when_grad_holds_older_gradients(name, stale):
    """Without zero_grad (gradient accumulation) or with zero_grad(set_to_none=False), .grad
    is not this backward's gradient; g_nᵀḡ must still be of this batch's individual
    gradients (Cockpit takes it from the parameter's gradient only when that is exactly
    this backward's Σ_n w·g_n)."""
    problem = make_problem(name, 7, torch.float64)
    grads = individual_gradients(problem.model, problem.loss_fn, problem.x, problem.y)
    expected = gradient_tests(flat(grads, list(grads)))
    gen = torch.Generator().manual_seed(0)
    for p in problem.model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen, dtype=p.dtype) if stale == "random"
                  else torch.zeros_like(p))
    cockpit = Cockpit(problem.model, [quantities.NormTest(), quantities.InnerTest(),
                                      quantities.OrthoTest(), quantities.GradNorm()])
    losses = problem.losses()
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    out = cockpit.get_output()[0]
    for test, value in expected.items():
        assert rel_close(out[test], value, 1e-6), (test, out[test], value)
    assert rel_close(out["GradNorm"], flat(grads, list(grads)).mean(0).norm().item(), 1e-6)


def test_batch_gradients_over_consecutive_and_interrupted_tracked_steps():
    """Cockpit reuses its copies of the batch gradient from one tracked step in the directly
    following one; every step's GradNorm and NormTest must still be of that step's batch."""
    problem = make_problem("cnn", 6, torch.float64)
    model = problem.model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tracked = {0, 1, 2, 4, 5}
    cockpit = Cockpit(model, [quantities.GradNorm(tracked.__contains__),
                              quantities.NormTest(tracked.__contains__)], optimizer=opt)
    gen = torch.Generator().manual_seed(3)
    expected = {}
    for step in range(6):
        x = torch.randn(problem.x.shape, generator=gen, dtype=problem.x.dtype)
        grads = individual_gradients(model, problem.loss_fn, x, problem.y)
        G = flat(grads, list(grads))
        expected[step] = (G.mean(0).norm().item(), gradient_tests(G)["NormTest"])
        opt.zero_grad()
        losses = problem.loss_fn(model(x), problem.y)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    out = cockpit.get_output()
    for step in tracked:
        assert rel_close(out[step]["GradNorm"], expected[step][0], 1e-6)
        assert rel_close(out[step]["NormTest"], expected[step][1], 1e-6)


def test_a_gradient_test_written_for_numbers_gives_the_same_values():
    """The per-parameter values are formed on arrays; a GradientTest whose formula takes
    numbers only (``math.sqrt``) is asked once per parameter instead, with the same result
    (and NaN where a parameter's ‖g_B‖ is 0)."""

    class ScalarNormTest(quantities.NormTest):
        def formula(self, n, S, G, D2):
            return math.sqrt(max((S / G - n) / (n * (n - 1)), 0.0))

    problem = make_problem("mlp_relu", 7, torch.float64)
    with torch.no_grad():  # a parameter without gradient: ‖g_B‖ = 0 there
        problem.model[0].bias.mul_(0).add_(-1e3)
    out, _ = run_one_step(problem, instruments=[quantities.NormTest(), ScalarNormTest()])
    keys = [k for k in out if k.startswith("NormTest/")]
    assert keys and any(math.isnan(out[k]) for k in keys)
    for k in keys:
        other = out["ScalarNormTest/" + k.split("/", 1)[1]]
        assert other == out[k] or (math.isnan(other) and math.isnan(out[k])), k
    assert out["ScalarNormTest"] == out["NormTest"]
