"""Stress tool: how often does a 2-process gloo run abort when its processes exit?

Each run starts the two processes of tests/exit_worker.py (gloo on 127.0.0.1; they train a
small MLP with DistributedDataParallel for a few steps and leave right after the last
collective) and counts their exit codes (-6: SIGABRT, "terminate called without an active
exception"). Every option except the ones below is passed on to the worker (see its
docstring: --last, --exit, --pin, --idle, --linger, --unsafe-release, --steps).

    python scripts/ddp_exit_stress.py --runs 20 --pin --idle --linger 0.05
    python scripts/ddp_exit_stress.py --runs 20 --pin --idle --linger 0.05 --unsafe-release
    python scripts/ddp_exit_stress.py --runs 20 --last tensor --pin --idle   # no Cockpit

``--cores DIR`` lets aborting processes dump core into DIR; read the aborting thread's stack
with ``gdb $(python -c 'import sys; print(sys.executable)') DIR/core -batch -ex bt``.
Numbers: benchmarks/RESULTS.md, "Exit of gloo processes".
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.exit_worker import run_pair  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--cores", type=Path, default=None)
    args, worker_args = parser.parse_known_args()
    if args.cores is not None:
        args.cores.mkdir(parents=True, exist_ok=True)
    codes: collections.Counter = collections.Counter()
    failed_runs = 0
    start = time.perf_counter()
    for run in range(args.runs):
        results = run_pair(worker_args, cwd=args.cores, cores=args.cores is not None)
        codes.update(code for code, _ in results)
        if any(code != 0 for code, _ in results):
            failed_runs += 1
            print(f"run {run}: " + "; ".join(
                f"rank {r}: exit {code} " + " | ".join(err.strip().splitlines()[-2:])
                for r, (code, err) in enumerate(results) if code != 0), flush=True)
    print(f"{' '.join(worker_args)}: {args.runs} runs ({time.perf_counter() - start:.0f} s), "
          f"runs with a failed rank: {failed_runs}; exit codes of the {2 * args.runs} "
          f"processes: {dict(codes)}")


if __name__ == "__main__":
    main()
