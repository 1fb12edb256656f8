"""Cost of the DeadUnits instrument, as a ratio in the same process.

DeadUnits reads each Linear/convolution weight's mini-batch gradient once (a max over each
row). One tracked step of economy + DeadUnits is run to capture the instrument's input; then
DeadUnits' compute and an untracked training step (and a tracked economy step) are timed,
interleaved, and the minimum of each is kept (the machine is shared: minima filter out
preemption). Problems: the DeepOBS 3C3D network (synthetic data, |B| = 128) and the digits
CNN (|B| = 64).

    python benchmarks/dead_units_overhead.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from cockpit import Cockpit, configuration, quantities
from cockpit.benchmark.problems.digits import digits_cnn, load_digits_tensors, minibatches
from cockpit.benchmark.problems.paper_models import cifar10_3c3d, synthetic_batches


def _clock(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, model, batches, repeats: int) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    dead = quantities.DeadUnits()
    captured = []
    compute = dead.compute

    def keep(data):
        captured.append(data)
        return compute(data)

    dead.compute = keep
    cockpit = Cockpit(model, [*configuration("economy"), dead], optimizer=opt)
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
    data = captured[-1]
    t_dead, t_plain, t_tracked = [], [], []
    for _ in range(repeats):
        t_dead.append(min(_clock(lambda: compute(data)) for _ in range(5)))
        t_plain.append(_clock(untracked))
        t_tracked.append(_clock(tracked))
    cockpit.close()
    dead_s, plain_s, tracked_s = min(t_dead), min(t_plain), min(t_tracked)
    return {"problem": name, "dead_units_ms": 1e3 * dead_s, "untracked_ms": 1e3 * plain_s,
            "tracked_ms": 1e3 * tracked_s, "of_untracked": dead_s / plain_s,
            "of_economy_step": dead_s / tracked_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    x, y, _, _ = load_digits_tensors(0)
    rows = [
        measure("digits CNN, |B| = 64", digits_cnn(), minibatches(x, y, 64), args.repeats),
        measure("cifar10_3c3d, |B| = 128", cifar10_3c3d(), synthetic_batches("cifar10_3c3d"),
                args.repeats),
    ]
    print("| problem | DeadUnits compute (min) | untracked step (min) | economy + DeadUnits "
          "tracked step (min) | DeadUnits ÷ untracked | DeadUnits ÷ tracked |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['problem']} | {r['dead_units_ms']:.3f} ms | {r['untracked_ms']:.1f} ms | "
              f"{r['tracked_ms']:.1f} ms | {r['of_untracked']:.2%} | "
              f"{r['of_economy_step']:.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
