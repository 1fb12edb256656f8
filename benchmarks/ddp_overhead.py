"""Overhead of Cockpit in a DistributedDataParallel run, as a ratio to an untracked DDP step.

Two processes (gloo on 127.0.0.1, one thread each) train a DeepOBS problem on synthetic data
with a per-process batch of ``--batch`` samples, with a configuration tracked in blocks of
consecutive steps (as benchmarks/overhead.py does: T t t t S u u u, T and S not measured).
Every tracked step reduces the per-rank statistics over both processes (two all-reduces,
plus Alpha's after-step slopes). The same schedule in a single process (one thread, the
same per-process batch, no process group) gives the single-process ratio; the goal is the
DDP ratio within 10 % of it.

    python benchmarks/ddp_overhead.py                         # cifar10_3c3d, economy
    python benchmarks/ddp_overhead.py --problem fmnist_2c2d --config NormTest --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

WORKER = r"""
import json, os, statistics, sys, time
import torch, torch.nn.functional as F
import torch.distributed as dist
from cockpit import Cockpit, configuration, quantities
from cockpit.benchmark.problems.paper_models import BUILDERS, synthetic_batches

problem, config, steps, batch, rank, world, port, out = sys.argv[1:9]
steps, batch, rank, world = int(steps), int(batch), int(rank), int(world)
torch.set_num_threads(1)
if world > 1:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    dist.init_process_group("gloo", rank=rank, world_size=world)
torch.manual_seed(0)
model = BUILDERS[problem]()
if world > 1:
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
batches = synthetic_batches(problem, batch, seed=rank)
CYCLE = "TtttSuuu"
kinds = ["w"] * 4 + [c for _ in range((steps + 2) // 3) for c in CYCLE]
tracked = [s for s, c in enumerate(kinds) if c in "Tt"]
instruments = (configuration(config, schedule=lambda s: s in tracked_set)
               if config in ("economy", "business", "full")
               else [getattr(quantities, config)(lambda s: s in tracked_set)])
tracked_set = set(tracked)
cockpit = Cockpit(model, instruments, optimizer=opt)
times = {"t": [], "u": []}
for step, kind in enumerate(kinds):
    x, y = next(batches)
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    opt.zero_grad()
    losses = F.cross_entropy(model(x), y, reduction="none")
    with cockpit(step, losses=losses):
        losses.mean().backward()
    opt.step()
    elapsed = time.perf_counter() - start
    if kind in times:
        times[kind].append(elapsed)
cockpit.close()
result = {k: statistics.median(v) for k, v in times.items()}
result["min_t"], result["min_u"] = min(times["t"]), min(times["u"])
with open(out, "w") as file:
    json.dump(result, file)
if world > 1:
    dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(problem: str, config: str, steps: int, batch: int, world: int) -> list[dict]:
    port = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"{r}.json") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, problem, config, str(steps),
                                   str(batch), str(r), str(world), port, outs[r]],
                                  stderr=subprocess.PIPE, text=True) for r in range(world)]
        for proc in procs:
            _, err = proc.communicate()
            if proc.returncode != 0:
                sys.exit(f"worker failed:\n{err}")
        results = []
        for out in outs:
            with open(out) as file:
                results.append(json.load(file))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="cifar10_3c3d")
    parser.add_argument("--config", default="economy")
    parser.add_argument("--steps", type=int, default=24, help="tracked steps measured")
    parser.add_argument("--batch", type=int, default=64, help="samples per process")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeats):
        single = run(args.problem, args.config, args.steps, args.batch, 1)[0]
        ddp = run(args.problem, args.config, args.steps, args.batch, 2)
        ddp_t = max(r["t"] for r in ddp)
        ddp_u = max(r["u"] for r in ddp)
        rows.append((single["t"] / single["u"], ddp_t / ddp_u, single, ddp))
        print(f"single process: tracked {single['t']*1e3:.0f} ms / untracked "
              f"{single['u']*1e3:.0f} ms = {rows[-1][0]:.2f}x   "
              f"DDP (2 processes): {ddp_t*1e3:.0f} ms / {ddp_u*1e3:.0f} ms = {rows[-1][1]:.2f}x")
    single_ratio = statistics.median(r[0] for r in rows)
    ddp_ratio = statistics.median(r[1] for r in rows)
    print(f"\n{args.problem} {args.config}, {args.batch} samples per process, 1 thread each: "
          f"single {single_ratio:.2f}x, DDP {ddp_ratio:.2f}x "
          f"(DDP / single = {ddp_ratio / single_ratio:.3f}; goal ≤ 1.10)")


if __name__ == "__main__":
    main()
