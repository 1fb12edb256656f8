"""Time the exact histogram kernels against torch.histc and materialize-then-histogram.

Run: ``PYTHONPATH=src python benchmarks/histogram_kernels.py [--threads 2] [--repeats 5]``.
Prints median wall-clock times, ns per histogrammed element and speed-ups.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from cockpit.engine.histogram import BinSpec, histogram_dense, histogram_outer

SPEC = BinSpec(-2.0, 2.0, 100)  # Cockpit's GradHist1d default


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (threshold cache, allocator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def histc_clamped(x: torch.Tensor) -> torch.Tensor:
    """torch.histc with outliers clamped into the edge bins (histc drops them)."""
    return torch.histc(x.clamp(SPEC.lo, SPEC.hi), SPEC.bins, SPEC.lo, SPEC.hi)


def row(name: str, n: int, seconds: float, baseline: float) -> None:
    print(f"{name:44s} {seconds * 1e3:9.1f} ms {seconds / n * 1e9:7.2f} ns/elt "
          f"{baseline / seconds:6.1f}x")


def bench_dense(repeats: int, gen: torch.Generator) -> None:
    shape = (128, 895_210)  # |B| x D of DeepOBS 3C3D
    x = 0.01 * torch.randn(shape, generator=gen)
    x[torch.rand(shape, generator=gen) < 0.3] = 0.0
    n = x.numel()
    moved = (histogram_dense(x, SPEC).counts.float() - histc_clamped(x)).abs().sum() / 2
    print(f"\n1d dense, {shape[0]}x{shape[1]} float32 (0.01*randn, 30% zeros), {SPEC}")
    print(f"(torch.histc miscounts {int(moved)}: float32 counts stall at 2**24 per bin)")
    t_histc = median_seconds(lambda: torch.histc(x, SPEC.bins, SPEC.lo, SPEC.hi), repeats)
    t_dense = median_seconds(lambda: histogram_dense(x, SPEC), repeats)
    row("torch.histc (no clamping, baseline)", n, t_histc, t_histc)
    row("histogram_dense (exact, clamped, NaN-aware)", n, t_dense, t_histc)


def bench_outer(name: str, N: int, I: int, J: int, repeats: int, gen) -> None:
    delta = 1e-2 * torch.randn(N, I, generator=gen)
    a = torch.randn(N, J, generator=gen).relu()
    n = N * I * J

    def materialized_dense():
        return histogram_dense(delta[:, :, None] * a[:, None, :], SPEC)

    def materialized_histc():
        return torch.histc(delta[:, :, None] * a[:, None, :], SPEC.bins, SPEC.lo, SPEC.hi)

    assert torch.equal(histogram_outer(delta, a, SPEC).counts, materialized_dense().counts)
    print(f"\nouter, {name}: N={N}, I={I}, J={J} ({n / 1e6:.0f}M products), "
          "delta=1e-2*randn, a=relu(randn)")
    t_histc = median_seconds(materialized_histc, repeats)
    t_dense = median_seconds(materialized_dense, repeats)
    t_outer = median_seconds(lambda: histogram_outer(delta, a, SPEC), repeats)
    row("materialize + torch.histc (baseline)", n, t_histc, t_histc)
    row("materialize + histogram_dense", n, t_dense, t_histc)
    row("histogram_outer (no materialization)", n, t_outer, t_histc)
    print(f"{'histogram_outer vs materialize + dense':44s} {t_dense / t_outer:6.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, "
          f"median of {args.repeats} runs")
    gen = torch.Generator().manual_seed(0)
    bench_dense(args.repeats, gen)
    bench_outer("3C3D fc1", 128, 512, 1152, args.repeats, gen)
    bench_outer("2C2D fc1", 128, 1024, 3136, args.repeats, gen)


if __name__ == "__main__":
    main()
