"""Sums of millions of float32 products on a CPU (``cockpit.engine.float_sums``) against float64:
‖x‖² and ⟨a, b⟩ of an embedding-sized vector of equal-sized numbers (Adam's first update),
of Gaussian numbers, with a remainder beyond the rows, in every floating dtype; and Alpha on
AdamW's first steps of a layer that large stays on its predicted path (a float32 dot product
there drifted by 1e-3 and failed the check that the real update is the predicted one). Sums
of squares over the samples (``sample_sum_sq``) against float64, and without the float64
copy of the squares that ``sum(dtype=torch.float64)`` makes (allocations counted by the
profiler)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, quantities
from cockpit.engine import float_sums
from cockpit.engine.float_sums import sample_sum_sq
from tests.models import Problem, train

N = 12_865_792 + 77  # GPT-2 small's token embedding (50257 × 256) and a remainder


def vectors(kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if kind == "equal":  # ±lr everywhere: Adam's first update
        a = torch.sign(torch.randn(N, generator=gen)) * 1e-4
        b = a * (1 + 1e-3 * torch.randn(N, generator=gen))
    else:
        a, b = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", ["equal", "gaussian"])
def test_norms_and_dots_keep_their_digits(kind, dtype):
    a, b = vectors(kind, dtype)
    exact_sq = float((a.double() ** 2).sum())
    exact_dot = float((a.double() * b.double()).sum())
    got_sq = float_sums.sq_norm(a)
    got_dot = float_sums.dot(a, b)
    assert got_sq.dtype == got_dot.dtype == torch.float64 and got_sq.dim() == 0  # (by rows)
    assert abs(float(got_sq) / exact_sq - 1) <= 1e-6  # (torch.dot of float32: 1e-2)
    # (Gaussian: the terms cancel, so the error is relative to Σ|a_i b_i|)
    scale = float((a.double() * b.double()).abs().sum())
    assert abs(float(got_dot) - exact_dot) <= 1e-5 * scale


def test_short_integer_and_strided_vectors():
    x = torch.arange(-5, 6)
    assert float(float_sums.sq_norm(x)) == 110.0
    wide = torch.randn(3, 2**17)[:, ::2]  # not contiguous
    expected = float((wide.double() ** 2).sum())
    assert float(float_sums.sq_norm(wide)) == pytest.approx(expected, rel=1e-7)
    assert float(float_sums.dot(wide, wide)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [1000, 2**16 + 300], ids=["short", "by rows"])
def test_norms_neither_overflow_nor_lose_half_precisions_digits(length, dtype):
    """A diverging float32 run's parameters (1e19: squares beyond float32's range), a
    float16 weight with ‖W‖ > 256 (squares beyond float16's), bfloat16 Gaussian numbers
    (summed in bfloat16: 2e-3 off): ‖x‖² and ⟨x, x⟩ as float64 sums."""
    gen = torch.Generator().manual_seed(0)
    magnitude = {torch.float32: 1e19, torch.float16: 20.0, torch.bfloat16: 1.0}[dtype]
    x = (magnitude * torch.randn(length, generator=gen)).to(dtype)
    exact = float((x.double() ** 2).sum())
    assert float(float_sums.sq_norm(x)) == pytest.approx(exact, rel=1e-6)
    assert float(float_sums.dot(x, x)) == pytest.approx(exact, rel=1e-6)


def test_alpha_on_adamws_first_step_of_a_large_layer_is_predicted():
    """A Linear layer of 12.8 M numbers whose gradient has no zero: Adam's first update is
    ±lr in every element, whose float32 dot products drifted by 1e-3."""
    torch.manual_seed(0)
    model = nn.Linear(3200, 4000)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cockpit = Cockpit(model, [quantities.Alpha()], optimizer=opt)
    problem = Problem("linear", model, torch.randn(6, 3200), torch.randint(0, 4000, (6,)),
                      lambda out, y: F.cross_entropy(out, y, reduction="none"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(problem, cockpit, 3, opt)
        cockpit.close()
    assert not [w for w in caught if "does not match the prediction" in str(w.message)]
    output, notes = cockpit.get_output(), cockpit.get_notes()
    assert all(output[step]["Alpha"] is not None for step in range(2)), notes


def peak_allocated(fn) -> int:
    """The most bytes allocated at once on the CPU while ``fn`` runs (the profiler's
    allocation events), above what was allocated before."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    events = []

    def walk(nodes):
        for node in nodes:
            if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sample_sum_sq_equals_float64_without_a_wide_copy(dtype):
    gen = torch.Generator().manual_seed(0)
    c = (torch.randn(16, 2**17, generator=gen) * 1e-3).to(dtype)
    expected = c.square().double().sum(0)  # (the squares in c's dtype, as Cockpit forms them)
    got = sample_sum_sq(c)
    assert got.dtype == torch.float64 and got.shape == (2**17,)
    torch.testing.assert_close(got, expected, rtol=1e-6 if dtype != torch.float64 else 1e-15,
                               atol=0)
    small = c[:, :1000]  # (a small block: summed in float64, as ever)
    assert torch.equal(sample_sum_sq(small), small.square().sum(0, dtype=torch.float64))
    if dtype == torch.bfloat16:  # (a CPU widens half precision to float32 to reduce it)
        return
    block, out = c.numel() * c.element_size(), 2**17 * 8
    # the squares (c's size) and the sums; ``square().sum(0, dtype=float64)`` made a float64
    # copy of the squares beside them (three blocks' worth for float32)
    assert peak_allocated(lambda: sample_sum_sq(c)) <= block + 2 * out
    owned = c.clone()
    assert peak_allocated(lambda: sample_sum_sq(owned, owned=True)) <= 2 * out
    torch.testing.assert_close(owned.double(), c.square().double())  # (squared in place)
