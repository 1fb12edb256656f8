"""Time the exact histogram kernels against torch.histc and materialize-then-histogram.

Run: ``PYTHONPATH=src python benchmarks/histogram_kernels.py [--repeats 5] [--quick]``.
Prints median (and best) wall-clock times, ns per histogrammed element and speed-ups.
"""

from __future__ import annotations

import argparse

import torch

from _common import timed
from cockpit.engine.histograms import exact as hmod
from cockpit.engine.histograms.exact import (
    BinSpec,
    histogram2d_dense,
    histogram_dense,
    histogram_outer,
)
from cockpit.engine.histograms.outer2d import histogram2d_outer

SPEC = BinSpec(-2.0, 2.0, 100)  # Cockpit's GradHist1d default
SPEC_G, SPEC_THETA = BinSpec(-1.0, 1.0, 40), BinSpec(-2.0, 2.0, 50)  # GradHist2d defaults


def header(title: str) -> None:
    print(f"\n{title}\n{'method':46s} {'median ms':>10s} {'best ms':>9s} {'ns/elt':>7s} "
          f"{'speed-up':>8s}")


def row(name: str, n: int, t: tuple[float, float], baseline: tuple[float, float]) -> None:
    print(f"{name:46s} {t[0] * 1e3:10.1f} {t[1] * 1e3:9.1f} {t[0] / n * 1e9:7.2f} "
          f"{baseline[0] / t[0]:7.1f}x")


def reference_dense(x: torch.Tensor, spec: BinSpec) -> torch.Tensor:
    """The plain definition (isfinite mask, bin_index, bincount): the pre-optimization code."""
    return hmod._reference_dense(x, spec)[0]


def bench_dense(repeats: int, gen: torch.Generator, quick: bool) -> None:
    shape = (16 if quick else 128, 895_210)  # |B| x D of DeepOBS 3C3D
    x = 0.01 * torch.randn(shape, generator=gen)
    x[torch.rand(shape, generator=gen) < 0.3] = 0.0
    n = x.numel()
    counts = histogram_dense(x, SPEC)[0]
    assert torch.equal(counts, reference_dense(x, SPEC))
    edges = SPEC.edges(torch.float32)[1:-1]
    header(f"1d dense, {shape[0]}x{shape[1]} float32 (0.01*randn, 30% zeros), {SPEC}")
    t_histc = timed(lambda: torch.histc(x, SPEC.bins, SPEC.lo, SPEC.hi), repeats)
    row("torch.histc (inexact edges, drops outliers)", n, t_histc, t_histc)
    row("torch.bucketize + bincount", n, timed(
        lambda: torch.bincount(torch.bucketize(x.view(-1), edges, right=True)), repeats), t_histc)
    row("reference: isfinite + bin_index + bincount", n,
        timed(lambda: reference_dense(x, SPEC), repeats), t_histc)
    t_dense = timed(lambda: histogram_dense(x, SPEC), repeats)
    row("histogram_dense (exact)", n, t_dense, t_histc)

    theta = torch.randn(shape[1], generator=gen)
    header(f"2d dense on the same data, theta ~ randn, {SPEC_G} x {SPEC_THETA}")
    t_1d = timed(lambda: histogram_dense(x, SPEC_G), repeats)
    row("histogram_dense (1d, same g)", n, t_1d, t_1d)
    t_2d = timed(lambda: histogram2d_dense(x, theta, SPEC_G, SPEC_THETA), repeats)
    row("histogram2d_dense", n, t_2d, t_1d)
    print(f"{'2d / 1d cost ratio':46s} {t_2d[0] / t_1d[0]:10.2f}")


def bench_outer(name: str, N: int, I: int, J: int, repeats: int, gen, quick: bool) -> None:
    for scale in (1e-2, 1e-1, 1.0):
        delta = scale * torch.randn(N, I, generator=gen)
        a = torch.randn(N, J, generator=gen).relu()
        header(f"outer, {name}: N={N}, I={I}, J={J} ({N * I * J / 1e6:.0f}M products), "
               f"delta={scale:g}*randn, a=relu(randn)")
        bench_outer_case(delta, a, repeats, quick)


def bench_outer_case(delta: torch.Tensor, a: torch.Tensor, repeats: int, quick: bool) -> None:
    n = delta.numel() * a.shape[1]
    result = histogram_outer(delta, a, SPEC)[0]
    t_mat = timed(lambda: hmod._outer_materialized(delta, a, SPEC), repeats)
    if n <= 2**27 and not quick:
        full = delta[:, :, None] * a[:, None, :]
        assert torch.equal(result, reference_dense(full, SPEC))
        del full
        t_histc = timed(lambda: torch.histc(
            delta[:, :, None] * a[:, None, :], SPEC.bins, SPEC.lo, SPEC.hi), repeats)
        row("materialize all + torch.histc", n, t_histc, t_mat)
    else:
        assert torch.equal(result, hmod._outer_materialized(delta, a, SPEC)[0])
    row("materialize blockwise + dense kernel", n, t_mat, t_mat)
    t_outer = timed(lambda: histogram_outer(delta, a, SPEC), repeats)
    row("histogram_outer (sorted a, exact searches)", n, t_outer, t_mat)


def materialize_2d(delta: torch.Tensor, a: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """The previous GradHist2d path for Linear layers: form δ_n a_nᵀ for sample chunks of
    2^25 elements, then histogram2d_dense."""
    step = max(1, 2**25 // theta.numel())
    return sum(histogram2d_dense((d[:, :, None] * x[:, None, :]).flatten(1), theta.reshape(-1),
                                 SPEC_G, SPEC_THETA)[0]
               for d, x in zip(delta.split(step), a.split(step), strict=True))


def bench_outer_2d(name: str, N: int, I: int, J: int, repeats: int, gen, quick: bool) -> None:
    """GradHist2d on a Linear weight: histogram2d_outer against forming the products, and
    against the 1-D kernel that GradHist1d runs on the same layer (the goal: 2d ≤ 1.3x 1d)."""
    theta = 0.05 * torch.randn(I, J, generator=gen)
    for scale in (1e-2, 1e-1):
        delta = scale * torch.randn(N, I, generator=gen)
        a = torch.randn(N, J, generator=gen).relu()
        header(f"2d outer, {name}: N={N}, I={I}, J={J} ({N * I * J / 1e6:.0f}M products), "
               f"delta={scale:g}*randn, a=relu(randn), theta=0.05*randn, {SPEC_G} x {SPEC_THETA}")
        bench_outer_2d_case(delta, a, theta, repeats, quick)


def bench_outer_2d_case(delta, a, theta, repeats: int, quick: bool) -> None:
    n = delta.numel() * a.shape[1]
    result = histogram2d_outer(delta, a, theta, SPEC_G, SPEC_THETA)[0]
    assert torch.equal(result, materialize_2d(delta, a, theta))
    t_1d = timed(lambda: histogram_outer(delta, a, SPEC), repeats)
    row("histogram_outer (1d, GradHist1d bins)", n, t_1d, t_1d)
    if not quick:
        row("materialize (sample chunks) + histogram2d_dense", n,
            timed(lambda: materialize_2d(delta, a, theta), repeats), t_1d)
    t_2d = timed(lambda: histogram2d_outer(delta, a, theta, SPEC_G, SPEC_THETA), repeats)
    row("histogram2d_outer (exact)", n, t_2d, t_1d)
    print(f"{'2d / 1d cost ratio':46s} {t_2d[0] / t_1d[0]:10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smaller dense data, no histc")
    parser.add_argument("--only-2d", action="store_true", help="only the 2d outer benchmark")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, "
          f"{args.repeats} timed runs after one warm-up; speed-up = baseline median / median")
    gen = torch.Generator().manual_seed(0)
    if not args.only_2d:
        bench_dense(args.repeats, gen, args.quick)
        bench_outer("3C3D fc1", 128, 512, 1152, args.repeats, gen, args.quick)
        bench_outer("2C2D fc1", 128, 1024, 3136, args.repeats, gen, args.quick)
    bench_outer_2d("3C3D fc1", 128, 512, 1152, args.repeats, gen, args.quick)


if __name__ == "__main__":
    main()
