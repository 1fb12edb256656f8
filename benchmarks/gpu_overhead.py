"""Cockpit's overhead on a GPU, beside the original package's (cockpit-for-pytorch 1.0.2 with
BackPACK 1.7.1, measured on one NVIDIA H200 with torch 2.11 + CUDA 13; ``benchmarks/data/
gpu_h200_*.jsonl``, which also hold this project's numbers when the GPU work began).

Parts (``--parts``, all by default):

* ``side``: the tracked step and the untracked step (the same model without Cockpit, same
  initialization and data) interleaved in one process, |B| = 128, float32, tracked every
  step: median times, their ratio, and the peak memory of each (CUDA) — for 3C3D (CIFAR-10)
  and All-CNN-C (CIFAR-100) in the economy, business and full configurations;
* ``gpt2``: GPT-2 124M from its config (no weights downloaded), bf16 autocast, B = 8,
  T = 256, economy vs untracked, with peak memory;
* ``resnet``: a CIFAR-size ResNet-18 with GroupNorm, economy tracked every step (step ratio)
  and every 10th step (run-time ratio);
* ``fig7``: the paper's Figure 7, whole-run time of 3C3D training with a configuration
  tracked every 1, 4, 16, 64 steps as a multiple of training without Cockpit;
* ``idle``: a 3C3D step inside ``with cockpit(step, ...)`` that no instrument tracks,
  interleaved with the step without Cockpit.

Peak memory (CUDA) is measured as at the filing: in ``side`` and ``resnet`` the first two
steps above what was allocated before them; for GPT-2 building the model, its optimizer and
Cockpit and three steps above what was allocated before (parameters, optimizer state and
Cockpit's copies such as θ_0 included: the memory a training run needs).

Every cell prints this project's number, the original's, and ours/original (the goal:
≤ 0.5 in every cell). The original's numbers are from an H200: on another device the ratios
ours/original are indicative only. A cell that fails prints its error and the run goes on.

    python benchmarks/gpu_overhead.py                         # CUDA, everything (~4 min, H200)
    python benchmarks/gpu_overhead.py --parts side fig7 --json out.json
    python benchmarks/gpu_overhead.py --device cpu --quick    # dry run: tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, configuration

DATA = Path(__file__).parent / "data"
CONFIGS = ("economy", "business", "full")
PROBLEMS = ("cifar10_3c3d", "cifar100_allcnnc")
ORIGINAL_NAMES = {"allcnnc": "cifar100_allcnnc"}  # the problem names of the measuring scripts
EVERY = (1, 4, 16, 64)


# ----------------------------------------------------------------------------- problems
def make_problem(name: str) -> tuple[Callable[[], nn.Module], tuple[int, ...], int]:
    """(model factory, input shape, number of classes)."""
    if name == "cifar10_3c3d":
        from cockpit.benchmark.problems.paper_models import cifar10_3c3d

        return cifar10_3c3d, (3, 32, 32), 10
    if name == "cifar100_allcnnc":
        from cockpit.benchmark.problems.large_nets import all_cnn_c

        return all_cnn_c, (3, 32, 32), 100
    if name == "resnet18_gn":
        return resnet18_groupnorm, (3, 32, 32), 10
    raise KeyError(name)


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with GroupNorm and a shortcut (a 1×1 convolution where the shape
    changes), as in ResNet-18 with GroupNorm(8) instead of BatchNorm."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(8, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(8, c_out)
        self.shortcut = (nn.Sequential() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.GroupNorm(8, c_out)))

    def forward(self, x):
        h = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(h)) + self.shortcut(x))


def resnet18_groupnorm(num_classes: int = 10) -> nn.Module:
    widths = [(64, 64, 1), (64, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2),
              (256, 256, 1), (256, 512, 2), (512, 512, 1)]
    return nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.GroupNorm(8, 64), nn.ReLU(),
                         *[BasicBlock(*w) for w in widths], nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(512, num_classes))


def batches(shape, classes: int, batch: int, device, count: int = 4, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, *shape, generator=generator).to(device),
             torch.randint(0, classes, (batch,), generator=generator).to(device))
            for _ in range(count)]


def trainer(make: Callable[[], nn.Module], data, device, qs_of=None, seed: int = 0):
    """step(i) of SGD on ``data[i % len(data)]``; with ``qs_of`` (a function of nothing that
    returns the instruments) Cockpit watches it."""
    torch.manual_seed(seed)
    model = make().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cockpit = Cockpit(model, qs_of(), optimizer=opt) if qs_of is not None else None

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        context = cockpit(i, losses=losses) if cockpit is not None else contextlib.nullcontext()
        with context:
            losses.mean().backward()
        opt.step()

    return step


# ----------------------------------------------------------------------------- measuring
class Clock:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], object]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def peak_mib(self, fn: Callable[[], object]) -> float | None:
        """Peak memory above the memory allocated before ``fn`` (MiB; None off CUDA): of the
        steps alone, as the original's side by side measured it."""
        if not self.cuda:
            fn()
            return None
        self.sync()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        fn()
        self.sync()
        return (torch.cuda.max_memory_allocated(self.device) - before) / 2**20

    def built(self, factory: Callable[[], Callable[[int], None]], steps: int = 3
              ) -> tuple[Callable[[int], None], float | None]:
        """The step ``factory()`` builds, and the peak memory (MiB; None off CUDA) of
        building it and running ``steps`` steps above the memory allocated before: the
        model, its optimizer state and what Cockpit holds between steps (θ_0, s_{t−1})
        included, as a training run needs them."""
        if not self.cuda:
            step = factory()
            for i in range(steps):
                step(i)
            return step, None
        self.sync()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        step = factory()
        for i in range(steps):
            step(i)
        self.sync()
        return step, (torch.cuda.max_memory_allocated(self.device) - before) / 2**20


def interleaved(clock: Clock, untracked, tracked, steps: int, seconds: float, start: int = 2
                ) -> tuple[list[float], list[float]]:
    """Alternate untracked and tracked steps: at most ``steps`` pairs, fewer (but at least
    3) once ``seconds`` have passed."""
    base, watched = [], []
    began, i = time.perf_counter(), start
    least = min(3, steps)
    while len(watched) < steps and (len(watched) < least
                                    or time.perf_counter() - began < seconds):
        base.append(clock.time(lambda i=i: untracked(i)))
        watched.append(clock.time(lambda i=i: tracked(i)))
        i += 1
    return base, watched


def side_cell(args, clock: Clock, problem: str, config: str) -> dict:
    make, shape, classes = make_problem(problem)
    data = batches(shape, classes, args.batch, clock.device)
    untracked = trainer(make, data, clock.device)
    peak_untracked = clock.peak_mib(lambda: [untracked(i) for i in range(2)])
    tracked = trainer(make, data, clock.device, lambda: configuration(config))
    peak_tracked = clock.peak_mib(lambda: [tracked(i) for i in range(2)])
    base, watched = interleaved(clock, untracked, tracked, args.steps, args.cell_seconds)
    return {"untracked_ms": 1e3 * statistics.median(base),
            "tracked_ms": 1e3 * statistics.median(watched),
            "ratio": statistics.median(watched) / statistics.median(base),
            "peak_untracked_MiB": peak_untracked, "peak_tracked_MiB": peak_tracked,
            "n": len(watched)}


def run_time(clock: Clock, step, steps: int, warmup: int = 3) -> float:
    """Mean time per step of ``steps`` steps after ``warmup`` steps."""
    for i in range(warmup):
        step(i)
    total = clock.time(lambda: [step(i) for i in range(warmup, warmup + steps)])
    return total / steps


def fig7_cells(args, clock: Clock, emit) -> None:
    make, shape, classes = make_problem("cifar10_3c3d")
    data = batches(shape, classes, args.batch, clock.device)
    base = run_time(clock, trainer(make, data, clock.device), args.fig7_steps)
    for config in CONFIGS:
        for every in args.every:
            record = {"part": "fig7", "config": config, "every": every}
            if args.out_of_time():
                emit({**record, "skipped": "time limit"})
                continue
            try:
                steps = max(args.fig7_steps if config != "full" or every > 1
                            else max(args.fig7_steps // 4, 2), every)
                step = trainer(make, data, clock.device,
                               lambda config=config, every=every: configuration(config, every))
                record.update(ratio=run_time(clock, step, steps) / base, base_ms=1e3 * base)
            except Exception as error:
                record["error"] = f"{type(error).__name__}: {error}"[:400]
            emit(record)


def idle_cell(args, clock: Clock, emit) -> None:
    """A step no instrument tracks (economy's instruments scheduled for no step) inside
    ``with cockpit(step, ...)``, interleaved with the same step without Cockpit (goal:
    ≤ 1.02×)."""
    make, shape, classes = make_problem("cifar10_3c3d")
    data = batches(shape, classes, args.batch, clock.device)
    plain = trainer(make, data, clock.device)
    idle = trainer(make, data, clock.device, lambda: configuration("economy", lambda s: False))
    for i in range(3):
        plain(i), idle(i)
    base, watched = interleaved(clock, plain, idle, 20 * args.fig7_steps, args.cell_seconds,
                                start=3)
    emit({"part": "idle", "ratio": statistics.median(watched) / statistics.median(base),
          "untracked_ms": 1e3 * statistics.median(base),
          "tracked_ms": 1e3 * statistics.median(watched), "pairs": len(base)})


def gpt2_problem(device: torch.device, quick: bool) -> tuple[object, list[torch.Tensor]]:
    """GPT-2 124M's config (a 2-layer one if ``quick``) and four batches of token ids
    (B = 8, T = 256; quick: 2, 32) on ``device``."""
    from transformers import GPT2Config

    if quick:
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64)
        batch, length = 2, 32
    else:
        config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                            n_positions=1024)
        batch, length = 8, 256
    generator = torch.Generator().manual_seed(0)
    data = [torch.randint(0, config.vocab_size, (batch, length), generator=generator)
            .to(device) for _ in range(4)]
    return config, data


def gpt2_trainer(config, data: list[torch.Tensor], device: torch.device, tracked: bool
                 ) -> tuple[Callable[[int], None], Cockpit | None]:
    """step(i) of AdamW on GPT-2 built from ``config`` (bf16 autocast on CUDA), economy
    tracked every step if ``tracked``, and its Cockpit."""
    from transformers import GPT2LMHeadModel

    from cockpit.integrations.transformers import sequence_losses

    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt) if tracked else None
    autocast = device.type == "cuda"

    def step(i: int) -> None:
        ids = data[i % len(data)]
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids).logits
        losses = sequence_losses(logits.float(), ids, shift=True)
        context = (cockpit(i, losses=losses) if cockpit is not None
                   else contextlib.nullcontext())
        with context:
            losses.mean().backward()
        opt.step()

    return step, cockpit


def gpt2_cells(args, clock: Clock, emit) -> None:
    config, data = gpt2_problem(clock.device, args.quick)
    batch, length = data[0].shape
    autocast = clock.device.type == "cuda"

    def build(tracked: bool) -> Callable[[int], None]:
        return gpt2_trainer(config, data, clock.device, tracked)[0]

    record = {"part": "gpt2", "B": batch, "T": length, "layers": config.n_layer,
              "bf16_autocast": autocast}
    try:
        untracked, peak_untracked = clock.built(lambda: build(False))
        tracked, peak_tracked = clock.built(lambda: build(True))
        base, watched = interleaved(clock, untracked, tracked, min(args.steps, 6),
                                    args.cell_seconds)
        record.update(untracked_ms=1e3 * statistics.median(base),
                      tracked_ms=1e3 * statistics.median(watched),
                      ratio=statistics.median(watched) / statistics.median(base),
                      peak_untracked_MiB=peak_untracked, peak_tracked_MiB=peak_tracked)
    except Exception as error:
        record["error"] = f"{type(error).__name__}: {error}"[:400]
    emit(record)


def resnet_cells(args, clock: Clock, emit) -> None:
    make, shape, classes = make_problem("resnet18_gn")
    if args.quick:
        shape = (3, 16, 16)
    data = batches(shape, classes, args.batch, clock.device)
    for every in (1, 10):
        record = {"part": "resnet", "every": every}
        if args.out_of_time():
            emit({**record, "skipped": "time limit"})
            continue
        try:
            if every == 1:
                record.update(side_cell_for(args, clock, make, data))
            else:
                base = run_time(clock, trainer(make, data, clock.device), args.fig7_steps)
                step = trainer(make, data, clock.device, lambda: configuration("economy", 10))
                steps = 10 if args.quick else max(args.fig7_steps, 20)
                record.update(ratio=run_time(clock, step, steps) / base, base_ms=1e3 * base)
        except Exception as error:
            record["error"] = f"{type(error).__name__}: {error}"[:400]
        emit(record)


def side_cell_for(args, clock: Clock, make, data) -> dict:
    untracked = trainer(make, data, clock.device)
    tracked = trainer(make, data, clock.device, lambda: configuration("economy"))
    peak_untracked = clock.peak_mib(lambda: [untracked(i) for i in range(2)])
    peak_tracked = clock.peak_mib(lambda: [tracked(i) for i in range(2)])
    base, watched = interleaved(clock, untracked, tracked, args.steps, args.cell_seconds)
    return {"untracked_ms": 1e3 * statistics.median(base),
            "tracked_ms": 1e3 * statistics.median(watched),
            "ratio": statistics.median(watched) / statistics.median(base),
            "peak_untracked_MiB": peak_untracked, "peak_tracked_MiB": peak_tracked}


# ----------------------------------------------------------------------------- the original
def load_reference() -> dict:
    """The H200 measurements: {(part, key...): {"original": record, "ours_then": record}}."""
    reference: dict = {}

    def read(name: str):
        path = DATA / f"gpu_h200_{name}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    for r in read("side"):
        key = ("side", ORIGINAL_NAMES.get(r["problem"], r["problem"]), r["config"])
        reference.setdefault(key, {})["original" if r["impl"] == "original" else "ours_then"] = r
    for r in read("fig7"):
        key = ("fig7", r["config"], r["every"])
        reference.setdefault(key, {})["original" if r["impl"] == "original" else "ours_then"] = r
    gpt2 = {("untracked" if r["config"] is None else "tracked"): r for r in read("gpt2")}
    if len(gpt2) == 2:
        reference[("gpt2",)] = {"ours_then": {
            "tracked_ms": gpt2["tracked"]["step_ms"],
            "ratio": gpt2["tracked"]["step_ms"] / gpt2["untracked"]["step_ms"],
            "peak_tracked_MiB": 1024 * gpt2["tracked"]["peak_GiB"],
            "peak_untracked_MiB": 1024 * gpt2["untracked"]["peak_GiB"]}}
    for r in read("extra"):
        if r.get("part", "").startswith("resnet18_gn_economy_every"):
            every = int(r["part"].removeprefix("resnet18_gn_economy_every"))
            reference[("resnet", every)] = {"ours_then": r}
    return reference


def key_of(record: dict) -> tuple:
    part = record["part"]
    if part == "side":
        return ("side", record["problem"], record["config"])
    if part == "fig7":
        return ("fig7", record["config"], record["every"])
    if part == "resnet":
        return ("resnet", record["every"])
    return (part,)


# ----------------------------------------------------------------------------- printing
def fmt_ratio(record: dict | None) -> str:
    if not record:
        return "–"
    if "error" in record:
        return "error"
    if "skipped" in record:
        return "skipped"
    text = f"{record['ratio']:.2f}×"
    if record.get("tracked_ms") is not None:
        ms = record["tracked_ms"]
        text += f" ({ms / 1e3:.2f} s)" if ms >= 1e3 else f" ({ms:.1f} ms)"
    return text


def fmt_peak(record: dict | None) -> str:
    if not record or record.get("peak_tracked_MiB") is None:
        return "–"
    extra = record["peak_tracked_MiB"] - record["peak_untracked_MiB"]
    return f"+{extra / 1024:.2f} GiB" if abs(extra) >= 1024 else f"+{extra:.0f} MiB"


def versus(ours: dict, original: dict | None, field: str) -> str:
    if not original or field not in original or field not in ours:
        return "–"
    return f"{ours[field] / original[field]:.2f}"


def print_table(records: list[dict], reference: dict, device_name: str) -> None:
    print(f"\n## Overhead on {device_name} (original package and 'at filing': one NVIDIA "
          "H200, torch 2.11 + CUDA 13)\n")
    print("| problem | configuration | this project | peak memory | original package | "
          "ours/original (tracked step) | this project at filing |")
    print("|---|---|---|---|---|---|---|")
    for r in records:
        if r["part"] not in ("side", "gpt2", "resnet"):
            continue
        ref = reference.get(key_of(r), {})
        if r["part"] == "side":
            name, config = r["problem"], r["config"]
        elif r["part"] == "gpt2":
            name = f"GPT-2 ({r.get('layers')} layers, B={r.get('B')}, T={r.get('T')})"
            config = "economy"
        else:
            name = "ResNet-18 GroupNorm"
            config = "economy, every step" if r["every"] == 1 else "economy, every 10th (run)"
        ours = fmt_ratio(r)
        if "error" in r:
            ours = f"error: {r['error'][:80]}"
        print(f"| {name} | {config} | {ours} | {fmt_peak(r)} | "
              f"{fmt_ratio(ref.get('original'))} {fmt_peak(ref.get('original'))} | "
              f"{versus(r, ref.get('original'), 'tracked_ms')} | "
              f"{fmt_ratio(ref.get('ours_then'))} |")
    for r in records:
        if r["part"] == "idle" and "ratio" in r:
            print(f"\nA step no instrument tracks, inside `with cockpit(step, ...)`: "
                  f"{r['ratio']:.3f}× the step without Cockpit ({r['tracked_ms']:.2f} vs "
                  f"{r['untracked_ms']:.2f} ms, median of {r['pairs']} pairs; goal ≤ 1.02×)")
    fig7 = [r for r in records if r["part"] == "fig7"]
    if not fig7:
        return
    everys = sorted({r["every"] for r in fig7})
    print("\n## Figure 7 (3C3D): run time with tracking every k-th step / without Cockpit — "
          "this project / original (ours ÷ original)\n")
    print("| configuration | " + " | ".join(f"every {k}" for k in everys) + " |")
    print("|---|" + "---|" * len(everys))
    for config in CONFIGS:
        cells = []
        for k in everys:
            r = next((x for x in fig7 if x["config"] == config and x["every"] == k), None)
            ref = reference.get(("fig7", config, k), {}).get("original")
            if r is None or "ratio" not in r:
                cells.append("error" if r and "error" in r else "–")
                continue
            text = f"{r['ratio']:.2f}"
            if ref:
                text += f" / {ref['ratio']:.2f} ({r['ratio'] / ref['ratio']:.2f})"
            cells.append(text)
        print(f"| {config} | " + " | ".join(cells) + " |")


def goal_checks(records: list[dict], reference: dict) -> list[tuple[str, float, float]]:
    """The GPU goals this run measured: (goal, measured, bound), met when measured ≤ bound.
    Step ratios (tracked ÷ untracked), the tracked step over the original package's, Figure
    7's run-time ratios and their quotient by the original's, the idle step, GPT-2's peak."""
    checks: list[tuple[str, float, float]] = []

    def add(goal: str, value: float | None, bound: float) -> None:
        if value is not None and math.isfinite(value):
            checks.append((goal, value, bound))

    for r in records:
        if "ratio" not in r:
            continue
        original = reference.get(key_of(r), {}).get("original") or {}
        part = r["part"]
        if part == "side":
            name = f"{r['problem']} {r['config']}"
            if (r["problem"], r["config"]) == ("cifar10_3c3d", "economy"):
                add(f"{name}: tracked step ≤ 2× the untracked", r["ratio"], 2.0)
            if "tracked_ms" in original:
                add(f"{name}: tracked step ≤ half the original's",
                    r["tracked_ms"] / original["tracked_ms"], 0.5)
        elif part == "gpt2":
            add("GPT-2 124M economy: tracked step ≤ 1.5×", r["ratio"], 1.5)
            if r.get("peak_tracked_MiB") and r.get("peak_untracked_MiB"):
                add("GPT-2 124M economy: peak memory ≤ 1.25×",
                    r["peak_tracked_MiB"] / r["peak_untracked_MiB"], 1.25)
        elif part == "resnet":
            every = r["every"]
            add(f"ResNet-18 GroupNorm economy every {'step' if every == 1 else '10th step'}",
                r["ratio"], 3.0 if every == 1 else 1.2)
        elif part == "idle":
            add("a step no instrument tracks ≤ 1.02×", r["ratio"], 1.02)
        elif part == "fig7":
            config, every = r["config"], r["every"]
            if original.get("ratio"):
                add(f"Figure 7 {config} every {every}: ≤ half the original's",
                    r["ratio"] / original["ratio"], 0.5)
            if (config == "economy" and every >= 4) or (config == "business" and every >= 16):
                add(f"Figure 7 {config} every {every}: ≤ 2×", r["ratio"], 2.0)
    return checks


def print_goals(records: list[dict], reference: dict) -> None:
    checks = goal_checks(records, reference)
    if not checks:
        return
    met = sum(value <= bound for _, value, bound in checks)
    print(f"\n## Goals: {met} of {len(checks)} met\n")
    for goal, value, bound in checks:
        print(f"- {'met' if value <= bound else 'NOT met'}: {goal} — {value:.3g} (≤ {bound:g})")


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true",
                        help="tiny batches, few steps, a 2-layer GPT-2: a dry run")
    parser.add_argument("--parts", nargs="+",
                        default=["side", "gpt2", "resnet", "fig7", "idle"],
                        choices=["side", "gpt2", "resnet", "fig7", "idle"])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=PROBLEMS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--batch", type=int, default=None, help="default 128 (quick: 4)")
    parser.add_argument("--steps", type=int, default=None,
                        help="most tracked steps per cell (default 10; quick: 2)")
    parser.add_argument("--cell-seconds", type=float, default=None,
                        help="time per cell after 3 tracked steps (default 8; quick: 0)")
    parser.add_argument("--fig7-steps", type=int, default=None,
                        help="steps per Figure 7 run (default 64; quick: 2)")
    parser.add_argument("--every", type=int, nargs="+", default=None,
                        help="Figure 7's k (default 1 4 16 64; quick: 1 4)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds; cells after it are skipped (default none)")
    parser.add_argument("--json", default=None, help="write every record to this file")
    parser.add_argument("--side-by-side", default="on", choices=["on", "off"],
                        help="off: every small parameter reduced alone in its hook (the "
                             "path before cockpit.engine.side_by_side), for an A/B run")
    parser.add_argument("--stacks", default="on", choices=["on", "off"],
                        help="off: every Linear weight and normalization layer formed alone "
                             "(the path before cockpit.engine.stacked), for an A/B run")
    args = parser.parse_args(argv)
    if args.side_by_side == "off":
        from cockpit.engine import processing
        processing.SMALL_BYTES = -1
    if args.stacks == "off":
        from cockpit.engine import stacked
        stacked.capacity = stacked.norm_capacity = lambda *args: 0
    quick = args.quick
    args.batch = args.batch or (4 if quick else 128)
    args.steps = args.steps or (2 if quick else 10)
    args.cell_seconds = args.cell_seconds if args.cell_seconds is not None else (
        0.0 if quick else 8.0)
    args.fig7_steps = args.fig7_steps or (2 if quick else 64)
    args.every = args.every or ([1, 4] if quick else list(EVERY))
    started = time.perf_counter()
    args.out_of_time = lambda: (args.time_limit is not None
                                and time.perf_counter() - started > args.time_limit)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: run with --device cpu (a dry run) on this machine.")
        return 2
    if device.type == "cpu" and not quick:
        print("note: on a CPU the numbers are not comparable with the GPU table; "
              "benchmarks/overhead.py measures the CPU overhead")
    clock = Clock(device)
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"CPU ({platform.processor() or platform.machine()})")
    meta = {"device": device_name, "torch": torch.__version__, "quick": quick,
            "side_by_side": args.side_by_side, "stacks": args.stacks,
            "batch": args.batch, "python": sys.version.split()[0],
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"# gpu_overhead on {device_name}, torch {torch.__version__}, |B| = {args.batch}"
          + (" (quick dry run)" if quick else ""), flush=True)
    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(record)
        print(json.dumps(record), flush=True)

    warnings.simplefilter("ignore")
    if "side" in args.parts:
        for problem in args.problems:
            for config in args.configs:
                record = {"part": "side", "problem": problem, "config": config,
                          "batch": args.batch}
                if args.out_of_time():
                    emit({**record, "skipped": "time limit"})
                    continue
                try:
                    record.update(side_cell(args, clock, problem, config))
                except Exception as error:
                    record["error"] = f"{type(error).__name__}: {error}"[:400]
                emit(record)
    for part, run in (("gpt2", gpt2_cells), ("resnet", resnet_cells), ("idle", idle_cell),
                      ("fig7", fig7_cells)):
        if part not in args.parts:
            continue
        if args.out_of_time():
            emit({"part": part, "skipped": "time limit"})
            continue
        try:
            run(args, clock, emit)
        except Exception as error:
            emit({"part": part, "error": f"{type(error).__name__}: {error}"[:400]})
    reference = load_reference()
    print_table(records, reference, device_name)
    print_goals(records, reference)
    meta["seconds"] = round(time.perf_counter() - started, 1)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as file:
            json.dump({"meta": meta, "records": records,
                       "reference": [{"key": list(k), **v} for k, v in reference.items()]},
                      file, indent=1, default=str)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
