"""Exact histogram kernels against numpy brute force (materialized, float64 binning)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cockpit.engine import histogram as hmod
from cockpit.engine.histogram import (
    BinSpec,
    histogram2d_dense,
    histogram_dense,
    histogram_outer,
    reference_bin_index,
)

# --------------------------------------------------------------------------- references


def np_bin_index(x: np.ndarray, spec: BinSpec) -> np.ndarray:
    """Reference bin per element (float64 formula); -1 for non-finite."""
    x64 = np.asarray(x, dtype=np.float64).ravel()
    finite = np.isfinite(x64)
    with np.errstate(invalid="ignore", over="ignore"):
        pos = np.floor((x64 - spec.lo) * spec.bins / (spec.hi - spec.lo))
    idx = np.clip(np.nan_to_num(pos, nan=0.0), 0, spec.bins - 1).astype(np.int64)
    return np.where(finite, idx, -1)


def np_hist(x: np.ndarray, spec: BinSpec) -> tuple[np.ndarray, int]:
    idx = np_bin_index(x, spec)
    return np.bincount(idx[idx >= 0], minlength=spec.bins), int((idx < 0).sum())


def np_outer(delta: torch.Tensor, a: torch.Tensor) -> np.ndarray:
    """All products, materialized in the inputs' dtype by numpy (IEEE, no torch)."""
    d, x = delta.numpy(), a.numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        return d[:, :, None] * x[:, None, :]


def assert_hist(result, expected_counts: np.ndarray, expected_nonfinite: int) -> None:
    counts, n_nonfinite = result
    assert counts.dtype == torch.int64
    np.testing.assert_array_equal(counts.numpy(), expected_counts)
    assert int(n_nonfinite) == expected_nonfinite


def edge_neighbours(spec: BinSpec, dtype: torch.dtype) -> torch.Tensor:
    """Nominal edges and their float neighbours in ``dtype``: the hardest values to bin."""
    e = spec.edges(torch.float64).to(dtype)
    up = torch.nextafter(e, torch.full_like(e, math.inf))
    down = torch.nextafter(e, torch.full_like(e, -math.inf))
    up2 = torch.nextafter(up, torch.full_like(e, math.inf))
    down2 = torch.nextafter(down, torch.full_like(e, -math.inf))
    return torch.cat([e, up, down, up2, down2])


# --------------------------------------------------------------------------- BinSpec


@pytest.mark.parametrize(
    "args",
    [(0.0, 1.0, 0), (0.0, 1.0, -3), (1.0, 1.0, 5), (2.0, 1.0, 5), (math.nan, 1.0, 5),
     (0.0, math.inf, 5), (0.0, 1.0, 2.5), (-1e308, 1e308, 4), (0.0, 1.0, True)],
)
def test_binspec_rejects_invalid(args):
    with pytest.raises(ValueError):
        BinSpec(*args)


def test_binspec_edges():
    spec = BinSpec(-2.0, 2.0, 100)
    e = spec.edges(torch.float32)
    assert e.shape == (101,) and e.dtype == torch.float32
    assert e[0].item() == -2.0 and e[-1].item() == 2.0


def test_zeros_land_in_bin_containing_zero():
    spec = BinSpec(-2.0, 2.0, 100)
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor([0.0, -0.0], dtype=dtype)
        counts, _ = histogram_dense(x, spec)
        assert counts[50].item() == 2 and counts.sum().item() == 2
        assert reference_bin_index(x, spec).tolist() == [50, 50]


def test_reference_bin_index_matches_python_floats():
    spec = BinSpec(-0.3, 0.7, 37)
    x = torch.cat([edge_neighbours(spec, torch.float64), torch.randn(200, dtype=torch.float64)])
    expected = [
        min(max(math.floor((v - spec.lo) * spec.bins / (spec.hi - spec.lo)), 0), spec.bins - 1)
        for v in x.tolist()
    ]
    assert reference_bin_index(x, spec).tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("spec", [BinSpec(-2.0, 2.0, 100), BinSpec(-0.1, 0.3, 7)])
def test_thresholds_reproduce_reference(dtype, spec):
    t = hmod._thresholds(spec, dtype, torch.device("cpu"))
    x = torch.cat([edge_neighbours(spec, dtype), (torch.randn(1000) * 2).to(dtype)])
    idx = torch.bucketize(x, t, right=True)
    np.testing.assert_array_equal(idx.numpy(), np_bin_index(x.double().numpy(), spec))


# --------------------------------------------------------------------------- dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "spec", [BinSpec(-2.0, 2.0, 100), BinSpec(-0.05, 0.02, 13), BinSpec(-1.0, 1.0, 1000)]
)
def test_dense_matches_brute_force(dtype, spec):
    gen = torch.Generator().manual_seed(0)
    n = 3 * hmod._CHUNK + 123  # several chunks, ragged end
    x = 0.02 * torch.randn(n, generator=gen, dtype=torch.float64)
    x[torch.rand(n, generator=gen) < 0.3] = 0.0
    x[torch.rand(n, generator=gen) < 0.05] = -0.0
    x[:50] = 1e3 * torch.randn(50, generator=gen, dtype=torch.float64)  # far outside
    x = torch.cat([x, edge_neighbours(spec, torch.float64)]).to(dtype)
    x = torch.cat([x, edge_neighbours(spec, dtype)])
    before = x.clone()
    assert_hist(histogram_dense(x, spec), *np_hist(x.numpy(), spec))
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_nonfinite_excluded_and_counted(dtype):
    spec = BinSpec(-1.0, 1.0, 20)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2 * hmod._CHUNK + 6, generator=gen).to(dtype)
    x[7] = math.nan
    x[hmod._CHUNK + 3] = math.inf
    x[hmod._CHUNK + 4] = -math.inf
    x[-1] = math.nan
    counts, n_nonfinite = histogram_dense(x.view(-1, 2), spec)
    assert int(n_nonfinite) == 4 and counts.sum().item() + 4 == x.numel()
    assert_hist((counts, n_nonfinite), *np_hist(x.numpy(), spec))


def test_dense_non_contiguous_and_empty():
    spec = BinSpec(-2.0, 2.0, 100)
    x = torch.randn(300, 400, dtype=torch.float64).t()[::2]
    assert_hist(histogram_dense(x, spec), *np_hist(x.numpy(), spec))
    assert_hist(histogram_dense(torch.empty(0), spec), np.zeros(100, dtype=np.int64), 0)


def test_dense_generic_path_matches_cpu_path():
    spec = BinSpec(-0.5, 0.5, 30)
    x = torch.randn(5000, dtype=torch.float64)
    x[::97] = math.nan
    counts, nf = hmod._dense_generic(x, spec)
    assert_hist((counts, nf), *np_hist(x.numpy(), spec))


# --------------------------------------------------------------------------- outer


def outer_case(gen, N, I, J, dtype, delta_scale=1e-2, zero_frac=0.5):
    delta = delta_scale * torch.randn(N, I, generator=gen, dtype=torch.float64)
    delta[torch.rand(N, I, generator=gen) < 0.05] = 0.0
    a = torch.randn(N, J, generator=gen, dtype=torch.float64).clamp_min(0.0)
    a[torch.rand(N, J, generator=gen) < zero_frac - 0.5] = 0.0
    return delta.to(dtype), a.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "spec", [BinSpec(-2.0, 2.0, 100), BinSpec(-0.05, 0.05, 40), BinSpec(-0.011, 0.003, 9)]
)
def test_outer_matches_brute_force(dtype, seed, spec):
    gen = torch.Generator().manual_seed(seed)
    delta, a = outer_case(gen, N=6, I=40, J=70, dtype=dtype, zero_frac=0.8)
    a[0] = -a[0]  # a sample with negative activations
    a[1, :10] = 50.0 * torch.randn(10, generator=gen).to(dtype)  # far outside [lo, hi]
    delta[2, :5] = torch.tensor([3.0, -7.0, 1e-30, -1e-30, 0.0], dtype=dtype)
    before = (delta.clone(), a.clone())
    result = histogram_outer(delta, a, spec)
    assert_hist(result, *np_hist(np_outer(delta, a), spec))
    assert torch.equal(delta, before[0]) and torch.equal(a, before[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outer_products_on_bin_edges(dtype):
    """δ·a hitting edges exactly and by one rounding: exercises the threshold search."""
    spec = BinSpec(-1.0, 1.0, 10)
    e = edge_neighbours(spec, dtype)
    a = torch.cat([e, e / 3, e * 0.7]).to(dtype)[None].repeat(2, 1)
    a[1] = a[1].flip(0)
    delta = torch.tensor([[1.0, -1.0, 3.0, -3.0, 1 / 0.7, 0.5, -2.0]], dtype=dtype).repeat(2, 1)
    delta[1] *= 1.0000001
    assert_hist(histogram_outer(delta, a, spec), *np_hist(np_outer(delta, a), spec))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outer_single_sample_and_underflow(dtype):
    gen = torch.Generator().manual_seed(5)
    tiny = torch.finfo(dtype).tiny
    delta = torch.randn(1, 30, generator=gen).to(dtype) * tiny * 4  # products underflow
    a = torch.randn(1, 25, generator=gen).to(dtype)
    a[0, :5] = 0.0
    for spec in (BinSpec(-tiny, tiny, 8), BinSpec(0.0, 1e-3, 5), BinSpec(-2.0, 2.0, 100)):
        assert_hist(histogram_outer(delta, a, spec), *np_hist(np_outer(delta, a), spec))


def test_outer_many_queries_blockwise(monkeypatch):
    monkeypatch.setattr(hmod, "_MAX_QUERIES_PER_BLOCK", 64)
    gen = torch.Generator().manual_seed(3)
    delta, a = outer_case(gen, N=9, I=20, J=300, dtype=torch.float32, delta_scale=0.5)
    spec = BinSpec(-0.3, 0.3, 60)
    assert_hist(histogram_outer(delta, a, spec), *np_hist(np_outer(delta, a), spec))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outer_fallbacks_nonfinite_and_overflow(dtype):
    gen = torch.Generator().manual_seed(4)
    spec = BinSpec(-1.0, 1.0, 16)
    delta, a = outer_case(gen, N=3, I=8, J=9, dtype=dtype)
    delta[0, 0] = math.nan
    a[1, 2] = math.inf
    a[2, 3] = torch.finfo(dtype).max / 2  # finite factor, overflowing products
    delta[2, 1] = 8.0
    expected = np_hist(np_outer(delta, a), spec)
    assert expected[1] > 0
    assert_hist(histogram_outer(delta, a, spec), *expected)


def test_outer_rejects_bad_shapes():
    spec = BinSpec(-1.0, 1.0, 4)
    with pytest.raises(ValueError):
        histogram_outer(torch.randn(3, 2), torch.randn(4, 2), spec)
    with pytest.raises(ValueError):
        histogram_outer(torch.randn(3, 2), torch.randn(3, 2, dtype=torch.float64), spec)
    with pytest.raises(TypeError):
        histogram_outer(torch.ones(3, 2, dtype=torch.int64), torch.randn(3, 2), spec)


# --------------------------------------------------------------------------- 2d


def np_hist2d(g: np.ndarray, theta: np.ndarray, sg: BinSpec, st: BinSpec):
    ig = np_bin_index(g, sg).reshape(g.shape)
    it = np.broadcast_to(np_bin_index(theta, st), g.shape)
    ok = (ig >= 0) & (it >= 0)
    flat = ig[ok] * st.bins + it[ok]
    counts = np.bincount(flat, minlength=sg.bins * st.bins).reshape(sg.bins, st.bins)
    return counts, int((~ok).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hist2d_matches_brute_force(dtype):
    gen = torch.Generator().manual_seed(6)
    sg, st = BinSpec(-1.0, 1.0, 40), BinSpec(-2.0, 2.0, 50)
    N, D = 7, hmod._CHUNK + 999  # column blocks with a ragged end
    g = (0.05 * torch.randn(N, D, generator=gen, dtype=torch.float64))
    g[torch.rand(N, D, generator=gen) < 0.3] = 0.0
    g[0, :100] = 30.0 * torch.randn(100, generator=gen, dtype=torch.float64)
    theta = torch.randn(D, generator=gen, dtype=torch.float64) * 1.5
    theta[:len(edge_neighbours(st, dtype))] = edge_neighbours(st, dtype).double()
    g, theta = g.to(dtype), theta.to(dtype)
    counts, nf = histogram2d_dense(g, theta, sg, st)
    exp_counts, exp_nf = np_hist2d(g.numpy(), theta.numpy(), sg, st)
    np.testing.assert_array_equal(counts.numpy(), exp_counts)
    assert int(nf) == exp_nf == 0
    # marginals are sums of the 2d counts
    np.testing.assert_array_equal(counts.sum(1).numpy(), np_hist(g.numpy(), sg)[0])
    np.testing.assert_array_equal(counts.sum(0).numpy(), N * np_hist(theta.numpy(), st)[0])


def test_hist2d_small_rows_and_nonfinite():
    gen = torch.Generator().manual_seed(7)
    sg, st = BinSpec(-0.5, 0.5, 9), BinSpec(-1.0, 1.0, 11)
    g = torch.randn(5000, 30, generator=gen) * 0.3  # many rows per chunk
    theta = torch.randn(30, generator=gen)
    g[123, 4] = math.nan
    g[4000, 0] = -math.inf
    for th in (theta, theta.clone().index_fill_(0, torch.tensor([2]), math.nan)):
        counts, nf = histogram2d_dense(g, th, sg, st)
        exp_counts, exp_nf = np_hist2d(g.numpy(), th.numpy(), sg, st)
        np.testing.assert_array_equal(counts.numpy(), exp_counts)
        assert int(nf) == exp_nf
        assert counts.sum().item() + int(nf) == g.numel()


def test_dense_parallel_split_matches_brute_force(monkeypatch):
    monkeypatch.setattr(hmod, "_MIN_ELEMENTS_PER_WORKER", 1000)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    spec = BinSpec(-0.1, 0.1, 50)
    x = 0.05 * torch.randn(3 * hmod._CHUNK + 17, dtype=torch.float64)
    x[5] = math.nan
    assert_hist(hmod.histogram_dense(x, spec), *np_hist(x.numpy(), spec))
