"""Cockpit's arguments, checked at construction: a clear error for each misuse."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from cockpit.configurations import configuration
from cockpit.engine.capture import compiled
from cockpit.engine.histograms.exact import BinSpec, warn_if_slow
from cockpit.engine.reduction import ranks
from cockpit.quantities.base import Quantity


def checked_arguments(model: Any, quantities: Sequence[Quantity] | str | None,
                      optimizer: Any, grad_scaler: Any, distributed: Any, memory_steps: Any
                      ) -> list[Quantity]:
    """Raise on a misused argument; the instruments as a list."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"Cockpit needs a torch.nn.Module, got {type(model).__name__}")
    ranks.check_supported_wrapper(model)
    compiled.check_supported(model)
    quantities = checked_quantities(quantities)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
        raise TypeError(
            f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}"
        )
    if distributed not in (None, False):
        raise ValueError("distributed must be None (combine the processes of an "
                         "initialised process group) or False (this process alone), "
                         f"got {distributed!r}")
    if memory_steps is not None and int(memory_steps) < 1:
        raise ValueError(f"memory_steps must be at least 1 (or None), got {memory_steps!r}")
    return quantities


def checked_quantities(quantities: Sequence[Quantity] | str | None) -> list[Quantity]:
    """The instruments: a list, a configuration's name, or None (economy)."""
    if quantities is None:
        quantities = configuration("economy")
    elif isinstance(quantities, str):
        quantities = configuration(quantities)
    quantities = list(quantities)
    for quantity in quantities:
        if not isinstance(quantity, Quantity):
            raise TypeError(
                f"quantities must be Quantity instances (e.g. cockpit.quantities.NormTest()"
                f"), got {quantity!r}"
            )
    return quantities


def warn_slow_bins(quantities: list[Quantity], hist_bins: BinSpec | None,
                   hist2d_bins: tuple[BinSpec, BinSpec]) -> None:
    """Warn about bins so many that the histograms would slow training down."""
    used = {type(q).__name__ for q in quantities}
    fixed = () if hist_bins is None else ((hist_bins, "hist_bins", "GradHist1d"),)
    for spec, name, user in (*fixed,
                             (hist2d_bins[0], "hist2d_bins[0]", "GradHist2d"),
                             (hist2d_bins[1], "hist2d_bins[1]", "GradHist2d")):
        if user in used:
            warn_if_slow(spec, name)


def resolved_memory_budget(memory_budget: Any, model: nn.Module) -> int | None:
    """The bytes of individual gradients one layer may hold at once: ``memory_budget`` as
    given (a positive number of bytes, or None for no limit), or for ``"auto"`` 512 MiB,
    at most 1/16 of a GPU's memory. The statistics' temporaries add a few times the
    gradients held (GPT-2's tied token embedding at |B| = 8 with 411 MB of individual
    gradients added 4.6 GB to a CPU step's peak, 0.37 GB in chunks of 128 MiB:
    benchmarks/memory_budget.py), while layers below 512 MiB (3C3D's largest at |B| = 128:
    288 MiB; a Linear layer without sequence dimensions never materializes all at once)
    keep their one pass."""
    if isinstance(memory_budget, str) and memory_budget == "auto":
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            return min(2**29, total // 16)
        return 2**29
    if memory_budget is None:
        return None
    if (isinstance(memory_budget, bool) or not isinstance(memory_budget, int | float)
            or not memory_budget >= 1):
        raise ValueError(
            "memory_budget must be a positive number of bytes (e.g. 2**30), 'auto' (the "
            f"default) or None (no limit), got {memory_budget!r}")
    return int(memory_budget)
