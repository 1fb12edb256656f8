"""Helpers of the benchmark tests: a user-defined optimizer (loaded by import path) whose
steps take a little time, so that a sweep can be interrupted in the middle."""

from __future__ import annotations

import time

import torch


class SlowSGD(torch.optim.SGD):
    """Plain SGD that sleeps ``delay`` seconds per step."""

    def __init__(self, params, lr: float = 0.01, delay: float = 0.05):
        super().__init__(params, lr=lr)
        self.delay = delay

    def step(self, closure=None):
        time.sleep(self.delay)
        return super().step(closure)
