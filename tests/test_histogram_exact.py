"""Histogram counts against exact rational arithmetic (fractions.Fraction): bins of the real
edges e_k = lo + k·(hi − lo)/bins, at tiny magnitudes of both signs and around every edge.

Negative elements of magnitude below ~6e-8 were counted in [0, w) by the float32 formula
⌊(x − lo)·scale⌋ (x − lo rounds to −lo); zero is now the edge e_m of the formula
⌊x·scale⌋ + m, so the sign decides. What remains inexact is documented in
:mod:`cockpit.engine.histogram`: a value within one rounding of x·scale below a non-zero
edge (at most the one float next to the edge) may be counted one bin high; the test pins
that down too."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from cockpit.engine.histogram import BinSpec, histogram2d_dense, histogram_dense, histogram_outer
from cockpit.engine.histogram2d_outer import histogram2d_outer

SPECS = [BinSpec(-2.0, 2.0, 100), BinSpec(-1.0, 1.0, 40), BinSpec(-2.0, 2.0, 50),
         BinSpec(-0.3, 0.7, 1000), BinSpec(-0.05, 0.02, 13)]


def exact_bin(x: float, spec: BinSpec) -> int:
    position = (Fraction(x) - Fraction(spec.lo)) * spec.bins / (Fraction(spec.hi)
                                                                - Fraction(spec.lo))
    return min(max(math.floor(position), 0), spec.bins - 1)


def exact_counts(values: torch.Tensor, spec: BinSpec) -> torch.Tensor:
    counts = torch.zeros(spec.bins, dtype=torch.long)
    for v in values.reshape(-1).tolist():
        counts[exact_bin(v, spec)] += 1
    return counts


def tiny_values(dtype: torch.dtype) -> torch.Tensor:
    finfo = torch.finfo(dtype)
    magnitudes = [finfo.smallest_normal / 2**10, finfo.tiny, 1e-30, 1e-12, 1e-9, 1e-8, 3e-8,
                  6e-8, 1e-7, 1e-6, 1e-4]
    magnitudes = [m for m in magnitudes if m > 0 and torch.tensor(m, dtype=dtype).item() > 0]
    values = torch.tensor(magnitudes, dtype=dtype)
    return torch.cat([values, -values, torch.tensor([0.0, -0.0], dtype=dtype)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec", SPECS[:3], ids=str)
def test_tiny_values_of_both_signs_are_binned_exactly(dtype, spec):
    x = tiny_values(dtype)
    expected = exact_counts(x, spec)
    m = spec.zero_bin
    assert expected[m - 1] == (x < 0).sum() and expected[m] == (x >= 0).sum()
    assert torch.equal(histogram_dense(x, spec)[0], expected)
    assert torch.equal(spec.bin_index(x), torch.tensor([exact_bin(v, spec) for v in x.tolist()]))
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


def edge_values(spec: BinSpec, dtype: torch.dtype, steps: int = 3) -> torch.Tensor:
    """The floats nearest to every edge and their ``steps`` neighbours on both sides."""
    edges = torch.tensor([float(Fraction(spec.lo) + k * (Fraction(spec.hi) - Fraction(spec.lo))
                                / spec.bins) for k in range(spec.bins + 1)], dtype=dtype)
    out = [edges]
    for direction in (math.inf, -math.inf):
        e = edges
        for _ in range(steps):
            e = torch.nextafter(e, torch.full_like(e, direction))
            out.append(e)
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_values_at_the_edges(dtype, spec):
    """Exact at the zero edge and wherever x·scale rounds correctly; elsewhere at most the
    float next to a non-zero edge is one bin high (relative distance ≤ one rounding)."""
    x = edge_values(spec, dtype)
    got = spec.bin_index(x)
    want = torch.tensor([exact_bin(v, spec) for v in x.tolist()])
    counts = histogram_dense(x, spec)[0]
    assert torch.equal(counts, torch.bincount(got, minlength=spec.bins))
    wrong = (got != want).nonzero().squeeze(1)
    eps = torch.finfo(dtype).eps
    w = Fraction(spec.hi) - Fraction(spec.lo)
    for i in wrong.tolist():
        v = Fraction(x[i].item())
        assert abs(int(got[i]) - int(want[i])) == 1, (x[i].item(), got[i], want[i])
        edge = Fraction(spec.lo) + max(int(got[i]), int(want[i])) * w / spec.bins
        assert edge != 0
        if spec.zero_bin is not None:  # ⌊x·scale⌋ + m: only x·scale's rounding, upwards
            assert got[i] > want[i] and abs(edge - v) <= eps * abs(edge)
        else:  # ⌊(x − lo)·scale⌋: the rounding of x − lo as well
            assert abs(edge - v) <= 2 * eps * (abs(Fraction(spec.lo)) + abs(v))
    if spec.zero_bin is not None:
        near_zero = x.abs() < float(w) / spec.bins / 2
        assert near_zero.sum() == 7 and torch.equal(got[near_zero], want[near_zero])
        assert wrong.numel() <= spec.bins - 2  # at most the float below each non-zero edge
