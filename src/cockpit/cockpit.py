"""The public API: a Cockpit watches a training loop; its steps go through the step
pipeline (:mod:`cockpit.step`), its misuse checks are :mod:`cockpit.loop_checks`.

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

import os
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from cockpit.arguments import checked_arguments, resolved_memory_budget, warn_slow_bins
from cockpit.diagnose.live import LiveDiagnosis
from cockpit.engine import gc_pause, initial_parameters, sharded
from cockpit.engine.capture import compiled
from cockpit.engine.histograms.auto_range import AutoRange
from cockpit.engine.histograms.exact import BinSpec
from cockpit.engine.reduction import ranks
from cockpit.engine.rules.batchnorm_frozen import FROZEN_STATISTICS
from cockpit.engine.statistics import PER_SAMPLE_STATS
from cockpit.engine.tracker import ModuleTracker
from cockpit.engine.workspace import release_workspace
from cockpit.loop_checks import OutsideBackwardWatch, check_optimizer_owns_parameters
from cockpit.loop_checks.optimizer import steps_any
from cockpit.quantities.base import Quantity, Value
from cockpit.step.hist_range import HistogramRange
from cockpit.step.instrument_traits import needs_initial_parameters, predicts_update
from cockpit.step.recorder import Recorder
from cockpit.step.schedule_plan import SchedulePlan
from cockpit.step.sequence import StepSequence
from cockpit.step.warn_once import WarnOnce
from cockpit.step.watched_run import WatchedRun
from cockpit.store.metadata import run_metadata
from cockpit.store.runlog import RunLogWriter


class Cockpit:
    """Watch the inside of training: computes the instruments at the scheduled steps.

    Args:
        model: the network. It is not wrapped or modified; hooks are removed by
            :meth:`close`. A compiled model (``torch.compile(model)``, or ``model.compile()``
            called before) runs its compiled graph at untracked steps and its eager module
            at tracked ones, whose values are the eager model's
            (:mod:`cockpit.engine.capture.compiled`).
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
        memory_budget: bytes of individual gradients one layer may hold at once; a layer
            above it (e.g. a large vocabulary's embedding) is processed in sample chunks,
            exactly, at some extra time, and said so once in the notes. A number given
            also caps the chunks of the curvature's batched backpropagations (the GGN's
            and the Hessian diagonal's; by default 1/16 of a GPU's memory, at most 8 GiB).
            ``"auto"`` (default): 512 MiB, at most 1/16 of a GPU's memory; None: no limit.

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
        memory_budget: int | str | None = "auto",
    ):
        self.quantities = checked_arguments(model, quantities, optimizer, grad_scaler,
                                            distributed, memory_steps)
        if logdir is not None and not isinstance(logdir, str | os.PathLike):
            raise TypeError(f"logdir must be a directory path (a str or pathlib.Path), got "
                            f"{type(logdir).__name__}: Cockpit(..., logdir='runs/exp1')")
        self.model, self.optimizer, self.grad_scaler = model, optimizer, grad_scaler
        self.strict, self.batchnorm, self.hist2d_specs = strict, batchnorm, hist2d_bins
        self.memory_steps = None if memory_steps is None else int(memory_steps)
        warn_slow_bins(self.quantities, hist_bins, hist2d_bins)
        # a compiled model (torch.compile): hooks on the eager module inside, which runs at
        # tracked steps only (see cockpit.engine.capture.compiled)
        hist_spec: BinSpec | AutoRange = AutoRange() if hist_bins is None else hist_bins
        budget = resolved_memory_budget(memory_budget, model)
        # a budget the user gave also caps the curvature's chunks ("auto" leaves them theirs)
        self.tracker = ModuleTracker(compiled.uncompiled(model), hist_spec, hist2d_bins,
                                     strict=strict, batchnorm=batchnorm, memory_budget=budget,
                                     curvature_budget=None if isinstance(memory_budget, str)
                                     else budget)
        self._compiled = compiled.EagerAtTrackedSteps(model, self.tracker)
        self._params: dict[str, Tensor] = dict(self.tracker.params)
        unowned = check_optimizer_owns_parameters(optimizer, self._params)
        # another optimizer trains some parameters: θ_t before the first optimizer's step,
        # θ_(t+1) after all of them (at the next step's block), Alpha along that update
        self._shared = bool(unowned) and len(unowned) < len(self._params)
        if self._shared or (batchnorm == FROZEN_STATISTICS and any(
                isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())):
            # Alpha's prediction covers neither the other optimizer's update nor individual
            # shares of a frozen-statistics batch gradient: it projects the kept calls on
            # the update after the step instead
            for quantity in filter(predicts_update, self.quantities):
                quantity.predict = False  # type: ignore[attr-defined]
        initial = (initial_parameters.snapshot(self._params)
                   if any(map(needs_initial_parameters, self.quantities)) else None)
        start_time = time.perf_counter()
        self._warn = WarnOnce(strict)
        combined = ranks.world_size() if distributed is None else 1
        # every process's Cockpit must take part in the collectives: checked at the first
        # tracked step
        attachment = ranks.attach() if combined > 1 else None
        self._handles: list = []
        self._step_depth = 0  # optimizer.step() calls in progress (nested: see its hooks)
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
            self._handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))
        # other optimizers: whether they step on the model's parameters
        self._steps_ours: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if self._shared:
            self._handles.append(register_optimizer_step_pre_hook(
                self._before_any_optimizer_step))
        writes = write_on_all_ranks or combined == 1 or ranks.rank() == 0
        sinks = list(sinks) if writes else []
        log = self._open_log(logdir, resume) if logdir is not None and writes else None
        if log is not None:
            sinks.insert(0, log)
        resumed_from = None if log is None else log.resumed_from
        hist = HistogramRange(hist_spec, self.tracker)
        recorder = Recorder(self.quantities, self._warn, hist, sinks, log, self.memory_steps,
                            resumed=resumed_from is not None)
        watch = OutsideBackwardWatch(self._params, lambda: self.tracker.in_own_work)
        self._run = WatchedRun(
            self.tracker, self.quantities, optimizer, self._params, initial, grad_scaler,
            batchnorm, hist2d_bins, hist, self._warn, watch, recorder, ranks=combined,
            accumulating=grad_accumulation, start_time=start_time,
            ddp=tuple(m for m in model.modules()
                      if isinstance(m, torch.nn.parallel.DistributedDataParallel)))
        self._diagnosis = (LiveDiagnosis(self.parameter_shapes(), self._warn, self._warn.guard,
                                         sinks, strict) if diagnose else None)
        if self._diagnosis is not None:
            recorder.on_record = self._diagnosis.add
        self._steps = StepSequence(self._run, SchedulePlan(self.quantities).tracked,
                                   resumed_from, attachment, self._diagnosis)
        self._log, self._output = log, recorder.output  # (what tests read)
        self._closed = False
        if any(q.needs & PER_SAMPLE_STATS for q in self.quantities):
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
        return _StepContext(self._steps, int(step), losses)

    def get_output(self) -> dict[int, dict[str, Value]]:
        """All values so far: ``{step: {instrument name: value}}``. A tracked step whose
        backward passes are complete is recorded first (under gradient accumulation with
        an optimizer: once it stepped). Steps beyond the last ``memory_steps`` are read
        back from the run log (with a ``logdir``; without one they are gone, see
        ``memory_steps``)."""
        self._complete_open_step()
        self._run.recorder.read_back()
        return self._run.recorder.all_output()

    def get_notes(self) -> dict[int, dict[str, str]]:
        """Why a value is None or missing, per recorded step and instrument: the reasons
        recorded with the values, and for an instrument without a value at a recorded step
        "not scheduled at this step: <schedule>" or why it is still pending (Alpha needs the
        next step). The last two are derived from the schedules here, not stored in the run
        log (a name missing from a step of the run log was not scheduled there)."""
        self._complete_open_step()
        self._run.recorder.read_back()
        return self._run.recorder.all_notes()

    def _complete_open_step(self) -> None:
        """Before values are read: the open step is recorded, unless its micro-batches may
        go on — under gradient accumulation (said, or learned) with an optimizer, whose step
        (or the trainer's :meth:`end_step`) ends it: a checkpoint or a callback that reads
        values between two micro-batches must not cut the step short (it would be recorded
        as its first micro-batches, and the next refused)."""
        if self.optimizer is None or not self._run.accumulating:
            self._steps.finish()

    def end_step(self) -> None:
        """Record the open tracked step now: all of its backward passes are done.

        Cockpit does this by itself in ``optimizer.step()``'s pre-hook. A trainer that runs
        the backward pass inside ``optimizer.step(closure)`` (Lightning) calls it after that
        hook; its integration sets ``ends_steps_at_optimizer_step = False`` and calls
        ``end_step()`` after the last backward pass of the step, before the update."""
        self._steps.end_step()

    def parameter_shapes(self) -> dict[str, list[int]]:
        """The shapes of the model's trainable parameters by name (what the diagnosis
        reads besides the values)."""
        return {k: list(p.shape) for k, p in self._params.items()}

    def state_dict(self) -> dict[str, Any]:
        """What a run resumed from a checkpoint needs to continue with the same values:
        θ_0 of Distance (on the CPU), the last step seen (step numbering), the instruments'
        state carried from step to step (GradientNoiseScaleEMA's moving averages) and
        GradHist1d's automatic range. The steps recorded so far are read first. Under
        ``fully_shard`` θ_0 is this rank's slice (``"initial_params_holder"`` says whose):
        save it on every rank and load each rank's own. Under gradient accumulation a step
        whose optimizer step has not come yet is not in the state (a checkpoint between its
        micro-batches describes θ_t before its update)."""
        self._complete_open_step()
        self._run.recorder.read_back()  # (the moving averages include every recorded step)
        initial, holder = (None, None) if self._run.initial is None else (
            sharded.saved_slices(self._run.initial))
        state: dict[str, Any] = {"initial_params": initial, "last_step": self._steps.last_step}
        if holder is not None:
            state["initial_params_holder"] = holder
        instruments = {q.name: own for q in self.quantities if (own := q.state_dict())}
        if instruments:
            state["instruments"] = instruments
        hist_range = self._run.hist.state_dict()
        if hist_range:
            state["histogram_range"] = hist_range
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a run saved by :meth:`state_dict` (call it before the first step). A
        θ_0 that does not fit the model (another model, or under ``fully_shard`` another
        rank's slice) raises ValueError; the step numbering is restored even then."""
        for quantity in self.quantities:
            own = state.get("instruments", {}).get(quantity.name)
            if own:
                quantity.load_state_dict(own)
        self._run.hist.load_state_dict(state.get("histogram_range", {}))
        last, seen = state.get("last_step"), self._steps.last_step
        if last is not None:  # (a resumed run log may be ahead of the checkpoint)
            self._steps.last_step = max(int(last), seen if seen is not None else int(last))
        initial, own = state.get("initial_params"), self._run.initial
        if initial is not None and own is not None:
            missing = set(own) - set(initial)
            if missing:
                raise ValueError(
                    f"the saved Cockpit state lacks θ_0 of {sorted(missing)[:3]}: it was saved "
                    "for another model")
            restored = sharded.restored_slices(initial, state.get("initial_params_holder"), own)
            self._run.initial = (initial_parameters.host_copies(restored)
                                 if initial_parameters.kept_on_host(self._params) else restored)

    def close(self) -> None:
        """Finish pending work, remove every hook and close the sinks. Idempotent."""
        if self._closed:
            return
        self._steps.finish()
        self._steps.finish_update()
        self._run.recorder.finish()
        self._run.watch.reset()
        if self._diagnosis is not None:
            self._diagnosis.feed(final=True)
        self._remove_hooks()
        release_workspace()
        gc_pause.release()
        self._run.recorder.close_sinks()
        self._closed = True

    def __enter__(self) -> Cockpit:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def hist_spec(self) -> BinSpec | AutoRange:
        """The bins of GradHist1d now (an automatic range is decided at the first step)."""
        return self._run.hist.spec

    # ------------------------------------------------------------------ hooks
    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        # (a subclass whose step() calls super().step() runs the hooks once per class whose
        # step torch wrapped: nested; one optimizer step is counted when the outer one ends)
        self._step_depth += 1
        if self.ends_steps_at_optimizer_step:
            steps = self._steps
            steps.end_step()
            # until its post-hook a block is a closure's evaluation (StepSequence.exit)
            steps.stepping, steps.evaluated = True, None

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._step_depth = max(0, self._step_depth - 1)
        if not self._step_depth:
            self._run.optimizer_steps += 1
        steps = self._steps
        steps.stepping, steps.evaluated = False, None
        if not self._shared:  # (else at the next block: after every optimizer's step)
            steps.finish_update()

    def _before_any_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Another optimizer that steps on some of the model's parameters ends the step
        as the watched one would: θ_t is taken before any of them moves it."""
        if optimizer is self.optimizer or not self.ends_steps_at_optimizer_step:
            return
        ours = self._steps_ours.get(optimizer)
        if ours is None:
            ours = self._steps_ours[optimizer] = steps_any(optimizer, self._params.values())
        if ours:
            self._steps.end_step()

    def _open_log(self, logdir: str, resume: bool) -> RunLogWriter:
        try:
            meta = run_metadata(self.model, self.tracker.model, self._params, self.optimizer,
                                self.quantities, self.batchnorm, self.tracker.precision_note)
            return RunLogWriter(logdir, meta=meta, resume=resume)
        except BaseException:  # a refused run log leaves no hooks on the model
            self._remove_hooks()
            raise

    def _remove_hooks(self) -> None:
        self.tracker.remove()
        self._compiled.remove()
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _StepContext:
    """What ``cockpit(step, losses=...)`` returns; the backward pass goes inside it."""

    def __init__(self, steps: StepSequence, step: int, losses: Tensor | None):
        self.steps, self.step, self.losses = steps, step, losses

    def __enter__(self) -> _StepContext:
        self.steps.enter(self.step, self.losses)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.steps.exit(failed=exc_type is not None)
