"""``benchmarks/gc_pause.py`` on the GPT-2 proxy (148 parameter tensors, ``transformers``
imported): with the collector held back during tracked steps a tracked step starts fewer
collections of the youngest generation than without (each would move the step's live
objects into the older generations)."""

from __future__ import annotations

import re

from tests.benchmark.bench_helpers import run_benchmark


def test_held_tracked_steps_start_fewer_collections():
    out = run_benchmark("gc_pause.py", "--problems", "gpt2", "--steps", "20", "--pairs", "1",
                        timeout=600).stdout
    rows = dict(re.findall(r"^gpt2\s+(held|not held)\s+collections ([\d.]+)/", out, re.M))
    assert set(rows) == {"held", "not held"}, out
    assert float(rows["held"]) < 0.5 * float(rows["not held"]), out
