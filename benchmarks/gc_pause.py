"""Python's cyclic garbage collector in a tracked run, with and without Cockpit holding it
back during tracked steps (``cockpit.engine.gc_pause``; off: ``COCKPIT_GC_PAUSE=0``).

    python benchmarks/gc_pause.py                       # the three proxies, every step
    python benchmarks/gc_pause.py --problems gpt2 --every 10 --steps 600

``host_overhead.py``'s problems (|B| = 2, accelerator paths forced, one thread), each run in
processes of its own, with and without the hold alternated: the collections per step of each
generation and the time they took (``gc.callbacks``), and the whole run's time per step
(medians hide the full collections, which come every few hundred steps and take the most).
The GPT-2 proxy imports ``transformers``, as a user's run of GPT-2 does: its process holds
≈ 400,000 objects, which every full collection traverses.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from host_overhead import PROBLEMS, _registered
from op_count import make_step


def one_run(problem: str, config: str, every: int, steps: int) -> dict[str, float]:
    """Collections a step per generation, their ms a step, and the run's ms a step."""
    from cockpit.engine.histograms import device as histogram_device
    from cockpit.schedules import every as every_kth

    torch.set_num_threads(1)
    histogram_device._forced = True
    step, _ = make_step(_registered(problem), config, 2,
                        schedule=every_kth(every) if every > 1 else None)
    for i in range(2 * every + 3):
        step(i)
    counts, seconds, started = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            counts[info["generation"]] += 1
            seconds[info["generation"]] += time.perf_counter() - started[0]

    first = 2 * every + 3
    gc.callbacks.append(watch)
    start = time.perf_counter()
    for i in range(first, first + steps):
        step(i)
    total = time.perf_counter() - start
    gc.callbacks.remove(watch)
    result = {f"gen{g} per step": counts[g] / steps for g in range(3)}
    result.update({f"gen{g} ms": 1000 * seconds[g] / steps for g in range(3)})
    result["step ms"] = 1000 * total / steps
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", choices=sorted(PROBLEMS),
                        default=["3c3d", "resnet18_gn", "gpt2"])
    parser.add_argument("--config", default="economy")
    parser.add_argument("--every", type=int, default=1, help="track every k-th step")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=2, help="alternated runs of each")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # (a run in this process)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.config, args.every, args.steps)))
        return
    print(f"{args.config}, tracked every {args.every}, {args.steps} steps a run, "
          f"{args.pairs} alternated runs of each; per step: collections of generations "
          "0/1/2, the ms they took, the run's ms")
    for problem in args.problems:
        runs: dict[str, list[dict]] = {"held": [], "not held": []}
        for _ in range(args.pairs):
            for label, value in (("not held", "0"), ("held", "1")):
                env = {**os.environ, "COCKPIT_GC_PAUSE": value}
                out = subprocess.run(
                    [sys.executable, __file__, "--one", problem, "--config", args.config,
                     "--every", str(args.every), "--steps", str(args.steps)],
                    env=env, capture_output=True, text=True, check=True).stdout
                runs[label].append(json.loads(out.strip().splitlines()[-1]))
        for label, results in runs.items():
            def mean(key: str, results=results) -> float:
                return statistics.mean(r[key] for r in results)
            collections = "/".join(f"{mean(f'gen{g} per step'):.2f}" for g in range(3))
            ms = "/".join(f"{mean(f'gen{g} ms'):.3f}" for g in range(3))
            total = sum(mean(f"gen{g} ms") for g in range(3))
            steps = ", ".join(f"{r['step ms']:.2f}" for r in results)
            print(f"{problem:12s} {label:9s} collections {collections}, {ms} ms "
                  f"(total {total:.2f} ms); run {steps} ms a step")


if __name__ == "__main__":
    main()
