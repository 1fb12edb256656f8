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
    python benchmarks/host_overhead.py --phases          # where a tracked step's time goes
    python benchmarks/host_overhead.py --phases --every 10 --steps 40   # and the step after
    python benchmarks/host_overhead.py --device cuda     # the same on a GPU's host

``--device cuda`` runs the same tiny problems on a GPU (each step timed from an idle device
to the end of its kernels): the step is still its host's time, now with CUDA's dispatch and
launches, which calibrates this CPU proxy against a GPU machine.

``--every k`` tracks every k-th step (``configuration(config, every(k))``) and prints the
extra time of each step of the cycle: the tracked step, the step after it (Alpha observes
θ_{t+1} there: its forward pass is recorded and each layer projects the individual
gradients on s_t) and the untracked ones.

``--phases`` times the parts of Cockpit's pipeline inside the tracked steps (wrapping its
methods in this process; with ``--every k`` also inside the step after each, where Alpha
observes θ_{t+1}): the block's start (reading back the previous step's numbers
among it), the layers' hooks, the dot products when a parameter's gradient arrives, the
Linear weights stacked (formed where a stack fills: mostly inside the two before), the
small parameters side by side, the step's end before the optimizer (the gradient check
among it) and the instruments of the update after it; ms per tracked step, medians.

``3c3d``: 3C3D's six layers with 4–8 channels, SGD with momentum 0.9. ``resnet18_gn``: the
CIFAR-size ResNet-18 with GroupNorm of ``gpu_overhead.py`` at an eighth of its width (62
parameter tensors, 8–64 channels, 32×32 images; SGD with momentum): its convolutions still
do some arithmetic on this CPU, so its numbers hold more than the host's time. ``gpt2``: a
``transformers`` GPT-2 with 12 blocks of width 16 (148 parameter tensors, as GPT-2 124M),
T = 8, AdamW: the per-parameter host work of a language model.

The difference (ms) is the number to compare between commits (interleave runs of both:
the machine's load moves it by ±5 %); a ratio to this untracked step means nothing on a
GPU, whose untracked step is the model's real arithmetic. Two parts weigh more here than
on a GPU: multi-tensor ops (``torch._foreach_*``) loop over their tensors on a CPU (one
kernel for all on CUDA), and histograms are counted by bucketize and histc (one Triton
kernel on CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from cockpit.benchmark.problems.small_nets import TFSamePool
from cockpit.engine.histograms import device as histogram_device
from cockpit.schedules import every

sys.path.insert(0, str(Path(__file__).parent))
from gpu_overhead import BasicBlock, Clock
from op_count import MODELS, _image_problem, gpt2_problem, make_step


def tiny_3c3d() -> nn.Sequential:
    """3C3D's layers (three convolutions, three Linear layers) with 4–8 channels."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 5), nn.ReLU(), TFSamePool(3, 2),
        nn.Conv2d(4, 4, 3), nn.ReLU(), TFSamePool(3, 2),
        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), TFSamePool(3, 2),
        nn.Flatten(), nn.Linear(36, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
        nn.Linear(8, 10))


def tiny_resnet18_groupnorm() -> nn.Module:
    """ResNet-18 with GroupNorm (``gpu_overhead.resnet18_groupnorm``: 20 convolutions, 20
    GroupNorm layers, 62 parameter tensors) at an eighth of its width, 8–64 channels."""
    widths = [(8, 8, 1), (8, 8, 1), (8, 16, 2), (16, 16, 1), (16, 32, 2), (32, 32, 1),
              (32, 64, 2), (64, 64, 1)]
    return nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.GroupNorm(8, 8), nn.ReLU(),
                         *[BasicBlock(*w) for w in widths], nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(64, 10))


PROBLEMS = {
    "3c3d": functools.partial(_image_problem, tiny_3c3d),
    "resnet18_gn": functools.partial(_image_problem, tiny_resnet18_groupnorm),
    "gpt2": functools.partial(gpt2_problem, vocab=64, length=8, n_layer=12, n_embd=16,
                              n_head=2),
}


def _registered(problem: str) -> str:
    """The name under which ``op_count.make_step`` builds ``problem``."""
    MODELS[f"host:{problem}"] = PROBLEMS[problem]
    return f"host:{problem}"


def measure(problem: str, config: str, steps: int, device: str = "cpu"
            ) -> tuple[float, float]:
    """Medians (s) of the untracked and the tracked step, alternated."""
    plain, _ = make_step(_registered(problem), None, 2, device)
    tracked, watcher = make_step(_registered(problem), config, 2, device)
    for i in range(5):
        plain(i)
        tracked(i)
    times: tuple[list[float], list[float]] = ([], [])
    clock = Clock(torch.device(device))  # (on CUDA from an idle device to its kernels' end)
    for i in range(5, 5 + steps):
        for step, out in zip((plain, tracked), times, strict=True):
            out.append(clock.time(functools.partial(step, i)))
    assert watcher is not None
    watcher.close()
    return statistics.median(times[0]), statistics.median(times[1])


# (label, module, qualified name) of the pipeline's parts that ``--phases`` times
PHASES = (
    ("block start", "cockpit.step.sequence", "StepSequence.enter"),
    ("  reading back the previous step", "cockpit.engine.readout", "Readout.receive"),
    ("layers' hooks", "cockpit.engine.processing", "CallProcessor.process_guarded"),
    ("dot products at a gradient", "cockpit.engine.processing",
     "CallProcessor.gradient_arrived"),
    # (formed where a stack fills: mostly inside the two phases above, the rest after them)
    ("  Linear weights stacked", "cockpit.engine.processing",
     "CallProcessor.reduce_stack_guarded"),
    ("small parameters side by side", "cockpit.engine.processing",
     "CallProcessor.reduce_side_by_side"),
    ("block end", "cockpit.step.sequence", "StepSequence.exit"),
    ("step end (before the optimizer)", "cockpit.step.sequence", "StepSequence.end_step"),
    ("  gradient check", "cockpit.step.tracked_step", "TrackedStep.measure_gradient_mismatch"),
    ("update's instruments (after it)", "cockpit.step.sequence",
     "StepSequence.finish_update"),
)


@contextlib.contextmanager
def wrapped_phases(wrap):
    """While inside, each method of :data:`PHASES` is ``wrap(label, method)`` (restored
    after)."""
    restore = []
    for label, module_name, qualified in PHASES:
        owner_name, attribute = qualified.split(".")
        owner = getattr(importlib.import_module(module_name), owner_name)
        original = owner.__dict__[attribute]
        setattr(owner, attribute, wrap(label, original))
        restore.append((owner, attribute, original))
    try:
        yield
    finally:
        for owner, attribute, original in restore:
            setattr(owner, attribute, original)


@contextlib.contextmanager
def timed_phases(totals: dict[str, float]):
    """Adds each phase's time to ``totals`` while inside (the methods wrapped, restored)."""

    def timing(label: str, original):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - start

        return timed

    with wrapped_phases(timing):
        yield


def measure_phases(problem: str, config: str, steps: int, device: str = "cpu",
                   k: int | None = None) -> dict[int, dict[str, float]]:
    """Median time (s) per step of each of :data:`PHASES` (on CUDA: the host's time in each,
    the device not waited for): of the tracked step (position 0), and with ``k`` (tracked
    every k-th step) also of the step after it (position 1: Alpha's θ_{t+1})."""
    schedule = None if k is None else every(k)
    tracked, watcher = make_step(_registered(problem), config, 2, device, schedule=schedule)
    cycle = 1 if k is None else k
    for i in range(3 * cycle):
        tracked(i)
    positions = (0,) if k is None else (0, 1)
    per_step = {pos: {label: [] for label, _, _ in PHASES} for pos in positions}
    i = 3 * cycle
    while len(per_step[positions[-1]][PHASES[0][0]]) < steps:
        position = i % cycle
        if position not in per_step:
            tracked(i)
        else:
            totals: dict[str, float] = {}
            with timed_phases(totals):
                tracked(i)
            for label, times in per_step[position].items():
                times.append(totals.get(label, 0.0))
        i += 1
    assert watcher is not None
    watcher.close()
    return {pos: {label: statistics.median(times) for label, times in by_label.items()}
            for pos, by_label in per_step.items()}


def measure_cycle(problem: str, config: str, k: int, cycles: int, device: str = "cpu"
                  ) -> list[float]:
    """The median extra time (s) of each step of a cycle of ``k`` (position 0 tracked) over
    an untracked step, alternated."""
    plain, _ = make_step(_registered(problem), None, 2, device)
    tracked, watcher = make_step(_registered(problem), config, 2, device, schedule=every(k))
    for i in range(3 * k):
        plain(i)
        tracked(i)
    by_position: list[list[float]] = [[] for _ in range(k)]
    untracked: list[float] = []
    clock = Clock(torch.device(device))
    for i in range(3 * k, (3 + cycles) * k):
        untracked.append(clock.time(functools.partial(plain, i)))
        by_position[i % k].append(clock.time(functools.partial(tracked, i)))
    assert watcher is not None
    watcher.close()
    base = statistics.median(untracked)
    return [statistics.median(times) - base for times in by_position]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--config", default="economy", choices=["economy", "business", "full"])
    parser.add_argument("--steps", type=int, default=150, help="timed steps of each kind")
    parser.add_argument("--every", type=int, default=None, metavar="K",
                        help="track every K-th step: the extra time of each step of a cycle")
    parser.add_argument("--phases", action="store_true",
                        help="time the parts of Cockpit's pipeline in the tracked steps")
    parser.add_argument("--device", default="cpu",
                        help="cuda: the same tiny problems on a GPU, where a step's time is "
                             "its host's with CUDA's launches (the CPU proxy's calibration)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    histogram_device._forced = args.device == "cpu"  # (a GPU takes its own paths)
    device = args.device
    if args.phases:
        for problem in args.problems:
            phases = measure_phases(problem, args.config, args.steps, device, args.every)
            for position, by_label in phases.items():
                which = ("tracked step" if position == 0
                         else "step after it (Alpha's θ_{t+1})")
                cycle = "" if args.every is None else f", every {args.every}"
                print(f"{problem} {args.config} ({device}{cycle}): ms per {which}")
                for label, seconds in by_label.items():
                    print(f"  {label:36s} {seconds * 1e3:7.3f}")
        return
    if args.every is not None:
        for problem in args.problems:
            extra = measure_cycle(problem, args.config, args.every,
                                  max(1, args.steps // args.every), device)
            print(f"{problem} {args.config} every {args.every}: extra ms per step of the "
                  "cycle " + ", ".join(f"{e * 1e3:.2f}" for e in extra)
                  + f"; per step of the run {sum(extra) / len(extra) * 1e3:.2f}")
        return
    for problem in args.problems:
        plain, tracked = measure(problem, args.config, args.steps, device)
        print(f"{problem} {args.config} ({device}): untracked {plain * 1e3:.2f} ms, tracked "
              f"{tracked * 1e3:.2f} ms, host overhead {(tracked - plain) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
