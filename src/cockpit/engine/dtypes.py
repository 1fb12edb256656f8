"""Dtypes without host work that changes nothing: type promotion without a dispatched op
(``torch.promote_types`` goes through the dispatcher, an aten op per call, though its answer
depends on the two dtypes alone), and a tensor in a dtype without a call where it has it
already (``x.to(x.dtype)`` returns ``x`` after ~1 µs of argument parsing: hundreds of
times per tracked step of a model with many parameters)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype ``torch.promote_types(a, b)``, asked once per pair."""
    return torch.promote_types(a, b)


def in_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``: ``x`` itself where it has that dtype."""
    return x if x.dtype == dtype else x.to(dtype)
