"""Helpers shared by the benchmark scripts (run them from the repository root:
``python benchmarks/<script>.py``; this directory is then on ``sys.path``)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, min) wall time of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up (threshold cache, allocator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def run_worker(worker: str, *args: str) -> dict:
    """Run the script ``worker`` in a fresh Python process; its last output line is JSON.
    A failing worker ends the benchmark with its error output."""
    result = subprocess.run([sys.executable, "-c", worker, *args], capture_output=True,
                            text=True)
    if result.returncode != 0:
        sys.exit(f"worker failed ({' '.join(args)}):\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])
