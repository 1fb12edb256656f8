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
``-100``, i.e. padding and prompt tokens, excluded; shifted by one position for a causal LM:
``CockpitCallback(shift_labels=...)`` where the model's class does not tell, with a
warning; a sequence left without a target raises ValueError), for a classification head
the loss its ``*ForSequenceClassification`` model defines by ``config.problem_type``
(cross-entropy, mean squared error, binary cross-entropy averaged over the example's
labels) — with the Trainer's ``label_smoothing_factor`` ε in the cross-entropy, and trains
on their mean,

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
``train(resume_from_checkpoint=...)``, read from the checkpoint folder training resumes
from (the wrapped ``trainer.train`` notes it). With DDP every rank's values
describe the global batch (also with ``gradient_accumulation_steps``: the micro-batches under
DDP's ``no_sync`` merge with the synchronizing one, then the ranks). Mixed precision:
``bf16=True`` runs the forward pass under autocast; Cockpit reads the float32 gradients before
clipping, and the curvature instruments the logits behind accelerate's cast to float32 (the
engine takes a ``ModelOutput``'s ``logits`` as the network output). With ``fp16=True`` the
Trainer's GradScaler is handed to Cockpit, which unscales (on the CPU accelerate 1.15
enables neither autocast nor a scaler for ``fp16``: float32 training). With
``max_grad_norm`` before an Adam-like optimizer Alpha measures the real update
(:func:`~cockpit.integrations._common.measure_clipped_updates`). The totals go to the loggers
of ``report_to`` (TensorBoard, W&B, …) as ``cockpit/<name>`` at the Trainer's step number of
the same update: Cockpit's step t (``state.global_step`` = t when its backward pass runs)
is logged at t + 1, where the Trainer logs that update's ``train/loss`` (each parameter's
values too with ``log_per_parameter=True``); the run log (``logdir=``) keeps everything,
numbered by Cockpit's steps.

Not covered: a Trainer subclass whose ``compute_loss`` does not call ``compute_loss_func``
(nothing is recorded; a warning after the first step says so), and a model output with an
auxiliary loss (``aux_loss``, e.g. a mixture of experts' router loss; ValueError).
"""

from __future__ import annotations

import copy
import functools
import os
import warnings
from collections.abc import Mapping, Sequence
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
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
AUXILIARY_LOSSES = ("aux_loss", "z_loss")  # the ends of a ModelOutput's router-loss fields


def sequence_losses(logits: Tensor, labels: Tensor, *, shift: bool = False,
                    problem_type: str | None = None, label_smoothing: float = 0.0) -> Tensor:
    """The individual losses ℓ_n ``[batch]`` of a Hugging Face model's output.

    - logits ``[B, C]`` (a classification head): ℓ_n by ``problem_type`` as the
      ``*ForSequenceClassification`` models define it (:func:`example_losses`);
    - labels ``[B, T]`` with logits ``[B, T, V]`` (token labels, e.g. language modelling):
      ℓ_n = (1/T_n) Σ_{t ∈ T_n} CE_ε(z_{n,t}, y_{n,t}), the mean over the T_n positions whose
      label is not −100 (padding and prompt tokens carry −100). ``shift=True`` for a causal
      LM: the logits at position t predict the label at t + 1 (z_{n, :−1} against y_{n, 1:},
      as the model's own loss). A sequence without any such position raises ValueError.

    CE_ε(z, y) = (1 − ε)·(−log p_y) + ε·(1/V) Σ_c (−log p_c), p = softmax(z), with
    ε = ``label_smoothing`` (the Trainer's ``label_smoothing_factor``): per token what the
    Trainer's ``LabelSmoother`` averages.
    """
    if logits.dim() == 2:
        return example_losses(logits, labels, problem_type=problem_type,
                              label_smoothing=label_smoothing)
    if labels.dim() != 2 or logits.dim() != 3 or logits.shape[:2] != labels.shape:
        raise ValueError(
            f"sequence_losses expects logits [B, C] with labels [B] (or [B, C]), or logits "
            f"[B, T, V] with labels [B, T]; got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if shift:  # the labels move one to the left, the last position ignored: the logits
        # stay whole (a slice of them would be copied below)
        labels = torch.cat([labels[:, 1:], labels.new_full((len(labels), 1), IGNORE_INDEX)],
                           dim=1)
    # tokens as rows [B·T, V]: the softmax over contiguous rows (over the strided class
    # dimension of logits.transpose(1, 2) it is several times slower)
    tokens = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="none",
                             label_smoothing=label_smoothing).view(labels.shape)
    counts = (labels != IGNORE_INDEX).sum(1)
    if bool((counts == 0).any()):
        empty = (counts == 0).nonzero().flatten().tolist()
        raise ValueError(
            f"sequences {empty[:5]} have no label other than {IGNORE_INDEX}"
            f"{' after the shift' if shift else ''}: their loss is undefined; drop them from "
            "the batch (or give them a target token)")
    return tokens.sum(1) / counts.to(tokens.dtype)


def problem_type_of(logits: Tensor, labels: Tensor) -> str:
    """The rule of the ``*ForSequenceClassification`` models where ``config.problem_type``
    is not set: one output (C = 1) is regression, integer labels (int64, int32) are single
    class indices, anything else one target per output (multi-label)."""
    if logits.shape[-1] == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def example_losses(logits: Tensor, labels: Tensor, *, problem_type: str | None = None,
                   label_smoothing: float = 0.0) -> Tensor:
    """The individual losses ℓ_n ``[B]`` of a classification head's logits z ``[B, C]``,
    whose mean is the loss of the ``*ForSequenceClassification`` model (``problem_type``
    None: :func:`problem_type_of`):

    - ``"regression"``: ℓ_n = (1/C) Σ_c (z_{n,c} − y_{n,c})² (MSE; for C = 1 (z_n − y_n)²);
    - ``"single_label_classification"``: ℓ_n = CE_ε(z_n, y_n), ε = ``label_smoothing``;
    - ``"multi_label_classification"``: ℓ_n = (1/C) Σ_c BCE(σ(z_{n,c}), y_{n,c}), binary
      cross-entropy with logits averaged over the example's labels.
    """
    kind = problem_type or problem_type_of(logits, labels)
    if kind not in PROBLEM_TYPES:
        raise ValueError(f"unknown problem_type {kind!r}; one of {PROBLEM_TYPES}")
    if label_smoothing and kind != "single_label_classification":
        raise ValueError(
            f"label smoothing smooths class labels; the {kind} loss has none: set "
            "label_smoothing_factor=0 (the Trainer's own label smoother fails there too)")
    if kind == "single_label_classification":
        return F.cross_entropy(logits, labels.reshape(-1), reduction="none",
                               label_smoothing=label_smoothing)
    if labels.numel() != logits.numel():
        raise ValueError(f"a {kind} loss needs one target per output: logits "
                         f"{tuple(logits.shape)}, labels {tuple(labels.shape)}")
    targets = labels.reshape(logits.shape).to(logits.dtype)
    if kind == "regression":
        return (logits - targets).pow(2).mean(-1)
    return F.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(-1)


class CockpitCallback(TrainerCallback):
    """Cockpit for a Hugging Face ``Trainer``.

    Args:
        quantities: the instruments, as for :class:`~cockpit.Cockpit` (a list, a
            configuration name or None for economy).
        log_per_parameter: also send each parameter's values
            (``cockpit/<instrument>/<parameter>``) to the ``report_to`` loggers; by default
            only the totals (about a dozen scalars a step) go there, and the run log
            (``logdir=``) keeps everything.
        shift_labels: for token labels ``[B, T]``, whether the logits at position t predict
            the label at t + 1 (a causal LM) or at t. None: from the model's class (the
            causal-LM classes of transformers' auto mappings shift; token classification,
            masked LM and sequence-to-sequence classes do not); a class in none of them is
            taken as not shifting, with a warning.
        **cockpit_kwargs: every other argument of :class:`~cockpit.Cockpit` except ``model``,
            ``optimizer`` and ``grad_scaler`` (the Trainer's): ``logdir=``, ``sinks=``, ….

    Call :meth:`attach` with the Trainer before ``trainer.train()``. The running Cockpit is
    ``callback.cockpit``.
    """

    def __init__(self, quantities: Sequence[Quantity] | str | None = None, *,
                 log_per_parameter: bool = False, shift_labels: bool | None = None,
                 **cockpit_kwargs: Any):
        check_cockpit_kwargs(cockpit_kwargs)
        self.quantities = quantities
        self.cockpit_kwargs = cockpit_kwargs
        self.log_per_parameter = log_per_parameter
        self.shift_labels = shift_labels
        self.cockpit: Cockpit | None = None
        self.trainer: Any = None  # transformers.Trainer, once attached
        self._context: Any = None
        self._shift: bool | None = None  # shift_labels, or what the model's class tells
        self._resume_folder: str | None = None  # the checkpoint train() resumes from
        self._entered = False  # a Cockpit block ran in this optimizer step
        self._warned_no_block = False

    def attach(self, trainer) -> None:
        """Hand Cockpit the individual losses: :meth:`compute_loss` becomes the Trainer's
        ``compute_loss_func``; the callback joins the Trainer's callbacks if it is not one
        yet, and logs to the Trainer's ``report_to`` loggers. ``trainer.train`` is wrapped
        to learn the checkpoint it resumes from (Cockpit's state is read from there)."""
        own = getattr(trainer, "compute_loss_func", None)
        if own is not None and own != self.compute_loss:
            raise ValueError(
                "the Trainer has its own compute_loss_func; Cockpit needs the loss as the mean "
                "of individual losses: drop it, or use Cockpit directly in a custom loop")
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        trainer.compute_loss_func = self.compute_loss
        trainer.train = self._resuming(trainer)
        self.trainer = trainer
        self._shift = None

    def _resuming(self, trainer) -> Any:
        """``trainer.train`` that first notes the checkpoint folder it resumes from (``True``:
        the last checkpoint in ``output_dir``, as the Trainer resolves it)."""
        from transformers.trainer_utils import get_last_checkpoint

        train = getattr(trainer.train, "_cockpit_unwrapped", trainer.train)  # attached again

        @functools.wraps(train)
        def resuming_train(resume_from_checkpoint: str | bool | None = None, *args: Any,
                           **kwargs: Any) -> Any:
            folder = resume_from_checkpoint
            if isinstance(folder, bool):
                folder = get_last_checkpoint(trainer.args.output_dir) if folder else None
            self._resume_folder = None if folder is None else os.fspath(folder)
            try:
                return train(resume_from_checkpoint, *args, **kwargs)
            finally:
                self._resume_folder = None

        resuming_train._cockpit_unwrapped = train  # type: ignore[attr-defined]
        return resuming_train

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
        self._entered = False
        if state.global_step > 0:  # resumed from a checkpoint
            self._load_state(self._resume_folder or _checkpoint_folder(args, state), state)

    def _load_state(self, folder: str, state) -> None:
        """Cockpit's state from the checkpoint folder training resumed from."""
        assert self.cockpit is not None
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            warnings.warn(
                f"training resumed at step {state.global_step} without Cockpit's state "
                f"({path} is missing): Distance is measured from the resumed parameters",
                RuntimeWarning, stacklevel=3)
            return
        try:
            self.cockpit.load_state_dict(torch.load(path, weights_only=True))
        except ValueError as error:  # (fully_shard: rank 0's slice of θ_0 on another)
            warnings.warn(f"training resumed at step {state.global_step} without "
                          f"Cockpit's θ_0 ({error}): Distance is measured from the "
                          "resumed parameters", RuntimeWarning, stacklevel=3)

    def on_step_end(self, args, state, control, **kwargs):
        """An optimizer step without a Cockpit block: the Trainer's ``compute_loss`` did not
        call ``compute_loss_func`` (once, with a warning)."""
        entered, self._entered = self._entered, False
        if entered or self._warned_no_block:
            return
        self._warned_no_block = True
        warnings.warn(
            f"Cockpit recorded nothing in the Trainer's step {state.global_step}: its "
            "compute_loss did not call compute_loss_func, which CockpitCallback.attach set "
            f"({type(self.trainer).__name__}.compute_loss overridden?). Call "
            "self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch) "
            "from your compute_loss for the loss it returns, or use Cockpit directly in a "
            "custom loop",
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
        if labels is None:
            raise ValueError(
                "the batch has no 'labels': Cockpit computes each example's loss from the "
                "model's logits and the labels (name them 'labels' in the batch)")
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        training = torch.is_grad_enabled() and logits.requires_grad
        if training:
            _refuse_auxiliary_loss(outputs)
        shift = labels.dim() == 2 and logits.dim() == 3 and self._shifts_labels()
        losses = sequence_losses(logits, labels, shift=shift,
                                 problem_type=getattr(self._config(), "problem_type", None),
                                 label_smoothing=_label_smoothing(trainer))
        loss = losses.mean()
        if not training:
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
        self._entered = True
        loss.register_hook(self._at_backward_start)
        return loss

    def _model(self) -> Any:
        """The Trainer's model without the wrappers of accelerate and PEFT."""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        if type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
            model = model.get_base_model()
        return model

    def _config(self) -> Any:
        return getattr(self._model(), "config", None)

    def _shifts_labels(self) -> bool:
        """Whether the logits at position t predict the label at t + 1: ``shift_labels``, or
        what the model's class tells (:func:`_class_shifts_labels`); a class that does not
        tell is taken as not shifting, with a warning (once)."""
        if self.shift_labels is not None:
            return self.shift_labels
        if self._shift is None:
            model = self._model()
            known = _class_shifts_labels(model, getattr(self.trainer, "_loss_shifts_labels",
                                                        False))
            if known is None:
                warnings.warn(
                    f"Cockpit cannot tell whether the logits of {type(model).__name__} at "
                    "position t predict the label at t (token classification, masked LM, "
                    "sequence-to-sequence) or at t + 1 (a causal LM): its class is in none of "
                    "transformers' auto mappings. Cockpit assumes t (labels not shifted); "
                    "pass CockpitCallback(..., shift_labels=True) for a causal LM, or "
                    "shift_labels=False", RuntimeWarning, stacklevel=4)
            self._shift = bool(known)
        return self._shift

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
        """Scalars to the Trainer's ``report_to`` loggers at the Trainer's step number of the
        same update: Cockpit's step t is the update the Trainer logs at ``global_step``
        t + 1 (its ``train/loss``, ``train/grad_norm``)."""
        from transformers.integrations import get_reporting_integration_callbacks

        trainer = self.trainer
        kinds = tuple(get_reporting_integration_callbacks(trainer.args.report_to))
        if not kinds:
            return
        state = copy.copy(trainer.state)
        state.global_step = step + 1
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, kinds):
                try:
                    callback.on_log(trainer.args, state, trainer.control, logs=dict(metrics),
                                    model=trainer.model)
                except Exception as error:  # a logger never stops training
                    warnings.warn(f"Cockpit could not log to {type(callback).__name__}: "
                                  f"{error}", RuntimeWarning, stacklevel=2)


def _label_smoothing(trainer) -> float:
    """ε of the Trainer's label smoother (``label_smoothing_factor``; none where the Trainer
    turned it off, as for multi-label classification)."""
    smoother = getattr(trainer, "label_smoother", None)
    if smoother is None:
        return 0.0
    return float(getattr(smoother, "epsilon", trainer.args.label_smoothing_factor))


def _refuse_auxiliary_loss(outputs: Any) -> None:
    """A model output with an auxiliary loss (``aux_loss``, ``encoder_z_loss``, …: a mixture
    of experts' router losses): the model's own loss adds it, and Cockpit cannot, since its
    per-sample instruments need the loss to be a function of the individual losses alone."""
    if not isinstance(outputs, Mapping):
        return
    found = [key for key, value in outputs.items()
             if key.endswith(AUXILIARY_LOSSES) and value is not None]
    if found:
        raise ValueError(
            f"the model returns an auxiliary loss ({', '.join(found)}: e.g. a mixture of "
            "experts' router load balancing), which its own loss adds; Cockpit trains on the "
            "mean of the individual losses, and its per-sample instruments need the loss to "
            "be a function of them alone, so it cannot add the term and the run would train "
            "on another objective. Turn the term off for the tracked run (e.g. "
            "config.output_router_logits=False), or use Cockpit in a custom loop where you "
            "decide how to treat the term")


def _names(*mappings: Mapping[str, Any]) -> set[str]:
    """The class names of transformers' auto mappings (a value may be a tuple of names)."""
    out: set[str] = set()
    for mapping in mappings:
        for value in mapping.values():
            out.update((value,) if isinstance(value, str) else value)
    return out


def _class_shifts_labels(model: Any, loss_shifts: bool) -> bool | None:
    """Whether the model's class shifts token labels: True for a causal LM (its loss type is
    the causal-LM loss, ``loss_shifts``, as the Trainer reads it, or its class is in the
    causal-LM auto mapping), False for an encoder-decoder, token classification or masked
    LM; None where the class does not tell."""
    from transformers.models.auto import modeling_auto as auto

    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    if loss_shifts or name in _names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return True
    unshifted = _names(auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
                       auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                       auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    if name in unshifted or getattr(model, "loss_type", None) in ("ForTokenClassification",
                                                                   "ForMaskedLM"):
        return False
    return None


def _checkpoint_folder(args, state) -> str:
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
