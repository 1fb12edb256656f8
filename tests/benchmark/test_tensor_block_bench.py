"""``benchmarks/tensor_block.py``: the norms of a model's parameters by multi-tensor ops and
by one block, timed and their peak memory (here a quick run of small shapes on the CPU)."""

from __future__ import annotations

from tests.benchmark.bench_helpers import run_benchmark


def test_tensor_block_benchmark_times_both_forms():
    out = run_benchmark("tensor_block.py", "--models", "resnet18_gn", "3c3d", "--scale", "8",
                        "--repeats", "1").stdout
    times, peaks = out.split("\npeak memory")
    rows = {line.split()[0]: line for line in times.splitlines()[1:]}
    assert rows["resnet18_gn"].split()[1] == "62" and "(no block)" not in rows["resnet18_gn"]
    assert rows["3c3d"].split()[1] == "12" and rows["3c3d"].count("(no block)") == 2
    assert rows["resnet18_gn"].count(" / ") == 4
    # peak memory above the inputs, × their bytes: a block is one copy of the tensors and
    # its column sums, a difference of blocks two copies (no float64 copy of either)
    resnet = next(line for line in peaks.splitlines() if line.startswith("resnet18_gn"))
    _, block, _, block_difference = (float(r.rstrip("×")) for r in resnet.split()[2:])
    assert 1.0 <= block < 1.5 and 2.0 <= block_difference < 2.5
