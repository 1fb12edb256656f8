"""Helpers of the benchmark tests: a user-defined optimizer (loaded by import path) whose
steps take a little time, so that a sweep can be interrupted in the middle; a benchmark
script run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str, timeout: int = 300
                  ) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<script> args...`` run from the repository root (this checkout's
    ``src`` importable, one thread), which must exit without an error; its output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


class SlowSGD(torch.optim.SGD):
    """Plain SGD that sleeps ``delay`` seconds per step."""

    def __init__(self, params, lr: float = 0.01, delay: float = 0.05):
        super().__init__(params, lr=lr)
        self.delay = delay

    def step(self, closure=None):
        time.sleep(self.delay)
        return super().step(closure)
