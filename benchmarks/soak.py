"""Soak: resident memory over 10,000 tracked steps of a tiny MLP (economy, every step).

A debugger left on for a week must not grow the process: each recorded step used to stay in
memory for ``get_output()`` (+11.7 KiB per step). Now Cockpit keeps the last
``memory_steps`` steps; with a ``logdir`` older steps are read back from the run log.

Prints the resident set size (RSS, from /proc/self/statm) after 1k, 5k and 10k tracked
steps, and the growth per step between 1k and 10k, for three settings run in separate
processes: a ``logdir``, no ``logdir``, and ``memory_steps=None`` (everything in memory:
the old behaviour, for comparison).

    PYTHONPATH=src python benchmarks/soak.py [--steps 10000]
"""

from __future__ import annotations

import argparse
import json
import sys

WORKER = r"""
import json, os, sys, tempfile, time
import torch, torch.nn as nn, torch.nn.functional as F
from cockpit import Cockpit, configuration

torch.set_num_threads(1)
steps, mode = int(sys.argv[1]), sys.argv[2]
page = os.sysconf("SC_PAGE_SIZE")

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page / 2**20

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
tmp = tempfile.mkdtemp()
kwargs = {"logdir": tmp} if mode == "logdir" else {}
if mode == "all_in_memory":
    kwargs["memory_steps"] = None
cockpit = Cockpit(model, configuration("economy"), optimizer=opt, **kwargs)
x, y = torch.randn(16, 10), torch.randint(0, 4, (16,))
marks, start = {}, time.perf_counter()
for step in range(steps):
    opt.zero_grad()
    losses = F.cross_entropy(model(x), y, reduction="none")
    with cockpit(step, losses=losses):
        losses.mean().backward()
    opt.step()
    if step + 1 in (1000, 5000, 10000) or step + 1 == steps:
        marks[step + 1] = rss_mib()
seconds = time.perf_counter() - start
cockpit.close()
out = cockpit.get_output()
print(json.dumps({"rss": marks, "seconds": seconds, "steps_returned": len(out),
                  "first": min(out), "last": max(out)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    args = parser.parse_args()
    sys.path.insert(0, "benchmarks")
    from _common import run_worker

    print(f"{args.steps} tracked steps, MLP 10-32-4, batch 16, economy every step")
    print("| setting | RSS 1k (MiB) | RSS 5k | RSS 10k | growth 1k→10k per step | "
          "get_output() steps | s/step |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("logdir", "no_logdir", "all_in_memory"):
        result = run_worker(WORKER, str(args.steps), mode)
        rss = {int(k): v for k, v in result["rss"].items()}
        first, last = min(rss), max(rss)
        growth = (rss[last] - rss[first]) * 2**20 / max(last - first, 1) / 1024
        cells = " | ".join(f"{rss[k]:.1f}" if k in rss else "–" for k in (1000, 5000, 10000))
        print(f"| {mode} | {cells} | {growth:+.2f} KiB | {result['steps_returned']} "
              f"({result['first']}–{result['last']}) | "
              f"{result['seconds'] / args.steps * 1e3:.2f} ms |")
    print(json.dumps({"steps": args.steps}))


if __name__ == "__main__":
    main()
