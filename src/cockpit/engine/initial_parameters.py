"""θ_0, the parameters when the Cockpit was created (Distance ‖θ_t − θ_0‖, paper Table 2),
kept where it costs least.

θ_0 is read only where Distance is formed, at the end of a tracked step's backward passes;
kept beside the parameters it is one more copy of the model in device memory during every
backward pass, where a training step peaks (GPT-2 124M: 475 MiB of a 4.2 GiB step). So on a
GPU a θ_0 above :data:`HOST_ABOVE` bytes waits in the host's pinned memory, one buffer per
dtype, and :func:`brought` copies the part a group of differences needs to the device
(asynchronous copies from pinned memory, one per run of adjacent tensors) right before it is
read, freed after. The values are the same numbers either way: the copy is exact.
Elsewhere (CPU, smaller models, sharded parameters) θ_0 is a clone beside each parameter.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from cockpit.engine import sharded

HOST_ABOVE = 2**27
"""Bytes of θ_0 above which it is kept in the host's pinned memory on a GPU (32 M float32
parameters: GPT-2 124M is, a CIFAR ResNet-18 with 45 MB is not)."""

# Tests set this to keep θ_0 in a host buffer (unpinned) on any device, the CPU included,
# and to copy it in :func:`brought` as from a GPU's host.
_forced = False


def snapshot(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """θ_0 of ``params`` (detached copies): on the host when :func:`kept_on_host`, else on
    each parameter's device."""
    if not kept_on_host(params):
        return {k: p.detach().clone() for k, p in params.items()}
    return host_copies(params)


def kept_on_host(params: Mapping[str, Tensor]) -> bool:
    """Whether θ_0 of ``params`` waits in the host's memory: plain (unsharded) tensors on one
    CUDA device with more than :data:`HOST_ABOVE` bytes (any device when forced)."""
    tensors = list(params.values())
    if not tensors or sharded.has_sharded(tensors):
        return False
    if _forced:
        return True
    device = tensors[0].device
    return (device.type == "cuda" and all(t.device == device for t in tensors)
            and sum(t.numel() * t.element_size() for t in tensors) > HOST_ABOVE)


def held_apart(initial: list[Tensor], params: list[Tensor]) -> bool:
    """Whether θ_0 (``initial``, as :func:`snapshot` made it) waits apart from ``params``
    and must be :func:`brought` to their device."""
    return bool(initial) and (initial[0].device != params[0].device or (
        _forced and initial[0].device.type == "cpu"))


def host_copies(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Copies of ``tensors`` in the host's memory as views of one buffer per dtype, in the
    given order (so that :func:`brought` copies adjacent ones at once); pinned where a GPU
    is present."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    pin = torch.cuda.is_available()
    out: dict[str, Tensor] = {}
    for dtype, names in by_dtype.items():
        buffer = torch.empty(sum(tensors[k].numel() for k in names), dtype=dtype,
                             pin_memory=pin)
        offset = 0
        for name in names:
            t = tensors[name].detach()
            view = buffer[offset: offset + t.numel()].view(t.shape)
            view.copy_(t)
            out[name] = view
            offset += t.numel()
    return out


def brought(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """``tensors`` on ``device``: as they are where they already live there; host ones by one
    asynchronous copy per run of tensors adjacent in one buffer (as :func:`host_copies`
    lays them out), split into views of the copy."""
    out: list[Tensor] = []
    start = 0
    while start < len(tensors):
        first = tensors[start]
        if first.device == device and not _forced:
            out.append(first)
            start += 1
            continue
        stop = start + 1
        while stop < len(tensors) and _follows(tensors[stop - 1], tensors[stop]):
            stop += 1
        run = tensors[start:stop]
        sizes = [t.numel() for t in run]
        flat = first.as_strided((sum(sizes),), (1,), first.storage_offset())
        copied = flat.to(device, non_blocking=True, copy=True)
        out.extend(piece.view(t.shape) for piece, t in zip(copied.split(sizes), run,
                                                           strict=True))
        start = stop
    return out


def _follows(a: Tensor, b: Tensor) -> bool:
    """Whether ``b`` starts in ``a``'s buffer right where ``a`` ends (both contiguous)."""
    return (a.device == b.device and a.dtype == b.dtype and a.is_contiguous()
            and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel())
