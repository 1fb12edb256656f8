"""The kernel for sums over many tensors (``cockpit.engine.tensor_sums``) in Triton's
interpreter on the CPU: Σx², Σ(x − c·y)², and Σx², Σy², Σx·y per tensor against float64
sums for tensors that end inside a program's chunk and span several, in float32, bfloat16
and float16; which lists it takes; a tracked step whose norms, Distance, gradient check and
update check take it equals one that takes the blocks; a kernel that fails gives way to
the blocks with one warning. Each check runs in a subprocess: the interpreter is chosen
when Triton is imported."""

from __future__ import annotations

import pytest

from tests.engine.test_histogram_fused import run_interpreted

pytest.importorskip("triton")


def test_sums_equal_the_sums_in_float64():
    run_interpreted("""
        import torch
        from cockpit.engine import tensor_sums as S
        torch.manual_seed(0)
        sizes = [1, 5, S.CHUNK, S.CHUNK + 3, 3 * S.CHUNK - 1] + [7] * (S.MIN_TENSORS - 5)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xs = [torch.randn(s).to(dtype) for s in sizes]
            ys = [(3 * torch.randn(s)).to(dtype) for s in sizes]
            x64, y64 = [x.double() for x in xs], [y.double() for y in ys]
            c = torch.tensor(0.7, dtype=dtype)
            c64 = float(c)
            want = {
                "squares": torch.stack([x.square().sum() for x in x64]),
                "differences": torch.stack([(x - y).square().sum()
                                            for x, y in zip(x64, y64)]),
                "scaled": torch.stack([(x - c64 * y).square().sum()
                                       for x, y in zip(x64, y64)]),
                "pairs": torch.stack([
                    torch.stack([x.square().sum() for x in x64]),
                    torch.stack([y.square().sum() for y in y64]),
                    torch.stack([(x * y).sum() for x, y in zip(x64, y64)])]),
            }
            bound = {  # the same sums of absolute values: float32's rounding of each
                "pairs": torch.stack([want["pairs"][0], want["pairs"][1], torch.stack(
                    [(x * y).abs().sum() for x, y in zip(x64, y64)])]),
            }
            got = {
                "squares": S.sq_norms(xs),
                "differences": S.sq_norms_of_differences(xs, ys),
                "scaled": S.sq_norms_of_differences(xs, ys, c),
                "pairs": S.pair_sums(xs, ys),
            }
            for key, value in got.items():
                assert value.dtype == torch.float64 and value.shape == want[key].shape, key
                scale = bound.get(key, want[key])
                assert ((value - want[key]).abs() <= 1e-6 * scale).all(), (dtype, key)
            # views one element past a 16-byte address: the kernel without wide loads
            shifted = [torch.cat([x[:1], x]).narrow(0, 1, x.numel()) for x in xs]
            assert [v.data_ptr() % 16 for v in shifted[:1]] == [xs[0].element_size()]
            table, aligned = S._table(tuple(v.data_ptr() for v in shifted), xs[0].device)
            assert not aligned and S._table(tuple(x.data_ptr() for x in xs), xs[0].device)[1]
            assert torch.equal(S.sq_norms(shifted), got["squares"]), dtype
            assert torch.equal(S.pair_sums(shifted, ys), got["pairs"]), dtype
    """)


def test_the_lists_the_kernel_takes():
    """At least MIN_TENSORS dense plain tensors of one dtype (not float64) and device (also
    channels-last, a pair then with equal strides), the second list of the same sizes; not
    with COCKPIT_TENSOR_SUMS=0."""
    run_interpreted("""
        import os, pytest, torch
        from cockpit.engine import tensor_sums as S
        torch.manual_seed(0)
        n = S.MIN_TENSORS
        xs = [torch.randn(3, 4) for _ in range(n)]
        assert S.available(xs) and S.available(xs, [torch.randn(12) for _ in range(n)])
        assert not S.available(xs[:-1])
        assert not S.available([x.double() for x in xs])
        assert not S.available(xs[:-1] + [xs[0].t()])  # (not contiguous)
        assert not S.available(xs[:-1] + [xs[0].half()])
        assert not S.available(xs, [torch.randn(13) for _ in range(n)])
        assert not S.available(xs, [torch.randn(12).half() for _ in range(n)])
        assert S.sq_norms(xs[:-1]) is None
        # lists checked once for two questions: their sizes passed on, not checked again
        ys = [torch.randn(3, 4) for _ in range(n)]
        sizes = S.checked(xs, ys)
        assert sizes == (12,) * n and S.checked(xs[:-1], ys[:-1]) is None
        real, S.checked = S.checked, lambda *args: pytest.fail("checked again")
        pairs = S.pair_sums(xs, ys, sizes)
        torch.testing.assert_close(S.sq_norms_of_differences(ys, xs, None, sizes),
                                   pairs[0] + pairs[1] - 2 * pairs[2], rtol=1e-5, atol=1e-5)
        S.checked = real
        # channels-last weights and gradients: read place by place, pairs of equal strides
        last = [torch.randn(4, 3, 2, 5).to(memory_format=torch.channels_last) for _ in xs]
        other = [torch.randn(4, 3, 2, 5).to(memory_format=torch.channels_last) for _ in xs]
        assert S.available(last) and S.available(last, other)
        assert not S.available(last, [y.contiguous() for y in other])
        want = torch.stack([(x.double() - y.double()).square().sum()
                            for x, y in zip(last, other)])
        torch.testing.assert_close(S.sq_norms_of_differences(last, other), want, rtol=1e-6,
                                   atol=0)
        os.environ["COCKPIT_TENSOR_SUMS"] = "0"
        assert not S.available(xs) and S.sq_norms(xs) is None
    """)


_TRACKED_RUN = """
    import os, warnings, torch
    from torch import nn
    from cockpit import Cockpit, configuration, quantities
    from cockpit.engine import tensor_sums
    from cockpit.engine.histograms import device as histogram_device
    from tests.engine.test_memory_budget import assert_same_outputs

    histogram_device._forced = True  # (the accelerators' path: blocks where no kernel)
    calls = []
    real = tensor_sums._sums

    def spy(xs, ys, scale, mode, sizes):
        calls.append(mode)
        return real(xs, ys, scale, mode, sizes)

    tensor_sums._sums = spy

    def outputs():
        torch.manual_seed(0)
        layers = [m for _ in range(16) for m in (nn.Linear(8, 8), nn.Tanh())]
        model = nn.Sequential(*layers, nn.Linear(8, 3))  # (34 parameter tensors)
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(10, 8, generator=gen), torch.randint(0, 3, (10,), generator=gen)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = configuration("economy") + [quantities.ParamNorm()]
        cockpit = Cockpit(model, config, optimizer=opt, strict=True)
        for step in range(3):
            opt.zero_grad()
            losses = nn.functional.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()
        return cockpit.get_output()
"""


def test_a_tracked_step_that_takes_the_kernel_is_unchanged():
    """Economy with ParamNorm and AdamW on 34 parameter tensors (three steps): GradNorm,
    ParamNorm, Distance, UpdateSize, the gradient check and Alpha's update check take the
    kernel in its three modes, and every value equals the blocks' (float32 rounding)."""
    run_interpreted(_TRACKED_RUN + """
    with_kernel = outputs()
    assert set(calls) == {tensor_sums.SQUARES, tensor_sums.DIFFERENCES, tensor_sums.PAIRS}
    assert len(calls) >= 3 * 4, calls
    os.environ["COCKPIT_TENSOR_SUMS"] = "0"
    calls.clear()
    with_blocks = outputs()
    assert not calls
    assert assert_same_outputs(with_blocks, with_kernel, rtol=1e-5, atol=1e-9) > 50
    """)


def test_a_failing_kernel_gives_way_to_the_blocks():
    """A kernel that fails (no compiler) is used no more, with one warning; the step's
    values are those of the blocks."""
    run_interpreted(_TRACKED_RUN + """
    os.environ["COCKPIT_TENSOR_SUMS"] = "0"
    with_blocks = outputs()
    del os.environ["COCKPIT_TENSOR_SUMS"]

    def failing(xs, ys, scale, mode, sizes):
        calls.append(mode)
        raise RuntimeError("no compiler")

    tensor_sums._sums = failing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        without = outputs()
    assert len(calls) == 1 and "no compiler" in tensor_sums.SWITCH.broken
    assert sum("norms of many tensors" in str(w.message) for w in caught) == 1
    assert assert_same_outputs(with_blocks, without) > 50
    """)
