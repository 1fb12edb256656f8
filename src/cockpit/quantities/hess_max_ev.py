"""HessMaxEV: λ_max(H_B(θ)), the largest algebraic eigenvalue of the mini-batch loss's
Hessian (paper eq. 26).

Matrix-free: Hessian-vector products on the user's own forward graph
(:class:`cockpit.curvature.HessianVectorProduct`, no ``backward(create_graph=True)``, nothing
left on ``.grad``), and a Lanczos iteration with full reorthogonalization whose stopping
rule bounds the error of λ_max itself (:mod:`cockpit.curvature.lanczos`): with the default
``tol=1e-3`` the recorded value θ satisfies θ ≤ λ_max ≤ θ·(1 + 1e-3) except with
probability ``miss_probability`` = 1e-3 (a random start vector seeded by ``seed``; the run
is deterministic given the seed).

What the solver did is recorded beside the value, never as an instrument of its own: the
step's note says how many Hessian-vector products were spent and which relative accuracy
was reached, and :attr:`HessMaxEV.solver` keeps the same per step as numbers
(``{step: {"num_hvp", "rel_error", "converged", "discarded_hvp"}}``; the iteration reads
its coefficients from the device once per ``check_every`` = 4 products, so up to 3 products
past the stop are computed and discarded). At a step with a non-finite loss the
first products are not finite and the run stops at Lanczos's first read: the value is NaN
with the note saying why (the losses are read only then).

Over processes (DistributedDataParallel, ``fully_shard``) every rank holds the graph of its
own N_r samples: H_B v = Σ_r (N_r/N) H_r v is one all-reduce of the product per
Hessian-vector product, and every rank runs the same iteration on the same numbers and
records the same value, that of one process on the whole batch up to rounding
(:mod:`cockpit.quantities.hessian_operator`). Under ``fully_shard`` the products
differentiate the graph's unsharded parameters, gathered whole, with FSDP's backward hooks
held (:mod:`cockpit.engine.sharded`). None where the batch is split over micro-batches (the
earlier micro-batches' graphs are gone) and under ``fully_shard``'s mixed precision.

``per_parameter=True`` also records λ_max of each parameter tensor's diagonal block H_θθ of
the Hessian as ``"HessMaxEV/<parameter>"`` (one Lanczos run with the same stopping rule per
block, on Hessian-vector products with respect to that tensor alone: their cost adds up over
the tensors). By Cauchy interlacing each block's λ_max is ≤ the whole Hessian's.

``warm_start=True`` mixes the previous step's eigenvector into the start vector (the
guarantee is kept, see the Lanczos module). It does not save products under this stopping
rule (measured: 25.9 vs 25.7 per step on a logistic regression), so it is off by default.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cockpit.curvature.lanczos import EigResult, lanczos_max_eigenvalue
from cockpit.engine.engine_view import EngineView
from cockpit.quantities.base import Quantity, StepData, Value
from cockpit.quantities.descriptor import PURPLE, Descriptor, Panel
from cockpit.quantities.hessian_operator import (
    NON_FINITE_ON_A_RANK,
    batch_matvec,
    iteration_dtype,
    open_operator,
)
from cockpit.schedules import Schedule

NON_FINITE = "non-finite loss at this step: the Hessian-vector products were not finite"


class HessMaxEV(Quantity):
    descriptor = Descriptor(
        panel=Panel("HessMaxEV", "curvature", "Largest Hessian eigenvalue λ_max(H_B): sharpness",
                    order=1, readout=("HessMaxEV",)),
        color=PURPLE)
    differentiates_graph = True
    whole_batch_graph = True  # λ_max of a sum is not formed from the parts' λ_max

    def __init__(
        self,
        schedule: Schedule | int | None = None,
        *,
        tol: float = 1e-3,
        max_iter: int = 100,
        miss_probability: float = 1e-3,
        warm_start: bool = False,
        per_parameter: bool = False,
        seed: int = 0,
    ):
        super().__init__(schedule)
        if not tol > 0 or max_iter < 1 or not 0 < miss_probability < 1:
            raise ValueError(
                "HessMaxEV needs tol > 0, max_iter >= 1 and 0 < miss_probability < 1")
        self.tol, self.max_iter, self.warm_start = tol, max_iter, warm_start
        self.miss_probability = miss_probability
        self.per_parameter = per_parameter
        self._blocks: dict[str, EigResult] = {}  # parameter → Lanczos result of its block
        self.generator = torch.Generator().manual_seed(seed)
        self.solver: dict[int, dict[str, float | int | bool]] = {}
        self._vector: Tensor | None = None
        self._result = None
        self._skipped: str | None = None
        self._prepared: int | None = None  # the step whose first block was prepared

    def prepare(self, step: int, engine: EngineView, optimizer, losses: Tensor | None
                ) -> None:
        self._result, self._skipped, self._blocks = None, None, {}
        share = open_operator(engine, losses, again=step == self._prepared)
        self._prepared = step
        if isinstance(share, str):
            self._skipped = share
            return
        if share is None:
            return
        assert losses is not None
        matvec, dim = batch_matvec(engine, losses, share.params, share)
        v0 = self._vector if self.warm_start else None
        if v0 is not None and v0.numel() != dim:
            v0 = None
        dtype, device = iteration_dtype(share.params)
        with engine.suspended():
            self._result = lanczos_max_eigenvalue(
                matvec, dim, v0=v0, tol=self.tol, max_iter=self.max_iter,
                miss_probability=self.miss_probability, generator=self.generator,
                dtype=dtype, device=device,
            )
        if not math.isfinite(self._result.value) and not bool(
                torch.isfinite(losses.detach()).all()):  # read only after a failed run
            self._result, self._skipped = None, NON_FINITE
            return
        if self.warm_start and math.isfinite(self._result.value):
            self._vector = self._result.vector.detach()
        if self.per_parameter:
            for name, param in share.params.items():
                block, size = batch_matvec(engine, losses, {name: param}, share)
                with engine.suspended():
                    self._blocks[name] = lanczos_max_eigenvalue(
                        block, size, tol=self.tol, max_iter=self.max_iter,
                        miss_probability=self.miss_probability, generator=self.generator,
                        dtype=dtype, device=device)

    def compute(self, data: StepData) -> dict[str, Value]:
        result, self._result = self._result, None
        skipped, self._skipped = self._skipped, None
        if skipped is not None:
            data.notes["HessMaxEV"] = skipped
            return {"HessMaxEV": math.nan if skipped in (NON_FINITE, NON_FINITE_ON_A_RANK)
                    else None}
        if result is None:
            data.notes["HessMaxEV"] = "not computed (no individual losses at this step)"
            return {"HessMaxEV": None}
        self.solver[data.step] = {"num_hvp": result.num_matvecs,
                                  "rel_error": result.rel_error,
                                  "converged": result.converged,
                                  "discarded_hvp": result.discarded}
        if not math.isfinite(result.value):
            data.notes["HessMaxEV"] = (
                f"a Hessian-vector product was not finite (after {result.num_matvecs})")
            return {"HessMaxEV": math.nan}
        confidence = 1 - self.miss_probability
        if result.converged:
            data.notes["HessMaxEV"] = (
                f"Lanczos: {result.num_matvecs} Hessian-vector products; relative accuracy "
                f"{result.rel_error:.0e} reached (λ_max ≤ value·(1 + {result.rel_error:.0e}) "
                f"with probability ≥ {confidence:g})")
        else:
            reached = ("none" if not math.isfinite(result.rel_error)
                       else f"{result.rel_error:.0e}")
            data.notes["HessMaxEV"] = (
                f"Lanczos did not reach tol={self.tol:g} in {result.num_matvecs} "
                f"Hessian-vector products (max_iter); relative accuracy reached: {reached}. "
                "The value is a lower bound of λ_max")
        out: dict[str, Value] = {"HessMaxEV": float(result.value)}
        blocks, self._blocks = self._blocks, {}
        unconverged = [name for name, block in blocks.items() if not block.converged]
        for name, block in blocks.items():
            out[f"HessMaxEV/{name}"] = float(block.value)
        if blocks:
            data.notes["HessMaxEV"] += (
                f"; per parameter: {sum(b.num_matvecs for b in blocks.values())} products for "
                f"{len(blocks)} diagonal blocks")
            if unconverged:
                data.notes["HessMaxEV"] += (
                    f", tol not reached (a lower bound) for {', '.join(unconverged[:4])}"
                    f"{' …' if len(unconverged) > 4 else ''}")
        return out
