"""The host's time of a tracked step, measured on the CPU where the device's work is nil.

On a GPU a tracked step is bound by the host: Python deciding what to form and the kernels
it launches, while the device idles (``host_profile.py`` on a GPU; ``op_count.py`` counts
the launches). This benchmark measures that host time without a GPU: the problems keep
their structure (layers, parameter tensors, optimizer) with tiny widths and |B| = 2, so a
kernel's arithmetic is next to nothing and a step's time is the host's — Python and the
dispatch of each op. The accelerators' paths are forced (histograms, side by side, the
batched fits), as on a GPU. Tracked and untracked steps alternate in one process; the
medians and their difference are printed.

    python benchmarks/host_overhead.py                   # both problems, economy
    python benchmarks/host_overhead.py --problems gpt2 --steps 60
    python benchmarks/host_overhead.py --every 10        # each step of a cycle of 10

``--every k`` tracks every k-th step (``configuration(config, every(k))``) and prints the
extra time of each step of the cycle: the tracked step, the step after it (Alpha observes
θ_{t+1} there: its forward pass is recorded and each layer projects the individual
gradients on s_t) and the untracked ones.

``3c3d``: 3C3D's six layers with 4–8 channels, SGD with momentum 0.9. ``gpt2``: a
``transformers`` GPT-2 with 12 blocks of width 16 (148 parameter tensors, as GPT-2 124M),
T = 8, AdamW: the per-parameter host work of a language model.

The difference (ms) is the number to compare between commits (interleave runs of both:
the machine's load moves it by ±5 %); a ratio to this untracked step means nothing on a
GPU, whose untracked step is the model's real arithmetic.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from cockpit import Cockpit, configuration
from cockpit.benchmark.problems.small_nets import TFSamePool
from cockpit.engine.histograms import device as histogram_device
from cockpit.schedules import every

sys.path.insert(0, str(Path(__file__).parent))
from op_count import MODELS, _image_problem, gpt2_problem, make_step


def tiny_3c3d() -> nn.Sequential:
    """3C3D's layers (three convolutions, three Linear layers) with 4–8 channels."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 5), nn.ReLU(), TFSamePool(3, 2),
        nn.Conv2d(4, 4, 3), nn.ReLU(), TFSamePool(3, 2),
        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), TFSamePool(3, 2),
        nn.Flatten(), nn.Linear(36, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
        nn.Linear(8, 10))


PROBLEMS = {
    "3c3d": functools.partial(_image_problem, tiny_3c3d),
    "gpt2": functools.partial(gpt2_problem, vocab=64, length=8, n_layer=12, n_embd=16,
                              n_head=2),
}


def measure(problem: str, config: str, steps: int) -> tuple[float, float]:
    """Medians (s) of the untracked and the tracked step, alternated."""
    MODELS[f"host:{problem}"] = PROBLEMS[problem]
    plain, _ = make_step(f"host:{problem}", None, 2)
    tracked, watcher = make_step(f"host:{problem}", config, 2)
    for i in range(5):
        plain(i)
        tracked(i)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(5, 5 + steps):
        for step, out in zip((plain, tracked), times, strict=True):
            start = time.perf_counter()
            step(i)
            out.append(time.perf_counter() - start)
    assert watcher is not None
    watcher.close()
    return statistics.median(times[0]), statistics.median(times[1])


def measure_cycle(problem: str, config: str, k: int, cycles: int) -> list[float]:
    """The median extra time (s) of each step of a cycle of ``k`` (position 0 tracked) over
    an untracked step, alternated with untracked steps of the same model."""
    torch.manual_seed(0)
    made = PROBLEMS[problem](2)
    model, optimizer, batches = made.model, made.optimizer, made.batches
    watcher = Cockpit(model, configuration(config, every(k)), optimizer=optimizer)

    def step(i: int, watched: bool) -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        losses = made.losses(model, batches[i % len(batches)])
        if watched:
            with watcher(i, losses=losses):
                losses.mean().backward()
        else:
            losses.mean().backward()
        optimizer.step()
        return time.perf_counter() - start

    for i in range(3 * k):
        step(i, True)
    by_position: list[list[float]] = [[] for _ in range(k)]
    plain: list[float] = []
    for i in range(3 * k, (3 + cycles) * k):
        by_position[i % k].append(step(i, True))
        plain.append(step(i, False))
    watcher.close()
    base = statistics.median(plain)
    return [statistics.median(times) - base for times in by_position]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--config", default="economy", choices=["economy", "business", "full"])
    parser.add_argument("--steps", type=int, default=150, help="timed steps of each kind")
    parser.add_argument("--every", type=int, default=None, metavar="K",
                        help="track every K-th step: the extra time of each step of a cycle")
    args = parser.parse_args()
    torch.set_num_threads(1)
    histogram_device._forced = True
    if args.every is not None:
        for problem in args.problems:
            extra = measure_cycle(problem, args.config, args.every,
                                  max(1, args.steps // args.every))
            print(f"{problem} {args.config} every {args.every}: extra ms per step of the "
                  "cycle " + ", ".join(f"{e * 1e3:.2f}" for e in extra)
                  + f"; per step of the run {sum(extra) / len(extra) * 1e3:.2f}")
        return
    for problem in args.problems:
        plain, tracked = measure(problem, args.config, args.steps)
        print(f"{problem} {args.config}: untracked {plain * 1e3:.2f} ms, tracked "
              f"{tracked * 1e3:.2f} ms, host overhead {(tracked - plain) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
