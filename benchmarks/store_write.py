"""Cost of ``RunLogWriter.write_step`` for economy-like and full-like steps.

economy: 40 scalars + a 100-bin GradHist1d + 10 per-parameter 100-bin GradHist1d.
full:    economy + a 40×50 GradHist2d overall and per parameter (10) + 30 per-parameter
         scalars (GradNorm/HessTrace/... per parameter).

Prints the median (and 90th percentile) wall-clock µs per ``write_step`` call and the
median CPU µs of the calling thread (less sensitive to a busy machine), with and without zlib,
plus the database size per step and the time to read the whole log back.

    PYTHONPATH=src python benchmarks/store_write.py [--steps 300]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

if "cockpit" not in sys.modules:  # load cockpit.store without cockpit/__init__ (torch)
    _pkg = types.ModuleType("cockpit")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[1] / "src" / "cockpit")]
    sys.modules["cockpit"] = _pkg

from cockpit.store import RunLogReader, RunLogWriter

PARAMS = [f"layer{i}.{kind}" for i in range(5) for kind in ("weight", "bias")]


def _hist1d(rng: np.random.Generator) -> dict:
    counts, edges = np.histogram(rng.standard_normal(10_000), bins=100)
    return {"counts": counts.astype(np.int64), "edges": edges}


def _hist2d(rng: np.random.Generator) -> dict:
    counts, eg, ep = np.histogram2d(rng.standard_normal(10_000), rng.random(10_000), (40, 50))
    return {"counts": counts.astype(np.int64), "edges_grad": eg, "edges_param": ep}


def economy_step(rng: np.random.Generator) -> dict:
    values: dict = {f"Scalar{i}": float(rng.random()) for i in range(40)}
    values["GradHist1d"] = _hist1d(rng)
    values.update({f"GradHist1d/{p}": _hist1d(rng) for p in PARAMS})
    return values


def full_step(rng: np.random.Generator) -> dict:
    values = economy_step(rng)
    values["GradHist2d"] = _hist2d(rng)
    values.update({f"GradHist2d/{p}": _hist2d(rng) for p in PARAMS})
    for name in ("GradNorm", "HessTrace", "TICDiag"):
        values.update({f"{name}/{p}": float(rng.random()) for p in PARAMS})
    return values


def measure(make, steps: int, compress: bool) -> dict[str, float]:
    rng = np.random.default_rng(0)
    payloads = [make(rng) for _ in range(min(steps, 20))]
    with tempfile.TemporaryDirectory() as tmp:
        times, cpu_times = [], []
        with RunLogWriter(tmp, compress=compress) as writer:
            for step in range(steps):
                t0, c0 = time.perf_counter(), time.thread_time()
                writer.write_step(step, payloads[step % len(payloads)])
                times.append(time.perf_counter() - t0)
                cpu_times.append(time.thread_time() - c0)
            # a late value into an earlier step (the Alpha path: upsert)
            late = []
            for step in range(min(steps, 50)):
                t0 = time.perf_counter()
                writer.write_step(step, {"Alpha": 0.1})
                late.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in Path(tmp).iterdir())
        t0 = time.perf_counter()
        out = RunLogReader(tmp).output()
        read_s = time.perf_counter() - t0
        assert len(out) == steps
    us = np.array(times) * 1e6
    return {
        "median_us": float(np.median(us)),
        "p90_us": float(np.percentile(us, 90)),
        "cpu_median_us": float(np.median(cpu_times) * 1e6),
        "late_median_us": float(np.median(np.array(late) * 1e6)),
        "kb_per_step": size / steps / 1024,
        "read_ms_per_step": read_s / steps * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(
        f"{'step kind':10} {'zlib':5} {'median µs':>10} {'p90 µs':>9} {'cpu µs':>7} {'late µs':>8} "
        f"{'KiB/step':>9} {'read ms/step':>13}"
    )
    for label, make in (("economy", economy_step), ("full", full_step)):
        for compress in (True, False):
            r = measure(make, args.steps, compress)
            print(
                f"{label:10} {compress!s:5} {r['median_us']:10.0f} {r['p90_us']:9.0f} "
                f"{r['cpu_median_us']:7.0f} "
                f"{r['late_median_us']:8.0f} {r['kb_per_step']:9.1f} {r['read_ms_per_step']:13.2f}"
            )


if __name__ == "__main__":
    main()
