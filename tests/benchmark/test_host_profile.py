"""``benchmarks/host_profile.py`` on the CPU: the tracked and untracked steps' times, the
profiler's op table and, with ``--by-site``, the ops' own time by Cockpit's function."""

from __future__ import annotations

import re

from tests.benchmark.bench_helpers import run_benchmark


def test_host_profile_gives_the_ops_time_by_cockpits_function():
    out = run_benchmark("host_profile.py", "--device", "cpu", "--batch", "4", "--steps", "1",
                        "--device-only", "--by-site", "--top", "8", "--path", "accelerator").stdout
    assert re.search(r"3c3d economy, \|B\| = 4, cpu: tracked [\d.]+ ms, untracked", out)
    sites = out.split("== the ops' own time by Cockpit's function")[1].split("== by op")[0]
    rows = [line.split(None, 1) for line in sites.splitlines()[1:] if line.strip()]
    assert rows and all(float(ms) >= 0 for ms, _ in rows)
    names = [where for _, where in rows]
    assert "training" in names  # (the user's step: its forward and backward pass)
    assert any(where.startswith("cockpit/engine/") for where in names)
    # the total in the header is the sum over every function, the listed ones among them
    total = float(re.search(r"all ops ([\d.]+)", sites).group(1))
    assert sum(float(ms) for ms, _ in rows) <= total + 0.1 * len(rows)
