"""Diagonal curvature with batched backpropagations (one vmap'd backward pass for all factor
columns or Hutchinson samples) against the one-by-one loop, on one device.

Inside one tracked step of 3C3D (CIFAR-10, C = 10) or All-CNN-C (CIFAR-100, C = 100), |B| =
128 (``--batch``), each method's diagonal is computed with ``batched=False`` and
``batched=True`` alternately, ``--repeats`` times; printed: the median time of each and
loop / batched. Both give the same numbers (tests/curvature/test_curvature_batched.py).

    python benchmarks/curvature_batched.py                          # CPU, 3C3D
    python benchmarks/curvature_batched.py --device cuda --problems cifar10_3c3d cifar100_allcnnc
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from cockpit import Cockpit, every, quantities
from cockpit.curvature.diagonal import diagonal_replicates

METHODS = ("diag_ggn_exact", "diag_ggn_mc", "hutchinson")


class Timing(quantities.Quantity):
    """Times the curvature primitives inside a tracked step (before the user's backward)."""

    needs_activations = True  # (the diagonal curvature backpropagates from the layers' outputs)

    def __init__(self, methods, repeats: int, sync):
        super().__init__(every(1))
        self.methods, self.repeats, self.sync = methods, repeats, sync
        self.times: dict[tuple[str, bool], list[float]] = {}

    def prepare(self, step, tracker, optimizer, losses):
        for method in self.methods:
            for _ in range(self.repeats):
                for batched in (False, True):
                    generator = torch.Generator().manual_seed(0)
                    self.sync()
                    start = time.perf_counter()
                    diagonal_replicates(method, tracker, losses, tracker.params,
                                        num_samples=8, generator=generator, batched=batched)
                    self.sync()
                    self.times.setdefault((method, batched), []).append(
                        time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--problems", nargs="+", default=["cifar10_3c3d"],
                        choices=["cifar10_3c3d", "cifar100_allcnnc"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    print(f"device {device}, |B| = {args.batch}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    print("| problem | method | loop | batched | loop / batched |")
    print("|---|---|---|---|---|")
    for problem in args.problems:
        if problem == "cifar10_3c3d":
            from cockpit.benchmark.problems.paper_models import cifar10_3c3d as make
            classes = 10
        else:
            from cockpit.benchmark.problems.large_nets import all_cnn_c as make
            classes = 100
        torch.manual_seed(0)
        model = make().to(device)
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch, 3, 32, 32, generator=generator).to(device)
        y = torch.randint(0, classes, (args.batch,), generator=generator).to(device)
        timing = Timing(args.methods, 1, sync)
        cockpit = Cockpit(model, [timing])
        for step in range(1 + args.repeats):  # the first step warms up (kernel choices)
            if step == 1:
                timing.times = {}
            model.zero_grad(set_to_none=True)
            losses = F.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
        cockpit.close()
        for method in args.methods:
            loop = statistics.median(timing.times[(method, False)])
            batched = statistics.median(timing.times[(method, True)])
            print(f"| {problem} | {method} | {1e3 * loop:.1f} ms | {1e3 * batched:.1f} ms | "
                  f"{loop / batched:.2f} |", flush=True)
            print(json.dumps({"problem": problem, "method": method, "device": str(device),
                              "loop_ms": 1e3 * loop, "batched_ms": 1e3 * batched}),
                  flush=True)


if __name__ == "__main__":
    main()
