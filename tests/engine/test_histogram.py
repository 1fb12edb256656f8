"""Exact histogram kernels against brute force: materialize, bin exactly (every value
compared with the rational edges rounded up to float64, tests.reference.bin_indices), count."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cockpit.engine.histograms import exact as hmod
from cockpit.engine.histograms.exact import (
    BinSpec,
    histogram2d_dense,
    histogram_dense,
    histogram_outer,
)
from tests.reference import bin_indices_np as np_bins
from tests.reference import edge_neighbours, host_count

F32, F64 = torch.float32, torch.float64


# --------------------------------------------------------------------------- references


def np_hist(x: np.ndarray, spec: BinSpec) -> tuple[np.ndarray, int]:
    idx = np_bins(x, spec)
    return np.bincount(idx[idx >= 0], minlength=spec.bins), int((idx < 0).sum())


def np_products(delta: torch.Tensor, a: torch.Tensor) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return delta.numpy()[:, :, None] * a.numpy()[:, None, :]


def assert_hist(result, expected: tuple[np.ndarray, int]) -> None:
    counts, num_nonfinite = result
    assert counts.dtype == torch.int64 and counts.shape == expected[0].shape
    np.testing.assert_array_equal(counts.numpy(), expected[0])
    num_nonfinite = host_count(num_nonfinite)
    assert isinstance(num_nonfinite, int) and num_nonfinite == expected[1]


SPECS = [BinSpec(-2.0, 2.0, 100), BinSpec(-0.05, 0.02, 13), BinSpec(-0.3, 0.7, 1000),
         BinSpec(0.0, 1.0, 1)]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1000 elements: exercises chunk loops, ragged ends and block indexing."""
    monkeypatch.setattr(hmod, "_CPU_CHUNK", 1000)


# --------------------------------------------------------------------------- BinSpec


@pytest.mark.parametrize(
    "args", [(0.0, 1.0, 0), (0.0, 1.0, -3), (1.0, 1.0, 5), (2.0, 1.0, 5), (math.nan, 1.0, 5),
             (0.0, math.inf, 5), (0.0, 1.0, 2.5)],
)
def test_binspec_rejects_invalid(args):
    with pytest.raises(ValueError):
        BinSpec(*args)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_bin_index_is_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    for spec in SPECS:
        x = torch.cat([edge_neighbours(spec, dtype), torch.randn(5000, generator=gen).to(dtype)])
        np.testing.assert_array_equal(spec.bin_index(x).numpy(), np_bins(x.numpy(), spec))
    assert BinSpec().bin_index(torch.tensor([0.0, -0.0], dtype=dtype)).tolist() == [50, 50]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("spec", [*SPECS, BinSpec(-1e-30, 3e-31, 7), BinSpec(-1e20, 1e25, 9)])
def test_thresholds_are_the_rounded_up_edges(dtype, spec):
    t = hmod._thresholds(spec, dtype, torch.device("cpu"))
    assert t.shape == (spec.bins - 1,) and bool((t[1:] > t[:-1]).all())
    x = torch.cat([edge_neighbours(spec, dtype, steps=3), t, torch.nextafter(t, -t.abs() - 1),
                   (torch.randn(2000, dtype=F64) * (spec.hi - spec.lo)).to(dtype)])
    np.testing.assert_array_equal(torch.bucketize(x, t, right=True).numpy(),
                                  np_bins(x.numpy(), spec))


# --------------------------------------------------------------------------- dense


def gradient_like(gen, n: int, dtype: torch.dtype) -> torch.Tensor:
    x = 0.02 * torch.randn(n, generator=gen, dtype=F64)
    x[torch.rand(n, generator=gen) < 0.3] = 0.0
    x[torch.rand(n, generator=gen) < 0.05] = -0.0
    x[:50] = 1e3 * torch.randn(50, generator=gen, dtype=F64)  # far outside [lo, hi]
    x[50:60] = torch.tensor([1e30, -1e30, 3e38, -3e38, 1e-40, -1e-40, 5e-324, 2.0, -2.0, 1.99])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("spec", SPECS)
def test_dense_matches_brute_force(dtype, spec, small_chunks):
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([gradient_like(gen, 7321, dtype), edge_neighbours(spec, dtype)])
    x = x[torch.randperm(x.numel(), generator=gen)][: x.numel() // 7 * 7].view(-1, 7)
    before = x.clone()
    assert_hist(histogram_dense(x, spec), np_hist(x.numpy(), spec))
    assert torch.equal(x, before)


@pytest.mark.parametrize("bins", [1, 2, 127, 128, 129, 256])
def test_dense_two_lane_counting_at_the_byte_limits(bins, monkeypatch):
    """Indices up to 128 bins are counted in two int8 lanes; every bin, long runs of one
    bin (the case the lanes are for) and odd chunk lengths must still count exactly."""
    monkeypatch.setattr(hmod, "_CPU_CHUNK", 999)
    spec = BinSpec(-1.0, 1.0, bins)
    gen = torch.Generator().manual_seed(5)
    centers = (torch.arange(bins, dtype=F32) + 0.5) / spec.scale + spec.lo
    runs = centers[torch.randint(0, bins, (40,), generator=gen)].repeat_interleave(101)
    x = torch.cat([centers, runs, 3 * torch.randn(2345, generator=gen)])
    assert_hist(histogram_dense(x, spec), np_hist(x.numpy(), spec))
    assert hmod._counting_dtype(bins) == (torch.int8 if bins <= 128 else torch.uint8)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_dense_large_single_chunk_path(dtype):
    gen = torch.Generator().manual_seed(2)
    x = gradient_like(gen, 3 * hmod._CPU_CHUNK + 17, dtype)
    assert_hist(histogram_dense(x, BinSpec()), np_hist(x.numpy(), BinSpec()))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_dense_nonfinite_excluded_and_counted(dtype, small_chunks):
    spec = BinSpec(-1.0, 1.0, 20)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[[7, 1003, 1004, 4999]] = torch.tensor([math.nan, math.inf, -math.inf, math.nan], dtype=dtype)
    x[2000] = torch.finfo(dtype).max  # finite, but (x − lo)·scale overflows
    counts, bad = histogram_dense(x, spec)
    assert bad == 4 and counts.sum().item() == x.numel() - 4
    assert_hist((counts, bad), np_hist(x.numpy(), spec))


def test_dense_empty_noncontiguous_and_other_dtypes():
    spec = BinSpec()
    x = torch.randn(300, 400, dtype=F64).t()[::2]
    assert_hist(histogram_dense(x, spec), np_hist(x.numpy(), spec))
    assert_hist(histogram_dense(torch.empty(0), spec), (np.zeros(100, dtype=np.int64), 0))
    h = torch.randn(1000).half()  # generic path: the plain definition
    expected = torch.bincount(spec.bin_index(h), minlength=100)
    assert torch.equal(histogram_dense(h, spec)[0], expected)


# --------------------------------------------------------------------------- outer


def outer_case(gen, N, I, J, dtype, scale):
    delta = scale * torch.randn(N, I, generator=gen, dtype=F64)
    delta[torch.rand(N, I, generator=gen) < 0.05] = 0.0
    a = torch.randn(N, J, generator=gen, dtype=F64).clamp_min(0.0)  # ReLU: ~half exact zeros
    return delta.to(dtype), a.to(dtype)


@pytest.fixture(params=["sorted", "all_materialized"])
def outer_mode(request, monkeypatch):
    """Force the search path even for tiny layers; or force every row to materialize."""
    monkeypatch.setattr(hmod, "_MIN_OUTER_PRODUCTS", 0)
    monkeypatch.setattr(hmod, "_SEARCH_COST", 0.0)
    monkeypatch.setattr(hmod, "_ROW_COST", 0.0)
    if request.param == "all_materialized":
        monkeypatch.setattr(hmod, "_SPAN_PER_J", 0.0)
        monkeypatch.setattr(hmod, "_MIN_HEAVY_SPAN", 0)
    return request.param


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("scale", [1e-2, 1e-1, 1.0, 50.0])
@pytest.mark.parametrize("spec", SPECS[:3])
def test_outer_matches_brute_force(dtype, scale, spec, outer_mode):
    gen = torch.Generator().manual_seed(int(scale * 100) + spec.bins)
    delta, a = outer_case(gen, N=5, I=40, J=90, dtype=dtype, scale=scale)
    a[0] = -a[0]  # negative activations
    a[1, :10] = 50.0 * torch.randn(10, generator=gen).to(dtype)  # far outside [lo, hi]
    delta[2, :6] = torch.tensor([3.0, -7.0, 1e-30, -1e-30, 0.0, -0.0], dtype=dtype)
    a[3] = 0.0  # a sample with only exact zeros
    before = delta.clone(), a.clone()
    assert_hist(histogram_outer(delta, a, spec), np_hist(np_products(delta, a), spec))
    assert torch.equal(delta, before[0]) and torch.equal(a, before[1])


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("shape", [(1, 30, 40), (6, 1, 50), (6, 30, 1), (1, 1, 1)])
def test_outer_degenerate_shapes(dtype, shape, outer_mode):
    gen = torch.Generator().manual_seed(4)
    delta, a = outer_case(gen, *shape, dtype=dtype, scale=0.3)
    spec = BinSpec(-0.2, 0.3, 17)
    assert_hist(histogram_outer(delta, a, spec), np_hist(np_products(delta, a), spec))
    empty = histogram_outer(delta[:, :0], a, spec)
    assert_hist(empty, (np.zeros(17, dtype=np.int64), 0))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_outer_products_on_and_next_to_edges(dtype, outer_mode):
    """a = 1 with δ = edges, and a = edges/3 with δ = 3: products one rounding from edges."""
    spec = BinSpec(-1.0, 1.0, 10)
    e = edge_neighbours(spec, dtype, steps=3)
    third = edge_neighbours(spec, dtype, steps=3) / 3
    a = torch.stack([torch.ones_like(e), third, e, e * 0.7]).to(dtype)
    delta = torch.stack([e, torch.full_like(e, 3.0), -e, torch.full_like(e, -1 / 0.7)]).to(dtype)
    assert_hist(histogram_outer(delta, a, spec), np_hist(np_products(delta, a), spec))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_outer_underflowing_and_subnormal_products(dtype, outer_mode):
    gen = torch.Generator().manual_seed(5)
    tiny = torch.finfo(dtype).tiny
    delta = torch.randn(2, 30, generator=gen).to(dtype) * tiny * 4
    a = torch.randn(2, 25, generator=gen).to(dtype)
    a[:, :5] = 0.0
    for spec in (BinSpec(-tiny, tiny, 8), BinSpec(0.0, 1e-3, 5), BinSpec(-2.0, 2.0, 100)):
        assert_hist(histogram_outer(delta, a, spec), np_hist(np_products(delta, a), spec))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_outer_nonfinite_and_overflow_samples(dtype, outer_mode):
    gen = torch.Generator().manual_seed(6)
    spec = BinSpec(-1.0, 1.0, 16)
    delta, a = outer_case(gen, N=5, I=8, J=9, dtype=dtype, scale=0.5)
    delta[0, 0] = math.nan
    a[1, 2] = math.inf  # inf · 0 = NaN and inf · δ = ±inf: all non-finite
    a[2, 3] = torch.finfo(dtype).max / 2  # finite factors, overflowing products
    delta[2, 1] = 8.0
    expected = np_hist(np_products(delta, a), spec)
    assert expected[1] > 0
    assert_hist(histogram_outer(delta, a, spec), expected)


def test_outer_wrong_guesses_are_repaired(monkeypatch):
    """Replace searchsorted by random guesses: the exact verification and bisection must
    still give the brute-force counts (the path taken when t/δ rounds across an a)."""
    monkeypatch.setattr(hmod, "_MIN_OUTER_PRODUCTS", 0)
    gen = torch.Generator().manual_seed(7)
    delta, a = outer_case(gen, N=4, I=30, J=57, dtype=F32, scale=1.0)
    real = torch.searchsorted

    def random_guess(keys, query, **kwargs):
        if kwargs:  # not the boundary search
            return real(keys, query, **kwargs)
        sample = query >> 32
        return sample * 57 + torch.randint(0, 58, query.shape, generator=gen)

    monkeypatch.setattr(hmod.torch, "searchsorted", random_guess)
    spec = BinSpec(-1.0, 1.0, 40)
    result = histogram_outer(delta, a, spec)
    monkeypatch.setattr(hmod.torch, "searchsorted", real)
    assert_hist(result, np_hist(np_products(delta, a), spec))


@pytest.mark.parametrize("scale", [1e-3, 0.3, 30.0])  # searches, mixed, all materialized
def test_outer_default_settings_and_query_blocks(scale, monkeypatch):
    gen = torch.Generator().manual_seed(8)
    delta, a = outer_case(gen, N=8, I=200, J=400, dtype=F32, scale=scale)  # above cut-off
    spec = BinSpec(-0.3, 0.3, 60)
    expected = np_hist(np_products(delta, a), spec)
    assert_hist(histogram_outer(delta, a, spec), expected)
    monkeypatch.setattr(hmod, "_MAX_QUERIES_PER_BLOCK", 64)
    assert_hist(histogram_outer(delta, a, spec), expected)


def test_outer_rejects_mismatched_samples():
    with pytest.raises(ValueError):
        histogram_outer(torch.randn(3, 2), torch.randn(4, 2), BinSpec())


# --------------------------------------------------------------------------- 2d


def np_hist2d(g: np.ndarray, theta: np.ndarray, sg: BinSpec, st: BinSpec):
    ig = np_bins(g, sg).reshape(g.shape)
    it = np.broadcast_to(np_bins(theta, st), g.shape)
    ok = (ig >= 0) & (it >= 0)
    flat = ig[ok] * st.bins + it[ok]
    counts = np.bincount(flat, minlength=sg.bins * st.bins).reshape(sg.bins, st.bins)
    return counts, int((~ok).sum())


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("specs", [(BinSpec(-1.0, 1.0, 40), BinSpec(-2.0, 2.0, 50)),
                                   (BinSpec(-0.1, 0.1, 7), BinSpec(-1.0, 1.0, 11)),
                                   (BinSpec(-0.1, 0.1, 300), BinSpec(-1.0, 1.0, 200))])
@pytest.mark.parametrize("D", [37, 2500])  # many rows per chunk / column blocks per row
def test_hist2d_matches_brute_force(dtype, specs, D, small_chunks):
    sg, st = specs
    gen = torch.Generator().manual_seed(9)
    g = gradient_like(gen, 6 * D, dtype).view(6, D)
    theta = (1.5 * torch.randn(D, generator=gen, dtype=F64)).to(dtype)
    e = edge_neighbours(st, dtype)[:D]
    theta[: e.numel()] = e
    counts, bad = histogram2d_dense(g, theta, sg, st)
    assert counts.shape == (sg.bins, st.bins)
    assert_hist((counts, bad), np_hist2d(g.numpy(), theta.numpy(), sg, st))
    np.testing.assert_array_equal(counts.sum(1).numpy(), np_hist(g.numpy(), sg)[0])


def test_hist2d_nonfinite_pairs(small_chunks):
    gen = torch.Generator().manual_seed(10)
    sg, st = BinSpec(-0.5, 0.5, 9), BinSpec(-1.0, 1.0, 11)
    g = torch.randn(400, 30, generator=gen) * 0.3
    theta = torch.randn(30, generator=gen)
    g[123, 4] = math.nan
    g[300, 0] = -math.inf
    for th in (theta, theta.clone().index_fill_(0, torch.tensor([2, 4]), math.nan)):
        counts, bad = histogram2d_dense(g, th, sg, st)
        assert_hist((counts, bad), np_hist2d(g.numpy(), th.numpy(), sg, st))
        assert counts.sum().item() + bad == g.numel()
    assert_hist(histogram2d_dense(g[:0], theta, sg, st),
                (np.zeros((9, 11), dtype=np.int64), 0))
