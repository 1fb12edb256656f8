"""DistributedDataParallel's state that Cockpit's own backward passes must leave alone.

With ``static_graph=True`` DDP delays its first iteration's all-reduce: the first backward
pass through its output (``_DDPSink.backward``) queues ``reducer._delay_all_reduce`` to run
when that pass ends, and marks it queued so that no later pass queues it again. A
curvature instrument's own backward pass at that step (a Hessian-vector product before the
user's) would run it then — the gradients of Cockpit's pass, not the user's, would be
all-reduced, and the user's backward pass would synchronize nothing: every process then
steps on its own gradient. While Cockpit's passes run the delay is marked queued, so they
queue nothing; the user's backward pass queues it as without Cockpit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel

_QUEUED = "_static_graph_delay_allreduce_enqueued"  # (DDP's own flag; no public accessor)


def static_graph_ddp(model: nn.Module) -> tuple[DistributedDataParallel, ...]:
    """``model``'s DistributedDataParallel wrappers with ``static_graph``."""
    return tuple(m for m in model.modules()
                 if isinstance(m, DistributedDataParallel) and getattr(m, "static_graph", False))


@contextlib.contextmanager
def delayed_all_reduce_held(wrappers: tuple[DistributedDataParallel, ...]) -> Iterator[None]:
    """Inside: backward passes through the static-graph DDP ``wrappers``
    (:func:`static_graph_ddp`) queue no delayed all-reduce (see the module docstring)."""
    held = [m for m in wrappers if not getattr(m, _QUEUED, True)]
    for module in held:
        setattr(module, _QUEUED, True)
    try:
        yield
    finally:
        for module in held:
            setattr(module, _QUEUED, False)
