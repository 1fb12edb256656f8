"""The orchestrator: schedule, hooks armed, step pipeline, sinks.

Typical use, three added lines in an ordinary training loop::

    cockpit = Cockpit(model, configuration("economy"), optimizer=opt)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    results = cockpit.get_output()   # {step: {"NormTest": ..., "GradHist1d": {...}, ...}}

See ``docs/conventions.md`` for the conventions every instrument follows.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from cockpit._stacklevel import user_stacklevel
from cockpit.configurations import configuration
from cockpit.engine import compiled
from cockpit.engine import distributed as ranks
from cockpit.engine.histogram import (
    AutoRange,
    BinSpec,
    DecidedRange,
    choose_auto_spec,
    narrower_range,
    regroup,
    warn_if_slow,
)
from cockpit.engine.readout import Failed, Later, Noted, Readout
from cockpit.engine.reduction import StepReduction
from cockpit.engine.request import StepRequest
from cockpit.engine.rules.batchnorm_frozen import APPROXIMATION, FROZEN_STATISTICS
from cockpit.engine.tracker import GRAM_MEAN, PER_SAMPLE_STATS, BackwardStatistics, ModuleTracker
from cockpit.engine.workspace import release_workspace
from cockpit.loop_checks import (
    BATCH,
    EMPTY_BATCH,
    GRADIENT,
    LOSSES_NOT_BACKPROPAGATED,
    MODEL,
    ONLY_OUTSIDE,
    REPEATED_BACKWARD,
    SAME_FORWARD_AGAIN,
    STEP_BACKWARDS,
    OutsideBackwardWatch,
    gradient_mismatch,
    parameters_changed,
    parameters_holding_gradient,
)
from cockpit.quantities.base import Quantity, StepData, Value
from cockpit.store.arena import ArrayArena
from cockpit.store.outbox import StepOutbox


class Cockpit:
    """Watch the inside of training: computes the instruments at the scheduled steps.

    Args:
        model: the network. It is not wrapped or modified; hooks are removed by
            :meth:`close`. A compiled model (``torch.compile(model)``, or ``model.compile()``
            called before) runs its compiled graph at untracked steps and its eager module
            at tracked ones, whose values are the eager model's
            (:mod:`cockpit.engine.compiled`).
        quantities: the instruments — a list of :class:`~cockpit.quantities.Quantity`, a
            configuration name (``"economy"``, ``"business"``, ``"full"``) or None (economy).
        optimizer: the optimizer whose steps are watched (needed by UpdateSize, CABS and the
            learning-rate panel). Its ``step()`` is observed through torch's step hooks.
        hist_bins: bins of GradHist1d. Default: 100 bins over a range set once, at the
            first tracked step, to hold all but 1e-4 of that step's elements (a power of two
            bin width; the edge bins hold exactly the elements beyond it), then kept so that
            steps stay comparable. ``BinSpec(-2.0, 2.0, 100)`` is the paper's fixed range.
        hist2d_bins: (gradient bins, parameter bins) of GradHist2d.
        sinks: objects with ``write_step(step, values, notes)`` and ``close()``.
        logdir: directory of a crash-safe run log (see :mod:`cockpit.store`), one run per
            directory: a directory whose log holds steps is refused unless ``resume``.
        memory_steps: how many recorded steps Cockpit keeps in memory (default 1,000; None:
            all, memory then grows with the run). With a ``logdir``, :meth:`get_output` and
            :meth:`get_notes` read older steps back from the run log, so they return the
            whole run; without one they return the last ``memory_steps`` steps (warned once
            when the first step is dropped). Memory stays flat in a long run either way.
        resume: continue the run log in ``logdir`` (a run restarted from a checkpoint): its
            steps are kept, and the steps up to its last logged one are not recorded again
            (load the saved :meth:`state_dict` too, for Distance's θ_0).
        grad_scaler: the ``torch.amp.GradScaler`` of a mixed-precision loop, if any. Its
            scale multiplies the gradients of the backward pass and is divided out before
            the step; Alpha needs it to predict an update that is not linear in the gradient
            (Adam, RMSprop, Adagrad). Without it Alpha stays exact but takes its slower
            general path. SGD and every other instrument need nothing.
        grad_accumulation: the loop accumulates gradients over several backward passes
            (micro-batches) per optimizer step. Cockpit learns this by itself at the first
            step with two ``with cockpit(step, ...)`` blocks of the same step; saying it here
            gives InnerTest, OrthoTest and Alpha from the first step on (they need every
            micro-batch's layer inputs until the step is complete).
        write_on_all_ranks: with torch.distributed, every process writes the run log and the
            sinks (default: only rank 0; every rank computes the same global values).
        distributed: with a process group initialised, combine the processes' statistics
            into the global batch's (None, the default: data-parallel training, DDP); False:
            describe this process's own batch only, as if it ran alone — for processes that
            each train their own model (give each its own ``logdir``; every process writes).
        strict: re-raise errors inside Cockpit's hooks instead of recording "not computed"
            (useful in tests; never set it in a production run).
        diagnose: read the recorded values while training runs (:func:`cockpit.diagnose`)
            and warn once per new finding (a ``RuntimeWarning`` naming the bug, its
            evidence and advice); sinks with ``write_findings`` log the findings as text.
            The checks re-run after every tracked step early on, then as the run grows by
            10 %; they read recorded numbers only and never interrupt training.
        batchnorm: None (default): with a BatchNorm layer in training mode the per-sample
            instruments are None with the reason (individual gradients are undefined).
            ``"frozen_statistics"``: an approximation that differentiates each sample's loss
            with every BatchNorm layer's batch mean and variance held constant
            (:mod:`cockpit.engine.rules.batchnorm_frozen`); costs one extra backward pass
            without weight gradients per tracked step; labelled in the notes, the view and
            the run log; puts Alpha on its general path (kept layer calls). One backward
            pass per step in one process only.

    Gradient accumulation: all backward passes of one optimizer step go inside
    ``with cockpit(step, losses=...)`` blocks with the same ``step``; the step's values
    describe the union of their samples, whatever weight each micro-batch loss has. They are
    computed when the step is complete: at ``optimizer.step()``, at the next step's first
    block, or at :meth:`get_output` / :meth:`close`.

    A step never waits for the device: its values are formed on the parameters' device and
    cross to the host together (see :mod:`cockpit.engine.readout`), read at the next step's
    start, :meth:`get_output` or :meth:`close`; the run log, the sinks and the warnings about
    misuse found in the numbers (non-finite loss, gradients not zeroed) see a step then.

    torch.distributed: with a process group initialised (e.g. a model wrapped in
    ``DistributedDataParallel`` or sharded by ``fully_shard``: see docs/conventions.md
    for what the latter refuses), every rank's values describe the global batch; the
    per-rank statistics are combined with two all-reduces per tracked step. Gradients
    all-reduced by hand instead of by DDP: do it inside the ``with`` block, after the
    backward pass, so that Cockpit sees the gradient the optimizer steps on. At every
    tracked step Cockpit checks that the processes step on the same gradient; where they
    do not (each process trains its own model), the global values would describe a batch
    no optimizer steps on: the batch instruments are then None with the reason, and
    ``distributed=False`` watches each process on its own.
    """

    def __init__(
        self,
        model: nn.Module,
        quantities: Sequence[Quantity] | str | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        hist_bins: BinSpec | None = None,
        hist2d_bins: tuple[BinSpec, BinSpec] = (BinSpec(-1.0, 1.0, 40), BinSpec(-2.0, 2.0, 50)),
        sinks: Iterable[Any] = (),
        logdir: str | None = None,
        resume: bool = False,
        memory_steps: int | None = 1000,
        grad_scaler: Any = None,
        grad_accumulation: bool = False,
        write_on_all_ranks: bool = False,
        distributed: bool | None = None,
        strict: bool = False,
        diagnose: bool = False,
        batchnorm: str | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Cockpit needs a torch.nn.Module, got {type(model).__name__}")
        ranks.check_supported_wrapper(model)
        compiled.check_supported(model)
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
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.model = model
        self.quantities = quantities
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise TypeError(
                f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}"
            )
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self.strict = strict
        self.hist_spec: BinSpec | AutoRange = AutoRange() if hist_bins is None else hist_bins
        self.hist2d_specs = hist2d_bins
        used = {type(q).__name__ for q in quantities}
        fixed = () if hist_bins is None else ((hist_bins, "hist_bins", "GradHist1d"),)
        for spec, name, user in (*fixed,
                                 (hist2d_bins[0], "hist2d_bins[0]", "GradHist2d"),
                                 (hist2d_bins[1], "hist2d_bins[1]", "GradHist2d")):
            if user in used:
                warn_if_slow(spec, name)
        # a compiled model (torch.compile): hooks on the eager module inside, which runs at
        # tracked steps only (see cockpit.engine.compiled)
        self.tracker = ModuleTracker(compiled.uncompiled(model), self.hist_spec, hist2d_bins,
                                     strict=strict, batchnorm=batchnorm)
        self._compiled = compiled.EagerAtTrackedSteps(model, self.tracker)
        self.batchnorm = batchnorm
        if batchnorm == FROZEN_STATISTICS and any(
                isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            # Alpha's prediction needs the batch gradient's individual shares: it projects
            # the kept calls after the step instead
            for quantity in quantities:
                if isinstance(getattr(type(quantity), "predict", None), property):
                    quantity.predict = False  # type: ignore[attr-defined]
        self._params: dict[str, Tensor] = dict(self.tracker.params)
        self._check_optimizer_owns_parameters()
        self._watch = OutsideBackwardWatch(
            self._params, lambda: self.tracker.in_own_work)
        self._initial = (
            {k: p.detach().clone() for k, p in self._params.items()}
            if any(q.name == "Distance" for q in quantities)
            else None
        )
        self._start_time = time.perf_counter()
        self._output: dict[int, dict[str, Value]] = {}
        self._notes: dict[int, dict[str, str]] = {}
        # records whose numbers are still on their way from the device (see engine.readout)
        self._readout = Readout()
        self._unread: list[tuple[int, dict[str, Value], dict[str, str], list[int]]] = []
        self._warned: set[str] = set()
        self._pending_update: tuple[int, StepData, dict[str, Tensor], list[Quantity]] | None = None
        self._open: _OpenStep | None = None  # the tracked step whose backward passes come in
        self._in_block = False  # inside a tracked ``with`` block
        self._accumulating = grad_accumulation  # said, or learned at the first such step
        if distributed not in (None, False):
            raise ValueError("distributed must be None (combine the processes of an "
                             "initialised process group) or False (this process alone), "
                             f"got {distributed!r}")
        self._ranks = ranks.world_size() if distributed is None else 1
        # every process's Cockpit must take part in the collectives: checked at the first
        # tracked step (None: checked, or nothing to check)
        self._attachment = ranks.attach() if self._ranks > 1 else None
        self._handles: list = []
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
            self._handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))
        writes = write_on_all_ranks or self._ranks == 1 or ranks.rank() == 0
        self._sinks = list(sinks) if writes else []
        if logdir is not None and writes:
            from cockpit.store import RunLogWriter

            try:
                writer = RunLogWriter(logdir, meta=self._metadata(), resume=resume)
            except BaseException:  # a refused run log leaves no hooks on the model
                self.tracker.remove()
                self._compiled.remove()
                for handle in self._handles:
                    handle.remove()
                raise
            self._sinks.insert(0, writer)
            resumed_from = writer.resumed_from
            self._log: RunLogWriter | None = writer
        else:
            resumed_from, self._log = None, None
        if memory_steps is not None and int(memory_steps) < 1:
            raise ValueError(f"memory_steps must be at least 1 (or None), got {memory_steps!r}")
        self.memory_steps = None if memory_steps is None else int(memory_steps)
        # recorded arrays, packed (see cockpit.store.arena); small blocks under a bounded
        # window, so that the blocks of dropped steps are freed soon
        self._arena = ArrayArena() if memory_steps is None else ArrayArena(256 << 10)
        # steps dropped from memory (read back from the run log if there is one)
        self._dropped = resumed_from is not None
        # each step goes to the sinks whole, once all its instruments have a value or reason
        self._outbox = StepOutbox(self._step_complete, self._write_sinks)
        self._prepare_failures: dict[str, str] = {}
        # recent steps whose individual gradients are an approximation → its label
        self._approximated: dict[int, str] = {}
        # the last step seen; a step at or below it is not recorded (never overwritten)
        self._last_step: int | None = resumed_from
        self._consecutive = True
        self._closed = False
        self._diagnosis = _LiveDiagnosis(self) if diagnose else None
        if self._needs_per_sample_anywhere():
            for problem in self.tracker.check_batch_norm()[:1]:
                # a debugger never stops a run it can still partly watch: the per-sample
                # instruments are None (with this reason) at steps where BatchNorm mixes samples
                self._warn(problem + " The other instruments are computed.",
                           key=f"per-sample:{problem}")
        # integrations whose trainer runs the backward inside optimizer.step(closure) turn
        # this off and call end_step() between the last backward pass and the update
        self.ends_steps_at_optimizer_step = True

    # ------------------------------------------------------------------ public API
    def __call__(self, step: int, losses: Tensor | None = None) -> _StepContext:
        """Context for the backward pass of ``step``; ``losses`` are the individual losses."""
        if self._closed:
            raise RuntimeError("this Cockpit was closed; create a new one to keep tracking")
        if int(step) != step:
            raise TypeError(f"step must be an integer, got {step!r}")
        return _StepContext(self, int(step), losses)

    def get_output(self) -> dict[int, dict[str, Value]]:
        """All values so far: ``{step: {instrument name: value}}``. A tracked step whose
        backward passes are complete is recorded first. Steps beyond the last
        ``memory_steps`` are read back from the run log (with a ``logdir``; without one they
        are gone, see ``memory_steps``)."""
        self._finalize_open_step()
        self._read_back()
        output = self._read_log("output")
        for step, values in self._output.items():
            output.setdefault(step, {}).update(values)
        return {step: dict(values) for step, values in sorted(output.items())}

    def get_notes(self) -> dict[int, dict[str, str]]:
        """Why a value is None or missing, per recorded step and instrument: the reasons
        recorded with the values, and for an instrument without a value at a recorded step
        "not scheduled at this step: <schedule>" or why it is still pending (Alpha needs the
        next step). The last two are derived from the schedules here, not stored in the run
        log (a name missing from a step of the run log was not scheduled there)."""
        self._finalize_open_step()
        self._read_back()
        notes = self._read_log("notes")
        for step, recorded in self._notes.items():
            if recorded:
                notes.setdefault(step, {}).update(recorded)
        output = self._read_log("output") if self._dropped else {}
        for step, values in self._output.items():
            output.setdefault(step, {}).update(values)
        for step, values in output.items():
            for quantity in self.quantities:
                name = quantity.name
                if name in notes.get(step, {}) or _has_value(values, name):
                    continue
                reason = (f"pending: {_PENDING.get(name, _PENDING_OTHER)}"
                          if _scheduled(quantity, step)
                          else f"not scheduled at this step: {quantity.schedule!r}")
                notes.setdefault(step, {})[name] = reason
        return dict(sorted(notes.items()))

    def _read_log(self, what: str) -> dict[int, dict]:
        """The run log's ``output`` or ``notes`` when steps were dropped from memory (and a
        run log holds them), else nothing."""
        if not self._dropped or self._log is None:
            return {}
        from cockpit.store import RunLogReader

        try:
            with RunLogReader(self._log.logdir) as reader:
                return reader.output() if what == "output" else reader.notes()
        except Exception as error:  # reading back never stops training
            if self.strict:
                raise
            self._warn(f"Cockpit could not read the run log back: {error}", key="read-back")
            return {}

    def end_step(self) -> None:
        """Record the open tracked step now: all of its backward passes are done.

        Cockpit does this by itself in ``optimizer.step()``'s pre-hook. A trainer that runs
        the backward pass inside ``optimizer.step(closure)`` (Lightning) calls it after that
        hook; its integration sets ``ends_steps_at_optimizer_step = False`` and calls
        ``end_step()`` after the last backward pass of the step, before the update."""
        self._measure_gradient_mismatch()
        self._finalize_open_step()

    def state_dict(self) -> dict[str, Any]:
        """What a run resumed from a checkpoint needs to continue with the same values:
        θ_0 of Distance (on the CPU) and the last step seen (step numbering)."""
        initial = (None if self._initial is None
                   else {k: v.detach().cpu().clone() for k, v in self._initial.items()})
        return {"initial_params": initial, "last_step": self._last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a run saved by :meth:`state_dict` (call it before the first step)."""
        initial = state.get("initial_params")
        if initial is not None and self._initial is not None:
            missing = set(self._initial) - set(initial)
            if missing:
                raise ValueError(
                    f"the saved Cockpit state lacks θ_0 of {sorted(missing)[:3]}: it was saved "
                    "for another model")
            self._initial = {k: initial[k].to(device=v.device, dtype=v.dtype)
                             for k, v in self._initial.items()}
        last = state.get("last_step")
        if last is not None:  # (a resumed run log may be ahead of the checkpoint)
            self._last_step = max(int(last), self._last_step if self._last_step is not None
                                  else int(last))

    def close(self) -> None:
        """Finish pending work, remove every hook and close the sinks. Idempotent."""
        if self._closed:
            return
        self._finalize_open_step()
        self._finish_pending_update()
        self._read_back()
        self._record_unfinished()
        self._outbox.flush()
        self._watch.reset()
        if self._diagnosis is not None:
            self._diagnosis.feed(final=True)
        self.tracker.remove()
        self._compiled.remove()
        release_workspace()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for sink in self._sinks:
            self._guard(sink.close)
        self._closed = True

    def __enter__(self) -> Cockpit:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ step pipeline
    def _needs_per_sample_anywhere(self) -> bool:
        return any(q.needs & PER_SAMPLE_STATS for q in self.quantities)

    def _tracked(self, step: int) -> list[Quantity]:
        return [q for q in self.quantities if q.should_track(step)]

    def _capture_next(self, step: int) -> bool:
        """Whether the coming forward pass must be recorded. Skipped only when the steps
        seen so far were consecutive and the schedule leaves step + 1 untracked."""
        return not self._consecutive or bool(self._tracked(step + 1))

    def _enter(self, step: int, losses: Tensor | None) -> None:
        last = self._last_step
        try:
            self._open_block(step, losses)
        except BaseException:
            self._last_step = last  # a block refused at its start saw no step
            raise

    def _open_block(self, step: int, losses: Tensor | None) -> None:
        if self._in_block:
            raise RuntimeError("cockpit(step) blocks cannot be nested; close the previous one")
        self._watch.disarm()  # a block is open: its backward passes are seen
        open_step = self._open
        continues = open_step is not None and open_step.step == step
        unstepped = False  # the previous tracked step had no optimizer step
        if open_step is not None and not continues:
            if (self.optimizer is not None and self.grad_scaler is None
                    and bool(open_step.finite_losses)):  # (a non-finite loss: skipping is right)
                unstepped = True
                self._warn(
                    f"step {open_step.step} was not followed by optimizer.step() before step "
                    f"{step} began: if these backward passes are micro-batches of one "
                    "optimizer step, give them the same step number (their values were "
                    f"recorded as step {open_step.step} alone)", key="step-without-optimizer")
            self._finalize_open_step()
        if not continues:
            self._finish_pending_update()
            self._read_back()  # the previous step's numbers, one wait for all of them
            if self._diagnosis is not None:
                self._diagnosis.feed()
            if step == self._last_step and not self._tracked(step):
                # another micro-batch of an untracked step: nothing to record, the next
                # forward passes stay unrecorded (a compiled model stays compiled)
                self.tracker.clear_calls()
                self.tracker.capturing = self._capture_next(step)
                return
            if self._last_step is not None and step <= self._last_step:
                self._warn(STEP_BACKWARDS.format(step=step, last=self._last_step),
                           key="step-backwards")
                self.tracker.clear_calls()
                self.tracker.drop_spare_gradients()
                self._consecutive = False
                self.tracker.capturing = True
                return
            if self._last_step is not None and step != self._last_step + 1:
                self._consecutive = False
            self._last_step = step
        tracked = self._tracked(step)
        if tracked and self._attachment is not None:
            self._check_every_rank_attached()
        if not tracked:
            self.tracker.clear_calls()
            self.tracker.drop_spare_gradients()
            self.tracker.capturing = self._capture_next(step)
            return
        finite = None  # whether the losses are finite: a device flag, read with the values
        if any(q.needs_losses for q in tracked):
            losses = self._check_losses(losses, step, tracked)
            finite = torch.isfinite(losses.detach()).all()
        problems = self._step_problems(step, losses, open_step if continues else None)
        held = None
        if not continues and not unstepped:  # (unstepped: said more precisely above)
            held = self._check_gradients_zeroed(step)
        recorded = self.tracker.num_calls  # forward calls before those of other graphs go
        if losses is not None and losses.requires_grad:
            losses.register_hook(self.tracker.losses_hook)
            self.tracker.drop_calls_outside(losses)
        captured = self.tracker.num_calls
        if continues:
            assert open_step is not None
            # the previous backward's gradient copies belong to the step being merged
            self.tracker.drop_spare_gradients()
            request = open_step.new_request(self._gradient_scale())
        else:
            needs = frozenset().union(*(q.needs for q in tracked))
            split = self._accumulating or self._ranks > 1
            # one backward per process: the layers can wait for the synchronized gradient
            defer = self._ranks > 1 and not self._accumulating
            request = StepRequest(needs, gradient_scale=self._gradient_scale(), split=split,
                                  defer=defer)
            if split and GRAM_MEAN in needs:
                # g_nᵀḡ needs the whole step's ḡ: formed from kept calls at the reduction point
                request.needs, request.union_gram = needs - {GRAM_MEAN}, True
            open_step = _OpenStep(step, tracked, request, time.perf_counter() - self._start_time,
                                  StepReduction(self.tracker, needs, request,
                                                _sample_sum_keys(tracked), ranks=self._ranks))
            open_step.gradient_held = held
            if finite is not None:
                open_step.finite_losses = finite
            self._open = open_step
        open_step.problems.extend(problems)
        if losses is not None:
            open_step.forwards.add(losses.grad_fn)
        if finite is not None:
            open_step.checks.append(Later(_nonfinite_warning(step), finite))
        stats = self.tracker.begin(request, losses)
        self._in_block = True
        self._prepare_failures = open_step.prepare_failures
        for quantity in tracked:
            if _problem_of(quantity, problems) is None:  # (else it records None anyway)
                self._prepare(quantity, step, losses)
        if request.needs & PER_SAMPLE_STATS or GRAM_MEAN in open_step.reduction.needs:
            stats.problems.extend(self.tracker.check_batch_norm()[:1])
            if (self.batchnorm == FROZEN_STATISTICS and losses is not None and captured
                    and losses.requires_grad and not problems
                    and self.tracker.has_training_batch_norm()):
                self.tracker.run_frozen_pass(losses)
                open_step.approximation = APPROXIMATION
            if captured == 0 and not problems:
                stats.problems.append(
                    "the `losses` passed to cockpit(step, losses=...) do not depend on the "
                    "forward pass Cockpit recorded: pass the individual losses of the batch "
                    "you backpropagate" if recorded else
                    "Cockpit did not see this step's forward pass (create the forward pass "
                    "after the previous cockpit(...) context and call cockpit(step) with "
                    "consecutive step numbers)"
                )

    def _gradient_scale(self) -> float:
        return 1.0 if self.grad_scaler is None else float(self.grad_scaler.get_scale())

    def _prepare(self, quantity: Quantity, step: int, losses: Tensor | None) -> None:
        """Work before the user's backward pass; a failure is recorded, never raised."""
        try:
            quantity.prepare(step, self.tracker, self.optimizer, losses)
        except Exception as error:
            if self.strict:
                raise
            message = str(error)
            if "scaled_dot_product" in message:
                message += (
                    " — second derivatives through attention need PyTorch's math kernel: run "
                    "the forward pass under torch.nn.attention.sdpa_kernel(SDPBackend.MATH)"
                )
            self._prepare_failures[quantity.name] = f"failed: {message}"
            self._warn(f"{quantity.name} failed at step {step}: {message}", key=quantity.name)

    def _check_optimizer_owns_parameters(self) -> None:
        """Say at construction which of the model's trainable parameters the optimizer does
        not own; its settings are recorded only for the groups holding the model's."""
        if self.optimizer is None:
            return
        stepped = self._stepped_params()
        missing = [name for name in self._params if name not in stepped]
        kind = type(self.optimizer).__name__
        if self._params and len(missing) == len(self._params):
            warnings.warn(
                f"the optimizer passed to Cockpit ({kind}) owns none of the model's parameters: "
                "pass the optimizer that trains this model (Cockpit(model, ..., optimizer=opt)). "
                "Its learning rate and settings are not recorded as the model's, and the "
                "update instruments (UpdateSize, Alpha) measure steps that do not change this "
                "model", RuntimeWarning, stacklevel=user_stacklevel())
        elif missing:
            warnings.warn(
                f"the optimizer passed to Cockpit ({kind}) does not own {len(missing)} of the "
                f"model's {len(self._params)} trainable parameters: {_names(missing, 8)}. "
                "If another optimizer trains them, Cockpit sees only this one's steps (Alpha "
                "and UpdateSize describe the parameters this optimizer moves; its learning rate "
                "is recorded for its own parameters only); freeze them (requires_grad=False) "
                "if nothing should train them", RuntimeWarning, stacklevel=user_stacklevel())

    def _model_param_groups(self) -> list[dict]:
        """The optimizer's parameter groups that hold parameters of the model."""
        if self.optimizer is None:
            return []
        ids = {id(p) for p in self._params.values()}
        return [g for g in self.optimizer.param_groups if any(id(p) in ids for p in g["params"])]

    def _check_losses(self, losses: Tensor | None, step: int,
                      tracked: Sequence[Quantity] = ()) -> Tensor:
        if losses is None:
            names = sorted({q.name for q in tracked if q.needs_losses})
            raise ValueError(
                f"{', '.join(names) or 'these instruments'} need the individual losses at "
                f"step {step}: call cockpit(step, losses=losses) with losses = loss_fn(output, "
                "target, reduction='none') of shape [batch], and backpropagate losses.mean() "
                "(or track only instruments that need no losses, e.g. GradNorm, Distance, "
                "UpdateSize)"
            )
        if not isinstance(losses, Tensor) or losses.dim() != 1:
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(
                f"losses must be a 1-d tensor of individual losses [batch], got {shape}; "
                "use reduction='none' (and .mean() over non-batch dims, e.g. "
                "F.mse_loss(out, y, reduction='none').mean(1))"
            )
        if not losses.is_floating_point():
            raise TypeError(
                f"losses must be the floating-point individual losses of the batch you "
                f"backpropagate, got a tensor of dtype {losses.dtype}: pass losses = "
                "loss_fn(output, target, reduction='none')")
        return losses

    def _step_problems(self, step: int, losses: Tensor | None,
                       continued: _OpenStep | None) -> list[tuple[str, str]]:
        """What makes the step indescribable, known before its backward pass: (scope,
        reason) pairs (see :mod:`cockpit.loop_checks`), each warned once."""
        problems = []
        changed = parameters_changed(self.tracker.model, self.tracker.param_names, self._params)
        if changed is not None:
            problems.append((MODEL, changed))
        if losses is not None and losses.numel() == 0:
            problems.append((BATCH, EMPTY_BATCH))
        if (continued is not None and losses is not None and losses.grad_fn is not None
                and losses.grad_fn in continued.forwards):
            problems.append((GRADIENT, SAME_FORWARD_AGAIN.format(step=step)))
        self._warn_problems(step, problems)
        return problems

    def _warn_problems(self, step: int, problems: list[tuple[str, str]]) -> None:
        for _, reason in problems:
            kind = reason.replace(str(step), "")[:60]
            self._warn(f"step {step}: {reason}; these instruments are recorded as None with "
                       "this reason (see get_notes())", key=f"problem:{kind}")

    def _backward_problems(self, step: int, stats: BackwardStatistics
                           ) -> list[tuple[str, str]]:
        """What makes the step indescribable, seen in its backward pass."""
        problems = []
        if self.tracker.repeated_backward:
            problems.append((GRADIENT, REPEATED_BACKWARD.format(step=step)))
        if stats.losses is not None and stats.losses.numel() > 0 and stats.batch_grads:
            if self.tracker.loss_weight is None and self.tracker.weights_problem is None:
                problems.append((BATCH, LOSSES_NOT_BACKPROPAGATED.format(step=step)))
            elif self.tracker.weights_problem is not None:
                problems.append((GRADIENT, self.tracker.weights_problem))
        self._warn_problems(step, problems)
        return problems

    def _exit(self, failed: bool) -> None:
        open_step = self._open
        if not self._in_block or open_step is None:
            return
        self._in_block = False
        stats = self.tracker.end()
        open_step.problems.extend(self._backward_problems(open_step.step, stats))
        calls = self.tracker.take_kept_calls()
        # the same step may bring more micro-batches: keep recording forward passes
        self.tracker.capturing = True
        if failed:  # the user's backward raised: the step cannot be completed
            self._open = None
            return
        if open_step.reduction.micro_batches == 1 and not self._accumulating:
            self._accumulating = True
            self._warn(
                f"step {open_step.step}: several backward passes with the same step number "
                "(gradient accumulation); every instrument describes their union. Cockpit now "
                "keeps each micro-batch's layer inputs until the optimizer step (pass "
                "Cockpit(..., grad_accumulation=True) to say so from the start)",
                key="accumulation-learned")
        open_step.reduction.add(stats, calls, self.tracker.request)
        open_step.weights.append(self.tracker.loss_weight)
        # until the optimizer step (or the next block): see backward passes outside a block
        reached = list(open_step.reduction.stats.batch_grads) if open_step.reduction.stats else []
        self._watch.arm(blocks_saw_gradient=bool(reached), candidates=reached)

    def _stepped_params(self) -> dict[str, Tensor]:
        """The model's parameters the optimizer steps on (all of them without an optimizer):
        ``optimizer.zero_grad()`` never clears the others, so they are not read by the loop
        checks (frozen_parameters is the finding for those)."""
        if self.optimizer is None:
            return self._params
        owned = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        return {name: p for name, p in self._params.items() if id(p) in owned}

    def _check_gradients_zeroed(self, step: int) -> Later | None:
        """Definite misuse: the parameters hold a gradient before the step's first block
        (recorded as GradientHeld, and warned about once; decided when the step's numbers
        are read)."""
        names, nonzero = parameters_holding_gradient(self._stepped_params())
        if nonzero is None:
            return Later(lambda: {"GradientHeld": 0.0})

        def verdict(flags) -> Noted:
            held = [n for n, flag in zip(names, flags, strict=True) if flag]
            if not held:
                return Noted({"GradientHeld": 0.0})
            return Noted({"GradientHeld": 1.0}, warnings=((
                f"step {step}: {_names(held)} already hold a gradient when the first "
                f"`with cockpit({step}, ...)` block opens: zero the gradients before each step "
                "(optimizer.zero_grad()) and call backward inside `with cockpit(step, ...)`; "
                "the optimizer steps on more than the backward passes Cockpit sees",
                "gradients-not-zeroed"),))

        return Later(verdict, nonzero)

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self.ends_steps_at_optimizer_step:
            self._measure_gradient_mismatch()
            self._finalize_open_step()

    def _settle_hist_range(self, stats: BackwardStatistics) -> None:
        """At the first tracked step with histograms of every layer, the automatic range is
        chosen from their magnitude counts (summed over micro-batches and processes, so
        every process chooses the same) and the step's counts regrouped into it; later it
        narrows when the elements have shrunk into a quarter (:meth:`_narrow_hist_range`)."""
        if not isinstance(self.hist_spec, AutoRange) or not stats.hist1d:
            return
        if not stats.valid:
            stats.hist1d = {}
            return
        total = torch.stack([c.double().cpu() for c in stats.hist1d.values()]).sum(0)
        spec = choose_auto_spec(total.numpy(), self.hist_spec.outside)
        stats.hist1d = {name: regroup(c, spec) for name, c in stats.hist1d.items()}
        self.hist_spec = self.tracker.hist_spec = spec

    def _narrow_hist_range(self, hist: Value) -> None:
        """From the next step on, the automatic range narrows by 4 when this step's
        whole-network counts (global, the same in every process) fit into a quarter."""
        if isinstance(self.hist_spec, DecidedRange) and isinstance(hist, dict):
            narrower = narrower_range(hist["counts"], self.hist_spec)
            if narrower is not None:
                self.hist_spec = self.tracker.hist_spec = narrower

    def _measure_gradient_mismatch(self) -> None:
        """GradientMismatch of the open step: the gradient the optimizer is about to step on
        against the batch gradient of the backward passes Cockpit saw (single process)."""
        open_step = self._open
        if open_step is not None and not self._in_block and self._ranks == 1:
            reduced = open_step.reduction.stats
            mean = {} if reduced is None else reduced.batch_grads
            stepped = self._stepped_params()
            mean = {k: g for k, g in mean.items() if k in stepped}
            open_step.mismatch = gradient_mismatch(stepped, mean, open_step.weights)

    def _finalize_open_step(self) -> None:
        """Record the open tracked step: reduce its backward passes (micro-batches, then
        processes) and compute its instruments."""
        open_step, self._open = self._open, None
        if open_step is None:
            return
        if self._in_block:  # get_output() inside a block: nothing is complete yet
            self._open = open_step
            return
        evidence = self._watch.evidence
        self._watch.reset()
        if open_step.reduction.micro_batches == 0:
            return
        self.tracker.capturing = self._capture_next(open_step.step)
        step, tracked = open_step.step, open_step.tracked
        reduction = open_step.reduction
        stats = reduction.finish()
        self._settle_hist_range(stats)
        not_global = self._ranks_step_apart(step)
        self._prepare_failures = open_step.prepare_failures
        data = self._step_data(step, stats, open_step.elapsed)
        data.project = reduction.project_samples if reduction.keeps_calls else None
        data.unmerged = reduction.unmerged
        values: dict[str, Value] = {}
        laters: list[Later] = list(open_step.checks)
        model_problem = _problem(open_step.problems, (MODEL,))
        batch_problem = _problem(open_step.problems, (BATCH,))
        if model_problem is not None:
            data.notes["LearningRate"] = model_problem
        elif data.learning_rate is not None:  # one rate for the model's parameters
            values["LearningRate"] = data.learning_rate
        if stats.losses is not None and not_global is None:
            values["BatchSize"] = None if batch_problem is not None else float(stats.num_samples)
            if batch_problem is not None:
                data.notes["BatchSize"] = batch_problem
        if open_step.mismatch is not None and model_problem is None:
            laters.append(open_step.mismatch)
        if open_step.gradient_held is not None and model_problem is None:
            laters.append(open_step.gradient_held)
        split = open_step.request.split or stats.micro_batches > 1 or stats.ranks > 1
        if open_step.approximation is not None:
            self._approximated[step] = open_step.approximation
            for old in list(self._approximated)[:-4]:  # Alpha's value comes a step later
                del self._approximated[old]
        no_gradient = self._report_backward_outside(step, evidence, not stats.batch_grads)
        skipped = set()
        for quantity in tracked:
            reason = (not_global if not_global is not None and _describes_the_batch(quantity)
                      else no_gradient if no_gradient and _reads_gradient(quantity)
                      else _problem_of(quantity, open_step.problems))
            if reason is not None:
                data.notes[quantity.name] = reason
                values[quantity.name] = None
                skipped.add(quantity.name)
                continue
            _collect(self._compute(quantity, data, stats, split), values, laters)
        self._record(step, values, data.notes, laters)
        self._record_late(data)
        later = [q for q in tracked if q.needs_update and q.name not in skipped]
        if later:
            with torch.no_grad():  # θ_t, copied by one fused kernel (x·1 = x exactly)
                copies = torch._foreach_mul(list(self._params.values()), 1.0)
            self._pending_update = (step, data, dict(zip(self._params, copies, strict=True)),
                                    later)

    def _check_every_rank_attached(self) -> None:
        """Combine the processes' statistics only if every process runs this Cockpit (else
        the first all-reduce would wait for ever): otherwise this process alone."""
        index, self._attachment = self._attachment, None
        if index is None or ranks.every_rank_attached(index):
            return
        self._ranks = 1
        warnings.warn(
            f"Cockpit runs in only some of the {ranks.world_size()} processes (e.g. only on "
            "rank 0): its values describe this process's own batch, not the global one. For "
            "the global batch, create Cockpit in every process (each watches the same "
            "training; only rank 0 writes); Cockpit(..., distributed=False) says 'this process "
            "alone' without this check's wait", RuntimeWarning, stacklevel=user_stacklevel())

    def _ranks_step_apart(self, step: int) -> str | None:
        """With combined processes: the reason the global values describe no step, if the
        processes are about to step on different gradients (else None)."""
        if self._ranks == 1:
            return None
        device = next(iter(self._params.values())).device
        if not ranks.stepped_gradient_differs(self._stepped_params(), device):
            return None
        message = ("the processes step on different gradients (each trains its own model, or "
                   "gradients are not synchronized), so the global batch's values describe no "
                   "optimizer step: pass Cockpit(..., distributed=False) to watch each process "
                   "on its own, or synchronize the gradients (DistributedDataParallel, or "
                   "all-reduce them inside the `with` block)")
        self._warn(f"step {step}: {message}; the step's batch instruments are not recorded",
                   key="ranks-step-apart")
        return message

    def _report_backward_outside(self, step: int, evidence: str | None,
                                 no_gradient: bool) -> str | None:
        """Warn about a backward pass outside the blocks of ``step``; the note for the
        gradient instruments if the blocks saw no gradient at all (else None)."""
        if no_gradient:
            outside = (" (a backward pass outside the block did)" if evidence == ONLY_OUTSIDE
                       else "")
            message = (f"no backward pass reached the parameters inside `with cockpit({step}, "
                       f"...)`{outside}: call backward inside `with cockpit(step, ...)`")
            self._warn(f"step {step}: {message}; the step's gradient instruments are not "
                       "recorded", key="backward-outside")
            return message
        if evidence is not None:
            self._warn(
                f"step {step}: a backward pass outside `with cockpit({step}, ...)` added to "
                "the gradient of the backward passes inside it: call every backward pass of "
                "a step (every micro-batch) inside `with cockpit(step, ...)`; the step's "
                "values describe only the backward passes inside the block",
                key="backward-outside")
        return None

    def _step_data(self, step: int, stats: BackwardStatistics, elapsed: float) -> StepData:
        return StepData(
            step=step,
            losses=stats.losses,
            stats=stats,
            batch_grads=stats.batch_grads,
            params={k: p.detach() for k, p in self._params.items()},
            initial_params=self._initial,
            learning_rate=self._learning_rate(),
            hist_spec=self.hist_spec,
            hist2d_specs=self.hist2d_specs,
            time=elapsed,
            engine=self.tracker,
        )

    def _compute(self, quantity: Quantity, data: StepData, stats: BackwardStatistics,
                 split: bool = False) -> dict[str, Value] | Later:
        if quantity.name in self._prepare_failures:
            data.notes[quantity.name] = self._prepare_failures[quantity.name]
            return {quantity.name: None}
        if data.unmerged is not None and GRAM_MEAN in quantity.needs:
            data.notes[quantity.name] = data.unmerged
            return {quantity.name: None}
        if quantity.whole_batch_graph and split:
            data.notes[quantity.name] = (
                "needs the whole batch's graph in one backward pass; not formed when the "
                "batch is split over micro-batches or processes")
            return {quantity.name: None}
        if (quantity.needs & PER_SAMPLE_STATS and not stats.valid
                and not quantity.handles_invalid_statistics):
            reason = "; ".join(stats.problems)
            data.notes[quantity.name] = reason
            names = [q.name for q in self.quantities
                     if q.needs & PER_SAMPLE_STATS and not q.handles_invalid_statistics]
            self._warn(f"{', '.join(names)} not computed at step {data.step}: {reason}",
                       key=f"per-sample:{reason}")
            return {quantity.name: None}
        try:
            return _named(quantity.compute(data), quantity.name)
        except Exception as error:
            if self.strict:
                raise
            data.notes[quantity.name] = f"failed: {error}"
            self._warn(f"{quantity.name} failed at step {data.step}: {error}",
                       key=quantity.name)
            return {quantity.name: None}

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._finish_pending_update()

    def _finish_pending_update(self) -> None:
        if self._pending_update is None:
            return
        step, data, before, quantities = self._pending_update
        self._pending_update = None
        # θ_{t+1} − θ_t written over the snapshot (a fresh parameter-sized tensor costs page
        # faults: as much as the subtraction itself)
        with torch.no_grad():  # −(θ_t − θ_{t+1}) = θ_{t+1} − θ_t exactly
            snapshots = [before[k] for k in self._params]
            torch._foreach_sub_(snapshots, list(self._params.values()))
            torch._foreach_neg_(snapshots)
        update = dict(zip(self._params, snapshots, strict=True))
        data.notes.clear()
        values: dict[str, Value] = {}
        laters: list[Later] = []
        for quantity in quantities:
            try:
                _collect(_named(quantity.compute_after_update(data, update), quantity.name),
                         values, laters)
            except Exception as error:
                if self.strict:
                    raise
                data.notes[quantity.name] = f"failed: {error}"
                values[quantity.name] = None
        self._record(step, values, data.notes, laters)
        self._record_late(data)

    def _record_unfinished(self) -> None:
        """At close: an instrument scheduled at a recorded step that never got its value
        (Alpha at the last step needs the next one) is recorded as None with the reason."""
        for step, values in sorted(self._output.items()):
            missing = {q.name: f"not computed: {_PENDING.get(q.name, _PENDING_OTHER)}; the "
                       "run ended before it" for q in self.quantities
                       if _scheduled(q, step) and not _has_value(values, q.name)
                       and q.name not in self._notes.get(step, {})}
            if missing:
                self._record(step, dict.fromkeys(missing), missing)

    def _record_late(self, data: StepData) -> None:
        """Values that instruments computed now for earlier steps (Alpha), and warnings."""
        for step in sorted({*data.late, *data.late_values}):
            self._record(step, data.late.get(step, {}), data.late_notes.get(step, {}),
                         data.late_values.get(step, ()))
        data.late.clear()
        data.late_notes.clear()
        data.late_values.clear()
        for message in data.warnings:
            self._warn(message)
        data.warnings.clear()

    def _record(self, step: int, values: dict[str, Value], notes: dict[str, str],
                laters: Sequence[Later] = ()) -> None:
        """Record a step's values; those still on the device (``laters``) are sent to the
        host now and recorded, with every record after them, at the next read."""
        if not laters and not self._unread:
            self._record_now(step, values, notes)
            return
        indices = [self._readout.later(later) for later in laters]
        self._readout.send()
        self._unread.append((step, dict(values), dict(notes), indices))

    def _read_back(self) -> None:
        """Receive the values of the records made since the last read (one wait) and record
        them in order."""
        if not self._unread:
            return
        unread, self._unread = self._unread, []
        results = self._readout.receive()
        for step, values, notes, indices in unread:
            warned: list[tuple[str, str]] = []
            for index in indices:
                result = results[index]
                if isinstance(result, Failed):
                    if self.strict:
                        raise result.error
                    name = result.name or "Cockpit"
                    notes[name] = f"failed: {result.error}"
                    values[name] = None
                    warned.append((f"{name} failed at step {step}: {result.error}", name))
                elif isinstance(result, Noted):
                    values.update(result.values)
                    notes.update(result.notes)
                    warned.extend(result.warnings)
                else:
                    values.update(result)
            self._record_now(step, values, notes)
            for message, key in warned:
                self._warn(message, key=key)

    def _record_now(self, step: int, values: dict[str, Value], notes: dict[str, str]) -> None:
        self._narrow_hist_range(values.get("GradHist1d"))
        approximation = self._approximated.get(step)
        if approximation is not None:  # the per-sample instruments' values say so
            for quantity in self.quantities:
                if (quantity.needs & PER_SAMPLE_STATS
                        and values.get(quantity.name) is not None):
                    notes.setdefault(quantity.name, approximation)
        values = self._arena.keep_values(values)
        self._output.setdefault(step, {}).update(values)
        if notes:
            self._notes.setdefault(step, {}).update(notes)
        if self.memory_steps is not None and len(self._output) > self.memory_steps:
            self._drop_oldest()
        self._outbox.add(step, values, notes)
        if self._diagnosis is not None:
            self._diagnosis.pending.setdefault(step, {}).update(values)

    def _drop_oldest(self) -> None:
        """Forget the oldest recorded step (memory stays flat; the run log keeps it)."""
        oldest = min(self._output)
        del self._output[oldest]
        self._notes.pop(oldest, None)
        if not self._dropped and self._log is None:
            self._warn(
                f"Cockpit keeps the last {self.memory_steps} recorded steps in memory, so "
                "get_output() no longer returns the first steps of this run: pass "
                "Cockpit(..., logdir=DIR) to keep every step (get_output() then reads them "
                "back from the run log), or memory_steps=None to keep all in memory (memory "
                "grows with the run)", key="memory-steps")
        self._dropped = True

    def _step_complete(self, step: int, values: dict[str, Value], notes: dict[str, str]
                       ) -> bool:
        """Whether every instrument scheduled at ``step`` has its value or its reason."""
        return all(not _scheduled(q, step) or _has_value(values, q.name) or q.name in notes
                   for q in self.quantities)

    def _write_sinks(self, step: int, values: dict[str, Value], notes: dict[str, str]) -> None:
        for sink in self._sinks:
            self._guard(sink.write_step, step, values, dict(notes))

    def _learning_rate(self) -> float | None:
        rates = {float(group["lr"]) for group in self._model_param_groups() if "lr" in group}
        return rates.pop() if len(rates) == 1 else None

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as error:
            if self.strict:
                raise
            self._warn(f"Cockpit sink failed: {error}", key=f"sink:{type(error).__name__}")

    def _warn(self, message: str, key: str | None = None, stacklevel: int | None = None) -> None:
        """Warn once per key, at the user's line (``stacklevel`` is not used any more)."""
        key = key or message
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())

    def _metadata(self) -> dict[str, Any]:
        import platform

        import cockpit

        params = self._params
        groups = self._model_param_groups()
        stepped = self._stepped_params()
        return {
            "model": repr(self.model),
            "model_class": type(self.tracker.model).__name__,  # (inside torch.compile's wrapper)
            "num_parameters": int(sum(p.numel() for p in params.values())),
            "parameters": {k: list(p.shape) for k, p in params.items()},
            # only an optimizer that trains (some of) this model, only its groups that do
            "optimizer": type(self.optimizer).__name__ if groups else None,
            "optimizer_hyperparameters": [
                {k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in groups
            ] if groups else None,
            "parameters_not_in_optimizer": [n for n in params if n not in stepped],
            "quantities": [q.name for q in self.quantities],
            "schedules": {q.name: repr(q.schedule) for q in self.quantities},
            "versions": {
                "cockpit": cockpit.__version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            "start_time": time.time(),
            "device": str(next(iter(params.values())).device) if params else "cpu",
            "batchnorm": (None if self.batchnorm is None
                          else {"mode": self.batchnorm, "note": APPROXIMATION}),
        }


def _nonfinite_warning(step: int):
    def warn(finite) -> Noted:
        if finite:
            return Noted({})
        return Noted({}, warnings=((f"step {step}: non-finite loss; instruments of this step "
                                    "are recorded as NaN", "nonfinite"),))

    return warn


def _named(result: dict[str, Value] | Later, name: str) -> dict[str, Value] | Later:
    if isinstance(result, Later) and result.name is None:
        result.name = name
    return result


def _collect(result: dict[str, Value] | Later, values: dict[str, Value],
             laters: list[Later]) -> None:
    if isinstance(result, Later):
        laters.append(result)
    else:
        values.update(result)


def _jsonable(value: Any) -> bool:
    return isinstance(value, bool | int | float | str | type(None)) or (
        isinstance(value, tuple | list) and all(isinstance(v, int | float) for v in value)
    )


_PENDING = {
    "Alpha": "α at step t fits the loss and its slope at θ_t and θ_(t+1), and the latter are "
             "measured at the next step",
}
_PENDING_OTHER = "the instrument completes this step's value at a later step"


def _scheduled(quantity: Quantity, step: int) -> bool:
    """Whether the instrument's schedule gives it a value at ``step`` (Alpha also tracks
    the step after each of its steps, for the fit: ``starts``)."""
    starts = getattr(quantity, "starts", None)
    return bool(starts(step)) if callable(starts) else quantity.should_track(step)


def _has_value(values: dict[str, Value], name: str) -> bool:
    """Whether ``values`` hold instrument ``name`` (or only its per-parameter entries)."""
    return name in values or any(key.startswith(name + "/") for key in values)


def _names(names: list[str], limit: int = 4) -> str:
    """'a, b and 3 more' for messages."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


# instruments of this process's own parameters, update and clock, not of the batch
_OWN_PROCESS = frozenset({"Distance", "UpdateSize", "Parameters", "Time"})


def _problem(problems: list[tuple[str, str]], scopes: tuple[str, ...]) -> str | None:
    """The first reason among ``problems`` of one of ``scopes``."""
    return next((reason for scope, reason in problems if scope in scopes), None)


def _problem_of(quantity: Quantity, problems: list[tuple[str, str]]) -> str | None:
    """The reason ``quantity`` cannot describe the step, if one of ``problems`` touches it."""
    if quantity.name in ("Loss", "Time"):
        scopes: tuple[str, ...] = (BATCH,) if quantity.name == "Loss" else ()
    elif _reads_gradient(quantity):
        scopes = (MODEL, BATCH, GRADIENT)
    elif _describes_the_batch(quantity):
        scopes = (MODEL, BATCH)
    else:
        scopes = (MODEL,)
    return _problem(problems, scopes)


def _describes_the_batch(quantity: Quantity) -> bool:
    return quantity.name not in _OWN_PROCESS


def _reads_gradient(quantity: Quantity) -> bool:
    """Whether an instrument reads the user's backward pass (the batch gradient or the
    individual gradients), so it has nothing to describe without one."""
    return bool(quantity.needs & PER_SAMPLE_STATS) or quantity.name == "GradNorm"


class _OpenStep:
    """A tracked step whose backward passes (micro-batches) are still coming in."""

    def __init__(self, step: int, tracked: list[Quantity], request: StepRequest,
                 elapsed: float, reduction: StepReduction):
        self.step, self.tracked, self.request = step, tracked, request
        self.elapsed, self.reduction = elapsed, reduction
        self.prepare_failures: dict[str, str] = {}
        self.weights: list[float | None] = []  # loss weight w of each backward pass
        self.mismatch: Later | None = None  # GradientMismatch, set at optimizer.step()
        self.checks: list[Later] = []  # misuse checks decided when the numbers are read
        self.gradient_held: Later | None = None  # GradientHeld, checked at the first block
        # whether the first block's losses were finite: a device flag, read only where a
        # warning depends on it
        self.finite_losses: Tensor | bool = True
        self.problems: list[tuple[str, str]] = []  # (scope, reason): see loop_checks
        self.forwards: set = set()  # the losses' graph nodes backpropagated in its blocks
        self.approximation: str | None = None  # how its individual gradients are defined

    def new_request(self, gradient_scale: float) -> StepRequest:
        """The request of one more backward pass of this step: the same statistics; the
        instruments register their directions again in ``prepare``."""
        first = self.request
        return StepRequest(first.needs, gradient_scale=gradient_scale, split=first.split,
                           union_gram=first.union_gram, defer=first.defer)


class _LiveDiagnosis:
    """``Cockpit(..., diagnose=True)``: feeds recorded steps to a
    :class:`cockpit.diagnose.Diagnoser` and warns once per new finding."""

    def __init__(self, cockpit: Cockpit):
        from cockpit.diagnose import Diagnoser

        self.cockpit = cockpit
        self.diagnoser = Diagnoser(meta={"parameters": {
            k: list(p.shape) for k, p in cockpit._params.items()}})
        self.pending: dict[int, dict[str, Value]] = {}  # recorded since the last feed
        self.evaluated_at = 0  # number of steps at the last evaluation

    def feed(self, final: bool = False) -> None:
        try:
            self._feed(final)
        except Exception as error:  # a diagnosis never stops training
            if self.cockpit.strict:
                raise
            self.cockpit._warn(f"Cockpit diagnosis failed: {error}", key="diagnosis-failed")

    def _feed(self, final: bool) -> None:
        new, self.pending = self.pending, {}
        if new:  # also late values of earlier steps (Alpha of step t comes at t + 1)
            self.diagnoser.record.add(new)
        n = len(self.diagnoser.record.steps)
        if n == 0:
            return
        if not final and n - self.evaluated_at < max(1, self.evaluated_at // 10):
            return
        self.evaluated_at = n
        findings = self.diagnoser.evaluate()
        if not findings:
            return
        step = self.diagnoser.record.last_step
        for finding in findings:
            self.cockpit._warn(f"Cockpit diagnosis at step {step}: {finding}",
                               key=f"diagnosis:{finding.code}:{finding.parameters}")
        for sink in self.cockpit._sinks:
            write = getattr(sink, "write_findings", None)
            if write is not None:
                self.cockpit._guard(write, step, findings)


def _sample_sum_keys(quantities: list[Quantity]) -> tuple[str, ...]:
    return tuple(sorted({key for q in quantities for key in q.sample_sum_keys}))


class _StepContext:
    """What ``cockpit(step, losses=...)`` returns; the backward pass goes inside it."""

    def __init__(self, cockpit: Cockpit, step: int, losses: Tensor | None):
        self.cockpit, self.step, self.losses = cockpit, step, losses

    def __enter__(self) -> _StepContext:
        self.cockpit._enter(self.step, self.losses)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.cockpit._exit(failed=exc_type is not None)

