"""The stacks' dot-product kernel (``cockpit.engine.row_dots``) in Triton's interpreter on
the CPU: [g_{l,n}ᵀu_{l,k}] against float64 sums for 1 to 8 directions, widths that end
inside a block and span many programs; a stack of Linear weights takes it and gives the
values of the products and sums, and so do individual gradients materialized in chunks; a
tracked step whose stacks take it equals one whose stacks do not; a kernel that fails gives
way to the products and sums. Each check runs in a subprocess: the interpreter is chosen
when Triton is imported."""

from __future__ import annotations

import pytest

from tests.engine.test_histogram_fused import run_interpreted

pytest.importorskip("triton")


def test_dots_equal_the_sums_in_float64():
    run_interpreted("""
        import torch
        from cockpit.engine import row_dots
        torch.manual_seed(0)
        block = row_dots.BLOCK * row_dots.ITERS
        for layers, samples, width, k in [(3, 5, 3000, 1), (2, 4, 2 * block + 17, 3),
                                          (1, 2, block, 8), (2, 1, 5, 2)]:
            g, u = torch.randn(layers, samples, width), torch.randn(layers, k, width)
            got = row_dots.row_dots(g, u)
            assert got.shape == (layers, samples, k) and got.dtype == torch.float32
            exact = torch.einsum("lnd,lkd->lnk", g.double(), u.double())
            scale = torch.einsum("lnd,lkd->lnk", g.double().abs(), u.double().abs())
            assert ((got.double() - exact).abs() <= 1e-6 * scale).all(), (width, k)
    """)


def test_a_stack_takes_the_kernel_and_equals_the_products_and_sums():
    """Only float32 G of at least MIN_VALUES numbers and at most MAX_DIRECTIONS directions
    take the kernel; its dot products equal those of the products and sums, all layers' or
    one layer's."""
    run_interpreted("""
        import torch
        from cockpit.engine import row_dots
        from cockpit.engine.stacked import StackedGrads
        from tests.engine.test_stacked import sequence_grads

        grads = sequence_grads(4, torch.float32, n=6, t=3, i=40, j=30)
        gen = torch.Generator().manual_seed(2)
        directions = [[torch.randn(40, 30, generator=gen) for _ in range(3)] for _ in grads]
        rows = StackedGrads(grads).rows
        assert not row_dots.available(rows, 3)  # (4·6·1,200 numbers: below MIN_VALUES)
        row_dots.MIN_VALUES = 1
        assert row_dots.available(rows, 3) and not row_dots.available(rows.double(), 3)
        assert not row_dots.available(rows, row_dots.MAX_DIRECTIONS + 1)
        import os
        os.environ["COCKPIT_ROW_DOTS"] = "0"
        assert not row_dots.available(rows, 3)
        del os.environ["COCKPIT_ROW_DOTS"]
        calls = []
        real = row_dots.row_dots
        row_dots.row_dots = lambda g, u: calls.append(u.shape) or real(g, u)
        stack = StackedGrads(grads)
        stack.rows
        got = stack.dots(directions)
        got_layer = stack.layer_dots(2, directions[2])  # (one layer's plan: alone)
        assert calls == [torch.Size([4, 3, 1200]), torch.Size([1, 3, 1200])]
        row_dots.MIN_VALUES = 2**62
        stack = StackedGrads(grads)
        stack.rows
        want = stack.dots(directions)
        assert got.shape == want.shape == (3, 6, 4)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_layer, stack.layer_dots(2, directions[2]), rtol=1e-5,
                                   atol=1e-5)
    """)


def test_a_tracked_step_whose_stacks_take_the_kernel_is_unchanged():
    """Economy with AdamW on six Linear layers of one shape (the accelerators' path, three
    steps): every value equal with and without the kernel (float32 rounding)."""
    run_interpreted("""
        import pytest, torch
        from cockpit.engine import row_dots
        from tests.engine.test_narrow_products import assert_close_outputs, autocast_outputs

        monkeypatch = pytest.MonkeyPatch()
        calls = []
        real = row_dots.row_dots
        monkeypatch.setattr(row_dots, "row_dots", lambda g, u: calls.append(1) or real(g, u))
        monkeypatch.setattr(row_dots, "MIN_VALUES", 1)
        with_kernel, sizes = autocast_outputs("economy", monkeypatch)
        assert calls and sizes
        monkeypatch.setattr(row_dots, "MIN_VALUES", 2**62)
        without, _ = autocast_outputs("economy", monkeypatch)
        assert_close_outputs(without, with_kernel)
    """)


def test_individual_gradients_in_chunks_take_the_kernel():
    """Materialized individual gradients (a parameter formed in sample chunks: a large tied
    embedding under the memory budget): their dot products with one direction and with
    several by one launch of the kernel per chunk, equal to the products."""
    run_interpreted("""
        import torch
        from cockpit.engine import row_dots
        from cockpit.engine.rules.sample_grads import DenseSampleGrads

        gen = torch.Generator().manual_seed(4)
        sg = DenseSampleGrads(torch.randn(6, 40, 30, generator=gen))
        us = [torch.randn(40, 30, generator=gen) for _ in range(3)]
        calls = []
        real = row_dots.row_dots
        row_dots.row_dots = lambda g, u: calls.append((g.shape, u.shape)) or real(g, u)
        want_many, want_one = sg.dots_many(us), sg.dots(us[0])
        assert not calls  # (6·1,200 numbers: below MIN_VALUES)
        row_dots.MIN_VALUES = 1
        got_many, got_one = sg.dots_many(us), sg.dots(us[0])
        assert calls == [((1, 6, 1200), (1, 3, 1200)), ((1, 6, 1200), (1, 1, 1200))]
        assert got_many.shape == (3, 6) and got_one.shape == (6,)
        torch.testing.assert_close(got_many, want_many, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_one, want_one, rtol=1e-5, atol=1e-5)
    """)


def test_a_kernel_that_fails_gives_way_to_the_products_and_sums():
    run_interpreted("""
        import warnings, torch
        from cockpit.engine import row_dots
        from cockpit.engine.stacked import StackedGrads
        from tests.engine.test_stacked import sequence_grads

        grads = sequence_grads(3, torch.float32)
        directions = [[torch.randn(4, 6)] for _ in grads]
        want = StackedGrads(grads)
        want.rows
        want = want.dots(directions)
        row_dots.MIN_VALUES = 1

        def fail(*args):
            raise RuntimeError("no compiler")

        row_dots.row_dots = fail
        stack = StackedGrads(grads)
        stack.rows
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = stack.dots(directions)
        assert any("dot-product kernel failed" in str(w.message) for w in caught)
        assert row_dots.SWITCH.broken is not None and not row_dots.available(stack.rows, 1)
        torch.testing.assert_close(got, want)
    """)
