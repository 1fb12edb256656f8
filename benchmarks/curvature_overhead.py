"""Overhead of the curvature instruments and the business/full configurations.

Each configuration runs in a fresh subprocess on a DeepOBS problem (synthetic data,
|B| = 128, SGD). Two kinds of numbers, both relative to untracked steps of the same process:

* ``alone``: one instrument tracked at every second step; median(tracked) / median(untracked);
* ``every k``: a configuration tracked every k steps over a run of S = max(64, 4k) steps (so
  at least four tracked steps); the mean step time of the whole run (tracked and untracked
  steps) / the mean untracked step of the same process — how much longer the run takes —
  or, for k = 1 (no untracked step), / the median step of the run without Cockpit. (Means on
  both sides: step times are right-skewed on a shared machine, and a median denominator
  would count the untracked steps' own noise spikes as Cockpit's overhead.)

Peak memory is the subprocess's peak resident set size minus that of a run without Cockpit.

    python benchmarks/curvature_overhead.py                  # 3C3D, everything
    python benchmarks/curvature_overhead.py --only alone
    python benchmarks/curvature_overhead.py --only every --repeats 3
"""

from __future__ import annotations

import argparse

from _common import run_worker

WORKER = r"""
import json, resource, statistics, sys, time
import torch, torch.nn.functional as F
from cockpit import Cockpit, at, configuration, every, quantities
from cockpit.benchmark.problems.paper_models import BUILDERS, synthetic_batches

problem, config, mode = sys.argv[1:4]
k, steps = int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(2)
torch.manual_seed(0)
model = BUILDERS[problem]()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
batches = synthetic_batches(problem, 128)
warmup = 2
if mode == "alone":
    tracked_steps = {warmup + 1 + 2 * i for i in range(steps)}
    total = warmup + 2 * steps
    schedule = at(tracked_steps)
else:
    total = warmup + steps
    schedule = lambda s: s >= warmup and (s - warmup) % k == 0  # noqa: E731
    tracked_steps = {s for s in range(total) if schedule(s)}
cockpit = None
if config != "none":
    if config in ("economy", "business", "full"):
        qs = configuration(config, schedule)
    else:
        qs = [getattr(quantities, config)(schedule)]
    cockpit = Cockpit(model, qs, optimizer=opt)
times = []
for step in range(total):
    x, y = next(batches)
    start = time.perf_counter()
    opt.zero_grad()
    losses = F.cross_entropy(model(x), y, reduction="none")
    if cockpit is None:
        losses.mean().backward()
    else:
        with cockpit(step, losses=losses):
            losses.mean().backward()
    opt.step()
    if step >= warmup:
        times.append((step, time.perf_counter() - start))
hvps = None
if cockpit is not None:
    cockpit.close()
    counts = [r["num_hvp"] for q in cockpit.quantities if q.name == "HessMaxEV"
              for r in q.solver.values()]
    hvps = statistics.mean(counts) if counts else None
untracked = [t for s, t in times if s not in tracked_steps] or [t for _, t in times]
tracked = [t for s, t in times if s in tracked_steps]
print(json.dumps({
    "untracked": statistics.median(untracked),
    "untracked_mean": statistics.mean(untracked),
    "tracked": statistics.median(tracked) if tracked else None,
    "mean_all": statistics.mean(t for _, t in times),
    "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "hvps": hvps,
}))
"""

ALONE = ["GradHist1d", "GradHist2d", "HessTrace", "TICDiag", "TICTrace", "HessMaxEV"]
EVERY = [("business", 1), ("business", 16), ("business", 64), ("full", 1), ("full", 16),
         ("full", 64)]


def run(problem: str, config: str, mode: str, k: int, steps: int) -> dict:
    return run_worker(WORKER, problem, config, mode, str(k), str(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="cifar10_3c3d")
    parser.add_argument("--only", choices=["alone", "every"], default=None)
    parser.add_argument("--steps", type=int, default=3, help="tracked steps (alone)")
    parser.add_argument("--run-steps", type=int, default=64, help="run length (every k)")
    parser.add_argument("--every", nargs="+", default=None, metavar="CONFIG:K",
                        help="every-k runs to do, e.g. full:64 business:16 (default: all)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh subprocesses per every-k configuration; the median ratio "
                        "is reported with the range (the machine's noise is ±0.1–0.3×)")
    args = parser.parse_args()
    base = run(args.problem, "none", "alone", 1, 3)
    print(f"{args.problem}: untracked step {base['untracked'] * 1e3:.0f} ms, "
          f"peak {base['peak_mib']:.0f} MiB", flush=True)
    rows = []
    if args.only in (None, "alone"):
        for name in ALONE:
            r = run(args.problem, name, "alone", 1, args.steps)
            rows.append((name, "alone", r["tracked"] / r["untracked"], r["untracked"],
                         r["peak_mib"] - base["peak_mib"], r["hvps"]))
            print(rows[-1], flush=True)
    if args.only in (None, "every"):
        chosen = EVERY if args.every is None else [
            (c, int(k)) for c, k in (item.split(":") for item in args.every)]
        for config, k in chosen:
            # at least four tracked steps, so one-time work of the first (choosing kernels,
            # Lanczos without warm start) is amortized as it would be in a long run
            steps = max(args.run_steps, 4 * k)
            results = []
            for _ in range(max(1, args.repeats)):
                r = run(args.problem, config, "every", k, steps)
                untracked = base["untracked"] if k == 1 else r["untracked_mean"]
                results.append((r["mean_all"] / untracked, untracked, r))
            results.sort(key=lambda item: item[0])
            ratio, untracked, r = results[len(results) // 2]
            spread = (f" (runs {results[0][0]:.2f}–{results[-1][0]:.2f})"
                      if len(results) > 1 else "")
            rows.append((config, f"every {k}{spread}", ratio, untracked,
                         r["peak_mib"] - base["peak_mib"], r["hvps"]))
            print(rows[-1], flush=True)
    print("\n| configuration | tracked | time / untracked step | untracked step [ms] "
          "| peak memory − baseline [MiB] | HVPs per HessMaxEV |")
    print("|---|---|---|---|---|---|")
    for name, mode, ratio, untracked, extra, hvps in rows:
        hv = f"{hvps:.1f}" if hvps else "–"
        print(f"| {name} | {mode} | {ratio:.2f}× | {untracked * 1e3:.0f} | {extra:.0f} | {hv} |")


if __name__ == "__main__":
    main()
