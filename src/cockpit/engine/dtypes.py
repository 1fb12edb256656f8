"""Type promotion without a dispatched op: ``torch.promote_types`` goes through the
dispatcher (an aten op per call, host work on an accelerator), though its answer depends
on the two dtypes alone."""

from __future__ import annotations

import functools

import torch


@functools.cache
def promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype ``torch.promote_types(a, b)``, asked once per pair."""
    return torch.promote_types(a, b)
