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
