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
the synchronized gradient into ``p.grad``: the copies hold this process's gradient.

The copies reuse the buffers of the last tracked step (``spares``) where they fit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.engine.capture.end_of_backward import queue_at_end_of_backward


class BatchGradientCopies:
    """Aliases waiting for their copy, and the one copy that ends them."""

    def __init__(self) -> None:
        self.waiting: dict[str, Tensor] = {}

    def keep(self, name: str, alias: Tensor, grads: dict[str, Tensor],
             spares: dict[str, Tensor]) -> None:
        """``grads[name]`` is ``alias`` until the end of this backward pass, then a copy."""
        grads[name] = alias
        first = not self.waiting
        self.waiting[name] = alias
        if first and not queue_at_end_of_backward(lambda: self.copy(grads, spares)):
            self.copy(grads, spares)  # (not inside a backward pass: at once)

    def copy(self, grads: dict[str, Tensor], spares: dict[str, Tensor]) -> None:
        """Replace every waiting alias in ``grads`` by a copy (one multi-tensor copy)."""
        waiting, self.waiting = self.waiting, {}
        names = [k for k, alias in waiting.items() if grads.get(k) is alias]
        if not names:
            return
        sources = [waiting[k] for k in names]
        targets = [_fitting(spares.pop(k, None), source) for k, source in zip(names, sources,
                                                                              strict=True)]
        with torch.no_grad():
            torch._foreach_copy_(targets, sources)
        grads.update(zip(names, targets, strict=True))

    def discard(self) -> None:
        self.waiting = {}


def _fitting(spare: Tensor | None, source: Tensor) -> Tensor:
    if (spare is not None and spare.shape == source.shape and spare.dtype == source.dtype
            and spare.device == source.device and spare.stride() == source.stride()):
        return spare
    return torch.empty_like(source)
