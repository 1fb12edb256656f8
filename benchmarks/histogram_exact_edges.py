"""Histogram kernels exact at every bin edge against the kernels before the change, in one
process, runs interleaved (old, new, old, new, …) so that load on a shared machine hits
both alike.

Run: ``PYTHONPATH=src python benchmarks/histogram_exact_edges.py [--before COMMIT]``.
The previous kernels are read from git at COMMIT; each side gets its own ``BinSpec``.
"""

from __future__ import annotations

import argparse

import torch

from _common import interleaved, load_old
from cockpit.engine.histograms import exact as new_hist
from cockpit.engine.histograms import outer2d as new_2d


def report(name: str, n: int, old_new: tuple[float, float]) -> None:
    old, new = old_new
    print(f"| {name} | {old * 1e3:.1f} | {new * 1e3:.1f} | {old / n * 1e9:.2f} | "
          f"{new / n * 1e9:.2f} | {new / old:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", default="b8e2f71")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    old_hist, old_2d = load_old(args.before)
    mods = {"old": (old_hist, old_2d), "new": (new_hist, new_2d)}

    def specs(side: str, *triples):
        return [mods[side][0].BinSpec(*t) for t in triples]

    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, median of "
          f"{args.repeats} interleaved runs\n")
    print("| kernel (data) | old ms | new ms | old ns/elt | new ns/elt | new/old |")
    print("|---|---|---|---|---|---|")

    x = 0.01 * torch.randn(16, 895_210, generator=gen)
    x[torch.rand(x.shape, generator=gen) < 0.3] = 0.0
    theta = torch.randn(895_210, generator=gen)
    one = {side: specs(side, (-2.0, 2.0, 100))[0] for side in mods}
    two = {side: specs(side, (-1.0, 1.0, 40), (-2.0, 2.0, 50)) for side in mods}

    def call(side, name, *data, two_d=False):
        module = mods[side][1] if name == "histogram2d_outer" else mods[side][0]
        fn = getattr(module, name)
        return lambda: fn(*data, *(two[side] if two_d else [one[side]]))

    report("`histogram_dense`, 16×895,210 (3C3D), 0.01·randn, 30 % zeros", x.numel(),
           interleaved(call("old", "histogram_dense", x), call("new", "histogram_dense", x),
                       args.repeats))
    report("`histogram2d_dense`, same g, θ ~ randn", x.numel(), interleaved(
        call("old", "histogram2d_dense", x, theta, two_d=True),
        call("new", "histogram2d_dense", x, theta, two_d=True), args.repeats))
    wide = torch.randn(16, 895_210, generator=gen)
    report("`histogram_dense`, 16×895,210, randn (spread over all bins)", wide.numel(),
           interleaved(call("old", "histogram_dense", wide), call("new", "histogram_dense", wide),
                       args.repeats))

    for scale in (1e-2, 1e-1, 1.0):
        delta = scale * torch.randn(128, 512, generator=gen)
        a = torch.randn(128, 1152, generator=gen).relu()
        n = delta.numel() * a.shape[1]
        report(f"`histogram_outer`, 3C3D fc1, δ = {scale:g}·randn", n, interleaved(
            call("old", "histogram_outer", delta, a), call("new", "histogram_outer", delta, a),
            args.repeats))
        if scale == 1.0:
            continue
        w = 0.05 * torch.randn(512, 1152, generator=gen)
        report(f"`histogram2d_outer`, 3C3D fc1, δ = {scale:g}·randn", n, interleaved(
            call("old", "histogram2d_outer", delta, a, w, two_d=True),
            call("new", "histogram2d_outer", delta, a, w, two_d=True), args.repeats))


if __name__ == "__main__":
    main()
