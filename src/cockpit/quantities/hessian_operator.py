"""Instruments that run a Lanczos method on H_B·v, the Hessian-vector products of the user's
own forward graph (HessMaxEV, HessTopEV, HessDensity): the shared preparation and hand-over.

At ``prepare`` (the block's start, the graph still alive) the operator v ↦ H_B v over every
tracked parameter is built (:func:`open_operator`, :func:`batch_matvec`) and
:meth:`HessianOperatorQuantity.solve` runs on it; ``compute`` takes the result, or records
None with the reason. H_B is the Hessian of the batch loss L_B = (1/N) Σ_n ℓ_n(θ) (the mean
over all N samples of the step, as every instrument describes it).

Over processes (DistributedDataParallel, ``fully_shard``; one backward pass per process) rank
r holds the graph of its own N_r samples, and with H_r the Hessian of its mean loss

    H_B v = Σ_r (N_r / N) H_r v,

one all-reduce of the product vector per Hessian-vector product
(:func:`cockpit.engine.reduction.ranks.summed_over_ranks`). The counts N_r and whether every
loss is finite are all-reduced once first, so every rank takes the same path (a non-finite
loss on one rank: no products on any rank, with the reason). Every rank then runs the same
iteration on the same numbers — the same seeded start vector, the same all-reduced products,
the same arithmetic on them (devices of one kind) — so its stopping decisions (which read
only those numbers) are the same on every rank and no rank leaves the sequence of
all-reduces early. Under
``fully_shard`` the products differentiate the graph's unsharded, whole parameters
(:meth:`EngineView.graph_params`), so the vector is over all of θ on every rank, as under DDP.

Not formed (None with the reason) where the batch is split over micro-batches (the earlier
micro-batches' graphs are gone by the step's last block; the block's graph of a step already
prepared is not used), and under ``fully_shard``'s mixed precision (its graph computes in
``param_dtype``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from cockpit.curvature.diagonal import hessian_vector_product
from cockpit.engine.dtypes import promote
from cockpit.engine.engine_view import EngineView
from cockpit.engine.reduction.ranks import summed_over_ranks
from cockpit.quantities.base import Quantity, StepData
from cockpit.schedules import Schedule

NON_FINITE = "non-finite loss at this step: no Hessian-vector products"
NON_FINITE_ON_A_RANK = ("non-finite loss at this step (on at least one process): no "
                        "Hessian-vector products")
MIXED_PRECISION = ("not formed under fully_shard's mixed precision: the forward graph "
                   "computes in param_dtype")


DECLINED_ON_A_RANK = ("not formed: another process could not describe its batch at this "
                      "step (see that process's notes), so no Hessian-vector product is "
                      "summed over the processes")


RANK_HEADER = "hvp: N, the non-finite losses and the declining processes over the processes"


class BatchShare(NamedTuple):
    """Where H_B v is formed at this block: the parameters to differentiate (under
    ``fully_shard`` the unsharded ones) and this process's share N_r/N of the batch (1 in
    one process); ``ranks``: whether the products are summed over processes."""

    params: Mapping[str, Tensor]
    share: float
    ranks: bool


def open_operator(engine: EngineView, losses: Tensor | None, again: bool
                  ) -> BatchShare | str | None:
    """Whether v ↦ H_B v is formed at this block: None where it is not (no losses, a batch
    split over micro-batches, ``again``: a later block of a step already prepared), a str
    with the reason where it cannot be, else the :class:`BatchShare`. Over processes
    (``request.defer``: one backward pass per process) every rank reaches the all-reduce of
    (N_r, number of non-finite losses) here alike."""
    request = engine.request
    if losses is None or again or (request.split and not request.defer):
        return None
    if request.defer and engine.compute_dtypes:
        return MIXED_PRECISION
    params = engine.graph_params()  # (fully_shard: the unsharded ones)
    if not request.defer:
        return BatchShare(params, 1.0, False)
    device = next(iter(params.values())).device
    detached = losses.detach().to(device)
    total, non_finite, declined = _summed_header(engine, lambda: torch.stack([
        torch.tensor(float(detached.numel()), dtype=torch.float64, device=device),
        (~torch.isfinite(detached)).sum().double(),
        torch.zeros((), dtype=torch.float64, device=device)]))
    if declined > 0:
        return DECLINED_ON_A_RANK
    if non_finite > 0:
        return NON_FINITE_ON_A_RANK
    return BatchShare(params, detached.numel() / total, True)


def decline(engine: EngineView) -> None:
    """A process whose step's batch cannot be described (an empty batch, losses the backward
    pass did not go through; its curvature instruments prepare nothing) still answers the
    all-reduce of :func:`open_operator`'s header, declining: the other processes then form
    no product either (each would wait for this one's share)."""
    if not engine.request.defer or RANK_HEADER in engine.step_cache:
        return
    # (graph_params: the same gathers as open_operator's, under fully_shard)
    device = next(iter(engine.graph_params().values())).device
    _summed_header(engine, lambda: torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64,
                                                device=device))


def _summed_header(engine: EngineView, header: Callable[[], Tensor]) -> list[float]:
    """(N, non-finite losses, declining processes) summed over the processes: one
    all-reduce per step for every instrument of the block (``header``: this process's)."""
    if RANK_HEADER not in engine.step_cache:
        engine.step_cache[RANK_HEADER] = summed_over_ranks(header()).tolist()
    return engine.step_cache[RANK_HEADER]


def batch_matvec(engine: EngineView, losses: Tensor, params: Mapping[str, Tensor],
                 share: BatchShare) -> tuple[Callable[[Tensor], Tensor], int]:
    """(v ↦ H_B v on flat vectors, D) over ``params``: this process's H_r v on its graph
    (shared by the step's instruments), summed over the processes with weights N_r/N
    where ``share.ranks``."""
    hvp = hessian_vector_product(engine, losses, params)
    if not share.ranks:
        return hvp.matvec, hvp.dim
    weight = share.share

    def summed(v: Tensor) -> Tensor:
        return summed_over_ranks(hvp.matvec(v).mul_(weight))

    return summed, hvp.dim


def iteration_dtype(params: Mapping[str, Tensor]) -> tuple[torch.dtype, torch.device]:
    """The dtype (the parameters', at least float32) and device of the Krylov vectors."""
    first = next(iter(params.values()))
    return promote(first.dtype, torch.float32), first.device


class HessianOperatorQuantity(Quantity):
    differentiates_graph = True
    whole_batch_graph = True

    def __init__(self, schedule: Schedule | int | None = None, *, seed: int = 0):
        super().__init__(schedule)
        self.generator = torch.Generator().manual_seed(seed)
        self._result: Any = None
        self._skipped: str | None = None
        self._prepared: int | None = None  # the step whose first block was prepared

    def solve(self, matvec, dim: int, dtype: torch.dtype, device: torch.device) -> Any:
        """The instrument's computation on v ↦ H_B v (dimension ``dim``); a str is the
        reason it was not run."""
        raise NotImplementedError

    def prepare(self, step: int, engine: EngineView, optimizer, losses: Tensor | None
                ) -> None:
        self._result, self._skipped = None, None
        share = open_operator(engine, losses, again=step == self._prepared)
        self._prepared = step
        if share is None or isinstance(share, str):
            self._skipped = share
            return
        assert losses is not None
        if not share.ranks and not bool(torch.isfinite(losses.detach()).all()):
            self._skipped = NON_FINITE
            return
        matvec, dim = batch_matvec(engine, losses, share.params, share)
        with engine.suspended():
            result = self.solve(matvec, dim, *iteration_dtype(share.params))
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
