"""Cockpit in a Hugging Face ``transformers.Trainer``: a callback that drives the same
:class:`Cockpit` a plain loop uses.

    from cockpit.integrations.transformers import CockpitCallback

    cockpit = CockpitCallback("economy", logdir="runs/cockpit")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cockpit])
    cockpit.attach(trainer)   # the one extra line: Cockpit computes the loss per sequence
    trainer.train()

The individual losses: :meth:`CockpitCallback.attach` makes :meth:`CockpitCallback.compute_loss`
the Trainer's ``compute_loss_func``. It computes ℓ_n per example with
:func:`sequence_losses` — for a language model the mean token loss of each sequence (labels
``-100``, i.e. padding and prompt tokens, excluded; shifted by one position for a causal LM),
for classification the example's cross-entropy (mean squared error for one regression
output) — and trains on their mean,

    L = (1/|B|) Σ_n ℓ_n,   each micro-batch's mean divided by the number of micro-batches,

so a sequence counts once, whatever its length (the Trainer's default for language models
weights sequences by their token counts, which gives no individual gradients). Cockpit's
accumulation accepts any weighting of the micro-batches.

How the Trainer's loop maps onto a plain loop:

- each micro-batch's forward pass runs in ``compute_loss``; ``compute_loss`` enters
  ``cockpit(state.global_step, losses=...)`` and the end of that backward pass (an autograd
  callback queued from a hook on the loss, after DistributedDataParallel synchronized the
  gradients) leaves it — before the Trainer clips the gradients;
- ``optimizer.step()`` records the step (Cockpit's optimizer hooks, as in a plain loop).

Step numbers are ``state.global_step`` (optimizer steps). Checkpoints written in
``output_dir`` carry Cockpit's state (θ_0 of Distance, the step numbering) for
``train(resume_from_checkpoint=...)``. With DDP every rank's values
describe the global batch (also with ``gradient_accumulation_steps``: the micro-batches under
DDP's ``no_sync`` merge with the synchronizing one, then the ranks). Mixed precision:
``bf16=True`` runs the forward pass under autocast; Cockpit reads the float32 gradients before
clipping, and the curvature instruments the logits behind accelerate's cast to float32 (the
engine takes a ``ModelOutput``'s ``logits`` as the network output). With ``fp16=True`` the
Trainer's GradScaler is handed to Cockpit, which unscales (on the CPU accelerate 1.15
enables neither autocast nor a scaler for ``fp16``: float32 training). With
``max_grad_norm`` before an Adam-like optimizer Alpha measures the real update
(:func:`~cockpit.integrations._common.measure_clipped_updates`). The totals go to the loggers
of ``report_to`` (TensorBoard, W&B, …) as ``cockpit/<name>`` at Cockpit's step number
(each parameter's values too with ``log_per_parameter=True``); the run log (``logdir=``)
keeps everything.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cockpit._extras import missing_extra

try:
    from transformers import TrainerCallback
except ImportError as error:
    raise missing_extra(error, "transformers", "transformers",
                        "cockpit.integrations.transformers") from None
from cockpit.cockpit import Cockpit
from cockpit.integrations._common import (
    LoggerSink,
    check_cockpit_kwargs,
    measure_clipped_updates,
)
from cockpit.quantities.base import Quantity

__all__ = ["CockpitCallback", "sequence_losses"]

IGNORE_INDEX = -100
STATE_FILE = "cockpit_state.pt"  # in each checkpoint folder: θ_0 (Distance), step numbering


def sequence_losses(logits: Tensor, labels: Tensor, *, shift: bool = False) -> Tensor:
    """The individual losses ℓ_n ``[batch]`` of a Hugging Face model's output.

    - labels ``[B]`` (classification): ℓ_n = CE(z_n, y_n); with one float output per
      example (regression) ℓ_n = (z_n − y_n)²;
    - labels ``[B, T]`` (token labels, e.g. language modelling): ℓ_n = (1/T_n) Σ_{t ∈ T_n}
      CE(z_{n,t}, y_{n,t}), the mean over the T_n positions whose label is not −100 (padding
      and prompt tokens carry −100). ``shift=True`` for a causal LM: the logits at position
      t predict the label at t + 1 (z_{n, :−1} against y_{n, 1:}, as the model's own loss).
    """
    if labels.dim() == 1 and logits.dim() == 2:
        if logits.shape[-1] == 1 and labels.is_floating_point():
            return (logits.squeeze(-1) - labels.to(logits.dtype)) ** 2
        return F.cross_entropy(logits, labels, reduction="none")
    if labels.dim() != 2 or logits.dim() != 3 or logits.shape[:2] != labels.shape:
        raise ValueError(
            f"sequence_losses expects logits [B, C] with labels [B], or logits [B, T, V] with "
            f"labels [B, T]; got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if shift:  # the labels move one to the left, the last position ignored: the logits
        # stay whole (a slice of them would be copied below)
        labels = torch.cat([labels[:, 1:], labels.new_full((len(labels), 1), IGNORE_INDEX)],
                           dim=1)
    # tokens as rows [B·T, V]: the softmax over contiguous rows (over the strided class
    # dimension of logits.transpose(1, 2) it is several times slower)
    tokens = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)
    counts = (labels != IGNORE_INDEX).sum(1)
    if bool((counts == 0).any()):
        empty = (counts == 0).nonzero().flatten().tolist()
        raise ValueError(
            f"sequences {empty[:5]} have no label other than {IGNORE_INDEX}: their loss is "
            "undefined; drop them from the batch (or give them a target token)")
    return tokens.sum(1) / counts.to(tokens.dtype)


class CockpitCallback(TrainerCallback):
    """Cockpit for a Hugging Face ``Trainer``.

    Args:
        quantities: the instruments, as for :class:`~cockpit.Cockpit` (a list, a
            configuration name or None for economy).
        log_per_parameter: also send each parameter's values
            (``cockpit/<instrument>/<parameter>``) to the ``report_to`` loggers; by default
            only the totals (about a dozen scalars a step) go there, and the run log
            (``logdir=``) keeps everything.
        **cockpit_kwargs: every other argument of :class:`~cockpit.Cockpit` except ``model``,
            ``optimizer`` and ``grad_scaler`` (the Trainer's): ``logdir=``, ``sinks=``, ….

    Call :meth:`attach` with the Trainer before ``trainer.train()``. The running Cockpit is
    ``callback.cockpit``.
    """

    def __init__(self, quantities: Sequence[Quantity] | str | None = None, *,
                 log_per_parameter: bool = False, **cockpit_kwargs: Any):
        check_cockpit_kwargs(cockpit_kwargs)
        self.quantities = quantities
        self.cockpit_kwargs = cockpit_kwargs
        self.log_per_parameter = log_per_parameter
        self.cockpit: Cockpit | None = None
        self.trainer: Any = None  # transformers.Trainer, once attached
        self._context: Any = None

    def attach(self, trainer) -> None:
        """Hand Cockpit the individual losses: :meth:`compute_loss` becomes the Trainer's
        ``compute_loss_func``; the callback joins the Trainer's callbacks if it is not one
        yet, and logs to the Trainer's ``report_to`` loggers."""
        own = getattr(trainer, "compute_loss_func", None)
        if own is not None and own != self.compute_loss:
            raise ValueError(
                "the Trainer has its own compute_loss_func; Cockpit needs the loss as the mean "
                "of individual losses: drop it, or use Cockpit directly in a custom loop")
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        trainer.compute_loss_func = self.compute_loss
        self.trainer = trainer

    # ----------------------------------------------------------------- set-up, tear-down
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.trainer is None:
            raise RuntimeError(
                "CockpitCallback needs the Trainer: call callback.attach(trainer) before "
                "trainer.train()")
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        kwargs = dict(self.cockpit_kwargs)
        kwargs["sinks"] = [*kwargs.get("sinks", ()),
                           LoggerSink(self._report, self.log_per_parameter)]
        if args.gradient_accumulation_steps > 1:
            kwargs.setdefault("grad_accumulation", True)
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if self.cockpit is not None:
            self.cockpit.close()
        self.cockpit = Cockpit(model, self.quantities, optimizer=optimizer, grad_scaler=scaler,
                               **kwargs)
        measure_clipped_updates(self.cockpit, clips=bool(args.max_grad_norm))
        if state.global_step > 0:  # resumed from a checkpoint
            path = os.path.join(_checkpoint_folder(args, state), STATE_FILE)
            if os.path.exists(path):
                try:
                    self.cockpit.load_state_dict(torch.load(path, weights_only=True))
                except ValueError as error:  # (fully_shard: rank 0's slice of θ_0 on another)
                    warnings.warn(f"training resumed at step {state.global_step} without "
                                  f"Cockpit's θ_0 ({error}): Distance is measured from the "
                                  "resumed parameters", RuntimeWarning, stacklevel=2)
            else:
                warnings.warn(
                    f"training resumed at step {state.global_step} without Cockpit's state "
                    f"({path} is missing): Distance is measured from the resumed parameters",
                    RuntimeWarning, stacklevel=2)

    def on_save(self, args, state, control, **kwargs):
        """Cockpit's state goes into the checkpoint folder the Trainer just wrote."""
        folder = _checkpoint_folder(args, state)
        if self.cockpit is not None and state.is_world_process_zero and os.path.isdir(folder):
            torch.save(self.cockpit.state_dict(), os.path.join(folder, STATE_FILE))

    def on_train_end(self, args, state, control, **kwargs):
        self._leave(failed=False)
        if self.cockpit is not None:
            self.cockpit.close()

    # ----------------------------------------------------------------- the loss
    def compute_loss(self, outputs, labels: Tensor, num_items_in_batch=None) -> Tensor:
        """The Trainer's ``compute_loss_func``: the mean of :func:`sequence_losses`, scaled
        for gradient accumulation (and for the Trainer's multiplication by the number of
        processes when it averages over devices); the backward pass of this loss runs inside
        Cockpit's step context."""
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError("call callback.attach(trainer) before trainer.train()")
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        losses = sequence_losses(logits, labels, shift=self._shifts_labels())
        loss = losses.mean()
        if not (torch.is_grad_enabled() and loss.requires_grad):
            return loss  # evaluation: the plain mean
        args = trainer.args
        loss = loss / getattr(trainer, "current_gradient_accumulation_steps",
                              args.gradient_accumulation_steps)
        if (args.average_tokens_across_devices and num_items_in_batch is not None
                and args.world_size > 1):
            loss = loss / args.world_size  # the Trainer multiplies by it (DDP then averages)
        if self.cockpit is None:
            return loss
        self._leave(failed=True)  # a previous backward pass that never ran
        context = self.cockpit(trainer.state.global_step, losses=losses)
        context.__enter__()
        self._context = context
        loss.register_hook(self._at_backward_start)
        return loss

    def _shifts_labels(self) -> bool:
        """A causal LM's logits at position t predict the label at t + 1 (its class is a
        causal-LM class of transformers' auto mapping, as the Trainer decides it too)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if getattr(self.trainer, "_loss_shifts_labels", False):
            return True
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return False
        return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()

    def _at_backward_start(self, grad: Tensor) -> None:
        """Leave Cockpit's context when this backward pass is over: a callback queued now runs
        first at its end and queues the exit behind DistributedDataParallel's own (queued
        later), so the synchronized gradients are in place."""
        engine = torch.autograd.Variable._execution_engine

        def queue_exit() -> None:
            engine.queue_callback(lambda: self._leave(failed=False))

        engine.queue_callback(queue_exit)

    def _leave(self, failed: bool) -> None:
        context, self._context = self._context, None
        if context is not None:
            error = RuntimeError("backward pass did not run") if failed else None
            context.__exit__(type(error) if error else None, error, None)

    # ----------------------------------------------------------------- logging
    def _report(self, metrics: dict[str, float], step: int) -> None:
        """Scalars to the Trainer's ``report_to`` loggers, at Cockpit's step number."""
        from transformers.integrations import get_reporting_integration_callbacks

        trainer = self.trainer
        kinds = tuple(get_reporting_integration_callbacks(trainer.args.report_to))
        if not kinds:
            return
        state = copy.copy(trainer.state)
        state.global_step = step
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, kinds):
                try:
                    callback.on_log(trainer.args, state, trainer.control, logs=dict(metrics),
                                    model=trainer.model)
                except Exception as error:  # a logger never stops training
                    warnings.warn(f"Cockpit could not log to {type(callback).__name__}: "
                                  f"{error}", RuntimeWarning, stacklevel=2)


def _checkpoint_folder(args, state) -> str:
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
