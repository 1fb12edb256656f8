"""Instruments that run a Lanczos method on H_B·v, the Hessian-vector products of the user's
own forward graph (HessTopEV, HessDensity): the shared preparation and hand-over.

At ``prepare`` (the block's start, the graph still alive) the operator v ↦ H_B v over every
tracked parameter is built and :meth:`HessianOperatorQuantity.solve` runs on it; ``compute``
takes the result, or records None with the reason. They need the whole batch's graph (None
when the batch is split over micro-batches or processes) and finite losses. Under
``fully_shard`` (one process) the operator differentiates the graph's unsharded parameters
(:meth:`EngineView.graph_params`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cockpit.curvature.diagonal import hessian_vector_product
from cockpit.engine.engine_view import EngineView
from cockpit.quantities.base import Quantity, StepData
from cockpit.schedules import Schedule

NON_FINITE = "non-finite loss at this step: no Hessian-vector products"


class HessianOperatorQuantity(Quantity):
    differentiates_graph = True
    whole_batch_graph = True

    def __init__(self, schedule: Schedule | int | None = None, *, seed: int = 0):
        super().__init__(schedule)
        self.generator = torch.Generator().manual_seed(seed)
        self._result: Any = None
        self._skipped: str | None = None

    def solve(self, matvec, dim: int, dtype: torch.dtype, device: torch.device) -> Any:
        """The instrument's computation on v ↦ H_B v (dimension ``dim``); a str is the
        reason it was not run."""
        raise NotImplementedError

    def prepare(self, step: int, engine: EngineView, optimizer, losses: Tensor | None
                ) -> None:
        self._result, self._skipped = None, None
        if losses is None or engine.request.split:
            return
        params = engine.graph_params()  # (fully_shard, one process: the unsharded ones)
        if not bool(torch.isfinite(losses.detach()).all()):
            self._skipped = NON_FINITE
            return
        hvp = hessian_vector_product(engine, losses, params)
        first = next(iter(params.values()))
        with engine.suspended():
            result = self.solve(hvp.matvec, hvp.dim, first.dtype, first.device)
        if isinstance(result, str):
            self._skipped = result
        else:
            self._result = result

    def take_result(self, data: StepData) -> Any:
        """This step's result, or None with the reason in the notes."""
        result, self._result = self._result, None
        skipped, self._skipped = self._skipped, None
        if skipped is not None or result is None:
            data.notes[self.name] = skipped or "not computed (no individual losses)"
            return None
        return result
