"""The one-pass histogram kernel (cockpit.engine.histograms.fused) in Triton's interpreter on
the CPU: its lane counts sum to those of bucketize + add + histc (the accelerator path's
three kernels, themselves tested against exact arithmetic) for every floating dtype, at
the edges, for ±∞ and NaN, over many programs and iterations; the accelerator path's
dense and outer-product tallies take it and count exactly as without it. Each check runs
in a subprocess: the interpreter is chosen when Triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kernel_counts_equal_the_three_kernel_path_in_every_dtype():
    run_interpreted("""
        import math, torch
        from cockpit.engine.histograms import device as D, fused
        torch.manual_seed(0)
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            bins = 21
            thresholds = torch.linspace(-1, 1, bins + 1, dtype=torch.float64)[1:-1].to(dtype)
            edges = D.search_edges(thresholds)
            x = (torch.randn(3037, dtype=torch.float64) * 0.7).to(dtype)
            x[:60] = thresholds[torch.randint(0, bins - 1, (60,))]        # on the edges
            x[60:80] = torch.nextafter(x[:20], torch.tensor(-math.inf, dtype=dtype))
            x[80:84] = torch.tensor([math.nan, math.inf, -math.inf, 5.0])
            slots = edges.numel() + 1
            L = D.lanes(slots)
            assert fused.available(x, fused.MIN_VALUES) and not fused.available(x)
            expected = D.tally(D.bin_index(x, edges), slots).view(L, slots).sum(0)
            got = fused.tally_values(x, edges, L).view(L, slots).sum(0)
            assert torch.equal(expected, got), (dtype, expected, got)
            assert got[0] == 1 and got[-1] == 2  # −∞; +∞ and NaN
    """)


def test_uniform_bins_index_by_estimate_and_correction_exactly():
    """With equal bins the index is estimated from (x − lo)/w and corrected once each way:
    the counts equal the binary search's for the floats at, just below and just above
    every edge, tiny and huge values, ±∞ and NaN, in float32 and float64, for the test
    specs of the exact histograms (2 to 1,000 bins, asymmetric ranges)."""
    run_interpreted("""
        import math, torch
        from cockpit.engine.histograms import device as D, fused
        from cockpit.engine.histograms.exact import _search_edges_on
        from tests.engine.test_histogram_exact import SPECS, edge_values, tiny_values
        torch.manual_seed(3)
        for spec in SPECS:
            for dtype in (torch.float32, torch.float64):
                edges = _search_edges_on(spec, dtype, torch.device("cpu"))
                finfo = torch.finfo(dtype)
                special = torch.tensor([math.nan, math.inf, -math.inf, finfo.max, -finfo.max,
                                        spec.lo - 1e3, spec.hi + 1e3], dtype=dtype)
                width = spec.hi - spec.lo
                x = torch.cat([edge_values(spec, dtype), tiny_values(dtype), special,
                               (torch.rand(4000, dtype=torch.float64) * 1.2 * width
                                + spec.lo - 0.1 * width).to(dtype)])
                slots = edges.numel() + 1
                L = D.lanes(slots)
                expected = D.tally(D.bin_index(x, edges), slots).view(L, slots).sum(0)
                got = fused.tally_values(x, edges, L, (spec.lo, spec.hi))
                assert torch.equal(got.view(L, slots).sum(0), expected), (spec, dtype)
    """)


def test_many_programs_and_iterations_count_every_value_once():
    """Slots for 8 lanes, 300,000 values and at most 4 programs per lane: 16 reads per
    program, 19 programs, several on each lane; a block beyond the limit is refused."""
    run_interpreted("""
        import torch
        from cockpit.engine.histograms import device as D, fused
        torch.manual_seed(1)
        thresholds = torch.linspace(-3, 3, 999)
        edges = D.search_edges(thresholds)
        slots = edges.numel() + 1
        L = D.lanes(slots)
        assert L == 8
        x = torch.randn(300_000)
        x[::7] = 0.0  # a crowded bin
        fused.PROGRAMS_PER_LANE = 4
        out = fused.tally_values(x, edges, L)
        expected = torch.bincount(D.bin_index(x, edges).long(), minlength=slots)
        assert torch.equal(out.view(L, slots).sum(0).long(), expected)
        assert (out.view(L, slots).sum(1) > 0).all()  # the counts spread over the lanes
        try:
            fused.tally_values(torch.zeros(fused.block_limit(L) + 1, dtype=torch.float16),
                               edges, L)
        except ValueError as error:
            assert "split them" in str(error)
        else:
            raise AssertionError("a block beyond the limit was counted")
    """)


def test_rows_are_counted_apart_in_one_launch():
    """Five rows (layers of one shape, stacked) with different values, crowded bins and
    non-finite ones: each row's lane counts equal those of the row alone; Linear layers
    stacked (``cockpit.engine.stacked``) count through it exactly, in one launch."""
    run_interpreted("""
        import math, torch
        from unittest import mock
        from cockpit.engine.histograms import device as D, fused
        from cockpit.engine.histograms.exact import BinSpec, histogram_dense_counts
        from cockpit.engine.rules.sample_grads import SequenceOuterSampleGrads
        from cockpit.engine.stacked import StackedGrads
        torch.manual_seed(3)
        edges = D.search_edges(torch.linspace(-1, 1, 12)[1:-1])
        slots = edges.numel() + 1
        L = D.lanes(slots)
        x = torch.randn(5, 20_000) * torch.tensor([0.1, 0.5, 1.0, 2.0, 0.0])[:, None]
        x[1, :5] = torch.tensor([math.nan, math.inf, -math.inf, 1.0, -1.0])
        fused.PROGRAMS_PER_LANE = 2
        rows = fused.tally_rows(x, edges, L)
        assert rows.shape == (5, L * slots)
        for row, values in zip(rows, x):
            assert torch.equal(row.view(L, slots).sum(0),
                               fused.tally_values(values, edges, L).view(L, slots).sum(0))
        assert rows[4].view(L, slots).sum(0)[6] == 20_000  # every zero in one bin
        spec = BinSpec(-1.0, 1.0, 10)
        grads = [SequenceOuterSampleGrads(torch.randn(6, 4, 30), torch.randn(6, 4, 20))
                 for _ in range(3)]
        calls = []
        real = fused.tally_rows
        fused.MIN_VALUES = 1000
        with D.forced(), mock.patch.object(fused, "tally_rows",
                                           lambda *args: calls.append(1) or real(*args)):
            counts = StackedGrads(grads).histograms(spec, None)
        assert calls == [1]
        for got, sg in zip(counts, grads):
            assert torch.equal(got, histogram_dense_counts([sg.materialize()], spec))
    """)


def test_the_accelerator_path_takes_the_kernel_and_counts_exactly():
    """Dense values in pieces and a Linear layer's products δ[n, i]·a[n, j] in blocks,
    with the kernel and without (COCKPIT_FUSED_HISTOGRAM=0), against exact counts."""
    run_interpreted("""
        import math, os, torch
        from unittest import mock
        from cockpit.engine.histograms import device as D, fused
        from tests.engine.test_histogram_exact import exact_counts
        from cockpit.engine.histograms.exact import BinSpec, _search_edges_on
        torch.manual_seed(2)
        spec = BinSpec(-0.5, 0.5, 32)
        edges = _search_edges_on(spec, torch.float32, torch.device("cpu"))
        x = torch.randn(4, 1000) * 0.3
        x[0, :3] = torch.tensor([math.nan, math.inf, 0.25])
        delta, a = torch.randn(6, 40), torch.randn(6, 50)
        calls = []
        real = fused.tally_values
        fused.MIN_VALUES = 1000  # the kernel for these small tensors too
        with D.forced(), mock.patch.object(fused, "tally_values",
                                           lambda *args: calls.append(1) or real(*args)):
            dense = D.counts_1d(D.dense_tallies([x], edges, budget=8 * 1500), 32)
            outer = D.counts_1d(D.outer_tallies(delta, a, edges, budget=4 * 5000,
                                                uniform=(spec.lo, spec.hi)), 32)
            os.environ["COCKPIT_FUSED_HISTOGRAM"] = "0"
            before = len(calls)
            plain = D.counts_1d(D.outer_tallies(delta, a, edges, budget=4 * 5000), 32)
        assert len(calls) == before >= 3, calls  # pieces and blocks; none when disabled
        assert torch.equal(dense, exact_counts(x[torch.isfinite(x)], spec))
        products = (delta[:, :, None] * a[:, None, :]).reshape(-1)
        assert torch.equal(outer, exact_counts(products, spec))
        assert torch.equal(plain, outer)
    """)


def test_a_kernel_that_fails_gives_way_to_the_three_kernels_with_the_same_counts():
    """A kernel that cannot compile or run (a machine without a compiler for Triton) is
    reported once and not used again; the counts come from the three kernels."""
    run_interpreted("""
        import warnings, torch
        from cockpit.engine.histograms import device as D, fused
        from cockpit.engine.histograms.exact import BinSpec, _search_edges_on
        from tests.engine.test_histogram_exact import exact_counts

        class Failing:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    raise RuntimeError("no C compiler")
                return launch

        fused._kernel.cache_clear()
        fused._kernel = lambda: Failing()
        fused.MIN_VALUES = 1
        spec = BinSpec(-1.0, 1.0, 20)
        edges = _search_edges_on(spec, torch.float32, torch.device("cpu"))
        x = torch.randn(3, 500)
        with D.forced(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = D.counts_1d(D.dense_tallies([x], edges), 20)
            second = D.counts_1d(D.dense_tallies([x], edges), 20)
        assert torch.equal(first, exact_counts(x.reshape(-1), spec))
        assert torch.equal(second, first)
        assert len([w for w in caught if "histogram kernel failed" in str(w.message)]) == 1
        assert "no C compiler" in fused.SWITCH.broken and not fused.available(x)
    """)


def test_grad_hists_through_cockpit_with_the_kernel_equal_the_cpu_path():
    """GradHist1d and GradHist2d of a CNN with Linear and convolution layers over three
    steps, every 1-D block counted by the kernel (the 2-D pairs keep their path): the counts
    equal the CPU path's exactly."""
    run_interpreted("""
        import pytest
        from cockpit.engine.histograms import fused
        fused.MIN_VALUES = 1
        calls = []
        real = fused.tally_values
        fused.tally_values = lambda *args: calls.append(1) or real(*args)
        code = pytest.main(["-q", "-p", "no:cacheprovider", "tests/engine/"
                            "test_histogram_device.py::"
                            "test_grad_hists_through_cockpit_equal_the_cpu_path"])
        assert code == 0 and len(calls) >= 3, (code, len(calls))
    """)


def test_stacked_weights_through_cockpit_take_one_launch_per_stack():
    """Six Linear weights of one shape on sequences, economy with AdamW on the accelerators'
    path: at each step after the first (which counts magnitudes for GradHist1d's automatic
    range) one launch counts the six stacked layers and one the head's weight; the values
    equal the CPU path's (as ``test_cuda`` checks on a GPU)."""
    run_interpreted("""
        import torch
        from cockpit import configuration
        from cockpit.engine import stacked
        from cockpit.engine.histograms import device as D, fused
        from tests.engine.test_stacked import Tokens
        from tests.test_cuda import compare, train
        generator = torch.Generator().manual_seed(2)
        data = [(torch.randn(16, 5, 6, generator=generator),
                 torch.randint(0, 3, (16,), generator=generator)) for _ in range(4)]

        def run():
            return train("cpu", torch.float64, configuration("economy"), data,
                         make_model=lambda: Tokens(6),
                         make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))[0]

        cpu = run()
        launches, stacks = [], []
        fused.MIN_VALUES = 1
        real_rows, real_init = fused.tally_rows, stacked.StackedGrads.__init__
        fused.tally_rows = lambda *args: launches.append(args[0].shape) or real_rows(*args)
        stacked.StackedGrads.__init__ = (
            lambda self, grads: stacks.append(len(grads)) or real_init(self, grads))
        with D.forced():
            accelerator = run()
        assert stacks == [6] * 4, stacks
        # 16 samples: 6 layers of 6 × 6, the head of 3 × 6
        assert sorted(launches) == [torch.Size([1, 16 * 18])] * 3 + [torch.Size([6, 16 * 36])] * 3
        assert compare(accelerator, cpu, rtol=1e-9, max_count_diff=4) > 40
    """)
