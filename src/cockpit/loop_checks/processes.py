"""torch.distributed: whether every process runs Cockpit, whether the processes step
on the same gradient (else the global batch's values describe no optimizer step), and
whether DistributedDataParallel's ``join()`` lets a process run out of batches (its Cockpit
then answers no collective)."""

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


JOINING = (
    "DistributedDataParallel's join() is active (uneven numbers of batches per process): a "
    "process that ran out of batches answers no collective of Cockpit's, so no process can "
    "combine the batch's statistics, and its own would be one shard's; Cockpit records the "
    "batch instruments as None while join() is active. Give every process the same number "
    "of batches (DistributedSampler(..., drop_last=True)) to have them")


def joining(ddp: tuple[torch.nn.Module, ...]) -> bool:
    """Whether one of the DistributedDataParallel wrappers ``ddp`` is inside its ``join()``
    context (the Join context manager enables each joinable's ``_join_config``)."""
    return any(getattr(getattr(module, "_join_config", None), "enable", False)
               for module in ddp)
