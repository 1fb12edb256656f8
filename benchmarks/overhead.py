"""Overhead of Cockpit's instruments as a ratio to an untracked step in the same process.

For each DeepOBS problem (synthetic data, |B| = 128, SGD) and each configuration (one
instrument alone, or a named configuration), a fresh subprocess trains with Cockpit attached
and tracks every second step; the ratio is median(tracked step) / median(untracked step).
Peak memory is the subprocess's peak resident set size, compared with a subprocess that
trains without Cockpit, and with the largest layer's |B|×D_layer individual gradients.

    python benchmarks/overhead.py                      # everything, writes a markdown table
    python benchmarks/overhead.py --problems cifar10_3c3d --configs economy NormTest
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

WORKER = r"""
import json, resource, statistics, sys, time
import torch, torch.nn.functional as F
from cockpit import Cockpit, at, configuration, quantities
from cockpit.problems.deepobs import BUILDERS, synthetic_batches

problem, config, steps, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
torch.manual_seed(0)
model = BUILDERS[problem]()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
batches = synthetic_batches(problem, 128)
warmup = 3
tracked_steps = [s for s in range(warmup, warmup + 2 * steps) if (s - warmup) % 2 == 1]
cockpit = None
if config != "none":
    schedule = at(tracked_steps)
    if config in ("economy", "business", "full"):
        qs = configuration(config, schedule)
    else:
        qs = [getattr(quantities, config)(schedule)]
    cockpit = Cockpit(model, qs, optimizer=opt)
times = {"tracked": [], "untracked": []}
for step in range(warmup + 2 * steps):
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
    elapsed = time.perf_counter() - start
    if step >= warmup:
        times["tracked" if step in tracked_steps else "untracked"].append(elapsed)
if cockpit is not None:
    cockpit.close()
peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
largest = max(p.numel() for p in model.parameters())
print(json.dumps({
    "tracked": statistics.median(times["tracked"]) if cockpit else None,
    "untracked": statistics.median(times["untracked"] + ([] if cockpit else times["tracked"])),
    "peak_mib": peak_mib,
    "largest_layer_mib": 128 * largest * 4 / 2**20,
}))
"""

INSTRUMENTS = ["Loss", "GradNorm", "Distance", "UpdateSize", "NormTest", "InnerTest",
               "OrthoTest", "GradHist1d", "MeanGSNR", "EarlyStopping", "CABS"]


def run(problem: str, config: str, steps: int, threads: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", WORKER, problem, config, str(steps), str(threads)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=["cifar10_3c3d", "fmnist_2c2d"])
    parser.add_argument("--configs", nargs="+", default=[*INSTRUMENTS, "economy"])
    parser.add_argument("--steps", type=int, default=8, help="tracked steps per config")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for problem in args.problems:
        base = run(problem, "none", args.steps, args.threads)
        print(f"\n{problem}: untracked step without Cockpit {base['untracked'] * 1e3:.0f} ms, "
              f"peak {base['peak_mib']:.0f} MiB, largest layer |B|×D "
              f"{base['largest_layer_mib']:.0f} MiB", flush=True)
        print(f"{'config':>14} {'tracked/untracked':>18} {'untracked ms':>13} "
              f"{'peak − baseline MiB':>20}", flush=True)
        for config in args.configs:
            start = time.perf_counter()
            r = run(problem, config, args.steps, args.threads)
            ratio = r["tracked"] / r["untracked"]
            extra = r["peak_mib"] - base["peak_mib"]
            rows.append((problem, config, ratio, r["untracked"] * 1e3, extra,
                         base["largest_layer_mib"]))
            print(f"{config:>14} {ratio:>18.2f} {r['untracked'] * 1e3:>13.0f} {extra:>20.0f}"
                  f"   ({time.perf_counter() - start:.0f} s)", flush=True)
    print("\n| problem | configuration | tracked / untracked | untracked step [ms] "
          "| peak memory − baseline [MiB] | largest layer |B|×D [MiB] |")
    print("|---|---|---|---|---|---|")
    for problem, config, ratio, untracked, extra, largest in rows:
        print(f"| {problem} | {config} | {ratio:.2f}× | {untracked:.0f} | {extra:.0f} "
              f"| {largest:.0f} |")


if __name__ == "__main__":
    main()
