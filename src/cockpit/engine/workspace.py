"""Scratch memory reused from one layer and one tracked step to the next.

Per-sample work needs large temporaries (a convolution's unfolded input, a layer's |B|×D
individual gradients). Freshly allocated, each of them costs page faults on a CPU: glibc
serves blocks above a few MiB by ``mmap`` and returns them on free, so every tracked step
touches new pages — measured at 30–50 % of the time of the per-sample work on the DeepOBS
networks (e.g. unfolding 2C2D's second convolution: 54 ms fresh, 15 ms into a reused
buffer). A :class:`Workspace` keeps one growing buffer per purpose and hands out views of
it, so the pages are touched once.

Layers are processed one after another, so one buffer per purpose serves every layer; a
view stays valid until the next request for the same purpose. Whoever keeps a result
beyond that (e.g. individual gradients accumulated over several calls of a tied layer)
must copy it. Memory: the largest request per purpose, kept until :func:`release_workspace`
(called when a Cockpit is closed). A GPU's buffers are freed at the end of every tracked
step (``release_workspace(off_cpu_only=True)``): its caching allocator serves the next
step's requests without page faults or device allocations, and between tracked steps and
through the forward passes the memory is the training's (3C3D's unfolded inputs at
|B| = 128: 288 MiB).
"""

from __future__ import annotations

import math
import threading
import weakref

import torch
from torch import Tensor


class Workspace:
    """Growing scratch buffers, one per purpose (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}
        self._taken = 0  # counts requests, to tell whether a taken view is still valid
        self._last: dict[tuple[str, torch.dtype, torch.device], int] = {}
        # the views handed out, by (key, shape): a repeated request makes no new view (on a
        # GPU each view is host work per layer and step)
        self._views: dict[tuple, Tensor] = {}

    def take(self, purpose: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
             device: torch.device) -> tuple[Tensor, tuple]:
        """An uninitialized tensor of ``shape`` backed by the buffer of ``purpose``, and a
        ticket for :meth:`valid`. It invalidates every earlier tensor taken for the same
        purpose (dtype, device)."""
        numel = math.prod(shape)
        key = (purpose, dtype, torch.device(device))
        self._taken += 1
        self._last[key] = self._taken
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            self._buffers.pop(key, None)  # free the old buffer before allocating the new
            self._views = {k: v for k, v in self._views.items() if k[0] != key}
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        shape = tuple(shape)
        view = self._views.get((key, shape))
        if (view is None or view.shape != shape or view.storage_offset() != 0
                or not view.is_contiguous() or view.data_ptr() != buffer.data_ptr()):
            view = self._views[(key, shape)] = buffer[:numel].view(shape)
        return view, (key, self._taken)

    def valid(self, ticket: tuple) -> bool:
        """Whether the tensor taken with ``ticket`` still holds what was written to it."""
        key, number = ticket
        return self._last.get(key) == number and key in self._buffers

    def release(self, off_cpu_only: bool = False) -> None:
        """Forget the buffers (those on other devices than the CPU, if ``off_cpu_only``)."""
        if not off_cpu_only:
            self._buffers.clear()
            self._last.clear()
            self._views.clear()
            return
        for key in [k for k in self._buffers if k[2].type != "cpu"]:
            del self._buffers[key]
            self._last.pop(key, None)
        self._views = {k: v for k, v in self._views.items() if k[0] in self._buffers}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


PARAMETER_SIZED = "parameter-sized"
"""The purpose of the parameter-sized temporaries whose norm is taken at once (θ_t − θ_0,
p.grad − c·ḡ, a fit's residual a − Vc). They are formed one after another, so one buffer of
the largest parameter's size serves them all, kept from step to step."""

_LOCAL = threading.local()
_ALL: weakref.WeakSet[Workspace] = weakref.WeakSet()
_ALL_LOCK = threading.Lock()


def workspace() -> Workspace:
    """The calling thread's workspace (threads never share a buffer: on CUDA the backward
    hooks run in autograd's device threads, and training loops may run in several threads)."""
    ws = getattr(_LOCAL, "workspace", None)
    if ws is None:
        ws = _LOCAL.workspace = Workspace()
        with _ALL_LOCK:
            _ALL.add(ws)
    return ws


def release_workspace(off_cpu_only: bool = False) -> None:
    """Free the scratch buffers of every thread (those off the CPU, if ``off_cpu_only``).
    Safe while another thread works: tensors it holds keep their memory alive, and its next
    request allocates afresh."""
    with _ALL_LOCK:
        workspaces = list(_ALL)
    for ws in workspaces:
        ws.release(off_cpu_only)
