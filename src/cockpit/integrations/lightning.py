"""Cockpit in a Lightning ``Trainer``: a callback that drives the same :class:`Cockpit` a
plain loop uses.

    from cockpit.integrations.lightning import CockpitCallback

    class Model(L.LightningModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            losses = F.cross_entropy(self(x), y, reduction="none")
            return {"loss": losses.mean(), "losses": losses}   # individual losses for Cockpit

    trainer = L.Trainer(callbacks=[CockpitCallback("economy", logdir="runs/cockpit")])

How the hooks map onto a plain loop (Lightning 2.x, automatic optimization):

- the forward pass of each micro-batch runs in ``training_step``; the callback wraps the
  module's ``training_step`` to take the ``"losses"`` of its output;
- ``on_before_backward`` enters ``cockpit(trainer.global_step, losses=...)`` and
  ``on_after_backward`` leaves it, so every backward pass (each micro-batch of
  ``accumulate_grad_batches``, scaled by a mixed-precision GradScaler or not) is seen;
- ``on_before_optimizer_step`` (after the GradScaler unscaled the gradients, before gradient
  clipping and the update) records the step: :meth:`Cockpit.end_step`. Lightning runs the
  backward pass inside ``optimizer.step(closure)``, after the optimizer's pre-hook, so the
  callback ends steps itself;
- the optimizer's post-hook gives Cockpit the update θ_{t+1} − θ_t as in a plain loop.

Step numbers are ``trainer.global_step`` (optimizer steps); the micro-batches of one step
share it. With the DDP strategy every rank's values describe the global batch (Cockpit's own
reduction); only rank 0 writes. The totals go to the trainer's loggers as
``cockpit/<name>`` (each parameter's values too with ``log_per_parameter=True``); the run
log (``logdir=``) keeps everything. Cockpit watches the network the
LightningModule holds (its only child with parameters, see :func:`network_of`). The
callback's ``state_dict`` keeps θ_0 (Distance) and the step numbering across a checkpoint
resume.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from cockpit._extras import missing_extra

try:
    import lightning.pytorch as pl
except ImportError as error:
    raise missing_extra(error, "lightning", "lightning", "cockpit.integrations.lightning") \
        from None
from cockpit.cockpit import Cockpit
from cockpit.integrations._common import (
    LoggerSink,
    check_cockpit_kwargs,
    measure_clipped_updates,
)
from cockpit.quantities.base import Quantity

__all__ = ["CockpitCallback"]

LOSSES_KEY = "losses"
MANUAL_WAY_OUT = (
    "drop the callback and use one Cockpit per optimizer in the LightningModule — in "
    "on_train_start `self.cockpit_g = Cockpit(self.generator, optimizer="
    "self.trainer.optimizers[0], ...)`, in training_step `with self.cockpit_g(step, "
    "losses=losses): self.manual_backward(losses.mean())` before that optimizer's step() "
    "(step = self.trainer.fit_loop.total_batch_idx: batch_idx restarts every epoch), "
    "in on_train_end `self.cockpit_g.close()` (README, 'With your trainer')")


class CockpitCallback(pl.Callback):
    """Cockpit for a Lightning ``Trainer``.

    Args:
        quantities: the instruments, as for :class:`~cockpit.Cockpit` (a list, a
            configuration name or None for economy).
        log_per_parameter: also send each parameter's values
            (``cockpit/<instrument>/<parameter>``) to the trainer's loggers; by default only
            the totals (about a dozen scalars a step) go there, and the run log (``logdir=``)
            keeps everything.
        **cockpit_kwargs: every other argument of :class:`~cockpit.Cockpit` except ``model``,
            ``optimizer`` and ``grad_scaler`` (the trainer's): ``logdir=``, ``sinks=``,
            ``hist_bins=``, ``grad_accumulation=``, ``strict=``, ….

    ``training_step`` returns ``{"loss": losses.mean(), "losses": losses}`` with ``losses``
    the individual losses ``[batch]``. The running Cockpit is ``callback.cockpit``.
    """

    def __init__(self, quantities: Sequence[Quantity] | str | None = None, *,
                 log_per_parameter: bool = False, **cockpit_kwargs: Any):
        super().__init__()
        check_cockpit_kwargs(cockpit_kwargs)
        self.quantities = quantities
        self.cockpit_kwargs = cockpit_kwargs
        self.log_per_parameter = log_per_parameter
        self.cockpit: Cockpit | None = None
        self._losses: Tensor | None = None
        self._context: Any = None
        self._restored: dict[str, Any] | None = None
        self._wrapped: tuple[pl.LightningModule, Any] | None = None

    # ----------------------------------------------------------------- set-up, tear-down
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization or len(trainer.optimizers) != 1:
            what = ("manual optimization" if not pl_module.automatic_optimization
                    else f"{len(trainer.optimizers)} optimizers")
            raise NotImplementedError(
                f"CockpitCallback follows Lightning's automatic optimization with one "
                f"optimizer, this module uses {what}: {MANUAL_WAY_OUT}")
        optimizer = trainer.optimizers[0]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        kwargs = dict(self.cockpit_kwargs)
        kwargs["sinks"] = [*kwargs.get("sinks", ()), LoggerSink(functools.partial(
            _log_to, trainer), self.log_per_parameter)]
        if trainer.accumulate_grad_batches > 1:
            kwargs.setdefault("grad_accumulation", True)
        self.cockpit = Cockpit(network_of(pl_module), self.quantities, optimizer=optimizer,
                               grad_scaler=scaler, **kwargs)
        measure_clipped_updates(self.cockpit, clips=bool(trainer.gradient_clip_val),
                                elementwise=trainer.gradient_clip_algorithm == "value")
        # Lightning's backward runs inside optimizer.step(closure): the step ends here
        self.cockpit.ends_steps_at_optimizer_step = False
        if self._restored is not None:
            try:
                self.cockpit.load_state_dict(self._restored)
            except ValueError as error:  # (fully_shard: another rank's slice of θ_0)
                warnings.warn(f"training resumed without Cockpit's θ_0 ({error}): Distance is "
                              "measured from the resumed parameters", RuntimeWarning,
                              stacklevel=2)
            self._restored = None
        elif trainer.global_step > 0:
            warnings.warn(
                f"training resumed at step {trainer.global_step} without Cockpit's state (the "
                "checkpoint was saved without a CockpitCallback): Distance is measured from "
                "the resumed parameters", RuntimeWarning, stacklevel=2)
        self._wrap_training_step(pl_module)

    def _wrap_training_step(self, pl_module: pl.LightningModule) -> None:
        original = pl_module.training_step
        callback = self

        @functools.wraps(original)
        def training_step(*args, **kwargs):
            output = original(*args, **kwargs)
            callback._losses = (output.get(LOSSES_KEY) if isinstance(output, dict) else None)
            return output

        pl_module.training_step = training_step  # type: ignore[method-assign]
        self._wrapped = (pl_module, original)

    def _unwrap_training_step(self) -> None:
        if self._wrapped is not None:
            module, _ = self._wrapped
            module.__dict__.pop("training_step", None)  # the class's method again
            self._wrapped = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop(failed=False)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._stop(failed=True)

    def _stop(self, failed: bool) -> None:
        """Leave an open tracked block, restore ``training_step``, close the Cockpit."""
        self._leave(failed=failed)
        self._unwrap_training_step()
        if self.cockpit is not None:
            self.cockpit.close()

    # ----------------------------------------------------------------- one step
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: Tensor) -> None:
        if self.cockpit is None:
            return
        self._leave(failed=True)  # a previous backward that raised never reached its end
        losses, self._losses = self._losses, None
        context = self.cockpit(trainer.global_step, losses=losses)
        try:
            context.__enter__()
        except ValueError as error:
            if losses is None:
                raise ValueError(
                    f"{error}. With Lightning: return {{'loss': losses.mean(), "
                    f"'{LOSSES_KEY}': losses}} from training_step") from error
            raise
        self._context = context

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave(failed=False)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer) -> None:
        if self.cockpit is not None:
            self._leave(failed=False)
            self.cockpit.end_step()

    def _leave(self, failed: bool) -> None:
        context, self._context = self._context, None
        if context is not None:
            error = RuntimeError("backward pass failed") if failed else None
            context.__exit__(type(error) if error else None, error, None)

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        if self.cockpit is None:
            return dict(self._restored or {})
        return self.cockpit.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.cockpit is not None:  # restored after training began (rare strategies)
            self.cockpit.load_state_dict(state_dict)
        else:
            self._restored = dict(state_dict)


def network_of(pl_module: pl.LightningModule) -> torch.nn.Module:
    """The module Cockpit watches: the LightningModule's only child that holds parameters
    (``self.model`` or the like — its output feeds the loss, which curvature instruments
    need, whether ``training_step`` calls ``self(x)`` or ``self.model(x)``), otherwise the
    LightningModule itself (then ``training_step`` calls ``self(x)``)."""
    holders = [child for child in pl_module.children()
               if any(True for _ in child.parameters())]
    own = any(True for _ in pl_module.parameters(recurse=False))
    if len(holders) == 1 and not own:
        return holders[0]
    return pl_module


def _log_to(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    for logger in trainer.loggers:
        try:
            logger.log_metrics(metrics, step=step)
        except Exception as error:  # a logger never stops training
            warnings.warn(f"Cockpit could not log to {type(logger).__name__}: {error}",
                          RuntimeWarning, stacklevel=2)
