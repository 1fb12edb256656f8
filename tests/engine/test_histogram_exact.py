"""Histogram counts against exact rational arithmetic (fractions.Fraction): bins of the real
edges e_k = lo + k·(hi − lo)/bins, at tiny magnitudes of both signs and at, just below and
just above every edge, in float32 and float64, on every kernel path.

Bin k holds the x with e_k ≤ x < e_{k+1} (values below lo in bin 0, at or above hi in the
last). Earlier versions counted a float within one rounding below a non-zero edge one bin
high (58 of the 99 inner edges of the default spec in float32) and, before that, tiny
negative values in [0, w); both are excluded here for every path, with products rounded
toward −∞ and with the search that replaces them where directed rounding is missing."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import pytest
import torch

from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.histograms import exact as hmod
from cockpit.engine.histograms import outer2d as h2
from cockpit.engine.histograms import rounding
from cockpit.engine.histograms.exact import (
    BinSpec,
    histogram2d_dense,
    histogram_dense,
    histogram_outer,
)
from cockpit.engine.histograms.outer2d import histogram2d_outer
from tests.reference import bin_indices

F32, F64 = torch.float32, torch.float64
SPECS = [BinSpec(-2.0, 2.0, 100), BinSpec(-1.0, 1.0, 40), BinSpec(-2.0, 2.0, 50),
         BinSpec(-1.0, 3.0, 7), BinSpec(0.1, 0.7, 13), BinSpec(-0.3, 0.7, 1000),
         BinSpec(-0.05, 0.02, 13)]
IDS = [f"{s.lo}:{s.hi}:{s.bins}" for s in SPECS]


def exact_bin(x: float, spec: BinSpec) -> int:
    position = (Fraction(x) - Fraction(spec.lo)) * spec.bins / (Fraction(spec.hi)
                                                                - Fraction(spec.lo))
    return min(max(math.floor(position), 0), spec.bins - 1)


def exact_bins(values: torch.Tensor, spec: BinSpec) -> torch.Tensor:
    return torch.tensor([exact_bin(v, spec) for v in values.reshape(-1).tolist()],
                        dtype=torch.long)


def exact_counts(values: torch.Tensor, spec: BinSpec) -> torch.Tensor:
    return torch.bincount(exact_bins(values, spec), minlength=spec.bins)


def edge_values(spec: BinSpec, dtype: torch.dtype, steps: int = 3) -> torch.Tensor:
    """The float nearest to every exact edge e_0 … e_bins and its ``steps`` neighbours on
    both sides (torch.nextafter): the float just below, at and just above every edge."""
    width = Fraction(spec.hi) - Fraction(spec.lo)
    edges = torch.tensor([float(Fraction(spec.lo) + k * width / spec.bins)
                          for k in range(spec.bins + 1)], dtype=F64).to(dtype)
    out = [edges]
    for direction in (math.inf, -math.inf):
        e = edges
        for _ in range(steps):
            e = torch.nextafter(e, torch.full_like(e, direction))
            out.append(e)
    return torch.cat(out)


def tiny_values(dtype: torch.dtype) -> torch.Tensor:
    finfo = torch.finfo(dtype)
    magnitudes = [finfo.smallest_normal / 2**10, finfo.tiny, 1e-30, 1e-12, 1e-9, 1e-8, 3e-8,
                  6e-8, 1e-7, 1e-6, 1e-4]
    magnitudes = [m for m in magnitudes if m > 0 and torch.tensor(m, dtype=dtype).item() > 0]
    values = torch.tensor(magnitudes, dtype=dtype)
    return torch.cat([values, -values, torch.tensor([0.0, -0.0], dtype=dtype)])



@pytest.fixture(autouse=True, params=["rounded", "searched"])
def binning(request, monkeypatch):
    """rounded: ⌊fl↓(x·s)⌋ + m where the spec has that form (cockpit.engine.histograms.rounding);
    searched: as on a platform without directed rounding (or a GPU), every value compared
    with the rounded-up edges."""
    if request.param == "searched":
        monkeypatch.setattr(rounding, "available", lambda: False)
    else:
        assert rounding.available()
    return request.param


# --------------------------------------------------------------------------- 1-D


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_bin_index_and_thresholds_at_every_edge(dtype, spec):
    x = edge_values(spec, dtype)
    want = exact_bins(x, spec)
    assert torch.equal(spec.bin_index(x), want)
    # T_k: the smallest float of the dtype at or above e_k, so x ≥ e_k ⟺ x ≥ T_k
    t = hmod._thresholds(spec, dtype, torch.device("cpu"))
    below = torch.nextafter(t, torch.full_like(t, -math.inf))
    width = Fraction(spec.hi) - Fraction(spec.lo)
    edges = [Fraction(spec.lo) + k * width / spec.bins for k in range(1, spec.bins)]
    assert t.dtype == dtype and t.numel() == spec.bins - 1
    for k, e in enumerate(edges):
        assert Fraction(t[k].item()) >= e > Fraction(below[k].item()), k
    assert torch.equal(torch.bucketize(x, t, right=True), want)
    # the values at (rounded up), just below and just above every edge
    on = torch.cat([t, below, torch.nextafter(t, torch.full_like(t, math.inf))])
    assert torch.equal(spec.bin_index(on), exact_bins(on, spec))
    # the chunk kernel into narrow and wide integers
    for index_dtype in (torch.uint8, torch.int16, torch.int32):
        if spec.bins > 255 and index_dtype == torch.uint8:
            continue
        out = torch.empty(x.shape, dtype=index_dtype)
        assert hmod._bin_chunk(x, spec, torch.empty_like(x), out) is out
        assert torch.equal(out.long(), want), index_dtype


@pytest.mark.parametrize("dtype", [F32, F64])
def test_which_specs_have_the_rounded_form(dtype):
    """k(x) = clamp(⌊x·s⌋ + m) needs s = bins/(hi − lo) and m = −lo·s exact in the dtype."""
    form = {f"{s.lo}:{s.hi}:{s.bins}": hmod._exact_form(s, dtype) for s in SPECS}
    assert form == {"-2.0:2.0:100": (25.0, 50), "-1.0:1.0:40": (20.0, 20),
                    "-2.0:2.0:50": (12.5, 25), "-1.0:3.0:7": None, "0.1:0.7:13": None,
                    "-0.3:0.7:1000": None, "-0.05:0.02:13": None}
    assert hmod._exact_form(BinSpec(0.0, 1.0, 10), dtype) == (10.0, 0)
    assert hmod._exact_form(BinSpec(0.5, 1.5, 4), dtype) == (4.0, -2)
    assert hmod._exact_form(BinSpec(-3.0, 3.0, 100), dtype) is None
    assert hmod._exact_form(BinSpec(-2.0, 2.0, 100), torch.float16) is None


@pytest.mark.parametrize("path", ["fast", "chunked", "masked"])
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_dense_paths_at_every_edge(dtype, spec, path, monkeypatch):
    """fast: one chunk; chunked: chunks of 97 elements over several worker threads;
    masked: every chunk holds a NaN, so every chunk takes the masked reference path."""
    x = edge_values(spec, dtype)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(spec.bins))]
    expected = exact_counts(x, spec)
    if path != "fast":
        monkeypatch.setattr(hmod, "_CPU_CHUNK", 97)
    if path == "masked":
        x = torch.cat([x.view(-1, 1), torch.full((x.numel(), 1), math.nan, dtype=dtype)], 1)
    counts, bad = histogram_dense(x, spec)
    assert torch.equal(counts, expected)
    assert bad == (x.numel() // 2 if path == "masked" else 0)


@pytest.mark.parametrize(("outside", "clustered"), [(0, False), (5, False), (150, True),
                                                   (30000, False)])
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("spec", [SPECS[0], SPECS[5]], ids=[IDS[0], IDS[5]])
def test_gradient_like_data_with_edge_values(dtype, spec, outside, clustered):
    """Values inside the two bins at zero (exact zeros and tiny values of both signs among
    them) with none, a few, 150 clustered at the end, or many edge values mixed in, over
    more than one chunk."""
    gen = torch.Generator().manual_seed(outside)
    w = (spec.hi - spec.lo) / spec.bins
    inner = (torch.rand(100_003, generator=gen, dtype=F64) * 1.98 - 0.99) * w
    inner[::7] = 0.0
    tiny = torch.tensor([-1e-30, 1e-30, -1e-44, 1e-44, -0.0], dtype=F64)
    inner[1::7] = tiny.repeat(inner[1::7].numel())[: inner[1::7].numel()]
    e = edge_values(spec, dtype)
    picked = e[torch.randint(0, e.numel(), (outside,), generator=gen)]
    x = inner.to(dtype)
    if clustered:
        x = torch.cat([x, picked])
    else:
        x[torch.randperm(x.numel(), generator=gen)[:outside]] = picked
    # reference: comparison with the rational edges rounded up to float64 (exact, and fast
    # enough for 10^5 values; the edge values themselves are checked against Fraction above)
    want = bin_indices(x, spec.lo, spec.hi, spec.bins)
    assert torch.equal(histogram_dense(x, spec)[0], torch.bincount(want, minlength=spec.bins))
    assert torch.equal(spec.bin_index(x), want)
    theta = x.flip(0)
    st = BinSpec(-1.0, 3.0, 7)
    counts = histogram2d_dense(x.view(1, -1), theta, spec, st)[0]
    pairs = want * st.bins + bin_indices(theta, st.lo, st.hi, st.bins)
    assert torch.equal(counts.view(-1), torch.bincount(pairs, minlength=spec.bins * st.bins))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_not_fast_specs_and_other_dtypes_are_exact(dtype):
    """A range far from zero (m = −10⁷), a scale beyond float32 and float16 data (binned in
    float64) count exactly too."""
    assert hmod._exact_form(BinSpec(1e6, 1e6 + 1, 10), dtype) == (10.0, -10**7)
    assert hmod._exact_form(BinSpec(-1e-300, 1e-300, 4), dtype) is None
    for spec in (BinSpec(1e6, 1e6 + 1, 10), BinSpec(-1e-300, 1e-300, 4)):
        x = edge_values(spec, dtype)
        assert torch.equal(histogram_dense(x, spec)[0], exact_counts(x, spec))
        assert torch.equal(spec.bin_index(x), exact_bins(x, spec))
    h = edge_values(BinSpec(-1.0, 3.0, 7), torch.float16)
    assert torch.equal(histogram_dense(h, BinSpec(-1.0, 3.0, 7))[0],
                       exact_counts(h, BinSpec(-1.0, 3.0, 7)))


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("spec", SPECS[:3], ids=IDS[:3])
def test_tiny_values_of_both_signs_are_binned_exactly(dtype, spec):
    x = tiny_values(dtype)
    expected = exact_counts(x, spec)
    m = spec.zero_bin
    assert expected[m - 1] == (x < 0).sum() and expected[m] == (x >= 0).sum()
    assert torch.equal(histogram_dense(x, spec)[0], expected)
    assert torch.equal(spec.bin_index(x), exact_bins(x, spec))
    # as products δ·a of a Linear layer (the factored kernels), large enough for the
    # sorted search: every product is tiny and keeps the sign of δ·a
    gen = torch.Generator().manual_seed(0)
    delta = x[torch.randint(0, x.numel(), (8, 300), generator=gen)]
    a = torch.rand(8, 400, generator=gen, dtype=torch.float64).to(dtype) + 0.5
    a[:, ::3] *= -1
    products = delta[:, :, None] * a[:, None, :]
    # every product is far inside the two bins at zero: its exact bin is its sign's
    assert products.abs().max() < (spec.hi - spec.lo) / spec.bins / 2
    exact = torch.zeros(spec.bins, dtype=torch.long)
    exact[m - 1], exact[m] = (products < 0).sum(), (products >= 0).sum()
    assert torch.equal(histogram_outer(delta, a, spec)[0], exact)
    theta = torch.randn(300, 400, generator=gen, dtype=torch.float64).to(dtype)
    spec_theta = BinSpec(-2.0, 2.0, 5)
    two_d = histogram2d_outer(delta, a, theta, spec, spec_theta)[0]
    assert torch.equal(two_d.sum(1), exact)
    assert torch.equal(histogram2d_dense(products, theta, spec, spec_theta)[0], two_d)


# --------------------------------------------------------------------------- outer products


def edge_layer(spec: BinSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """δ, a whose products δ·a are the edge values themselves (δ = ±1), exactly twice them
    (δ = 1/2 with a = 2·edges), and within one rounding of them (δ = 3, a = edges/3)."""
    e = edge_values(spec, dtype)
    a = torch.stack([e, 2 * e, e / 3]).to(dtype)
    delta = torch.tensor([[1.0, -1.0], [0.5, -0.5], [3.0, -3.0]], dtype=dtype)
    return delta, a


def exact_product_counts(delta, a, spec) -> torch.Tensor:
    return exact_counts(delta[:, :, None] * a[:, None, :], spec)


@pytest.mark.parametrize("mode", ["blockwise", "searched", "rows"])
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_outer_paths_at_every_edge(dtype, spec, mode, monkeypatch):
    """blockwise: products formed in blocks (small layer); searched: every row counted by
    searches against the thresholds; rows: every row spanning bins formed whole."""
    if mode != "blockwise":
        monkeypatch.setattr(hmod, "_MIN_OUTER_PRODUCTS", 0)
        monkeypatch.setattr(hmod, "_SEARCH_COST", 0.0)
        monkeypatch.setattr(hmod, "_ROW_COST", 0.0)
    if mode == "searched":
        monkeypatch.setattr(hmod, "_SPAN_PER_J", 1e9)
    if mode == "rows":
        monkeypatch.setattr(hmod, "_SPAN_PER_J", 0.0)
        monkeypatch.setattr(hmod, "_MIN_HEAVY_SPAN", 0)
    delta, a = edge_layer(spec, dtype)
    counts, bad = histogram_outer(delta, a, spec)
    assert bad == 0 and torch.equal(counts, exact_product_counts(delta, a, spec))


# --------------------------------------------------------------------------- 2-D


def theta_for(spec_theta: BinSpec, I: int, J: int, dtype: torch.dtype) -> torch.Tensor:
    e = edge_values(spec_theta, dtype)
    index = torch.randperm(I * J, generator=torch.Generator().manual_seed(1)) % e.numel()
    return e[index].view(I, J)


def exact_2d(g: torch.Tensor, theta: torch.Tensor, sg: BinSpec, st: BinSpec) -> torch.Tensor:
    """g [N, D], θ [D]: counts of the exact bin pairs."""
    kg = exact_bins(g, sg).view(g.shape)
    kt = exact_bins(theta, st).expand(g.shape[0], -1)
    return torch.bincount((kg * st.bins + kt).reshape(-1),
                          minlength=sg.bins * st.bins).view(sg.bins, st.bins)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_dense_2d_at_every_edge(dtype, spec, monkeypatch):
    """Both axes at every edge; chunks of 97 elements; θ's spec non-dyadic as well."""
    monkeypatch.setattr(hmod, "_CPU_CHUNK", 97)
    st = BinSpec(-1.0, 3.0, 7) if spec.bins != 7 else BinSpec(0.1, 0.7, 13)
    x = edge_values(spec, dtype)
    g = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(2))].view(7, -1)
    theta = theta_for(st, 1, g.shape[1], dtype).view(-1)
    counts, bad = histogram2d_dense(g, theta, spec, st)
    assert bad == 0 and torch.equal(counts, exact_2d(g, theta, spec, st))


@pytest.mark.parametrize("mode", ["plain", "factored", "scan", "heavy", "sorted"])
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("spec", SPECS[:5], ids=IDS[:5])
def test_outer_2d_paths_at_every_edge(dtype, spec, mode, monkeypatch):
    """plain: products formed per sample block; factored: base bins, windows at the class
    ends (thresholds); scan: class ends formed whole; heavy: moved rows formed whole;
    sorted: end lists by one sort."""
    if mode != "plain":
        monkeypatch.setattr(h2, "_MIN_PRODUCTS", 0)
        for name in ("_WINDOW_COST", "_HEAVY_COST", "_BASE_COST", "_MATMUL_COST", "_FEW_ROWS"):
            monkeypatch.setattr(h2, name, 0.0)
    if mode == "scan":
        monkeypatch.setattr(h2, "_FEW_ROWS", 1e9)
    if mode == "heavy":
        monkeypatch.setattr(h2, "_HEAVY_FRACTION", 0.0)
    if mode == "sorted":
        monkeypatch.setattr(h2, "_TOPK_FRACTION", 1e-3)
    delta, a = edge_layer(spec, dtype)
    st = BinSpec(-1.0, 3.0, 7)
    theta = theta_for(st, delta.shape[1], a.shape[1], dtype)
    counts, bad = histogram2d_outer(delta, a, theta, spec, st)
    g = (delta[:, :, None] * a[:, None, :]).flatten(1)
    assert bad == 0 and torch.equal(counts, exact_2d(g, theta.reshape(-1), spec, st))


# --------------------------------------------------------------------------- specs


@pytest.mark.parametrize("reach", [0.1, 0.04, 2.0, 3.0, 1e-5, 7.0, 0.5, 123.4])
@pytest.mark.parametrize("bins", [100, 40, 2])
def test_symmetric_fast_spec_covers_the_reach_in_the_rounded_form(reach, bins):
    spec = hmod.symmetric_fast_spec(reach, bins)
    assert spec.lo == -spec.hi and spec.hi >= reach and spec.bins == bins
    assert spec.hi < 1.6 * reach  # at most the gap between two exact widths
    for dtype in (F32, F64):
        scale, m = hmod._exact_form(spec, dtype)
        assert Fraction(scale) == Fraction(bins) / (2 * Fraction(spec.hi)) and m == bins // 2
    assert hmod.symmetric_fast_spec(2.0, 100) == BinSpec(-2.0, 2.0, 100)
    assert hmod.symmetric_fast_spec(0.1, 100) == BinSpec(-0.125, 0.125, 100)


@pytest.mark.parametrize("args", [(0.0, 100), (-1.0, 100), (math.inf, 100), (1.0, 7)])
def test_symmetric_fast_spec_rejects_bad_input(args):
    with pytest.raises(ValueError, match="even bins"):
        hmod.symmetric_fast_spec(*args)


def test_cockpit_warns_at_setup_when_its_bins_are_searched():
    from cockpit import Cockpit
    from cockpit.quantities import GradHist1d, GradHist2d

    model = torch.nn.Linear(3, 2)
    with pytest.warns(UserWarning, match=r"hist_bins=BinSpec\(lo=-0.1, hi=0.1, bins=100\).*"
                                         r"BinSpec\(-0.125, 0.125, 100\) covers the range"):
        Cockpit(model, [GradHist1d()], hist_bins=BinSpec(-0.1, 0.1, 100))
    slow_2d = (BinSpec(-1.0, 1.0, 40), BinSpec(0.1, 0.7, 13))
    with pytest.warns(UserWarning, match=r"hist2d_bins\[1\]=BinSpec\(lo=0.1"):
        Cockpit(model, [GradHist2d()], hist2d_bins=slow_2d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Cockpit(model, [GradHist1d(), GradHist2d()])  # the defaults are rounded
        Cockpit(model, [GradHist1d()], hist2d_bins=slow_2d)  # not used: no warning


# --------------------------------------------------------------------------- accelerator path


@pytest.fixture
def device_path(monkeypatch):
    """The path GPUs take (cockpit.engine.histograms.device), run on the CPU, in blocks of
    97 elements (one copy of the counters, which count at most 97: the counts of every
    block summed)."""
    monkeypatch.setattr(histogram_device, "_LANES", 1)
    monkeypatch.setattr(histogram_device, "COUNTER_LIMIT", 97)
    with histogram_device.forced():
        yield


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_device_path_at_every_edge(dtype, spec, device_path):
    """Dense 1-D, Linear products, dense 2-D and Linear products against θ: exact at, just
    below and just above every edge; NaN and ±inf counted in no bin."""
    x = edge_values(spec, dtype)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(spec.bins))]
    nonfinite = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
    counts, bad = histogram_dense(torch.cat([x, nonfinite]), spec)
    assert torch.equal(counts, exact_counts(x, spec)) and int(bad) == 3

    delta, a = edge_layer(spec, dtype)
    counts, bad = histogram_outer(delta, a, spec)
    assert int(bad) == 0 and torch.equal(counts, exact_product_counts(delta, a, spec))

    st = BinSpec(-1.0, 3.0, 7) if spec.bins != 7 else BinSpec(0.1, 0.7, 13)
    g = x.view(7, -1) if x.numel() % 7 == 0 else x[: x.numel() // 7 * 7].view(7, -1)
    theta = theta_for(st, 1, g.shape[1], dtype).view(-1)
    counts, bad = histogram2d_dense(g, theta, spec, st)
    assert int(bad) == 0 and torch.equal(counts, exact_2d(g, theta, spec, st))

    N, I, J = delta.shape[0], delta.shape[1], a.shape[1]
    theta = theta_for(st, I, J, dtype)
    products = (delta[:, :, None] * a[:, None, :]).reshape(N, I * J)
    counts, bad = histogram2d_outer(delta, a, theta, spec, st)
    assert int(bad) == 0
    assert torch.equal(counts, exact_2d(products, theta.reshape(-1), spec, st))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_device_path_of_half_precision_equals_the_cpu_path(dtype, device_path):
    spec = BinSpec(-2.0, 2.0, 100)
    x = (torch.randn(3000, generator=torch.Generator().manual_seed(0)) * 1.5).to(dtype)
    counts, bad = histogram_dense(x, spec)
    assert torch.equal(counts, exact_counts(x.double(), spec)) and int(bad) == 0
