"""Curvature instruments against dense float64 references (torch.func.hessian, per-sample
Jacobians), and GradHist2d against materialized brute force."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev, vmap

from cockpit import Cockpit, configuration, quantities
from cockpit.curvature.diagonal import diagonal_curvature
from tests.models import make_problem
from tests.reference import bin_indices, individual_gradients, rel_close


def dense_hessian(problem) -> tuple[torch.Tensor, list[str], list[torch.Size]]:
    model = problem.model
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    params = [p.detach() for k, p in model.named_parameters() if p.requires_grad]
    shapes = [p.shape for p in params]
    sizes = [p.numel() for p in params]

    def loss(flat):
        chunks = [c.reshape(s) for c, s in zip(flat.split(sizes), shapes, strict=True)]
        out = functional_call(model, dict(zip(names, chunks, strict=True)), (problem.x,))
        return problem.loss_fn(out, problem.y).mean()

    flat = torch.cat([p.reshape(-1) for p in params])
    if problem.name != "transformer":
        return hessian(loss)(flat), names, shapes
    # attention kernels have no forward-mode AD: build the Hessian column by column
    flat = flat.clone().requires_grad_(True)
    with math_attention():
        (g,) = torch.autograd.grad(loss(flat), flat, create_graph=True)
    columns = [torch.autograd.grad(g, flat, e, retain_graph=True)[0]
               for e in torch.eye(flat.numel(), dtype=flat.dtype)]
    return torch.stack(columns), names, shapes


def dense_ggn_diagonal(problem) -> dict[str, torch.Tensor]:
    """diag of (1/N) Σ_n J_nᵀ (∂²ℓ_n/∂f_n²) J_n from per-sample Jacobians."""
    model = problem.model
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}

    def f_single(prm, x_n):
        return functional_call(model, prm, (x_n.unsqueeze(0),)).squeeze(0)

    out = functional_call(model, params, (problem.x,)).detach()
    jac = vmap(jacrev(f_single), in_dims=(None, 0))(params, problem.x)

    def loss_of_output(f_n, y_n):
        return problem.loss_fn(f_n.unsqueeze(0), y_n.unsqueeze(0))[0]

    out_hess = vmap(hessian(loss_of_output))(out, problem.y)
    n, c = out.shape[0], out[0].numel()
    result = {}
    for name, p in params.items():
        J = jac[name].reshape(n, c, -1)
        diag = torch.einsum("ncd,nce,ned->d", J, out_hess.reshape(n, c, c), J) / n
        result[name] = diag.reshape(p.shape)
    return result


def math_attention():
    """Second derivatives through attention need PyTorch's math kernel on CPU (the fused
    flash-attention kernel has no double backward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def one_step(problem, qs, strict=True):
    cockpit = Cockpit(problem.model, qs, strict=strict)
    with math_attention():
        losses = problem.losses()
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    return cockpit.get_output()[0]


@pytest.mark.parametrize("name", ["mlp_relu", "mlp_sigmoid", "cnn", "transformer"])
def test_hess_trace_and_tic_with_exact_ggn(name):
    problem = make_problem(name, 5)
    ggn = dense_ggn_diagonal(problem)
    grads = individual_gradients(problem.model, problem.loss_fn, problem.x, problem.y)
    out = one_step(problem, [quantities.HessTrace(curvature="diag_ggn_exact"),
                             quantities.TICDiag(curvature="diag_ggn_exact"),
                             quantities.TICTrace(curvature="diag_ggn_exact")])
    trace = sum(d.sum().item() for d in ggn.values())
    assert rel_close(out["HessTrace"], trace, 1e-6)
    for k, d in ggn.items():
        assert rel_close(out[f"HessTrace/{k}"], d.sum().item(), 1e-6, atol=1e-12)
    n = problem.x.shape[0]
    tic_diag = sum((grads[k].pow(2).sum(0) / (ggn[k].clamp(min=0) + 1e-7)).sum().item()
                   for k in ggn) / n
    tic_trace = sum(g.pow(2).sum().item() for g in grads.values()) / n / (trace + 1e-7)
    assert rel_close(out["TICDiag"], tic_diag, 1e-6)
    assert rel_close(out["TICTrace"], tic_trace, 1e-6)


def test_ggn_equals_hessian_for_relu_networks():
    problem = make_problem("mlp_relu", 6)
    H, _, _ = dense_hessian(problem)
    out = one_step(problem, [quantities.HessTrace()])  # default: exact GGN here
    assert rel_close(out["HessTrace"], torch.diagonal(H).sum().item(), 1e-6)


@pytest.mark.parametrize("name", ["mlp_relu", "mlp_sigmoid", "cnn", "transformer"])
def test_hess_max_ev_matches_eigvalsh(name):
    problem = make_problem(name, 4)
    H, _, _ = dense_hessian(problem)
    expected = torch.linalg.eigvalsh(H)[-1].item()
    quantity = quantities.HessMaxEV(tol=1e-8, max_iter=400)
    out = one_step(problem, [quantity])
    assert rel_close(out["HessMaxEV"], expected, 1e-5), (out["HessMaxEV"], expected)
    assert quantity.solver[0]["num_hvp"] >= 1
    assert "HessMaxEV.num_hvp" not in out  # solver bookkeeping is no instrument


@pytest.mark.parametrize("name", ["mlp_sigmoid", "cnn"])
def test_hess_max_ev_per_parameter_matches_eigvalsh_of_each_diagonal_block(name):
    problem = make_problem(name, 4)
    H, names, shapes = dense_hessian(problem)
    quantity = quantities.HessMaxEV(per_parameter=True)  # default tol 1e-3 on each block
    out = one_step(problem, [quantity])
    start = 0
    for k, shape in zip(names, shapes, strict=True):
        size = math.prod(shape)
        block = H[start:start + size, start:start + size]
        start += size
        expected = torch.linalg.eigvalsh(block)[-1].item()
        value = out[f"HessMaxEV/{k}"]
        assert value <= expected + 1e-6 * abs(expected), (k, value, expected)  # Ritz ≤ λ
        assert rel_close(value, expected, 1e-3, atol=1e-10), (k, value, expected)
    assert out["HessMaxEV"] == pytest.approx(torch.linalg.eigvalsh(H)[-1].item(), rel=1e-3)


@pytest.mark.parametrize("name", ["mlp_relu", "cnn"])
def test_hess_max_ev_default_tolerance_bounds_the_error(name):
    """Default tol = 1e-3 on λ_max itself."""
    problem = make_problem(name, 4)
    H, _, _ = dense_hessian(problem)
    eigenvalues = torch.linalg.eigvalsh(H)
    out = one_step(problem, [quantities.HessMaxEV()])
    value = out["HessMaxEV"]
    assert value <= eigenvalues[-1].item() * (1 + 1e-6)  # a Ritz value never overshoots
    assert rel_close(value, eigenvalues[-1].item(), 1e-3)


def test_user_gradients_unchanged_and_no_graph_left_on_grad():
    problem = make_problem("mlp_sigmoid", 5)
    losses = problem.losses()
    losses.mean().backward()
    expected = [p.grad.clone() for p in problem.model.parameters()]
    problem.model.zero_grad()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        one_step(problem, [quantities.HessMaxEV(), quantities.HessTrace(curvature="hutchinson")])
    assert not any("create_graph" in str(w.message) for w in record)
    for p, g in zip(problem.model.parameters(), expected, strict=True):
        assert torch.equal(p.grad, g)
        assert p.grad.grad_fn is None


class _Estimates(quantities.Quantity):
    """Collects many diagonal estimates within one tracked step (unbiasedness tests)."""

    needs_activations = True  # the diagonal curvature reads the recorded activations

    def __init__(self, method, repeats):
        super().__init__()
        self.method, self.repeats, self.samples = method, repeats, []

    def prepare(self, step, tracker, optimizer, losses):
        for seed in range(self.repeats):
            generator = torch.Generator().manual_seed(seed)
            diag = diagonal_curvature(self.method, tracker, losses, tracker.params,
                                      num_samples=1, generator=generator)
            self.samples.append(torch.cat([d.reshape(-1) for d in diag.values()]))


@pytest.mark.parametrize("method,reference", [("diag_ggn_mc", "ggn"), ("hutchinson", "hessian")])
def test_estimators_are_unbiased(method, reference):
    problem = make_problem("mlp_sigmoid", 4)
    if reference == "ggn":
        exact = torch.cat([d.reshape(-1) for d in dense_ggn_diagonal(problem).values()])
    else:
        H, _, _ = dense_hessian(problem)
        exact = torch.diagonal(H)
    estimates = _Estimates(method, 400)
    one_step(problem, [estimates])
    samples = torch.stack(estimates.samples)
    mean, stderr = samples.mean(0), samples.std(0) / math.sqrt(samples.shape[0])
    assert ((mean - exact).abs() <= 3 * stderr + 1e-10).float().mean() >= 0.97
    assert (mean - exact).abs().max() <= 5 * stderr.max() + 1e-10


def test_grad_hist_2d_counts_equal_brute_force():
    problem = make_problem("cnn", 7)
    grads = individual_gradients(problem.model, problem.loss_fn, problem.x, problem.y)
    params = dict(problem.model.named_parameters())
    out = one_step(problem, [quantities.GradHist2d()])

    def bins(v, lo, hi, k):
        return bin_indices(v, lo, hi, k)

    total = torch.zeros(40, 50, dtype=torch.long)
    for name, g in grads.items():
        gi = bins(g.reshape(g.shape[0], -1), -1.0, 1.0, 40)
        ti = bins(params[name].detach().reshape(1, -1), -2.0, 2.0, 50).expand_as(gi)
        counts = torch.bincount((gi * 50 + ti).reshape(-1), minlength=2000).reshape(40, 50)
        assert (torch.as_tensor(out[f"GradHist2d/{name}"]["counts"]) == counts).all()
        total += counts
    assert (torch.as_tensor(out["GradHist2d"]["counts"]) == total).all()


def test_full_configuration_runs_and_unsupported_options_are_clear():
    problem = make_problem("mlp_relu", 5)
    out = one_step(problem, configuration("full"))
    for name in ("HessTrace", "TICDiag", "HessMaxEV", "GradHist2d", "NormTest"):
        assert out[name] is not None, name
    with pytest.raises(ValueError, match="unknown curvature"):
        quantities.HessTrace(curvature="magic")


def test_unrecognized_loss_points_to_hutchinson():
    """A loss whose Hessian Cockpit does not factor: the GGN says so and points to
    Hutchinson's estimate, which "auto" takes for HessTrace (with that reason)."""
    problem = make_problem("mlp_relu", 5)
    problem.loss_fn = lambda out, y: torch.nn.functional.cross_entropy(
        out, y, reduction="none") + 0.1 * out.pow(2).sum(1)
    cockpit = Cockpit(problem.model, [quantities.HessTrace(curvature="diag_ggn_exact")])
    losses = problem.losses()
    with pytest.warns(RuntimeWarning, match="hutchinson"), cockpit(0, losses=losses):
        losses.mean().backward()
    assert cockpit.get_output()[0]["HessTrace"] is None
    trace = quantities.HessTrace()
    with pytest.warns(RuntimeWarning, match="not recognized"):
        out = one_step(problem, [trace])
    assert trace.method_used == "hutchinson" and math.isfinite(out["HessTrace"])


def smooth_problem(batch_size=5):
    """Tanh, sigmoid, GELU and SiLU activations, a convolution, cross-entropy."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(2, 3, 3), torch.nn.Tanh(), torch.nn.Flatten(),
        torch.nn.Linear(3 * 4, 5), torch.nn.Sigmoid(), torch.nn.Linear(5, 4), torch.nn.GELU(),
        torch.nn.Linear(4, 4), torch.nn.SiLU(), torch.nn.Linear(4, 3),
    ).double()
    problem = make_problem("mlp_relu", batch_size)
    problem.model = model
    problem.x = torch.randn(batch_size, 2, 6, dtype=torch.float64)
    return problem


@pytest.mark.parametrize("which", ["mlp_sigmoid", "smooth"])
@pytest.mark.parametrize("curvature", ["diag_hessian", "auto"])
def test_exact_hessian_diagonal_with_smooth_activations(which, curvature):
    problem = smooth_problem() if which == "smooth" else make_problem("mlp_sigmoid", 5)
    H, names, shapes = dense_hessian(problem)
    diag = torch.diagonal(H)
    quantity = quantities.HessTrace(curvature=curvature)
    out = one_step(problem, [quantity])
    assert quantity.method_used == "diag_hessian"
    assert rel_close(out["HessTrace"], diag.sum().item(), 1e-6)
    offset = 0
    for name, shape in zip(names, shapes, strict=True):
        size = math.prod(shape)
        assert rel_close(out[f"HessTrace/{name}"], diag[offset:offset + size].sum().item(),
                         1e-6, atol=1e-10), name
        offset += size
    ggn_trace = sum(d.sum().item() for d in dense_ggn_diagonal(problem).values())
    assert not rel_close(ggn_trace, diag.sum().item(), 1e-3)  # the residual terms matter here


def test_hessian_diagonal_not_applicable_is_clear_and_auto_falls_back():
    """Attention is not covered by the exact diagonal: HessTrace falls back to Hutchinson
    (unbiased for the Hessian), TICDiag to the GGN, each with a warning and a note."""
    problem = make_problem("transformer", 4)
    trace, tic = quantities.HessTrace(curvature="auto"), quantities.TICDiag(curvature="auto")
    with pytest.warns(RuntimeWarning, match="cannot use the exact Hessian diagonal"):
        cockpit = Cockpit(problem.model, [trace, tic])
        with math_attention():
            losses = problem.losses()
        with cockpit(0, losses=losses):
            losses.mean().backward()
        cockpit.close()
    assert trace.method_used == "hutchinson" and tic.method_used == "diag_ggn_exact"
    notes = cockpit.get_notes()[0]
    assert "Hutchinson" in notes["HessTrace"] and "BmmBackward0" in notes["HessTrace"]
    assert "GGN" in notes["TICDiag"]
    cockpit = Cockpit(problem.model, [quantities.HessTrace(curvature="diag_hessian")])
    losses = problem.losses()
    with pytest.warns(RuntimeWarning, match="cannot apply"), cockpit(0, losses=losses):
        losses.mean().backward()
    assert "hutchinson" in cockpit.get_notes()[0]["HessTrace"]


def test_ggn_instruments_under_autocast_equal_float32():
    """Under torch.autocast the model output is cast (out.float(), or autocast's own cast)
    before the cross-entropy; the GGN's loss detection looked for the loss directly on the
    output and refused. HessTrace and TICDiag then equal their float32 values to bfloat16
    accuracy (float32 itself is checked against dense Hessians above)."""
    values = {}
    for amp in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                              nn.Linear(8 * 8 * 8, 5))
        cockpit = Cockpit(model, [quantities.HessTrace(), quantities.TICDiag()], strict=True)
        x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(x)
        losses = nn.functional.cross_entropy(out.float(), y, reduction="none")
        with cockpit(0, losses=losses):
            losses.mean().backward()
        cockpit.close()
        values[amp] = cockpit.get_output()[0]
    for name in ("HessTrace", "TICDiag"):
        assert values[True][name] == pytest.approx(values[False][name], rel=1e-2)


@pytest.mark.parametrize("name", ["mlp_relu", "mlp_sigmoid", "cnn"])
def test_hess_top_ev_brackets_and_matches_eigvalsh(name):
    problem = make_problem(name, 4)
    H, _, _ = dense_hessian(problem)
    expected = torch.linalg.eigvalsh(H).flip(0)[:4].tolist()
    out = one_step(problem, [quantities.HessTopEV(k=4)])
    values, upper = out["HessTopEV"]["values"], out["HessTopEV"]["upper"]
    assert len(values) == len(upper) == 4
    for i, exact in enumerate(expected):
        assert values[i] <= exact * (1 + 1e-6) + 1e-12, (i, values[i], exact)  # lower bound
        assert exact <= upper[i] * (1 + 1e-6) + 1e-12, (i, upper[i], exact)  # upper bound
        assert rel_close(values[i], exact, 1e-3), (i, values[i], exact)
    assert list(values) == sorted(values, reverse=True)


def test_hess_top_ev_brackets_hold_for_a_cluster_of_equal_eigenvalues():
    """A diagonal operator with λ_1 = λ_2 = λ_3 (one Krylov sequence sees one copy only):
    deflation finds all three."""
    from cockpit.curvature.top_eigenvalues import top_eigenvalues

    diagonal = torch.cat([torch.tensor([5.0, 5.0, 5.0, 4.0]), torch.linspace(-1, 3, 60)]
                         ).double()
    result = top_eigenvalues(lambda v: diagonal * v, diagonal.numel(), 5,
                             generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for value, bound, exact in zip(result.values, result.upper, [5.0, 5.0, 5.0, 4.0, 3.0],
                                   strict=True):
        assert value <= exact + 1e-9 and exact <= bound + 1e-9
        assert value == pytest.approx(exact, rel=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hess_trace_sums_each_parameters_signed_diagonal(dtype):
    """HessTrace's per-parameter sums by multi-tensor kernels (‖d⁺‖₁ − ‖d⁻‖₁ for a Hessian's
    diagonal, which may be negative) equal each diagonal's float64 sum, non-finite entries
    included; a GGN's (≥ 0) is its ℓ1 norm."""
    from cockpit.quantities.hess_trace import _sums

    gen = torch.Generator().manual_seed(0)
    diagonal = {f"p{i}": torch.randn(shape, generator=gen).to(dtype)
                for i, shape in enumerate([(7, 3), (5,), (), (2, 2, 2)])}
    diagonal["p4"] = torch.tensor([1.0, float("inf"), -2.0], dtype=dtype)
    diagonal["p5"] = torch.tensor([float("-inf"), 3.0], dtype=dtype)
    diagonal["p6"] = torch.tensor([float("inf"), float("-inf")], dtype=dtype)
    diagonal["p7"] = torch.tensor([float("nan"), 1.0], dtype=dtype)
    got = _sums(diagonal, non_negative=False)
    expected = torch.stack([d.double().sum() for d in diagonal.values()])
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, equal_nan=True)
    squares = {k: d.square() for k, d in list(diagonal.items())[:4]}
    torch.testing.assert_close(_sums(squares, non_negative=True),
                               torch.stack([d.double().sum() for d in squares.values()]),
                               rtol=1e-12, atol=0.0)
    assert _sums({}, non_negative=False).shape == (0,)
