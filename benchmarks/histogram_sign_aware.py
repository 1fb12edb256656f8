"""Sign-aware bins (⌊x·scale⌋ + m) against the previous kernels (⌊(x − lo)·scale⌋), in one
process, runs interleaved (old, new, old, new, …) so that load on a shared machine hits
both alike.

Run: ``PYTHONPATH=src python benchmarks/histogram_sign_aware.py [--before COMMIT]``.
The previous kernels are read from git at COMMIT (default: the commit before the change).
"""

from __future__ import annotations

import argparse

import torch

from _common import interleaved, load_old
from cockpit.engine.histograms import exact as new_hist
from cockpit.engine.histograms import outer2d as new_2d

SPEC = new_hist.BinSpec(-2.0, 2.0, 100)
SPEC_G, SPEC_THETA = new_hist.BinSpec(-1.0, 1.0, 40), new_hist.BinSpec(-2.0, 2.0, 50)


def report(name: str, n: int, old_new: tuple[float, float]) -> None:
    old, new = old_new
    print(f"{name:52s} {old * 1e3:8.1f} {new * 1e3:8.1f} ms  {old / n * 1e9:5.2f} "
          f"{new / n * 1e9:5.2f} ns/elt  new/old {new / old:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", default="7403e4f")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    old_hist, old_2d = load_old(args.before)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, median of "
          f"{args.repeats} interleaved runs; columns: old, new")

    x = 0.01 * torch.randn(16, 895_210, generator=gen)
    x[torch.rand(x.shape, generator=gen) < 0.3] = 0.0
    theta = torch.randn(895_210, generator=gen)
    assert torch.equal(old_hist.histogram_dense(x, SPEC)[0].sum(), new_hist.histogram_dense(
        x, SPEC)[0].sum())
    report("histogram_dense 16x895210 (3C3D), 0.01*randn", x.numel(), interleaved(
        lambda: old_hist.histogram_dense(x, SPEC), lambda: new_hist.histogram_dense(x, SPEC),
        args.repeats))
    report("histogram2d_dense, same g, theta ~ randn", x.numel(), interleaved(
        lambda: old_hist.histogram2d_dense(x, theta, SPEC_G, SPEC_THETA),
        lambda: new_hist.histogram2d_dense(x, theta, SPEC_G, SPEC_THETA), args.repeats))

    for scale in (1e-2, 1e-1):
        delta = scale * torch.randn(128, 512, generator=gen)
        a = torch.randn(128, 1152, generator=gen).relu()
        n = delta.numel() * a.shape[1]
        report(f"histogram_outer 3C3D fc1, delta={scale:g}*randn", n, interleaved(
            lambda: old_hist.histogram_outer(delta, a, SPEC),  # noqa: B023
            lambda: new_hist.histogram_outer(delta, a, SPEC), args.repeats))  # noqa: B023
        w = 0.05 * torch.randn(512, 1152, generator=gen)
        report(f"histogram2d_outer 3C3D fc1, delta={scale:g}*randn", n, interleaved(
            lambda: old_2d.histogram2d_outer(delta, a, w, SPEC_G, SPEC_THETA),  # noqa: B023
            lambda: new_2d.histogram2d_outer(delta, a, w, SPEC_G, SPEC_THETA),  # noqa: B023
            args.repeats))


if __name__ == "__main__":
    main()
