"""``benchmarks/triton_kernels.py``: every launch of Cockpit's three Triton kernels that its
workloads make under the interpreter compiles for the H100/H200 (sm_90), the A100 (sm_80)
and the B200 (sm_100) with Triton's own compiler, without spilling registers, the sums over aligned
tensors with vector loads; and the check catches what the interpreter runs but the compiler
refuses."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import torch

from tests.benchmark.bench_helpers import ROOT, run_benchmark

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


def _kernel():
    """A kernel the interpreter runs (its ``for`` is Python's) and Triton cannot compile:
    ``break`` has no lowering."""

    @triton.jit
    def early(x_ptr, out_ptr, N: tl.constexpr):
        offsets = tl.arange(0, N)
        total = tl.zeros((N,), dtype=tl.float32)
        for step in range(4):
            if step == 2:
                break
            total += tl.load(x_ptr + offsets)
        tl.store(out_ptr + offsets, total)

    return early


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "triton_kernels", ROOT / "benchmarks" / "triton_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["triton_kernels"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    yield module
    del sys.modules["triton_kernels"]


def test_every_launch_compiles_for_the_gpus_without_spills():
    out = run_benchmark("triton_kernels.py", "--targets", "90", "80", "100", "--check",
                        "--launch-cost", timeout=600).stdout
    rows = re.findall(r"^(\w+)\s+sm_(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+\s+(.*)$",
                      out, re.M)
    compiled = {(kernel, int(target), constants) for kernel, target, *_, constants in rows}
    assert "failed: 0, spilling: 0" in out, out[-3000:]
    for target in (90, 80, 100):
        sums = {c for k, t, c in compiled if k == "sums" and t == target}
        for dtype in ("fp32", "bf16", "fp16"):  # the three modes, with and without c
            for mode, scale in (("0", "False"), ("1", "False"), ("1", "True"), ("2", "False")):
                assert any(f"DTYPE={dtype}," in c and f"MODE={mode}," in c
                           and f"HAS_SCALE={scale}," in c for c in sums), (dtype, mode)
        counts = {c for k, t, c in compiled if k == "count" and t == target}
        for widen in ("True", "False"):
            for uniform in ("True", "False"):
                assert any(f"UNIFORM={uniform}, WIDEN={widen}" in c for c in counts)
        dots = {c for k, t, c in compiled if k == "dots" and t == target}
        assert {int(re.search(r"\bK=(\d+)", c).group(1)) for c in dots} >= {1, 2, 3, 8}
    registers = [int(r) for _, _, r, *_ in rows]
    assert all(0 < r <= 255 for r in registers)
    # the sums over whole chunks of aligned tensors load 16 bytes a lane at once
    aligned_sums = [(int(wide), int(loads)) for kernel, _, _, _, wide, loads, constants in rows
                    if kernel == "sums" and "ALIGNED=True" in constants]
    assert len(aligned_sums) == 36 and all(0 < wide < loads for wide, loads in aligned_sums)
    assert sum(k == "sums" and "ALIGNED=False" in c for k, *_, c in rows) == 27
    costs = dict(re.findall(r"(\w+) ([\d.]+)", out.split("Python of a launch")[1].split(":")[1]))
    assert {"sums", "count", "dots"} <= set(costs) and all(float(v) > 0 for v in costs.values())


def test_the_check_fails_on_a_kernel_the_compiler_refuses(script):
    launch = script.Launch(
        __name__, "early", (script.TensorArg(torch.float32, 0),) * 2,
        (("N", 4),))
    with pytest.raises(Exception, match=r"Break"):
        script.compile_launch(launch, 90)
