"""Lanczos and power iteration against torch.linalg.eigvalsh of dense matrices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from curvature_reference import (
    dense_hessian,
    functional_loss,
    single_thread,  # noqa: F401  (autouse fixture)
)
from torch import nn

from cockpit.curvature import HessianVectorProduct, lanczos_max_eigenvalue, power_iteration


def random_symmetric(dim, eigenvalues=None, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=dtype))
    if eigenvalues is None:
        eigenvalues = torch.randn(dim, generator=gen, dtype=dtype)
    return Q @ torch.diag(torch.as_tensor(eigenvalues, dtype=dtype)) @ Q.T


def spectrum(kind, dim, seed):
    gen = torch.Generator().manual_seed(seed + 100)
    base = torch.rand(dim, generator=gen, dtype=torch.float64)
    if kind == "psd":
        return base * 5
    if kind == "indefinite":
        return base * 6 - 3
    # indefinite, most negative eigenvalue dominates in magnitude
    values = base * 2 - 1
    values[0] = -10.0
    return values


@pytest.mark.parametrize("kind", ["psd", "indefinite", "negative_dominant"])
@pytest.mark.parametrize("dim", [2, 7, 60, 150])
@pytest.mark.parametrize("tol", [1e-3, 1e-8])
def test_lanczos_matches_eigvalsh(kind, dim, tol):
    A = random_symmetric(dim, spectrum(kind, dim, seed=dim), seed=dim)
    lam = torch.linalg.eigvalsh(A)[-1].item()
    gen = torch.Generator().manual_seed(0)
    res = lanczos_max_eigenvalue(
        lambda v: A @ v, dim, tol=tol, max_iter=150, generator=gen, dtype=A.dtype
    )
    assert res.converged and res.rel_error <= tol
    assert abs(res.value - lam) <= tol * abs(lam) + 1e-12
    assert res.value <= lam + 1e-10  # Ritz values lie inside the spectrum
    assert abs(torch.linalg.vector_norm(res.vector).item() - 1) < 1e-12
    assert res.num_matvecs <= dim


def test_close_top_eigenvalues_in_a_cluster():
    """λ₁ within 0.3 % of λ₂ on top of a dense cluster, in a space larger than the Krylov
    space: a small Ritz residual alone would stop at λ₂ or between them."""
    dim = 600
    gen = torch.Generator().manual_seed(1)
    eigenvalues = torch.rand(dim, generator=gen, dtype=torch.float64) * 5.0
    eigenvalues[:3] = torch.tensor([6.0, 5.985, 5.97], dtype=torch.float64)
    A = random_symmetric(dim, eigenvalues, seed=2)
    for seed in range(4):
        res = lanczos_max_eigenvalue(lambda v: A @ v, dim, tol=1e-3, max_iter=200,
                                     dtype=A.dtype, generator=torch.Generator().manual_seed(seed))
        assert res.converged and abs(res.value - 6.0) <= 1e-3 * 6.0, (seed, res)


def test_power_iteration_returns_dominant_magnitude():
    dim = 50
    A = random_symmetric(dim, spectrum("negative_dominant", dim, seed=1), seed=1)
    evals = torch.linalg.eigvalsh(A)
    gen = torch.Generator().manual_seed(0)
    power = power_iteration(lambda v: A @ v, dim, generator=gen, dtype=A.dtype)
    assert power.converged
    assert abs(power.value - evals[0].item()) <= 1e-2 * abs(evals[0].item())  # ≈ −10
    lanczos = lanczos_max_eigenvalue(lambda v: A @ v, dim, generator=gen, dtype=A.dtype)
    assert abs(lanczos.value - evals[-1].item()) <= 1e-3 * abs(evals[-1].item())


def test_power_iteration_stopping_rule():
    A = random_symmetric(40, torch.linspace(0.1, 4.0, 40), seed=2)
    res = power_iteration(
        lambda v: A @ v,
        40,
        rtol=1e-6,
        atol=0.0,
        max_iter=1000,
        generator=torch.Generator().manual_seed(0),
        dtype=A.dtype,
    )
    assert res.converged and abs(res.value - 4.0) < 1e-3
    capped = power_iteration(lambda v: A @ v, 40, max_iter=3, rtol=0.0, atol=0.0, dtype=A.dtype)
    assert capped.num_matvecs == 3 and not capped.converged


def test_dim_one_and_zero_operator():
    res = lanczos_max_eigenvalue(lambda v: 3.0 * v, 1)
    assert res.value == pytest.approx(3.0) and res.num_matvecs == 1 and res.converged
    zero = lanczos_max_eigenvalue(lambda v: torch.zeros_like(v), 500)
    assert zero.value == 0.0 and zero.converged and zero.num_matvecs == 1
    power_zero = power_iteration(lambda v: torch.zeros_like(v), 500)
    assert power_zero.value == 0.0 and power_zero.converged


def test_early_breakdown_few_distinct_eigenvalues():
    eigenvalues = torch.tensor([1.0, 1.0, 2.0, 5.0] * 25, dtype=torch.float64)
    A = random_symmetric(100, eigenvalues, seed=3)
    res = lanczos_max_eigenvalue(
        lambda v: A @ v, 100, tol=1e-12, dtype=A.dtype, generator=torch.Generator().manual_seed(0)
    )
    assert res.converged and res.num_matvecs <= 4
    assert res.value == pytest.approx(5.0, rel=1e-10)


def test_warm_start_from_wrong_eigenvector_recovers():
    dim = 30
    eigenvalues = torch.linspace(-2.0, 3.0, dim, dtype=torch.float64)
    gen = torch.Generator().manual_seed(4)
    Q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    A = Q @ torch.diag(eigenvalues) @ Q.T
    wrong = Q[:, 5]  # exact eigenvector of a non-top eigenvalue: Krylov space is invariant
    res = lanczos_max_eigenvalue(lambda v: A @ v, v0=wrong, tol=1e-8, generator=gen)
    assert res.converged and res.value == pytest.approx(3.0, rel=1e-8)


def test_warm_start_keeps_accuracy_and_dtype():
    dim = 200
    spec = torch.linspace(0.0, 1.0, dim, dtype=torch.float64) ** 2 * 5.0
    A = random_symmetric(dim, spec, seed=5)
    gen = torch.Generator().manual_seed(0)
    cold = lanczos_max_eigenvalue(lambda v: A @ v, dim, tol=1e-6, dtype=A.dtype, generator=gen)
    perturbation = random_symmetric(dim, seed=6) * 1e-3
    B = A + perturbation
    warm = lanczos_max_eigenvalue(lambda v: B @ v, v0=cold.vector, tol=1e-6, generator=gen)
    lam_b = torch.linalg.eigvalsh(B)[-1].item()
    assert warm.converged and warm.value == pytest.approx(lam_b, rel=1e-6)
    single = lanczos_max_eigenvalue(lambda v: A.float() @ v, v0=cold.vector.float())
    assert single.vector.dtype == torch.float32
    assert single.value == pytest.approx(torch.linalg.eigvalsh(A)[-1].item(), rel=1e-3)


def test_generator_reproducible():
    A = random_symmetric(50, seed=7)
    runs = [
        lanczos_max_eigenvalue(
            lambda v: A @ v, 50, dtype=A.dtype, generator=torch.Generator().manual_seed(11)
        )
        for _ in range(2)
    ]
    assert runs[0].value == runs[1].value
    assert torch.equal(runs[0].vector, runs[1].vector)


def test_lanczos_on_mlp_hessian():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4)).double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 4, (8,))
    params = list(model.parameters())
    H = dense_hessian(functional_loss(model, x, y, "cross_entropy"), params)
    lam = torch.linalg.eigvalsh(H)[-1].item()
    losses = F.cross_entropy(model(x), y, reduction="none")
    with HessianVectorProduct(losses.mean(), params) as hvp:
        res = lanczos_max_eigenvalue(
            hvp.matvec,
            hvp.dim,
            tol=1e-6,
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(0),
        )
        assert hvp.num_calls == res.num_matvecs + res.discarded
    assert res.converged and res.value == pytest.approx(lam, rel=1e-6)


@pytest.mark.parametrize("check_every", [2, 4, 7])
def test_reading_every_few_products_changes_nothing_but_the_discarded_products(check_every):
    """Reading α, β once per ``check_every`` products: the same stop, value, vector and
    accuracy as reading them after every product (float64 and float32, a breakdown of a warm
    start that restarts, a stop at D, max_iter, a non-finite operator), with the products
    computed past a stop or restart discarded, fewer than ``check_every`` each."""
    dim = 30
    gen = torch.Generator().manual_seed(4)
    Q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    A = Q @ torch.diag(torch.linspace(-2.0, 3.0, dim, dtype=torch.float64)) @ Q.T
    B = random_symmetric(150, spectrum("psd", 150, seed=3), seed=3)
    C = random_symmetric(100, torch.tensor([1.0, 1.0, 2.0, 5.0] * 25, dtype=torch.float64),
                         seed=3)  # three distinct eigenvalues: a breakdown after 3 products
    v0 = torch.randn(100, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    cases = [  # (operator, keyword arguments)
        (lambda v: B @ v, dict(dim=150, tol=1e-8, max_iter=150, dtype=torch.float64)),
        (lambda v: B.float() @ v, dict(dim=150, tol=1e-3, max_iter=150)),
        (lambda v: C @ v, dict(v0=v0, tol=1e-12)),  # warm start: breakdown, restart
        (lambda v: A @ v, dict(dim=dim, tol=1e-14, dtype=torch.float64)),  # stops at D
        (lambda v: B @ v, dict(dim=150, tol=1e-12, max_iter=9, dtype=torch.float64)),
        (lambda v: v * float("nan"), dict(dim=5)),
    ]
    for matvec, kwargs in cases:
        calls = []

        def counted(v, matvec=matvec, calls=calls):
            calls.append(1)
            return matvec(v)

        one = lanczos_max_eigenvalue(matvec, generator=torch.Generator().manual_seed(0),
                                     check_every=1, **kwargs)
        few = lanczos_max_eigenvalue(counted, generator=torch.Generator().manual_seed(0),
                                     check_every=check_every, **kwargs)
        assert one.discarded == 0 and len(calls) == few.num_matvecs + few.discarded
        assert few.num_matvecs == one.num_matvecs and few.converged == one.converged
        assert few.discarded < check_every * (1 + (kwargs.get("v0") is not None))
        if one.value != one.value:
            assert few.value != few.value
            continue
        assert (few.value, few.second, few.rel_error) == (one.value, one.second, one.rel_error)
        assert torch.equal(few.vector, one.vector)


def test_non_finite_operator_gives_nan():
    res = lanczos_max_eigenvalue(lambda v: v * float("nan"), 5)
    assert res.value != res.value and not res.converged and res.num_matvecs == 1
    power = power_iteration(lambda v: v * float("nan"), 5)
    assert power.value != power.value and not power.converged and power.num_matvecs == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stopping_rule_errs_only_for_a_small_start_component(dtype):
    """The guarantee itself, run by run: if λ₁ lies above θ₁·(1 + rel_error), the start had
    |c| = |u₁ᵀq₁| ≤ δ/√(2D/π), and that happens in at most a fraction δ of the runs.

    δ = 0.2 makes the event frequent enough to observe; the spectrum has an isolated λ₁ over a
    large null space as mini-batch Hessians do. The rule is nearly tight here (the fraction is
    ≈ δ), so a threshold half as large or a β paired with the wrong α is caught."""
    dim, delta, runs = 1000, 0.2, 300
    gen = torch.Generator().manual_seed(0)
    eigenvalues = torch.zeros(dim, dtype=torch.float64)
    eigenvalues[0], eigenvalues[1] = 1.0, 0.78
    eigenvalues[2:62] = torch.rand(60, generator=gen, dtype=torch.float64) - 0.25
    A = random_symmetric(dim, eigenvalues, seed=1).to(dtype)
    evals, evecs = torch.linalg.eigh(A.double())  # of the operator actually applied
    lam, u = evals[-1].item(), evecs[:, -1]
    gen = torch.Generator().manual_seed(1)
    erred = []
    for _ in range(runs):
        replay = torch.Generator().manual_seed(0)
        replay.set_state(gen.get_state())
        start = torch.randn(dim, generator=replay, dtype=dtype).double()  # Lanczos' q₁
        c = abs(torch.dot(u, start).item()) / torch.linalg.vector_norm(start).item()
        res = lanczos_max_eigenvalue(lambda v: A @ v, dim, tol=1e-2, miss_probability=delta,
                                     generator=gen, dtype=dtype)
        assert res.converged
        if lam > res.value + res.rel_error * abs(res.value):
            erred.append(c * (2 * dim / torch.pi) ** 0.5)
    assert erred, "no run erred: the test would not see a broken rule"
    assert max(erred) <= delta
    assert len(erred) <= delta * runs + 3 * (runs * delta * (1 - delta)) ** 0.5


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 1e-5)])
def test_krylov_basis_keeps_nearly_parallel_vectors_orthonormal(dtype, tol):
    """Vectors that differ by 1e-6 of their length (the Krylov vectors of a clustered
    spectrum): after orthogonalization against the blocked basis, QQᵀ = I to working
    precision; rows, truncation and Σ c_i q_i agree with the explicit basis."""
    from cockpit.curvature.lanczos import KrylovBasis

    g = torch.Generator().manual_seed(0)
    d = 300
    base = torch.randn(d, generator=g, dtype=torch.float64)
    basis, rows = KrylovBasis(), []
    for _ in range(11):  # blocks of 4: two full, one partly filled
        w = (base + 1e-6 * torch.randn(d, generator=g, dtype=torch.float64)).to(dtype)
        q = basis.orthogonalize(w)
        q = q / torch.linalg.vector_norm(q)
        basis.append(q)
        rows.append(q.double())
    Q = torch.stack(rows)
    assert len(basis) == 11
    assert torch.allclose(Q @ Q.T, torch.eye(11, dtype=torch.float64), atol=tol, rtol=0)
    assert all(torch.equal(basis[i].double(), rows[i]) for i in range(11))
    assert torch.equal(basis[-1].double(), rows[-1])
    c = torch.randn(11, generator=g, dtype=torch.float64)
    combined = basis.combine(c.tolist()).double()
    assert torch.allclose(combined, (c.to(dtype).double() @ Q), atol=50 * tol, rtol=0)
    basis.truncate(5)
    assert len(basis) == 5
    with pytest.raises(IndexError):
        basis[5]
    w = basis.orthogonalize(rows[7].to(dtype)).double()
    assert torch.allclose(Q[:5] @ w, torch.zeros(5, dtype=torch.float64), atol=tol, rtol=0)
    assert torch.allclose(w, rows[7], atol=tol, rtol=0)  # q_6 … q_8 are gone
    basis.append(rows[9].to(dtype))
    assert torch.equal(basis[5].double(), rows[9])
