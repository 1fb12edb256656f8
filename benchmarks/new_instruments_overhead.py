"""Cost of GradientNoiseScale, ParamNorm and UpdateRatio in economy, as ratios in one process.

One tracked economy step captures the three instruments' inputs; then their work (compute,
and UpdateRatio's compute_after_update) is timed against an untracked training step and a
tracked economy step, interleaved, keeping the minimum of each (the machine is shared:
minima filter out preemption). The numbers they share with other economy instruments
(‖g_B‖² per parameter from GradNorm) stay cached as in a real step; ‖θ_t‖² and ‖s_t‖²
(UpdateRatio reads its own, in one host read) are recomputed in every timing. Problems: DeepOBS 3C3D
and 2C2D (synthetic data, |B| = 128).

    python benchmarks/new_instruments_overhead.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from cockpit import Cockpit, configuration
from cockpit.benchmark.problems.paper_models import BUILDERS, synthetic_batches

NEW = ("GradientNoiseScale", "ParamNorm", "UpdateRatio")


def _clock(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(problem: str, repeats: int) -> dict:
    torch.manual_seed(0)
    model = BUILDERS[problem]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    chosen = configuration("economy")
    new = [q for q in chosen if q.name in NEW]
    captured: dict[str, tuple] = {}
    for q in new:
        def keep(data, _q=q, _compute=q.compute):
            captured[_q.name] = (data,)
            return _compute(data)

        def keep_after(data, update, _q=q, _after=q.compute_after_update):
            captured[_q.name + ".after"] = (data, update)
            return _after(data, update)

        q.compute, q.compute_after_update = keep, keep_after
    cockpit = Cockpit(model, chosen, optimizer=opt)
    batches = synthetic_batches(problem, 128)
    x, y = next(batches)
    step = [0]

    def tracked():
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(step[0], losses=losses):
            losses.mean().backward()
        opt.step()
        step[0] += 1

    def untracked():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    tracked()
    tracked()  # UpdateRatio's values of the first step come at the second
    work = []
    for q in new:
        (data,) = captured[q.name]
        work.append((data, type(q).compute.__get__(q)))
        if q.name + ".after" in captured:
            data, update = captured[q.name + ".after"]
            work.append((data, lambda d, u=update, q=q: type(q).compute_after_update(q, d, u)))

    assert len(work) == 4, "expected 3 computes and UpdateRatio's compute_after_update"
    values = {k: v for data, fn in work for k, v in (fn(data) or {}).items()}
    assert all(values[name] is not None for name in NEW), values

    def instruments():
        for data, _ in work:  # ‖θ_t‖ is these instruments' own work: not from the cache
            data._formed.pop("param norms", None)
        for data, fn in work:
            fn(data)

    t_new, t_plain, t_tracked = [], [], []
    for _ in range(repeats):
        t_new.append(min(_clock(instruments) for _ in range(5)))
        t_plain.append(_clock(untracked))
        t_tracked.append(_clock(tracked))
    cockpit.close()
    new_s, plain_s, tracked_s = min(t_new), min(t_plain), min(t_tracked)
    return {"problem": problem, "new_ms": 1e3 * new_s, "untracked_ms": 1e3 * plain_s,
            "tracked_ms": 1e3 * tracked_s, "of_untracked": new_s / plain_s,
            "of_economy_step": new_s / tracked_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--problems", nargs="+", default=["cifar10_3c3d", "fmnist_2c2d"])
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rows = [measure(p, args.repeats) for p in args.problems]
    print("| problem | the three instruments (min) | untracked step (min) | economy tracked "
          "step (min) | ÷ untracked | ÷ tracked |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['problem']} | {r['new_ms']:.3f} ms | {r['untracked_ms']:.1f} ms | "
              f"{r['tracked_ms']:.1f} ms | {r['of_untracked']:.2%} | "
              f"{r['of_economy_step']:.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
