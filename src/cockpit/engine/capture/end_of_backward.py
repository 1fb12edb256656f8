"""Work for the end of the running backward pass: autograd runs the callbacks queued during
a pass after its last node, in the order they were queued (public in all but name:
``torch.autograd.Variable._execution_engine.queue_callback``, which DistributedDataParallel
uses for its own end of the pass)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def queue_at_end_of_backward(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the running backward pass ends; False (nothing queued) outside
    a backward pass."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
            callback)
    except Exception:  # not inside a backward pass (or an engine without callbacks)
        return False
    return True
