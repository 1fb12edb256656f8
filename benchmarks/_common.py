"""Helpers shared by the benchmark scripts (run them from the repository root:
``python benchmarks/<script>.py``; this directory is then on ``sys.path``)."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import types
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


def load_old(commit: str) -> tuple[types.ModuleType, types.ModuleType]:
    """The histogram kernels (``histogram``, ``histogram2d_outer``) as they were at ``commit``
    (a commit before they moved into ``engine/histograms/``), read from git and loaded as
    separate modules beside the current ones."""

    def source(path: str) -> str:
        text = subprocess.run(["git", "show", f"{commit}:{path}"], check=True,
                              capture_output=True, text=True).stdout
        return text.replace(  # their helpers at today's place
            "from cockpit.engine import histogram_device, rounding",
            "from cockpit.engine.histograms import device as histogram_device, rounding")

    old_hist = types.ModuleType("_old_histogram")
    sys.modules["_old_histogram"] = old_hist
    exec(compile(source("src/cockpit/engine/histogram.py"), "old_histogram", "exec"),
         old_hist.__dict__)
    old_2d = types.ModuleType("_old_histogram2d_outer")
    text = source("src/cockpit/engine/histogram2d_outer.py").replace(
        "from cockpit.engine.histogram import", "from _old_histogram import")
    exec(compile(text, "old_histogram2d_outer", "exec"), old_2d.__dict__)
    return old_hist, old_2d


def interleaved(old, new, repeats: int) -> tuple[float, float]:
    """Median wall times of ``old()`` and ``new()``, called alternately ``repeats`` times
    after one warm-up each (load on a shared machine hits both alike)."""
    old(), new()  # warm-up
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(repeats):
        for key, fn in (("old", old), ("new", new)):
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return statistics.median(times["old"]), statistics.median(times["new"])


def add_gpt2_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPT-2-shaped model's options the memory benchmarks share (sizes, memory budget,
    warm-up steps, bfloat16 autocast)."""
    parser.add_argument("--budget", type=int, default=128 * 2**20, help="bytes")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--autocast", action="store_true", help="bfloat16 autocast")


def allocations(prof) -> list[tuple[int, int, object]]:
    """(time, bytes: negative for a free, profiler node) of every allocation event."""
    events = []

    def walk(nodes):
        for node in nodes:
            if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
                events.append((node.start_time_ns, node.extra_fields.alloc_size, node))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    return sorted(events, key=lambda e: e[0])


def peak_of(events: list[tuple[int, int, object]]) -> tuple[int, int]:
    """The most bytes allocated at once over :func:`allocations`' events, above what was
    allocated before them, and the index of the event that reached it (-1: none)."""
    current = peak = 0
    at = -1
    for index, (_, size, _) in enumerate(events):
        current += size
        if current > peak:
            peak, at = current, index
    return peak, at


def cockpit_frame(node) -> str:
    """The innermost Cockpit function on the node's stack ("training" where none is)."""
    while node is not None:
        if re.search(r"(^|/)cockpit/[^(]*\.py\(", node.name):
            return re.sub(r"^.*?(cockpit/)", r"\1", node.name)
        node = node.parent
    return "training"
