"""Alpha: where along the update direction step t lands (paper Section 2.1, Appendix B.2).

Observations at both ends of s_t = θ_{t+1} − θ_t, with t = ‖s_t‖:

* at θ_t on batch B_t: the batch loss and its variance over the individual losses, and the
  slopes d_n = s_tᵀ g_n(θ_t) / ‖s_t‖ with their mean and variance;
* at θ_{t+1} on batch B_{t+1}: the same with g_n(θ_{t+1}), still along s_t.

A noise-informed quadratic f(τ) = w₀ + w₁τ + w₂τ² is fitted by eq. (10), and
α = 2t/ᾱ − 1 with ᾱ = −w₁/w₂ (:mod:`cockpit.quantities.alpha_fit` documents the fit and
every degenerate case). α < 0: the step stops short of the minimum along s_t; α = 0: it lands
on the valley floor; α > 0: it overshoots. α of step t is known once step t+1 was seen, and is
recorded under step t.

s_tᵀ g_n(θ_t) is needed before s_t exists. Two ways, neither holds |B|×D gradients:

* **predicted** (SGD, Adam, AdamW, RMSprop, Adagrad): inside each layer's backward hook the
  update is predicted from the layer's gradient and the optimizer state (without changing
  it) and the individual gradients are projected on it (on accelerators the small
  parameters' updates at the end of the backward pass, all at once:
  ``update_prediction.predict_updates``). After ``optimizer.step()`` the
  prediction is checked against the real update: a global rescaling (learning-rate change)
  is corrected; for SGD the update is fitted in the span of (gradient, parameter, old
  momentum buffer), which covers gradient clipping exactly. Tracked on consecutive steps,
  momentum SGD without Nesterov left s_{t−1} = −lr·b_old behind, so s_{t−1} (projected
  anyway, for α_{t−1}) takes the buffer's place and one projection serves both. The check
  reads nothing from the device at the step: the fit is solved and its residuals measured
  there, and decided when the step's numbers are read, before the next step begins (the
  fit's basis is held until then). On an accelerator the hooks keep the basis rows as they
  are and the end of the backward pass copies them, every parameter's at once, into the
  flat rows the batched fit reads (``update_fit.PackedBases``). A mismatch records the
  step as not computed, warns, and switches to the general path;
* **general** (any other optimizer, and any split batch: gradient accumulation or several
  processes, where no backward pass sees the gradient the optimizer steps on): each layer's
  input and output gradient are kept until the step, then s_tᵀ g_n is a Jacobian-vector
  product per layer (the engine's ``project``). Memory: about one forward pass's
  activations (per micro-batch).

At θ_{t+1} the direction s_t is known, so the projection is done directly in the hooks.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from cockpit.engine import sharded, update_fit
from cockpit.engine import update_prediction as up
from cockpit.engine.capture.end_of_backward import queue_at_end_of_backward
from cockpit.engine.engine_view import EngineView
from cockpit.engine.processing import GRADIENT
from cockpit.engine.readout import Later, Noted
from cockpit.engine.statistics import PROJECTIONS
from cockpit.quantities.alpha_fit import Observations, compute_alpha
from cockpit.quantities.base import (
    MeanVar,
    Quantity,
    StepData,
    Value,
    batch_mean_var,
    fused_norms,
)
from cockpit.quantities.descriptor import BLUE, Descriptor, Panel
from cockpit.schedules import Schedule

_PREDICTED = "alpha/predicted"
_PREVIOUS = "alpha/previous_update"


def _no_slope(device: torch.device) -> MeanVar:
    nan = torch.full((), math.nan, dtype=torch.float64, device=device)
    return nan, nan


def _alpha(length: float):
    """α of ``step`` from the observations at both ends: loss mean and variance, and the
    mean and variance of the unnormalized slopes s_tᵀg_n, divided by ‖s_t‖ (and ‖s_t‖²)
    here on the host."""

    def value(*observed) -> Noted:
        loss0, loss_var0, slope0, slope_var0, loss1, loss_var1, slope1, slope_var1 = map(
            float, observed)
        if length > 0:
            slope0, slope1 = slope0 / length, slope1 / length
            slope_var0, slope_var1 = slope_var0 / length**2, slope_var1 / length**2
        alpha, reason = compute_alpha(length, Observations(loss0, loss_var0, slope0, slope_var0),
                                      Observations(loss1, loss_var1, slope1, slope_var1))
        return Noted({"Alpha": alpha}, {"Alpha": reason} if reason is not None else {})

    return value


@dataclass
class _OpenStep:
    """What is known about step t before θ_{t+1} is observed."""

    step: int
    loss: MeanVar | None  # of the losses at θ_t, on the device
    predicted: bool
    sgd: bool = False
    basis: dict[str, list[Tensor]] = field(default_factory=dict)
    # SGD's basis rows as they are in the backward pass, copied at its end (_pack)
    unpacked: dict[str, list[Tensor]] = field(default_factory=dict)
    projections: dict[str, Tensor] = field(default_factory=dict)  # name → [K, N]
    project: Callable[[dict[str, Tensor]], Tensor] | None = None  # general path
    provider: Callable | None = None  # the predicted path's, for parameters seen late
    failure: str | None = None
    direction: dict[str, Tensor] | None = None  # s_t
    direction_length: float = math.nan  # ‖s_t‖
    moved: list[str] = field(default_factory=list)  # parameters with s_t ≠ 0
    optimizer_steps: int = 0  # the optimizer's steps before θ_t
    obs0: tuple[Tensor, ...] | None = None  # (loss mean, var, slope mean, var) at θ_t


class Alpha(Quantity):
    descriptor = Descriptor(
        panel=Panel("Alpha", "step size", "α: step size relative to the local quadratic minimum",
                    order=1),
        color=BLUE, reads_gradient=True,
        pending="α at step t fits the loss and its slope at θ_t and θ_(t+1), and the latter "
                "are measured at the next step")
    needs = frozenset({PROJECTIONS})
    needs_update = True
    handles_invalid_statistics = True
    schedule_offsets = (0, 1)  # α_t starts at step t and is completed at step t + 1
    projection_keys = (_PREDICTED, _PREVIOUS)

    def __init__(self, schedule: Schedule | int | None = None, rtol: float = 1e-3,
                 predict: bool = True):
        """``predict=False`` takes the general path from the first step: for a loop that
        changes the gradient after the backward pass in a way that is not a global rescaling
        of the update (clipping before an Adam step), where every prediction would fail."""
        super().__init__(schedule)
        self.rtol = rtol
        self._general = not predict  # also switched on after a failed prediction
        self._open: _OpenStep | None = None
        self._starting: _OpenStep | None = None

    @property
    def predict(self) -> bool:
        """Whether the next steps try the predicted (fast) path."""
        return not self._general

    @predict.setter
    def predict(self, value: bool) -> None:
        self._general = not value

    def starts(self, step: int) -> bool:
        return bool(self.schedule(step))

    def needs_update_at(self, step: int) -> bool:
        """s_t only where α_t starts: at a step that only observes θ_{t+1} for α_{t−1} the
        update is not read (no copy of θ)."""
        return self.starts(step)

    # ------------------------------------------------------------------ before backward
    def prepare(self, step: int, engine: EngineView, optimizer, losses: Tensor | None
                ) -> None:
        """Register this backward pass's directions in the engine's request (called once
        per backward pass: a step accumulated over micro-batches has several)."""
        request = engine.request
        opened = self._open
        previous: dict[str, Tensor] = {}
        if opened is not None and opened.step == step - 1 and opened.direction is not None:
            request.directions[_PREVIOUS] = opened.direction
            previous = {k: opened.direction[k] for k in opened.moved}
        if self._starting is not None and self._starting.step == step:
            state = self._starting  # a further micro-batch of the step
        else:
            self._starting = None
            if not self.starts(step) or optimizer is None:
                return
            # a batch split over micro-batches: no backward pass sees the gradient the
            # optimizer steps on (over processes, deferred processing does: ``defer``)
            sees_step_gradient = not request.split or request.defer
            # sharded parameters (fully_shard): the general path, which needs no θ_t, no
            # optimizer state and no gradient gathered on every rank
            predicted = (not self._general and sees_step_gradient and up.supports(optimizer)
                         and not sharded.has_sharded(engine.params.values()))
            is_sgd = up.supported_base(optimizer) is torch.optim.SGD
            state = _OpenStep(step, None, predicted, sgd=predicted and is_sgd)
            self._starting = state
        if state.predicted:
            state.provider = self._provider(optimizer, state, previous, request.gradient_scale)
            request.direction_providers[_PREDICTED] = state.provider
        else:
            request.keep_calls = True

    def _provider(self, optimizer, state: _OpenStep, previous: dict[str, Tensor],
                  gradient_scale: float = 1.0):
        """``previous``: s_{t−1} per parameter it moved, already a direction of this step;
        ``gradient_scale``: a GradScaler's factor, divided out before the optimizer steps."""

        def provide(name: str, param: Tensor, grad: Tensor) -> list[Tensor] | None:
            last = None
            if state.sgd:
                last = previous.get(name)
                rows = up.sgd_update_rows(optimizer, param, grad, previous_update=last,
                                          optimizer_checked=True)
                if rows is not None and rows[-1] is not last:  # (kept b_old's row instead)
                    last = None
                if rows is not None and self._pack_later(state, grad):
                    rows = state.unpacked[name] = [r if r.dtype == param.dtype
                                                   else r.to(param.dtype) for r in rows]
                    own = len(rows) - (last is not None)
                    directions = [GRADIENT, *rows[1:own]]  # (used now, before the step)
                    return directions if last is None else [*directions, last]
                basis = None if rows is None else up.stack_rows(rows, param.dtype)
            else:
                seen = grad if gradient_scale == 1.0 else grad / gradient_scale
                update = up.predict_update(optimizer, param, seen, optimizer_checked=True)
                basis = None if update is None else [update]
            if basis is None:
                _failed(param, grad)
                return None
            state.basis[name] = basis
            if not state.sgd:
                return basis
            # the gradient row is g_nᵀḡ up to a factor, which the engine has already; s_{t−1}
            # is given as the tensor registered for α_{t−1}, so one projection serves both
            # (rows of the basis itself: only those not replaced, no view of the others)
            own = len(basis) - (last is not None)
            rows = [GRADIENT, *(basis.unbind(0)[1:own] if own > 1 else ())]
            return rows if last is None else [*rows, last]

        def _failed(param: Tensor, grad: Tensor) -> None:
            state.failure = up.unsupported_reason(optimizer, param, grad) or (
                "the update could not be predicted"
            )

        def many(names: list[str], params: list[Tensor], grads: list[Tensor]
                 ) -> list[list[Tensor] | None]:
            """``provide`` for many parameters at once: one batched prediction."""
            seen = grads if gradient_scale == 1.0 else torch._foreach_div(grads, gradient_scale)
            updates = up.predict_updates(optimizer, params, seen, optimizer_checked=True)
            out: list[list[Tensor] | None] = []
            for name, param, grad, update in zip(names, params, grads, updates, strict=True):
                if update is None:
                    _failed(param, grad)
                    out.append(None)
                else:
                    state.basis[name] = basis = [update]
                    out.append(basis)
            return out

        if not state.sgd:  # (SGD's rows are the tensors as they are: nothing to batch)
            provide.many = many  # type: ignore[attr-defined]
        return provide

    def _pack_later(self, state: _OpenStep, grad: Tensor) -> bool:
        """Whether this parameter's basis rows are copied at the end of the backward pass,
        all parameters' at once (:class:`update_fit.PackedBases`, the accelerators' path),
        instead of one copy per parameter now: inside a backward pass, for plain tensors
        on a device the batched fit takes."""
        if not update_fit.packs(grad):
            return False
        if state.unpacked:
            return True  # (the end of this pass is queued already)
        return queue_at_end_of_backward(lambda: self._pack(state))

    def _pack(self, state: _OpenStep) -> None:
        """The end of the backward pass: every basis row the hooks left copied in one
        :class:`update_fit.PackedBases` per device (before the user's code and the
        optimizer step change them). Never raises into the backward pass: a failure makes
        the step's α not computed."""
        unpacked, state.unpacked = state.unpacked, {}
        try:
            by_device: dict[torch.device, list[str]] = {}
            for name, rows in unpacked.items():
                by_device.setdefault(rows[0].device, []).append(name)
            with torch.no_grad():
                for device, names in by_device.items():
                    packed = update_fit.PackedBases([unpacked[k] for k in names], device)
                    state.basis.update(zip(names, packed.slots(), strict=True))
        except Exception as error:
            state.failure = f"the update's basis could not be copied: {error}"

    # ------------------------------------------------------------------ after backward
    def compute(self, data: StepData) -> dict[str, Value]:
        assert data.losses is not None
        self._finish_previous(data)
        state, self._starting = self._starting, None
        if state is None:
            if self.starts(data.step):
                data.notes["Alpha"] = "needs optimizer= (the update s_t = θ_{t+1} − θ_t)"
                return {"Alpha": None}
            return {}
        state.loss = data.loss_mean_var()
        state.optimizer_steps = data.optimizer_steps
        stats = data.stats
        assert stats is not None
        if state.predicted:
            state.projections = dict(stats.projections.get(_PREDICTED, {}))
            self._predict_unreached(state, data.engine.params if data.engine else {})
        else:
            state.project = data.project
        state.provider = None  # (its closure holds s_(t−1): not kept until step t + 1)
        if stats.problems:  # no individual gradients (BatchNorm, ...): the general path
            # has none either, so no switch of path (and no warning that says so)
            state.failure, state.predicted = "; ".join(stats.problems), False
        elif data.unmerged is not None:  # not a failed prediction: no switch of path
            state.failure, state.predicted = data.unmerged, False
        self._open = state
        return {}

    @staticmethod
    def _predict_unreached(state: _OpenStep, params: dict[str, Tensor]) -> None:
        """Over processes the projections hold every parameter some process's backward
        pass reached; one this process's did not reach (a branch only another process's
        batch took, DistributedDataParallel with ``find_unused_parameters``) got no
        prediction in its hooks. Its update is predicted here from the synchronized gradient
        in ``p.grad`` — the same on every process, so every process fits the same update
        (and decides alike whether the prediction holds)."""
        assert state.provider is not None
        for name in state.projections.keys() - state.basis.keys():
            param = params.get(name)
            grad = None if param is None else param.grad
            if grad is None or state.provider(name, param, grad.detach()) is None:
                state.failure = state.failure or (
                    f"no gradient of {name} to predict its update from")

    def compute_after_update(self, data: StepData, update: dict[str, Tensor]
                             ) -> dict[str, Value] | Later:
        """s_tᵀg_n formed on the device as if every check passes, without reading it; the
        checks (‖s_t‖² per parameter, the loss statistics, ‖θ_{t+1}‖ per projected parameter
        — the rounding of the update — and the fit's residuals) are decided when the step's
        numbers are read, before the next step begins (:meth:`_decision`)."""
        state = self._open
        if state is None or state.step != data.step:
            return {}
        names = [k for k in state.projections if k in update] if state.predicted else []
        assert state.loss is not None
        with torch.no_grad():
            theta_norms = (fused_norms([data.params[k] for k in names])
                           if names else torch.zeros(0, dtype=torch.float64,
                                                     device=state.loss[0].device))
        update_norms = data.update_norm_vector(update)
        if sharded.has_sharded(update.values()):  # g_nᵀs_t needs all of s_t (sharded.py)
            update = {k: sharded.whole(s.detach()) for k, s in update.items()}
        checks, decide = self._slopes(state, update, names)
        state.project = None
        state.basis, state.unpacked = {}, {}
        return Later(self._decision(state, update, names, decide), update_norms, *state.loss,
                     theta_norms, *checks, name="Alpha")

    def _decision(self, state: _OpenStep, update: dict[str, Tensor], names: list[str],
                  decide: Callable) -> Callable[..., Noted]:
        """The host's half of :meth:`compute_after_update`: from the host copies of ‖s_t‖
        per parameter, the loss statistics, ‖θ_{t+1}‖ per projected parameter and the
        checks of :meth:`_slopes`, α's observations at θ_t (kept for the next step) or the
        reason why there are none."""
        keys = list(update)
        # ε of each projected parameter's dtype (θ_{t+1} − θ_t rounds by ≤ ε/2 per element)
        eps_of = {dtype: torch.finfo(dtype).eps for dtype in {update[k].dtype for k in names}}
        eps = [eps_of[update[k].dtype] for k in names]

        def value(update_norms: np.ndarray, loss_mean: np.ndarray, loss_var: np.ndarray,
                  theta_norms: np.ndarray, *checks) -> Noted:
            host = update_norms.tolist()
            sq_norms = dict(zip(keys, map(operator.mul, host, host), strict=True))
            length = math.sqrt(sum(sq_norms.values()))
            if not (math.isfinite(length) and np.isfinite(loss_mean)
                    and np.isfinite(loss_var)):
                self._close(state)
                return Noted({"Alpha": math.nan},
                             {"Alpha": "non-finite loss or update: α is undefined"})
            moved = [k for k, v in sq_norms.items() if v > 0]
            noise = dict(zip(names, map(operator.mul, eps, theta_norms.tolist()), strict=True))
            dots, reason = decide(checks, sq_norms, moved, noise)
            if dots is None:
                self._close(state)
                warned: tuple[tuple[str, str], ...] = ()
                if state.predicted and not self._general:
                    self._general = True
                    message = (
                        f"Alpha at step {state.step}: {reason}; Alpha switches to the general "
                        "path (keeps each layer's input and output gradient until the "
                        "optimizer step)")
                    warned = ((message, message),)
                return Noted({"Alpha": None}, {"Alpha": f"not computed: {reason}"}, warned)
            state.direction = {k: s.detach() if s.requires_grad else s
                               for k, s in update.items()}
            state.direction_length, state.moved = length, moved
            assert state.loss is not None
            slope = batch_mean_var(dots) if length > 0 else _no_slope(dots.device)
            device = state.loss[0].device
            state.obs0 = (*state.loss, *(t.to(device) for t in slope))
            return Noted({})

        return value

    def _close(self, state: _OpenStep) -> None:
        if self._open is state:
            self._open = None

    def _slopes(self, state: _OpenStep, update: dict[str, Tensor], names: list[str]
                ) -> tuple[tuple[Tensor, ...], Callable]:
        """s_tᵀ g_n(θ_t) for every sample, formed on the device as if every check passes:
        the tensors the checks read on the host, and ``decide(their host copies, sq_norms,
        moved, noise)`` → (s_tᵀg_n, None) or (None, the reason). ``sq_norms``: ‖s_t‖² per
        parameter; ``moved``: the parameters with s_t ≠ 0; ``noise``: ε·‖θ_{t+1}‖ per
        projected parameter, the rounding of θ_{t+1} − θ_t (≤ ε/2 per element)."""
        if state.failure or not state.predicted:
            reason, dots = state.failure, None
            if reason is None and state.project is None:
                reason = "the layer calls were not kept at this step"
            elif reason is None:
                try:
                    dots = state.project(update)  # type: ignore[misc]
                except Exception as error:
                    reason = f"projection failed: {error}"
            return (), lambda *_: (dots, reason)

        def unpredicted(moved: list[str]) -> str | None:
            missing = [k for k in moved if k not in state.projections]
            return (f"no individual gradients for updated parameter(s) {missing[:3]}"
                    if missing else None)

        if not state.sgd:
            with torch.no_grad():
                match = up.UpdateMatch([state.basis[k][0] for k in names],
                                       [update[k] for k in names])

            def decide_kappa(checks, sq_norms, moved, noise):
                missing = unpredicted(moved)
                if missing:
                    return None, missing
                kappa = match.kappa(checks[0], self.rtol,
                                    math.sqrt(sum(v * v for v in noise.values())),
                                    sum(sq_norms[k] for k in names))
                if kappa is None:
                    return None, (
                        "the real update does not match the prediction (the optimizer's state "
                        "or hyperparameters changed between backward and step, gradients "
                        "were modified, e.g. clipped, for an optimizer where that is not a "
                        "rescaling, or a GradScaler scaled the loss: pass it as "
                        "Cockpit(..., grad_scaler=scaler))")
                if not names:
                    return kappa * 0, None
                rows = torch.cat([p if p.shape[0] == 1 else p[:1]  # [P, N]: the update's rows
                                  for p in (state.projections[k] for k in names)])
                return kappa * rows.sum(0, dtype=torch.float64), None

            return (match.checks,), decide_kappa
        if not all(k in state.basis for k in names):
            return (), lambda checks, sq_norms, moved, noise: (
                None, unpredicted(moved) or "the update was not predicted for every parameter")
        with torch.no_grad():
            fits = update_fit.BasisFits([state.basis[k] for k in names], [update[k] for k in names])
            if names:
                device = state.projections[names[0]].device
                # Σ_k Σ_r c_{k,r} P_{k,r,n}: every tensor's rows stacked, one product
                rows = torch.cat([state.projections[k].to(device) for k in names]).double()
                dots = fits.coefficients.to(device) @ rows

        def decide_fit(checks, sq_norms, moved, noise):
            missing = unpredicted(moved)
            if missing:
                return None, missing
            answer = fits.accept(checks[0].tolist(), self.rtol, [noise[k] for k in names],
                                 [sq_norms[k] for k in names])
            if any(c is None for c in answer.values()):
                return None, (
                    "the real update is not an SGD step of the predicted form (the "
                    "optimizer's state or hyperparameters changed behind its back, or the "
                    "gradient changed after the `with` block, e.g. all-reduced after it)")
            if not names:
                return None, None
            if not answer:
                return dots, None
            # fitted once more in float64: those coefficients replace the first ones
            pieces = list(fits.coefficients.split([len(v) for v, _ in fits.problems]))
            for index, coefficients in answer.items():
                pieces[index] = update_fit.to_device(coefficients, fits.coefficients.device)
            with torch.no_grad():
                return torch.cat(pieces).to(device) @ rows, None

        return (fits.residual_norms,), decide_fit

    def _finish_previous(self, data: StepData) -> None:
        """Complete α of step t at step t + 1."""
        state = self._open
        if state is None or state.step >= data.step:
            return
        if state.step < data.step - 1:  # step t + 1 never came, or described no batch
            self._open = None
            data.late.setdefault(state.step, {})["Alpha"] = None
            data.late_notes.setdefault(state.step, {})["Alpha"] = (
                f"not computed: no step {state.step + 1} observed θ_(t+1) (the next step "
                f"described was {data.step}: the step numbers skipped it, or its batch could "
                "not be described); α at step t needs the loss and its slope at θ_(t+1), "
                "measured at step t + 1")
            return
        self._open = None
        if state.obs0 is None or state.direction is None:
            return
        taken = data.optimizer_steps - state.optimizer_steps
        if taken != 1:  # θ_(t+1) here is not θ_t + s_t
            data.late.setdefault(state.step, {})["Alpha"] = None
            data.late_notes.setdefault(state.step, {})["Alpha"] = (
                "not computed: the optimizer did not step between θ_t and step "
                f"{data.step} (e.g. a GradScaler skipped it)" if taken == 0 else
                f"not computed: the optimizer stepped {taken} times between θ_t and step "
                f"{data.step}'s parameters (steps under a number Cockpit did not record, "
                "e.g. a repeated step number), so they are not θ_t + s_t")
            return
        stats = data.stats
        assert stats is not None and data.losses is not None
        projections = stats.projections.get(_PREVIOUS, {})
        # a parameter this backward pass did not reach (a branch the batch did not take)
        # has g_n(θ_{t+1}) = 0: its projections are zero, not missing
        missing = [k for k in state.moved if k not in projections and k in stats.batch_grads]
        if stats.problems or missing:
            reason = "; ".join(stats.problems) or f"no individual gradients for {missing[:3]}"
            data.late.setdefault(state.step, {})["Alpha"] = None
            data.late_notes.setdefault(state.step, {})["Alpha"] = f"not computed: {reason}"
            return
        length = state.direction_length
        rows = list(projections.values())
        dots = ((torch.cat(rows) if all(p.shape[0] == 1 for p in rows)  # one row each: no views
                 else torch.stack([p[0] for p in rows])).sum(0, dtype=torch.float64)
                if rows else 0)
        loss = data.loss_mean_var()
        slope = batch_mean_var(dots) if length > 0 else _no_slope(loss[0].device)
        obs1 = (*loss, *(t.to(loss[0].device) for t in slope))
        data.late_values.setdefault(state.step, []).append(
            Later(_alpha(length), *state.obs0, *obs1, name="Alpha"))
