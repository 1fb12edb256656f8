"""The accelerator path's histograms (cockpit.engine.histograms.device), run on the CPU, against
exact rational arithmetic: the one-search bin index with its slots for −∞ and +∞/NaN, every
way the lane offsets are laid over a chunk, counts summed over chunks and sample chunks in
one op, the 2-D pairs with θ's lane offsets and without, and GradHist1d/GradHist2d through
Cockpit against the CPU path."""

from __future__ import annotations

import math

import pytest
import torch

from cockpit import Cockpit
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.histograms import exact as hmod
from cockpit.engine.histograms.exact import (
    BinSpec,
    histogram2d_dense,
    histogram2d_dense_counts,
    histogram_dense,
    histogram_dense_counts,
    histogram_outer,
    histogram_outer_counts,
)
from cockpit.engine.histograms.outer2d import histogram2d_outer, histogram2d_outer_counts
from cockpit.quantities import GradHist1d, GradHist2d
from tests.engine.test_histogram_exact import (
    IDS,
    SPECS,
    edge_values,
    exact_bins,
    exact_counts,
    theta_for,
    tiny_values,
)
from tests.models import make_problem, train

F32, F64 = torch.float32, torch.float64
NONFINITE = [math.nan, math.inf, -math.inf]


@pytest.fixture
def forced():
    with histogram_device.forced():
        yield


# (values per counter, copies of the counters): blocks of at most their product (the
# stand-in for values beyond 2^24 per counter); None: the real limit
BLOCKS = {"default": None, "96 in 32 lanes": (3, 32), "100 in 4 lanes": (25, 4),
          "7 in 1 lane": (7, 1), "5 in 1 lane": (5, 1)}


def small_blocks(monkeypatch, blocks: tuple[int, int] | None) -> None:
    """Blocks of at most ``per_counter · lanes`` values (fewer lanes where the slots of a
    histogram leave fewer)."""
    if blocks is not None:
        monkeypatch.setattr(histogram_device, "COUNTER_LIMIT", blocks[0])
        monkeypatch.setattr(histogram_device, "_LANES", blocks[1])


def edges_of(spec: BinSpec, dtype: torch.dtype) -> torch.Tensor:
    return hmod._search_edges_on(spec, dtype, torch.device("cpu"))


def mixed_values(spec: BinSpec, dtype: torch.dtype) -> torch.Tensor:
    """Every edge and its neighbours, tiny values of both signs, ±0 and the largest floats."""
    big = torch.finfo(dtype).max
    return torch.cat([edge_values(spec, dtype), tiny_values(dtype),
                      torch.tensor([big, -big, 1e30, -1e30], dtype=dtype)])


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_one_search_gives_every_finite_value_its_bin_and_the_nonfinite_their_slots(dtype,
                                                                                    spec):
    """0 for −∞, 1 + k(x) for finite x (exact at, below and above every edge), bins + 1
    for +∞ and NaN."""
    x = mixed_values(spec, dtype)
    index = histogram_device.bin_index(x, edges_of(spec, dtype))
    assert index.dtype == torch.int32
    assert torch.equal(index.long(), exact_bins(x, spec) + 1)
    special = histogram_device.bin_index(torch.tensor(NONFINITE, dtype=dtype),
                                         edges_of(spec, dtype))
    assert special.tolist() == [spec.bins + 1, spec.bins + 1, 0]


def test_edges_beyond_the_dtypes_range():
    """Edges beyond float32's largest value (thresholds +∞ and −F): the largest floats are
    finite and counted in their bins, ±∞ are not."""
    spec = BinSpec(-1e39, 1e39, 4)  # inner edges −5e38, 0, 5e38: two outside float32
    big = torch.finfo(F32).max
    x = torch.tensor([-big, -1e38, -0.0, 0.0, 1e38, big], dtype=F32)
    index = histogram_device.bin_index(x, edges_of(spec, F32))
    assert torch.equal(index.long(), exact_bins(x, spec) + 1)
    assert index.tolist() == [2, 2, 3, 3, 3, 3]
    special = histogram_device.bin_index(torch.tensor(NONFINITE, dtype=F32), edges_of(spec, F32))
    assert special.tolist() == [5, 5, 0]


@pytest.mark.parametrize("shape", [(64, 12), (2, 16, 3), (4, 8, 5), (3, 5, 7), (11,), ()])
def test_every_lane_layout_counts_the_same(shape, forced, monkeypatch):
    """Lane offsets of a trailing part of the shape, of rows of L, of flat positions (odd
    sizes) and a single element: the counts equal exact arithmetic; NaN and ±∞ in no bin."""
    spec = BinSpec(-2.0, 2.0, 100)
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen, dtype=F32) * 3
    flat = x.view(-1)
    if flat.numel() >= 3:
        flat[:3] = torch.tensor(NONFINITE)
    finite = x[torch.isfinite(x)]
    for limit in (histogram_device._MAX_PATTERN, 4):  # small: rows of L instead
        monkeypatch.setattr(histogram_device, "_MAX_PATTERN", limit)
        counts, bad = histogram_dense(x, spec)
        assert torch.equal(counts, exact_counts(finite, spec))
        assert int(bad) == x.numel() - finite.numel()


def test_lanes_only_spread_the_counting(forced, monkeypatch):
    """With one copy of the counters or 32 the counts agree (crowded bins included)."""
    spec = BinSpec(-1.0, 1.0, 40)
    x = torch.cat([torch.zeros(5000), torch.linspace(-1.5, 1.5, 999)]).view(-1, 7)
    expected = exact_counts(x, spec)
    for num_lanes in (1, 3, 32):
        monkeypatch.setattr(histogram_device, "_LANES", num_lanes)
        assert torch.equal(histogram_dense(x, spec)[0], expected)


@pytest.mark.parametrize("blocks", [BLOCKS[k] for k in ("default", "100 in 4 lanes",
                                                         "7 in 1 lane")])
def test_counts_of_several_chunks_are_summed_in_one_op(blocks, forced, monkeypatch):
    """histogram_dense_counts over chunks of different shapes (each split again beyond a
    block) equals the exact counts of all their elements; float64 and float32 chunks mix."""
    small_blocks(monkeypatch, blocks)
    spec = SPECS[0]
    gen = torch.Generator().manual_seed(1)
    chunks = [edge_values(spec, F32).view(101, 7)[:, 1:6],  # not contiguous
              torch.randn(13, 29, generator=gen, dtype=F64),
              torch.tensor([[math.nan, 0.5], [math.inf, -math.inf]], dtype=F32)]
    finite = torch.cat([c.double().reshape(-1) for c in chunks])
    finite = finite[torch.isfinite(finite)]
    assert torch.equal(histogram_dense_counts(chunks, spec), exact_counts(finite, spec))


@pytest.mark.parametrize("num_lanes", [1, 2])
def test_float32_counters_hold_a_full_block_of_one_bin(num_lanes, forced, monkeypatch):
    """L·2^24 + 1 equal elements counted with L copies of the counters: blocks of at most
    L·2^24 keep every float32 counter exact (2^24 + 1 is not a float32)."""
    monkeypatch.setattr(histogram_device, "_LANES", num_lanes)
    x = torch.zeros(num_lanes * histogram_device.COUNTER_LIMIT + 1)
    counts = histogram_dense_counts([x], BinSpec(-2.0, 2.0, 100))
    assert int(counts[50]) == x.numel() and int(counts.sum()) == x.numel()


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("blocks", BLOCKS.values(), ids=BLOCKS.keys())
def test_outer_products_counts(dtype, blocks, forced, monkeypatch):
    """Products δ·a at and next to every edge, overflowing to ±∞ and NaN from 0·∞, formed
    whole, in samples, rows of a sample and parts of a row: the counts-only entry point
    equals the counts of histogram_outer and exact arithmetic."""
    small_blocks(monkeypatch, blocks)
    spec = BinSpec(-1.0, 3.0, 7)
    big = torch.finfo(dtype).max
    delta = torch.tensor([[1.0, -1.0, 3.0], [big, 0.5, 1.0], [0.0, 2.0, -0.25]], dtype=dtype)
    a = torch.cat([edge_values(spec, dtype)[:20].view(1, -1),
                   torch.full((1, 20), 4.0, dtype=dtype),
                   torch.linspace(-3, 3, 20, dtype=dtype).view(1, -1)])
    a[2, 0] = math.inf
    products = (delta[:, :, None] * a[:, None, :]).reshape(-1)
    finite = products[torch.isfinite(products)]
    counts, bad = histogram_outer(delta, a, spec)
    assert torch.equal(counts, exact_counts(finite, spec))
    assert int(bad) == products.numel() - finite.numel() > 0
    assert torch.equal(histogram_outer_counts(delta, a, spec), counts)


def pair_counts(g: torch.Tensor, theta: torch.Tensor, spec_g: BinSpec, spec_t: BinSpec
                ) -> torch.Tensor:
    """Exact counts of the pairs (g[n, j], θ_j) with both finite (g [N, D], θ [D])."""
    thetas = theta.expand_as(g)
    ok = torch.isfinite(g) & torch.isfinite(thetas)
    cells = exact_bins(g[ok], spec_g) * spec_t.bins + exact_bins(thetas[ok], spec_t)
    return torch.bincount(cells, minlength=spec_g.bins * spec_t.bins).view(spec_g.bins,
                                                                           spec_t.bins)


@pytest.mark.parametrize("D", [40, 7, 1])  # 40: θ carries the lane offsets; 7, 1: it cannot
@pytest.mark.parametrize("blocks", [BLOCKS[k] for k in ("default", "96 in 32 lanes",
                                                         "5 in 1 lane")])
def test_pairs_with_and_without_thetas_lane_offsets(D, blocks, forced, monkeypatch):
    """Pairs (g, θ) at every edge of both specs, with non-finite g and θ, in one block, in
    rows and in parts of a row: counts equal exact arithmetic, the other pairs are counted,
    counts-only and the chunk sum agree."""
    small_blocks(monkeypatch, blocks)
    spec_g, spec_t = BinSpec(-1.0, 1.0, 40), BinSpec(-1.0, 3.0, 7)
    values = edge_values(spec_g, F32)
    g = values.repeat(-(-10 * D // values.numel()))[: 10 * D].view(10, D).clone()
    theta = theta_for(spec_t, 1, D, F32).view(-1).clone()
    g[0, 0], g[1, -1], g[2, D // 2] = NONFINITE
    if D > 1:
        theta[1] = math.nan
    counts, bad = histogram2d_dense(g, theta, spec_g, spec_t)
    assert torch.equal(counts, pair_counts(g, theta, spec_g, spec_t))
    assert int(bad) == int((~(torch.isfinite(g) & torch.isfinite(theta))).sum()) >= 3
    halves = [g[:4], g[4:]]
    assert torch.equal(histogram2d_dense_counts(halves, theta, spec_g, spec_t), counts)


@pytest.mark.parametrize("blocks", BLOCKS.values(), ids=BLOCKS.keys())
def test_outer_pairs_counts(blocks, forced, monkeypatch):
    small_blocks(monkeypatch, blocks)
    spec_g, spec_t = BinSpec(-1.0, 1.0, 40), BinSpec(-2.0, 2.0, 50)
    gen = torch.Generator().manual_seed(3)
    delta = torch.randn(6, 5, generator=gen, dtype=F64)
    a = torch.randn(6, 9, generator=gen, dtype=F64) * 0.3
    delta[2, 1] = math.inf
    theta = torch.randn(5, 9, generator=gen, dtype=F64) * 1.5
    products = (delta[:, :, None] * a[:, None, :]).reshape(6, 45)
    counts, bad = histogram2d_outer(delta, a, theta, spec_g, spec_t)
    assert torch.equal(counts, pair_counts(products, theta.reshape(-1), spec_g, spec_t))
    assert int(bad) == int((~torch.isfinite(products)).sum()) > 0
    assert torch.equal(histogram2d_outer_counts(delta, a, theta, spec_g, spec_t), counts)


def test_grad_hists_through_cockpit_equal_the_cpu_path(monkeypatch, one_thread):
    """GradHist1d (auto range, then fixed) and GradHist2d of a CNN with Linear and
    convolution layers over three steps: the accelerator path's counts equal the CPU
    path's exactly."""

    def run(accelerator: bool) -> dict:
        monkeypatch.setattr(histogram_device, "_forced", accelerator)
        problem = make_problem("cnn", 8, F32, seed=5)
        cockpit = Cockpit(problem.model, [GradHist1d(), GradHist2d()], strict=True)
        train(problem, cockpit, 3, torch.optim.SGD(problem.model.parameters(), lr=0.1))
        cockpit.close()
        return cockpit.get_output()

    cpu, accelerator = run(False), run(True)
    compared = 0
    for step, record in cpu.items():
        for key, value in record.items():
            if key.startswith("GradHist"):
                assert value.keys() == accelerator[step][key].keys()
                for field, v in value.items():
                    assert torch.equal(torch.as_tensor(v), torch.as_tensor(
                        accelerator[step][key][field])), (step, key, field)
                compared += 1
    assert compared >= 3 * 2 and any(int(v["counts"].sum()) > 0 for r in cpu.values()
                                     for k, v in r.items() if k == "GradHist2d")


@pytest.mark.parametrize("blocks", [(2, 32), (7, 1), (3, 4)])
def test_no_counter_receives_more_than_its_limit(blocks, forced, monkeypatch):
    """The float32 counters stay exact because no copy of a counter receives more than
    COUNTER_LIMIT counts (made small here), while a histc counts up to L·COUNTER_LIMIT
    values: dense chunks, Linear products (whole, rows of every sample, whole samples, rows
    and parts of a row of one sample) and pairs, with most values in one bin (0) and the
    whole chunk too."""
    per_counter, num_lanes = blocks
    small_blocks(monkeypatch, blocks)
    largest, sizes = [], []
    real = torch.histc

    def spy(x, *args, **kwargs):
        out = real(x, *args, **kwargs)
        sizes.append(x.numel())
        largest.append(int(out.max()))
        return out

    monkeypatch.setattr(torch, "histc", spy)
    gen = torch.Generator().manual_seed(0)
    spec, spec_t = BinSpec(-2.0, 2.0, 100), BinSpec(-1.0, 1.0, 40)

    def sparse(*shape):
        x = torch.randn(*shape, generator=gen)
        return x * (torch.rand(*shape, generator=gen) < 0.2)

    x, theta_x = sparse(3, 20), torch.randn(60, generator=gen)
    for N, I, J in [(4, 3, 20), (1, 3, 20), (2, 1, 100), (40, 2, 3)]:
        delta, a = sparse(N, I), sparse(N, J)
        theta = torch.randn(I, J, generator=gen)
        products = delta[:, :, None] * a[:, None, :]
        assert torch.equal(histogram_outer_counts(delta, a, spec),
                           exact_counts(products, spec))
        assert torch.equal(histogram2d_outer_counts(delta, a, theta, spec, spec_t),
                           pair_counts(products.reshape(N, -1), theta.reshape(-1), spec,
                                       spec_t))
    assert torch.equal(histogram_dense(x, spec)[0], exact_counts(x, spec))
    assert torch.equal(histogram2d_dense_counts([x.reshape(1, 60)], theta_x, spec, spec_t),
                       pair_counts(x.reshape(1, 60), theta_x, spec, spec_t))
    assert max(largest) == per_counter  # the zeros fill a counter of a full block
    assert max(sizes) == per_counter * num_lanes


def test_blocks_of_linear_products_fit_the_budget_and_are_as_few_as_it_allows(forced,
                                                                               monkeypatch):
    """The products of a Linear layer (float32: with their int32 index 8 bytes each) in
    blocks within the memory budget: all at once where they fit, else rows of every sample
    (one split), else whole samples; the fewest blocks the budget allows, of equal sizes,
    each contiguous (bucketize would copy it otherwise); the counts exact in every case."""
    seen = []
    real = torch.bucketize

    def spy(x, *args, **kwargs):
        seen.append((x.numel(), x.is_contiguous()))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch, "bucketize", spy)
    spec = BinSpec(-2.0, 2.0, 100)
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(6, 10, generator=gen), torch.randn(6, 8, generator=gen)
    long = torch.randn(40, 2, generator=gen), torch.randn(40, 3, generator=gen)
    for (delta, a), budget, blocks in [
            (wide, None, [480]), (wide, 480 * 8, [480]), (wide, 479 * 8, [240, 240]),
            (wide, 300 * 8, [240, 240]), (wide, 100 * 8, [96] * 5), (wide, 60 * 8, [48] * 10),
            (wide, 47 * 8, [40] * 12),  # rows of one sample
            (long, 100 * 8, [84, 84, 72])]:  # whole samples (a row of every sample: 120)
        seen.clear()
        lane_counts = hmod.histogram_outer_lanes(delta, a, spec, budget)
        expected = exact_counts(delta[:, :, None] * a[:, None, :], spec)
        assert torch.equal(lane_counts.counts(), expected), budget
        assert [size for size, _ in seen] == blocks, budget
        assert all(contiguous for _, contiguous in seen)


@pytest.mark.parametrize("accelerator", [False, True])
def test_embedding_histogram_counts_its_rows_and_implicit_zeros(accelerator, monkeypatch):
    """An Embedding's individual gradients (a few explicit rows, zeros elsewhere) count like
    the materialized |B|×D gradients, on both paths; a non-finite element of a row is left
    out of the counts, as in the dense histogram."""
    from cockpit.engine.rules.embedding import embedding_rule

    monkeypatch.setattr(histogram_device, "_forced", accelerator)
    torch.manual_seed(7)
    module = torch.nn.Embedding(11, 4)
    tokens = torch.randint(0, 11, (5, 3))
    out = module(tokens)
    delta = torch.randn_like(out)
    delta[2, 1, 3] = math.nan
    sg = embedding_rule(module, (tokens,), {}, out, delta)["weight"]
    spec = BinSpec(-2.0, 2.0, 9)
    dense = sg.materialize()
    expected = exact_counts(dense[torch.isfinite(dense)], spec)
    assert int(expected.sum()) == dense.numel() - 1
    assert torch.equal(sg.histogram(spec), expected)
