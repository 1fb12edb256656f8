"""``benchmarks/device_traffic.py``: the bytes and floating-point operations of a step's ops
by function, counted exactly for ops whose traffic is known, and its dry run on 3C3D."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import torch

from tests.benchmark.bench_helpers import ROOT, run_benchmark


@pytest.fixture(scope="module")
def traffic_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("device_traffic",
                                                  ROOT / "benchmarks" / "device_traffic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bytes_and_flops_of_known_ops(traffic_module):
    """A product reads both factors and writes the result (2·n·k·m FLOPs); a view moves
    nothing; an expanded input is read once; an in-place op reads and writes its tensor."""
    a, b = torch.randn(6, 5), torch.randn(5, 3)
    row = torch.randn(1, 3)
    x = torch.randn(4, 3)
    with traffic_module.Traffic() as traffic:
        a @ b
        x.view(12)
        x + row.expand(4, 3)
        x.mul_(2.0)
    user = traffic_module.USER
    assert traffic.ops[user] == 5  # (mm, view, expand, add, mul_)
    assert traffic.flops[user] == 2 * 6 * 5 * 3
    product = (30 + 15 + 18) * 4
    broadcast = (12 + 3 + 12) * 4  # (the expanded row read once: its 3 elements)
    in_place = (12 + 12) * 4
    assert traffic.bytes[user] == product + broadcast + in_place
    expected = (max(product / traffic.bandwidth, 180 / traffic.peak)
                + broadcast / traffic.bandwidth + in_place / traffic.bandwidth)
    assert traffic.seconds[user] == pytest.approx(expected)


def test_device_traffic_lists_a_tracked_steps_functions():
    out = run_benchmark("device_traffic.py", "--batch", "4", "--top", "40").stdout
    head, totals, _, *rows = out.strip().splitlines()
    plain, extra = map(float, re.search(
        r"estimated device time ([\d.]+) ms without Cockpit, Cockpit's ops ([\d.]+) ms more",
        head).groups())
    assert plain > 0 and extra > 0
    ops = int(re.search(r"Cockpit's ops: (\d+),", totals).group(1))
    functions = {line.split(maxsplit=4)[4]: float(line.split()[0]) for line in rows}
    assert "the user's loop" in functions
    assert any(name.startswith("engine/") for name in functions)
    cockpit_rows = [ms for name, ms in functions.items() if name != "the user's loop"]
    assert sum(cockpit_rows) <= extra + 1e-3 * len(rows)
    assert ops > 0


def test_a_modelled_cuda_kernel_counts_one_read_of_its_inputs(traffic_module, monkeypatch):
    """``--cuda-kernels``: the stacks' dot products counted as one kernel that reads G and
    the directions once, a histogram's lane counts as one that reads the values once and
    writes the counts, the differences' norms of two lists of tensors as one that reads
    both once (the CPU's ops inside not counted); the values as the CPU's."""
    from cockpit.engine import narrow_products, row_dots, tensor_sums
    from cockpit.engine.histograms import device, fused

    for module, name in ((fused, "available"), (fused, "tally_rows"),
                         (row_dots, "available"), (row_dots, "row_dots"),
                         (narrow_products, "_runs"), (narrow_products, "_bmm"),
                         (narrow_products, "_baddbmm"), (tensor_sums.SWITCH, "runs"),
                         (tensor_sums, "_kernel"), (tensor_sums, "_sums")):
        monkeypatch.setattr(module, name, getattr(module, name))  # (restored after the test)
    traffic_module.model_cuda_kernels()
    g, u = torch.randn(2, 3, 50), torch.randn(2, 4, 50)
    x = torch.randn(3, 64)
    edges = device.search_edges(torch.linspace(-1, 1, 6)[1:-1])
    slots = edges.numel() + 1
    lanes = device.lanes(slots)
    with traffic_module.Traffic() as traffic:
        dots = row_dots.row_dots(g, u)
        counts = fused.tally_rows(x, edges, lanes)
    user = traffic_module.USER
    assert traffic.ops[user] == 2
    assert traffic.bytes[user] == 4 * (g.numel() + u.numel() + x.numel() + edges.numel()
                                       + 2 * 3 * lanes * slots)
    torch.testing.assert_close(dots, torch.einsum("lnd,lkd->lnk", g, u))
    assert counts.view(3, lanes, slots).sum((1, 2)).tolist() == [64.0] * 3
    assert row_dots.available(torch.zeros(1, 1, row_dots.MIN_VALUES), 3)
    assert not row_dots.available(torch.zeros(1, 1, 8), 3)
    # a half-precision product with a float32 result: the factors read, G written, at the
    # half-precision peak; a bfloat16 product of the user's at that peak too
    a, b = torch.randn(2, 5, 7).bfloat16(), torch.randn(2, 7, 3).bfloat16()
    a0, b0 = a[0], b[0]
    assert narrow_products.available(a, b, torch.float32)
    with traffic_module.Traffic() as traffic:
        product = narrow_products.wide_products(a, b, 0.5)
        a0 @ b0
    flops = 2 * 2 * 5 * 7 * 3
    kernel = "engine/narrow_products.py:wide_products"
    assert product.dtype == torch.float32
    assert traffic.ops[kernel] == 1 and traffic.ops[user] == 1
    assert (traffic.flops[kernel], traffic.flops[user]) == (flops, flops // 2)
    assert traffic.bytes[kernel] == 2 * (70 + 42) + 4 * 30
    assert traffic.bytes[user] == 2 * (35 + 21 + 15)
    torch.testing.assert_close(product, 0.5 * (a.float() @ b.float()))
    assert traffic.seconds[kernel] == pytest.approx(
        max(344 / traffic.bandwidth, flops / traffic.half_peak))
    assert traffic.seconds[user] == pytest.approx(
        max(142 / traffic.bandwidth, flops / 2 / traffic.half_peak))
    # the norms of differences of two lists of tensors: each tensor read once
    xs = [torch.randn(3, 5) for _ in range(tensor_sums.MIN_TENSORS)]
    ys = [torch.randn(15) for _ in xs]
    with traffic_module.Traffic() as traffic:
        sq = tensor_sums.sq_norms_of_differences(xs, ys, torch.tensor(0.5))
    kernel = "engine/tensor_sums.py:_guarded"
    assert traffic.ops[kernel] == 1 and traffic.bytes[kernel] == 2 * 4 * 15 * len(xs)
    want = [(x.double().reshape(-1) - 0.5 * y.double()).square().sum()
            for x, y in zip(xs, ys, strict=True)]
    torch.testing.assert_close(sq, torch.stack(want))
