"""One crossing to the host per recorded step.

The instruments' numbers are formed on the parameters' device. Reading each of them on the
host (``.item()``, ``float(t)``) waits for the device every time: on a GPU the step then
costs a round trip per number instead of the kernels. Here an instrument returns a
:class:`Later` instead — a function of host numbers and the device tensors it needs — and
the step's tensors travel together:

* :meth:`Readout.send` packs every tensor of the record into one flat buffer (one ``cat``
  per device, promoted to float64, which holds float32/float16/bfloat16 values and counts
  below 2^53 exactly) and starts its copy to the host: on CUDA non-blocking into pinned
  memory, followed by an event, so the step returns without waiting;
* :meth:`Readout.receive` waits for the event (by then, at the next step, long done),
  unpacks the buffer into NumPy arrays and evaluates the functions in the order they were
  registered.

The buffer is packed when the record is made: tensors that change later (parameters, scratch
memory reused at the next step) are read as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor


class Later:
    """Values known once some tensors reach the host: ``fn(*arrays)`` gives a dict of values
    (instrument name → value) or a :class:`Noted` holding one.

    Each tensor argument arrives as a NumPy float64 array of the tensor's shape (a 0-dim
    tensor as a 0-dim array; ``float(array)`` reads it).
    """

    __slots__ = ("fn", "name", "tensors")

    def __init__(self, fn: Callable[..., Any], *tensors: Tensor, name: str | None = None):
        self.fn = fn
        self.tensors = tensors
        self.name = name  # the instrument whose value this is (for a failure's note)

    def __repr__(self) -> str:
        return f"Later({getattr(self.fn, '__qualname__', self.fn)!r}, {len(self.tensors)} tensors)"


class Noted(NamedTuple):
    """Values with notes (instrument name → reason) and warnings, from a :class:`Later`."""

    values: dict[str, Any]
    notes: Mapping[str, str] = MappingProxyType({})
    warnings: tuple[tuple[str, str], ...] = ()  # (message, key: warned once per key)


class Failed(NamedTuple):
    """The result of a :class:`Later` whose function raised."""

    name: str | None
    error: Exception


class Readout:
    """The tensors of the records made since the last read, on their way to the host.

    :meth:`send` packs a record's tensors into one float64 buffer per device and starts its
    copy; :meth:`receive` waits once (for the last copy: they are queued in order) and
    evaluates every record's functions.
    """

    def __init__(self) -> None:
        self._parts: list[tuple[Tensor, list[tuple[int, torch.Size]]]] = []  # (offset, shape)
        self._pending: list[Later] = []
        self._tasks: list[tuple[Later, int]] = []  # (later, index of its first tensor)
        self._count = 0  # tensors sent so far
        self._events: dict[torch.device, Any] = {}  # the last copy's event per device

    def __bool__(self) -> bool:
        return bool(self._tasks or self._pending)

    def later(self, later: Later) -> int:
        """Register ``later`` for the next :meth:`send`; returns its index."""
        self._pending.append(later)
        return len(self._tasks) + len(self._pending) - 1

    def send(self) -> None:
        """Pack the tensors of the Laters registered since the last send, start the copy."""
        pending, self._pending = self._pending, []
        tensors = []
        for later in pending:
            self._tasks.append((later, self._count + len(tensors)))
            tensors.extend(t.detach() if t.requires_grad else t for t in later.tensors)
        self._count += len(tensors)
        by_device: dict[torch.device, list[Tensor]] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        # a model spread over devices (rare): one part per tensor keeps their order
        groups = [[t] for t in tensors] if len(by_device) > 1 else list(by_device.values())
        for group in groups:
            device = group[0].device
            # exact in float64; a 1-d tensor needs no view (each is host work on a GPU), the
            # 0-dim ones are stacked into one part after the others
            parts = [t if t.dim() == 1 else t.reshape(-1) for t in group if t.dim() != 0]
            scalars = [t for t in group if t.dim() == 0]
            if len(scalars) == 1:
                parts.append(scalars[0].reshape(1))
            elif len({t.dtype for t in scalars}) == 1:
                parts.append(torch.stack(scalars))
            elif scalars:  # (stacked as they are, int64 and float32 would meet in float32)
                parts.append(torch.stack(scalars, out=torch.empty(
                    len(scalars), dtype=torch.float64, device=device)))
            layout, offset, tail = [], 0, sum(t.numel() for t in group if t.dim() != 0)
            for t in group:
                if t.dim() == 0:
                    layout.append((tail, t.shape))
                    tail += 1
                else:
                    layout.append((offset, t.shape))
                    offset += t.numel()
            if any(t.dtype == torch.float64 for t in group):
                flat = torch.cat(parts)  # promotes every dtype to float64 itself
            else:  # (float32 and int64 would promote to float32)
                flat = torch.empty(sum(t.numel() for t in group), dtype=torch.float64,
                                   device=device)
                torch.cat(parts, out=flat)
            if device.type == "cuda":
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._events[device] = event
            else:
                host = flat.to("cpu")
            self._parts.append((host, layout))

    def receive(self) -> list[Any]:
        """Wait for the copies and evaluate every registered function, in order."""
        self.send()
        for event in self._events.values():
            event.synchronize()  # the copies ran in stream order: the last one is enough
        arrays: list[np.ndarray] = []
        for host, layout in self._parts:
            values = host.numpy()
            for offset, shape in layout:
                arrays.append(values[offset : offset + shape.numel()].reshape(shape))
        results: list[Any] = []
        for later, first in self._tasks:
            try:
                results.append(later.fn(*arrays[first : first + len(later.tensors)]))
            except Exception as error:
                results.append(Failed(later.name, error))
        self.__init__()
        return results
