"""torch.distributed: whether every process runs Cockpit, and whether the processes step
on the same gradient (else the global batch's values describe no optimizer step)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from cockpit._stacklevel import user_stacklevel
from cockpit.engine.reduction import ranks


def every_rank_attached(index: int) -> bool:
    """Whether every process runs this Cockpit (``index``: this process's attachment):
    combining the processes' statistics otherwise waits for ever at the first all-reduce.
    Where not, warns that this process is watched alone."""
    if ranks.every_rank_attached(index):
        return True
    warnings.warn(
        f"Cockpit runs in only some of the {ranks.world_size()} processes (e.g. only on "
        "rank 0): its values describe this process's own batch, not the global one. For "
        "the global batch, create Cockpit in every process (each watches the same "
        "training; only rank 0 writes); Cockpit(..., distributed=False) says 'this process "
        "alone' without this check's wait", RuntimeWarning, stacklevel=user_stacklevel())
    return False


def ranks_step_apart(step: int, stepped: dict[str, Tensor], device: torch.device,
                     warn: Callable[..., None]) -> str | None:
    """With combined processes: the reason the global values describe no step, if the
    processes are about to step on different gradients (else None)."""
    if not ranks.stepped_gradient_differs(stepped, device):
        return None
    message = ("the processes step on different gradients (each trains its own model, or "
               "gradients are not synchronized), so the global batch's values describe no "
               "optimizer step: pass Cockpit(..., distributed=False) to watch each process "
               "on its own, or synchronize the gradients (DistributedDataParallel, or "
               "all-reduce them inside the `with` block)")
    warn(f"step {step}: {message}; the step's batch instruments are not recorded",
         key="ranks-step-apart")
    return message
