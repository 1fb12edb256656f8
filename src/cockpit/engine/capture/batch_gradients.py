"""The gradient each parameter receives in a tracked backward pass, copied once for all
parameters at the end of the pass.

A parameter's hook sees ∂L/∂θ of this backward pass before autograd accumulates it into
``p.grad``. Cockpit keeps its own copy (the user may edit ``p.grad`` in place later, and
micro-batches accumulate into it), but copying in each hook costs one kernel per parameter.
The hook keeps an alias instead (a detached view: autograd can still hand the tensor itself
to ``p.grad``, no clone), and one multi-tensor copy at the end of the backward pass, queued
with autograd's engine, moves every alias into a copy of Cockpit's own. Autograd runs its
queued callbacks in order, and Cockpit's is queued at the first parameter hook, before the
callbacks of DistributedDataParallel (queued when its last bucket is ready), which write
the synchronized gradient into ``p.grad``: the copies hold this process's gradient. With
``static_graph`` DDP's first iteration queues its all-reduce when the backward pass
reaches the model's output, before any parameter hook: there the copy is queued when it
reaches the losses (:meth:`BatchGradientCopies.reserve`).

The copies reuse the buffers of the last tracked step (``spares``) where they fit; the
others are made by one fused kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.engine.capture.end_of_backward import queue_at_end_of_backward


class BatchGradientCopies:
    """Aliases waiting for their copy, and the one copy that ends them."""

    def __init__(self) -> None:
        self.waiting: dict[str, Tensor] = {}
        self.queued = False  # the copy is queued at the end of this backward pass

    def reserve(self, grads: dict[str, Tensor], spares: dict[str, Tensor]) -> None:
        """Queue the copy now, at the start of a backward pass (see the module docstring)."""
        if not self.queued:
            self.queued = queue_at_end_of_backward(lambda: self.copy(grads, spares))

    def keep(self, name: str, alias: Tensor, grads: dict[str, Tensor],
             spares: dict[str, Tensor]) -> None:
        """``grads[name]`` is ``alias`` until the end of this backward pass, then a copy."""
        grads[name] = alias
        self.waiting[name] = alias
        if not self.queued:
            self.reserve(grads, spares)
            if not self.queued:
                self.copy(grads, spares)  # (not inside a backward pass: at once)

    def copy(self, grads: dict[str, Tensor], spares: dict[str, Tensor]) -> None:
        """Replace every waiting alias in ``grads`` by a copy (one multi-tensor copy)."""
        waiting, self.waiting, self.queued = self.waiting, {}, False
        names = [k for k, alias in waiting.items() if grads.get(k) is alias]
        if not names:
            return
        kept = {k: spare for k in names
                if (spare := spares.pop(k, None)) is not None and same_layout(spare, waiting[k])}
        fresh = [k for k in names if k not in kept]
        with torch.no_grad():
            if kept:
                torch._foreach_copy_(list(kept.values()), [waiting[k] for k in kept])
            if fresh:  # new copies by one fused kernel (x·1 = x exactly)
                grads.update(zip(fresh, torch._foreach_mul([waiting[k] for k in fresh], 1.0),
                                 strict=True))
        grads.update(kept)

    def discard(self) -> None:
        self.waiting, self.queued = {}, False


def same_layout(buffer: Tensor, source: Tensor) -> bool:
    """Whether ``buffer`` can take a copy of ``source`` as it is: shape, dtype, device and
    strides alike."""
    return (buffer.shape == source.shape and buffer.dtype == source.dtype
            and buffer.device == source.device and buffer.stride() == source.stride())
