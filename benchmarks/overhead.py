"""Overhead of Cockpit's instruments as a ratio to an untracked step in the same process.

For each DeepOBS problem (synthetic data, |B| = 128) and each configuration (one instrument
alone, or a named configuration), a fresh subprocess trains with Cockpit attached. The
schedule tracks blocks of consecutive steps, so every measured tracked step is preceded by
a tracked step ("tracked every step", which matters for Alpha: it finishes α of step t−1 at
step t). Each cycle of 8 steps is

    T₀ T T T S U U U     T₀: first tracked step of a block (not measured)
                          T : tracked steps, measured    S: the step after a block (Alpha
                          finishes its last α there; not measured)    U: untracked, measured

and the ratio is median(T) / median(U); min(T) / min(U) is printed beside it (less sensitive to
other processes loading the machine). Peak memory is the subprocess's peak resident set
size, compared with a subprocess that trains without Cockpit, and with the largest layer's
|B|×D_layer individual gradients (float32).

    python benchmarks/overhead.py                      # everything, writes a markdown table
    python benchmarks/overhead.py --problems cifar10_3c3d --configs economy NormTest
    python benchmarks/overhead.py --configs Alpha --optimizer custom
    python benchmarks/overhead.py --threads 1 --clock cpu     # robust on a loaded machine
    python benchmarks/overhead.py --repeats 3                 # median over 3 processes
    python benchmarks/overhead.py --configs business --curvature diag_ggn_mc
    python benchmarks/overhead.py --configs economy-previous economy --repeats 5 --interleave

``economy-previous``: economy without GradientNoiseScale, ParamNorm and UpdateRatio (what they
add). ``--interleave``: the repeats run round-robin over the configurations (A B A B …), so
that a slow phase of a shared machine hits both alike.

``--optimizer``: ``sgd`` (momentum 0.9), ``sgd-plain`` (no momentum), ``adam``, or
``custom`` — a subclass of torch.optim.Optimizer that Cockpit cannot predict (sign-SGD), so
Alpha takes the general path (per-layer projections after the step).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import run_worker

WORKER = r"""
import json, resource, statistics, sys, time
import torch, torch.nn.functional as F
from cockpit import Cockpit, configuration, quantities
from cockpit.benchmark.problems.paper_models import BUILDERS, synthetic_batches

problem, config, steps, threads, optimizer, clock, curvature = sys.argv[1:8]
now = time.perf_counter if clock == "wall" else time.process_time
steps, threads = int(steps), int(threads)
torch.set_num_threads(threads)
torch.manual_seed(0)
model = BUILDERS[problem]()


class SignSGD(torch.optim.Optimizer):
    # A custom optimizer Cockpit cannot predict: θ ← θ − lr · sign(g).
    def __init__(self, params, lr=1e-4):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


if optimizer == "sgd-plain":
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
elif optimizer == "sgd":
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
elif optimizer == "adam":
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
else:
    opt = SignSGD(model.parameters())
batches = synthetic_batches(problem, 128)
CYCLE = "TtttSuuu"  # T: tracked, not measured; t: tracked, measured; S: skip; u: untracked
warmup = 4  # untracked steps first (thread pools, allocator)
cycles = (steps + 2) // 3
kinds = ["w"] * warmup + [c for _ in range(cycles) for c in CYCLE]
tracked_steps = [s for s, c in enumerate(kinds) if c in "Tt"]
cockpit = None
if config != "none":
    schedule = set(tracked_steps).__contains__
    if config in ("economy", "business", "full"):
        qs = configuration(config, schedule)
    elif config == "economy-previous":  # economy before GradientNoiseScale, ParamNorm, UpdateRatio
        qs = [q for q in configuration("economy", schedule)
              if q.name not in ("GradientNoiseScale", "ParamNorm", "UpdateRatio")]
    else:
        qs = [getattr(quantities, config)(schedule)]
    for quantity in qs:  # HessTrace, TICDiag, TICTrace
        if curvature != "auto" and hasattr(quantity, "curvature"):
            quantity.curvature = curvature
    cockpit = Cockpit(model, qs, optimizer=opt)
times = {"t": [], "u": []}
for step, kind in enumerate(kinds):
    x, y = next(batches)
    start = now()
    opt.zero_grad()
    losses = F.cross_entropy(model(x), y, reduction="none")
    if cockpit is None:
        losses.mean().backward()
    else:
        with cockpit(step, losses=losses):
            losses.mean().backward()
    opt.step()
    elapsed = now() - start
    if kind in times:
        times[kind].append(elapsed)
nones = 0
if cockpit is not None:
    cockpit.close()
    nones = sum(v is None for values in cockpit.get_output().values() for v in values.values())
peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
largest = max(p.numel() for p in model.parameters())
print(json.dumps({
    "tracked": statistics.median(times["t"]) if cockpit else None,
    "untracked": statistics.median(times["u"] + ([] if cockpit else times["t"])),
    "tracked_min": min(times["t"]) if cockpit else None,
    "untracked_min": min(times["u"] + ([] if cockpit else times["t"])),
    "peak_mib": peak_mib,
    "largest_layer_mib": 128 * largest * 4 / 2**20,
    "not_computed": nones,
}))
"""

INSTRUMENTS = ["Loss", "GradNorm", "Distance", "UpdateSize", "NormTest", "InnerTest",
               "OrthoTest", "GradHist1d", "Alpha", "MeanGSNR", "EarlyStopping", "CABS"]


def run(problem: str, config: str, steps: int, threads: int, optimizer: str, clock: str,
        curvature: str = "auto") -> dict:
    return run_worker(WORKER, problem, config, str(steps), str(threads), optimizer, clock,
                      curvature)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=["cifar10_3c3d", "fmnist_2c2d"])
    parser.add_argument("--configs", nargs="+", default=[*INSTRUMENTS, "economy"])
    parser.add_argument("--optimizer", default="sgd",
                        choices=["sgd", "sgd-plain", "adam", "custom"])
    parser.add_argument("--steps", type=int, default=9, help="measured tracked steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh subprocesses per configuration; the median over them is "
                        "reported with the range (the machine's noise is ±0.3×)")
    parser.add_argument("--interleave", action="store_true",
                        help="run the repeats round-robin over the configurations")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall-clock time, or the process's CPU time (robust when other "
                        "processes load the machine; use with --threads 1)")
    parser.add_argument("--curvature", default="auto",
                        choices=["auto", "diag_ggn_exact", "diag_ggn_mc", "hutchinson",
                                 "diag_hessian"],
                        help="curvature= of HessTrace/TICDiag/TICTrace (business, full)")
    args = parser.parse_args()
    opts = (args.steps, args.threads, args.optimizer, args.clock, args.curvature)
    rows = []
    for problem in args.problems:
        base = run(problem, "none", *opts)
        print(f"\n{problem} ({args.optimizer}): step without Cockpit "
              f"{base['untracked'] * 1e3:.0f} ms, peak {base['peak_mib']:.0f} MiB, largest "
              f"layer |B|×D {base['largest_layer_mib']:.0f} MiB", flush=True)
        print(f"{'config':>14} {'tracked/untracked':>18} {'(min)':>6} {'untracked ms':>13} "
              f"{'peak − baseline MiB':>20}", flush=True)
        if args.interleave:
            interleaved: dict[str, list[dict]] = {c: [] for c in args.configs}
            for _ in range(max(1, args.repeats)):
                for config in args.configs:
                    interleaved[config].append(run(problem, config, *opts))
        for config in args.configs:
            start = time.perf_counter()
            runs = (interleaved.pop(config) if args.interleave else
                    [run(problem, config, *opts) for _ in range(max(1, args.repeats))])
            ratios = sorted(r["tracked"] / r["untracked"] for r in runs)
            ratio = statistics.median(ratios)
            ratio_min = statistics.median(r["tracked_min"] / r["untracked_min"] for r in runs)
            r = runs[0]
            extra = max(x["peak_mib"] for x in runs) - base["peak_mib"]
            untracked = statistics.median(x["untracked"] for x in runs)
            rows.append((problem, config, ratio, ratio_min, untracked * 1e3, extra,
                         base["largest_layer_mib"]))
            missing = f"  ({r['not_computed']} values not computed)" if r["not_computed"] else ""
            spread = f"  runs {ratios[0]:.2f}–{ratios[-1]:.2f}" if len(runs) > 1 else ""
            print(f"{config:>14} {ratio:>18.2f} {ratio_min:>6.2f} {untracked * 1e3:>13.0f} "
                  f"{extra:>20.0f}   ({time.perf_counter() - start:.0f} s){missing}{spread}",
                  flush=True)
    print(f"\noptimizer: {args.optimizer}, threads: {args.threads}, clock: {args.clock}\n")
    print("| problem | configuration | tracked / untracked (median) | (min) "
          "| untracked step [ms] | peak memory − baseline [MiB] | largest layer |B|×D [MiB] |")
    print("|---|---|---|---|---|---|---|")
    for problem, config, ratio, ratio_min, untracked, extra, largest in rows:
        print(f"| {problem} | {config} | {ratio:.2f}× | {ratio_min:.2f}× | {untracked:.0f} "
              f"| {extra:.0f} | {largest:.0f} |")


if __name__ == "__main__":
    main()
