"""The norms of a model's parameter tensors, and of their differences from a second list, by
multi-tensor ops, by one block (``cockpit.engine.tensor_block``) and, on CUDA, by the kernel
that reads each tensor once (``cockpit.engine.tensor_sums``): the host's time to issue each
(what binds a tracked step on a GPU) and the time until the device is done.

    python benchmarks/tensor_block.py --device cuda        # gpu_check.sh part (e)
    python benchmarks/tensor_block.py --models 3c3d --repeats 20

A multi-tensor op is one launch but makes a tensor per parameter (an allocation and a
tensor object for the host); the block takes one copy and a few ops whatever their number.
The parameter shapes are the models' own (GPT-2 124M's 148 tensors, ResNet-18 GroupNorm's
62, 3C3D's 12), filled with random numbers; ``--scale`` divides every first dimension (a
quick run on a CPU). A second table gives each form's peak memory above its inputs, as a
multiple of the tensors' bytes (``torch.cuda.max_memory_allocated`` on CUDA, the CPU
allocator's events from ``torch.profiler`` elsewhere).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from cockpit.engine import tensor_sums
from cockpit.engine.tensor_block import TensorBlock

sys.path.insert(0, str(Path(__file__).parent))
from _common import allocations, peak_of
from op_count import MODELS, gpt2_problem


def shapes_of(model: str) -> list[tuple[int, ...]]:
    """The parameter shapes of ``model`` (GPT-2 124M: 12 blocks, width 768)."""
    if model == "gpt2_124m":
        problem = gpt2_problem(1, vocab=50257, length=1024, n_layer=12, n_embd=768,
                               n_head=12)
    else:
        problem = MODELS[model](1)
    return [tuple(p.shape) for p in problem.model.parameters()]


def foreach_norms(xs: list[Tensor], ys: list[Tensor], c: Tensor) -> Tensor:
    return torch.stack(torch._foreach_norm(xs, dtype=torch.float64))


def block_norms(xs: list[Tensor], ys: list[Tensor], c: Tensor) -> Tensor:
    block = TensorBlock.of(xs)
    assert block is not None
    return block.sq_norms().sqrt_()


def foreach_differences(xs: list[Tensor], ys: list[Tensor], c: Tensor) -> Tensor:
    """‖x_k − c·y_k‖ as the multi-tensor ops formed them before the blocks."""
    differences = torch._foreach_sub(xs, torch._foreach_mul(ys, c))
    return torch.stack(torch._foreach_norm(differences, dtype=torch.float64))


def block_differences(xs: list[Tensor], ys: list[Tensor], c: Tensor) -> Tensor:
    x_block, y_block = TensorBlock.of(xs), TensorBlock.of(ys)
    assert x_block is not None and y_block is not None
    return x_block.subtract(y_block, c).sq_norms().sqrt_()


def kernel_norms(xs: list[Tensor], ys: list[Tensor], c: Tensor) -> Tensor:
    sq = tensor_sums.sq_norms(xs)
    assert sq is not None
    return sq.sqrt_()


def kernel_differences(xs: list[Tensor], ys: list[Tensor], c: Tensor) -> Tensor:
    sq = tensor_sums.sq_norms_of_differences(xs, ys, c)
    assert sq is not None
    return sq.sqrt_()


def timed(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """Medians (ms) of the host's time to issue ``fn`` and of the time until it is done."""
    host, done = [], []
    for _ in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        issued = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        host.append(issued - start)
        done.append(time.perf_counter() - start)
    return 1000 * statistics.median(host[2:]), 1000 * statistics.median(done[2:])


def peak_above(fn, device: torch.device) -> int:
    """Bytes allocated at ``fn``'s peak above what was allocated when it began (its result
    freed after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    return peak_of(allocations(prof))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2_124m", "resnet18_gn", "3c3d"],
                        choices=["gpt2_124m", *MODELS])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--scale", type=int, default=1, help="divides every first dimension")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"{'model':12s} {'tensors':>7s} {'numbers':>11s}  ms: host / done   "
          f"{'multi-tensor norm':>18s} {'block':>15s} {'differences (m-t)':>18s} "
          f"{'(block)':>15s} {'kernel norm':>15s} {'(kernel)':>15s}")
    peaks: list[str] = []
    with torch.no_grad():
        for model in args.models:
            shapes = [(max(1, s[0] // args.scale), *s[1:]) for s in shapes_of(model)]
            xs = [torch.randn(s, device=device) for s in shapes]
            ys = [torch.randn(s, device=device) for s in shapes]
            c = torch.tensor(0.5, device=device)

            taken = TensorBlock.of(xs) is not None
            if taken:  # (the same numbers as the multi-tensor ops)
                torch.testing.assert_close(block_differences(xs, ys, c),
                                           foreach_differences(xs, ys, c), rtol=1e-5, atol=0)
            kernel = tensor_sums.available(xs, ys)
            if kernel:  # (the same numbers as the multi-tensor ops, to float32 rounding)
                torch.testing.assert_close(kernel_differences(xs, ys, c),
                                           foreach_differences(xs, ys, c), rtol=1e-5, atol=0)
            cells = []
            for fn in (foreach_norms, block_norms, foreach_differences, block_differences,
                       kernel_norms, kernel_differences):
                if fn in (block_norms, block_differences) and not taken:
                    cells.append("(no block)")
                    continue
                if fn in (kernel_norms, kernel_differences) and not kernel:
                    cells.append("(no kernel)")
                    continue
                host, done = timed(functools.partial(fn, xs, ys, c), device, args.repeats)
                cells.append(f"{host:7.2f} / {done:6.2f}")
            print(f"{model:12s} {len(xs):7d} {sum(x.numel() for x in xs):11d}  {'':16s} "
                  + " ".join(f"{cell:>18s}" if k % 2 == 0 and k < 4 else f"{cell:>15s}"
                             for k, cell in enumerate(cells)))
            size = sum(x.numel() * x.element_size() for x in xs)
            ratios = []
            for fn in (foreach_norms, block_norms, foreach_differences, block_differences):
                if fn in (block_norms, block_differences) and not taken:
                    ratios.append("(no block)")
                    continue
                peak = peak_above(functools.partial(fn, xs, ys, c), device)
                ratios.append(f"{peak / size:.2f}×")
            peaks.append(f"{model:12s} {size / 2**20:9.1f}  "
                         + " ".join(f"{cell:>18s}" for cell in ratios))
    print(f"\npeak memory above the inputs, × the tensors' bytes\n{'model':12s} {'MiB':>9s}  "
          f"{'multi-tensor norm':>18s} {'block':>18s} {'differences (m-t)':>18s} "
          f"{'(block)':>18s}")
    print("\n".join(peaks))


if __name__ == "__main__":
    main()
