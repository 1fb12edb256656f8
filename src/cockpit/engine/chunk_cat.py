"""Several tensors flattened and concatenated by one copy: ``torch._chunk_cat`` (FSDP2's
copy-in) instead of a view (or copy) per tensor and a ``cat``. Older torch has the op but
views its inputs, which fails for non-contiguous ones: there only contiguous tensors take it
(the capability is probed once, on two CPU numbers' worth of work)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor


@functools.cache
def _takes_strided_inputs() -> bool:
    try:
        torch._chunk_cat([torch.ones(2, 3).T], 0, 1)
    except RuntimeError:
        return False
    return True


def chunk_cat_takes(tensors: Sequence[Tensor]) -> bool:
    """Whether ``torch._chunk_cat`` can flatten and concatenate ``tensors`` in this torch."""
    if getattr(torch, "_chunk_cat", None) is None:
        return False
    return _takes_strided_inputs() or all(t.is_contiguous() for t in tensors)


def flat_cat(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors flattened and concatenated, [Σ numel] (0-dim ones as one number): one
    op where ``torch._chunk_cat`` takes them, else a view per tensor and a ``cat``."""
    parts = [t if t.dim() else t.view(1) for t in tensors]
    if chunk_cat_takes(parts) and all(t.numel() for t in parts):
        return torch._chunk_cat(parts, 0, 1).view(-1)
    return torch.cat([t.reshape(-1) for t in parts])
