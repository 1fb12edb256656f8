"""Loss-Hessian factors against torch.func.hessian of the per-sample loss; MC unbiasedness."""

from __future__ import annotations

import pytest
import torch
from curvature_reference import (
    dense_hessian,
    diag_ggn_reference,
    flatten,
    functional_loss,
    per_sample_loss,
    single_thread,  # noqa: F401  (autouse fixture)
)
from torch import nn
from torch.func import hessian, vmap

from cockpit.curvature import exact_sqrt_factor, loss_hessian_wrt_output, mc_sqrt_factor

CASES = [("cross_entropy", "mean"), ("mse", "mean"), ("mse", "sum")]


def outputs_and_targets(kind, N=4, C=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = 2 * torch.randn(N, C, generator=gen, dtype=torch.float64)
    if kind == "cross_entropy":
        return out, torch.randint(0, C, (N,), generator=gen)
    return out, torch.randn(N, C, generator=gen, dtype=torch.float64)


def reference_output_hessians(out, target, kind, mse_reduction):
    def loss_n(f_n, t_n):
        return per_sample_loss(f_n.unsqueeze(0), t_n.unsqueeze(0), kind, mse_reduction)[0]

    return vmap(hessian(loss_n))(out, target)  # [N, C, C]


@pytest.mark.parametrize(("kind", "mse_reduction"), CASES)
def test_exact_factor_reproduces_output_hessian(kind, mse_reduction):
    out, target = outputs_and_targets(kind)
    expected = reference_output_hessians(out, target, kind, mse_reduction)
    S = exact_sqrt_factor(out, kind, mse_reduction=mse_reduction)
    assert S.shape == (out.shape[1], *out.shape)
    assert torch.allclose(torch.einsum("knc,knd->ncd", S, S), expected, atol=1e-12)
    hess = loss_hessian_wrt_output(out, kind, mse_reduction=mse_reduction)
    assert torch.allclose(hess, expected, atol=1e-12)


@pytest.mark.parametrize(("kind", "mse_reduction"), CASES)
def test_mc_factor_unbiased(kind, mse_reduction):
    out, target = outputs_and_targets(kind, N=3, C=4, seed=1)
    expected = reference_output_hessians(out, target, kind, mse_reduction)
    num_seeds, M = 500, 3
    draws = []
    for seed in range(num_seeds):
        S = mc_sqrt_factor(out, kind, M, torch.Generator().manual_seed(seed), mse_reduction)
        assert S.shape == (M, *out.shape)
        draws.append(torch.einsum("mnc,mnd->ncd", S, S))
    draws = torch.stack(draws)
    mean, stderr = draws.mean(0), draws.std(0) / num_seeds**0.5
    assert torch.all((mean - expected).abs() <= 3 * stderr + 1e-12)


def test_factors_keep_dtype_and_detach():
    out = torch.randn(2, 3, requires_grad=True)
    for factor in (exact_sqrt_factor(out, "cross_entropy"), mc_sqrt_factor(out, "mse", 2)):
        assert factor.dtype == torch.float32 and not factor.requires_grad


def test_mse_with_extra_dimensions():
    out = torch.randn(2, 3, 2, dtype=torch.float64)
    S = exact_sqrt_factor(out, "mse")
    assert S.shape == (6, 2, 3, 2)
    flat = S.reshape(6, 2, 6)
    expected = torch.eye(6, dtype=torch.float64) * 2 / 6
    assert torch.allclose(torch.einsum("knc,knd->ncd", flat, flat), expected.expand(2, 6, 6))


def test_unsupported_kind_points_to_hutchinson():
    with pytest.raises(ValueError, match='curvature="hutchinson"'):
        exact_sqrt_factor(torch.randn(2, 3), "huber")
    with pytest.raises(ValueError, match='curvature="hutchinson"'):
        mc_sqrt_factor(torch.randn(2, 3, 4), "cross_entropy")


@pytest.mark.parametrize("kind", ["cross_entropy", "mse"])
def test_diag_ggn_reference_equals_hessian_for_linear_model(kind):
    """For a model linear in θ the GGN is the Hessian: validates the reference itself."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,)) if kind == "cross_entropy" else torch.randn(6, 3).double()
    H = dense_hessian(functional_loss(model, x, y, kind), list(model.parameters()))
    assert torch.allclose(flatten(diag_ggn_reference(model, x, kind)), torch.diagonal(H))


@pytest.mark.parametrize(("kind", "mse_reduction"), CASES)
def test_diag_ggn_from_exact_factor_matches_reference(kind, mse_reduction):
    """diag(G) = (1/N) Σ_n Σ_k (J_nᵀ s_{k,n})^{⊙2} with per-sample vector backprops."""
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3), nn.Sigmoid(), nn.Linear(3, 3)
    ).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    params = list(model.parameters())
    out = model(x)
    S = exact_sqrt_factor(out, kind, mse_reduction=mse_reduction)
    diag = [torch.zeros_like(p) for p in params]
    for n in range(x.shape[0]):
        for k in range(S.shape[0]):
            jts = torch.autograd.grad(out[n], params, S[k, n], retain_graph=True)
            for d, g in zip(diag, jts, strict=True):
                d.add_(g**2 / x.shape[0])
    expected = diag_ggn_reference(model, x, kind, mse_reduction)
    assert torch.allclose(flatten(diag), flatten(expected), atol=1e-12)
