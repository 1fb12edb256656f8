"""Shared machinery of the diagonal-curvature instruments (HessTrace, TICDiag, TICTrace):
the ``curvature=`` option and one computation per backward pass, shared between instruments.

The diagonal is computed on each backward pass's graph (before the user's backward) for the
mean loss of its N_k samples, and added to the step's statistics as N_k · diag_k: the
diagonal of the mean loss over a step split into micro-batches or processes is then
Σ_k N_k diag_k / N, exactly (the Hessian and the GGN of a mean are the weighted means).

Under ``fully_shard`` the passes differentiate the graph's unsharded parameters, gathered
whole, with FSDP's backward hooks held (:mod:`cockpit.engine.sharded`): each rank adds its
own samples' N_r · diag_r, and the ranks combine as under DDP.

Every computed value says what it was computed from: the method goes into the step's note
(:data:`cockpit.curvature.diagonal.DESCRIPTIONS`); a stochastic value (Hutchinson, MC GGN)
carries its standard error as ``"<Instrument>.stderr"``, estimated from the spread of the
``mc_samples`` independent replicates (merged over micro-batches; not formed across
processes, where the note says so). When ``curvature="auto"`` cannot use the exact Hessian
diagonal, the instrument warns once and names the reason in the note.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch
from torch import Tensor

from cockpit._stacklevel import user_stacklevel
from cockpit.curvature.diagonal import (
    DESCRIPTIONS,
    STOCHASTIC,
    check_method,
    diagonal_replicates,
    resolve_method,
)
from cockpit.curvature.hvp import flatten_tensors
from cockpit.engine.dtypes import promote
from cockpit.engine.engine_view import EngineView
from cockpit.engine.readout import Later, Noted
from cockpit.quantities.base import Quantity, StepData, all_finite
from cockpit.schedules import Schedule

NON_FINITE = "non-finite loss at this step: the curvature was not computed"


class DiagonalCurvatureQuantity(Quantity):
    """An instrument that reads the diagonal curvature of L_B (see
    :mod:`cockpit.curvature.diagonal` for the methods)."""

    differentiates_graph = True
    needs_activations = True
    fallback = "ggn"  # what "auto" uses where the exact Hessian diagonal is not available

    def __init__(
        self,
        schedule: Schedule | int | None = None,
        curvature: str = "auto",
        *,
        loss: str | None = None,
        mc_samples: int = 8,
        mc_threshold: int = 32,
        max_backprops: int = 512,
        seed: int = 0,
    ):
        super().__init__(schedule)
        if curvature != "auto":
            check_method(curvature)
        if loss not in (None, "cross_entropy", "mse"):
            raise ValueError(
                f"loss must be 'cross_entropy', 'mse' or None (recognize), got {loss!r}; "
                "for other losses use curvature='hutchinson'"
            )
        if mc_samples < 1:
            raise ValueError(f"mc_samples must be at least 1, got {mc_samples}")
        self.curvature, self.loss = curvature, loss
        self.mc_samples, self.mc_threshold = mc_samples, mc_threshold
        self.max_backprops = max_backprops
        self.generator = torch.Generator().manual_seed(seed)
        self.method_used: str | None = None
        self.fallback_reason: str | None = None
        self._warned = False
        self._replicate_step: int | None = None
        self._replicates: list[dict[str, Tensor]] = []
        self._nonfinite = False  # known on the host: the computation failed on it
        self._finite: Tensor | None = None  # isfinite(losses).all() of the step, on the device
        self.sample_sum_keys = (
            f"diagonal/{curvature}/{self.fallback}/{loss}/{mc_samples}/{mc_threshold}/"
            f"{max_backprops}",)

    def prepare(self, step: int, engine: EngineView, optimizer, losses: Tensor | None
                ) -> None:
        if self._replicate_step != step:  # the first backward pass of a new step
            self._replicate_step, self._replicates, self._nonfinite = step, [], False
            self._finite = None
        if losses is None or self._nonfinite:
            return
        # (fully_shard: the unsharded parameters, gathered by the engine at the block's start)
        params = engine.graph_params()
        finite = _losses_finite(engine, losses)
        self._finite = finite if self._finite is None else self._finite & finite
        method, reason = resolve_method(self.curvature, engine, self.mc_threshold,
                                        self.max_backprops, self.fallback,
                                        losses if self.loss is None else None)
        try:
            replicates = self._shared(method, engine, losses, params)
        except Exception as error:
            if not bool(finite):  # e.g. sampling from NaN probabilities: read only here
                self._nonfinite = True
                return
            # e.g. a kernel without double backward
            if (not isinstance(error, RuntimeError) or self.curvature != "auto"
                    or method != "hutchinson"):
                raise
            method, reason = resolve_method("auto", engine, self.mc_threshold,
                                            self.max_backprops, "ggn")
            reason = f"{reason}; Hessian-vector products failed: {error}"
            replicates = self._shared(method, engine, losses, params)
        self.method_used, self.fallback_reason = method, reason
        if reason is not None and not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.name}: curvature='auto' cannot use the exact Hessian diagonal for this "
                f"model ({reason}); it uses {DESCRIPTIONS[method]} instead (recorded in the "
                "notes). Pass curvature= to choose.", RuntimeWarning,
                stacklevel=user_stacklevel())
        n = losses.shape[0]
        if method in STOCHASTIC:  # merge the replicates over the step's backward passes
            self._replicates = _merged(self._replicates, replicates, n)

    def _shared(self, method: str, engine: EngineView, losses: Tensor,
                params: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
        """The replicates of this backward pass, computed once for all instruments, per
        parameter of ``params`` (the forward graph's: :meth:`EngineView.graph_params`)."""
        key = ("diagonal", method, self.loss, self.mc_samples)
        if key not in engine.step_cache:
            replicates = diagonal_replicates(
                method, engine, losses, params, loss=self.loss,
                num_samples=self.mc_samples, generator=self.generator,
                max_backprops=self.max_backprops,
            )
            engine.step_cache[key] = replicates
        replicates = engine.step_cache[key]
        sums_key = (key, self.sample_sum_keys[0])
        if sums_key not in engine.step_cache:
            n = losses.shape[0]
            # (a Hutchinson estimate in a mixed precision policy's half precision: summed
            # over micro-batches and processes in the parameters' own precision)
            names = list(replicates[0])
            wide = [[r[k].to(promote(r[k].dtype, engine.params[k].dtype))
                     for k in names] for r in replicates]
            totals = wide[0]
            for more in wide[1:]:  # (one multi-tensor kernel per replicate)
                totals = torch._foreach_add(totals, more)
            # N·(the replicates' mean): one multi-tensor kernel for all parameters
            sums = torch._foreach_mul(totals, n / len(replicates))
            engine.add_sample_sums(self.sample_sum_keys[0], dict(zip(names, sums, strict=True)))
            engine.step_cache[sums_key] = True
        return replicates

    # ------------------------------------------------------------------ for compute()
    def skip_non_finite(self, data: StepData) -> bool:
        """Whether the step's loss is non-finite (read on the host; noted if so)."""
        flag = self.finite_flag(data)
        nonfinite = not bool(flag)
        if nonfinite:
            data.notes[self.name] = NON_FINITE
        return nonfinite

    def finite_flag(self, data: StepData) -> Tensor | bool:
        """isfinite of every loss of the step: a 0-dim device tensor, read with the value;
        False where the step is known on the host to be non-finite (then noted), True where
        no loss was seen."""
        if self._nonfinite:
            data.notes[self.name] = NON_FINITE
            return False
        flag = self._finite
        finite = data.losses_finite()
        if finite is not None:
            flag = finite if flag is None else flag & finite.to(flag.device)
        return True if flag is None else flag

    def later_if_finite(self, flag: Tensor | bool, values, *tensors: Tensor) -> Later:
        """``Later(values, *tensors)``, whose value is NaN with the non-finite note where the
        device flag of :meth:`finite_flag` reads False."""
        if not isinstance(flag, Tensor):
            return Later(values, *tensors, name=self.name)
        name = self.name

        def checked(finite, *arrays):
            if not finite:
                return Noted({name: math.nan}, {name: NON_FINITE})
            return values(*arrays)

        return Later(checked, flag, *tensors, name=name)

    def take_diagonal(self, data) -> dict[str, Tensor]:
        """diag(curvature) of the step's mean loss, from the step's statistics."""
        sums = None if data.stats is None else data.stats.sample_sums.get(self.sample_sum_keys[0])
        if not sums or not data.stats.num_samples:
            raise RuntimeError("the curvature of this step was not computed")
        n = data.stats.num_samples
        return dict(zip(sums, torch._foreach_div(list(sums.values()), float(n)), strict=True))

    def replicate_diagonals(self, data) -> list[dict[str, Tensor]] | None:
        """The stochastic method's independent replicate diagonals of the step's mean loss
        (None if exact, fewer than two, or split over processes)."""
        stats = data.stats
        if (self.method_used not in STOCHASTIC or len(self._replicates) < 2
                or stats is None or getattr(stats, "ranks", 1) > 1):
            return None
        n = stats.num_samples
        names = [list(r) for r in self._replicates]
        means = iter(torch._foreach_div([s for r in self._replicates for s in r.values()],
                                        float(n)))  # (one kernel for all of them)
        return [{k: next(means) for k in keys} for keys in names]

    def describe(self, data: StepData, value_name: str, stderr: float | None) -> str:
        """The note on how this step's value was computed."""
        method = self.method_used or "?"
        text = f"computed from {DESCRIPTIONS.get(method, method)}"
        if method in STOCHASTIC:
            text += f", {self.mc_samples} samples"
            if stderr is not None:
                text += f"; standard error {stderr:.3g} ({value_name}.stderr)"
            elif self.mc_samples < 2:
                text += "; no standard error from a single sample (mc_samples ≥ 2 gives one)"
            else:
                text += "; no standard error across processes"
        if self.fallback_reason is not None:
            text += (f" — curvature='auto': the exact Hessian diagonal is not available "
                     f"({self.fallback_reason})")
        return text


def standard_error(values: list[float]) -> float:
    """Standard error of the mean of independent replicates: std (ddof 1) / √M."""
    m = len(values)
    mean = math.fsum(values) / m
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (m - 1) / m)


def replicate_totals(replicates: list[dict[str, Tensor]]) -> Tensor:
    """Σ_j of every replicate diagonal over all parameters, float64 [M] on the device: the
    replicates laid end to end (:func:`flatten_tensors`: one copy where they share dtype
    and device) and summed per replicate, not one sum per replicate and parameter."""
    sizes = {sum(d.numel() for d in r.values()) for r in replicates}
    if len(sizes) > 1:  # (replicates over different parameters: one by one)
        return torch.stack([flatten_tensors(list(r.values())).sum(dtype=torch.float64)
                            for r in replicates])
    flat = flatten_tensors([d for r in replicates for d in r.values()])
    return flat.view(len(replicates), -1).sum(1, dtype=torch.float64)


def _merged(totals: list[dict[str, Tensor]], replicates: list[dict[str, Tensor]],
            n: int) -> list[dict[str, Tensor]]:
    """Σ over the step's backward passes of N_b · (replicate m of pass b), per replicate
    and parameter: ``totals`` (empty at the first pass) plus n · ``replicates``, in one
    multi-tensor kernel or two for all replicates and parameters."""
    keys = [list(r) for r in replicates]
    scaled = iter(torch._foreach_mul([d for r in replicates for d in r.values()], float(n)))
    new = [{k: next(scaled) for k in names} for names in keys]
    if not totals:
        return new
    if [list(t) for t in totals] != keys:  # (another set of parameters: one by one)
        return [{**t, **{k: t[k] + d if k in t else d for k, d in r.items()}}
                for t, r in zip(totals, new, strict=True)]
    summed = iter(torch._foreach_add([d for t in totals for d in t.values()],
                                     [d for r in new for d in r.values()]))
    return [{k: next(summed) for k in names} for names in keys]


def _losses_finite(engine: EngineView, losses: Tensor) -> Tensor:
    """:func:`all_finite` of the block's losses, formed once for every curvature instrument."""
    key = ("losses finite", id(losses))
    cached = engine.step_cache.get(key)
    if cached is None or cached[0] is not losses:
        cached = engine.step_cache[key] = (losses, all_finite(losses))
    return cached[1]
