"""A compiled model watched by Cockpit: the whole run's time against the compiled run
without Cockpit, as a ratio in the same process.

Four runs of the same training loop (SGD with momentum, |B| = 128, synthetic data of the
problem's shape), each on its own copy of the network, timed in blocks of ``--block`` steps,
the four blocks interleaved round by round (load on the shared machine hits all alike):

- ``compiled``: ``torch.compile(model)`` without Cockpit (the baseline);
- ``compiled + Cockpit``: ``Cockpit(torch.compile(model), economy every k-th step)``: the
  compiled graph at untracked steps, the eager module at tracked ones (Alpha also tracks the
  step after each of its steps, so 2 of every k steps are tracked);
- ``eager``: the uncompiled model without Cockpit (what compiling gains);
- ``eager + Cockpit``: Cockpit on the uncompiled model, the only way before compiled models
  were supported.

The compilations happen in warm-up blocks (two blocks, so that the tracked and untracked
steps have run); dynamo's counters are read around the timed blocks to show that nothing is
compiled again while Cockpit switches between the compiled graph and the eager module.

    python benchmarks/compile_overhead.py [--problems cifar10_3c3d fmnist_2c2d] [--every 10]
        [--rounds 5] [--block 20]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from cockpit import Cockpit, configuration
from cockpit.benchmark.problems.paper_models import BUILDERS, synthetic_batches
from cockpit.schedules import every


class Run:
    """One training loop, optionally compiled, optionally watched by Cockpit."""

    def __init__(self, model: torch.nn.Module, batches, compiled: bool, k: int | None):
        self.model = model
        self.called = torch.compile(model) if compiled else model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        self.cockpit = (None if k is None else
                        Cockpit(self.called, configuration("economy", every(k)),
                                optimizer=self.opt))
        self.batches, self.step = batches, 0

    def train(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            x, y = self.batches[self.step % len(self.batches)]
            self.opt.zero_grad()
            losses = F.cross_entropy(self.called(x), y, reduction="none")
            if self.cockpit is None:
                losses.mean().backward()
            else:
                with self.cockpit(self.step, losses=losses):
                    losses.mean().backward()
            self.opt.step()
            self.step += 1
        return time.perf_counter() - start

    def close(self) -> None:
        if self.cockpit is not None:
            self.cockpit.close()


def measure(problem: str, k: int, rounds: int, block: int) -> dict:
    torch.manual_seed(0)
    model = BUILDERS[problem]()
    source = synthetic_batches(problem)
    batches = [next(source) for _ in range(8)]
    runs = {
        "compiled": Run(copy.deepcopy(model), batches, compiled=True, k=None),
        "compiled + Cockpit": Run(copy.deepcopy(model), batches, compiled=True, k=k),
        "eager": Run(copy.deepcopy(model), batches, compiled=False, k=None),
        "eager + Cockpit": Run(copy.deepcopy(model), batches, compiled=False, k=k),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for run in runs.values():  # compilation, and the first tracked steps
            run.train(2 * block)
        graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["ok"]
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                times[name].append(run.train(block))
        recompiled = (counters["stats"]["unique_graphs"] - graphs,
                      counters["frames"]["ok"] - frames)
    for run in runs.values():
        run.close()
    base = times["compiled"]
    ratio = {name: statistics.median(t / b for t, b in zip(ts, base, strict=True))
             for name, ts in times.items()}
    step_ms = {name: 1e3 * statistics.median(ts) / block for name, ts in times.items()}
    return {"problem": problem, "ratio": ratio, "step_ms": step_ms, "recompiled": recompiled}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=["cifar10_3c3d", "fmnist_2c2d"])
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=20)
    args = parser.parse_args(argv)
    if args.block % args.every:
        sys.exit("--block must be a multiple of --every (each block holds whole periods)")
    torch.set_num_threads(2)
    names = ["compiled + Cockpit", "eager", "eager + Cockpit"]
    print(f"economy every {args.every}th step; whole run ÷ compiled run without Cockpit "
          f"(median of {args.rounds} rounds of {args.block} steps); ms per step")
    print("| problem | compiled [ms/step] | " + " | ".join(names)
          + " | graphs / frames compiled while timed |")
    print("|---|---|" + "---|" * len(names) + "---|")
    for problem in args.problems:
        r = measure(problem, args.every, args.rounds, args.block)
        cells = " | ".join(f"**{r['ratio'][n]:.2f}×** ({r['step_ms'][n]:.1f})"
                           if n == "compiled + Cockpit" else
                           f"{r['ratio'][n]:.2f}× ({r['step_ms'][n]:.1f})" for n in names)
        print(f"| {problem} | {r['step_ms']['compiled']:.1f} | {cells} | "
              f"{r['recompiled'][0]} / {r['recompiled'][1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
