"""``benchmarks/gpu_overhead.py --device cpu --quick``: the dry run of the GPU benchmark runs
every part without an error, writes its JSON, and prints the original package's H200 numbers
beside ours with the ratio ours/original."""

from __future__ import annotations

import json

from tests.benchmark.bench_helpers import run_benchmark


def test_gpu_overhead_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    table = run_benchmark("gpu_overhead.py", "--device", "cpu", "--quick", "--problems",
                          "cifar10_3c3d", "--configs", "economy", "--every", "4", "--json",
                          str(out), timeout=600).stdout
    data = json.loads(out.read_text())
    records = data["records"]
    assert {r["part"] for r in records} == {"side", "gpt2", "resnet", "fig7", "idle"}
    assert not [r for r in records if "error" in r or "skipped" in r], records
    side = next(r for r in records if r["part"] == "side")
    assert side["problem"] == "cifar10_3c3d" and side["ratio"] > 0 and side["n"] == 2
    assert {r["every"] for r in records if r["part"] == "resnet"} == {1, 10}
    assert [(r["config"], r["every"]) for r in records if r["part"] == "fig7"] == [
        ("economy", 4), ("business", 4), ("full", 4)]
    # the original package's H200 cell beside ours, and ours/original of the tracked step
    row = next(line for line in table.splitlines()
               if line.startswith("| cifar10_3c3d | economy |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4].startswith("7.53× (24.3 ms)")
    assert float(cells[5]) == round(side["tracked_ms"] / 24.344187999993494, 2)
    fig7_row = next(line for line in table.splitlines() if line.startswith("| economy | "))
    assert "/ 4.54 (" in fig7_row
    idle = next(r for r in records if r["part"] == "idle")
    assert idle["pairs"] >= 3 and idle["ratio"] > 0
    assert abs(idle["ratio"] - idle["tracked_ms"] / idle["untracked_ms"]) < 1e-9
    assert "A step no instrument tracks" in table
    # the goals the run measured, each with its value and whether it is met
    goal = next(line for line in table.splitlines()
                if line.startswith("- ") and "cifar10_3c3d economy: tracked step ≤ 2×" in line)
    assert goal.startswith("- met" if side["ratio"] <= 2 else "- NOT met")
    assert f"{side['ratio']:.3g} (≤ 2)" in goal
    assert data["meta"]["device"].startswith("CPU")


def test_curvature_batched_dry_run_on_the_cpu():
    """``benchmarks/curvature_batched.py`` (part b of ``gpu_check.sh``) runs on a small batch:
    each method's loop and batched time, and their ratio."""
    result = run_benchmark("curvature_batched.py", "--batch", "4", "--repeats", "1",
                           "--methods", "diag_ggn_exact", "diag_ggn_mc", timeout=600)
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["method"] for r in records] == ["diag_ggn_exact", "diag_ggn_mc"]
    assert all(r["loop_ms"] > 0 and r["batched_ms"] > 0 for r in records)
    assert "Timing failed" not in result.stderr
