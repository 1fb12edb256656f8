"""One tracked step, from its first ``with cockpit(step, ...)`` block to its values.

Its life, each stage a method called by :class:`cockpit.Cockpit`:

1. :func:`check_block`, then :meth:`TrackedStep.open_block` / :meth:`~TrackedStep.close_block`
   around each backward pass (one per micro-batch; their statistics are summed by the
   step's :class:`~cockpit.engine.reduction.step_reduction.StepReduction`);
2. :meth:`~TrackedStep.measure_gradient_mismatch` at ``optimizer.step()`` (or ``end_step``);
3. :meth:`~TrackedStep.finish` once its backward passes are complete: the reduction over
   micro-batches and processes, every instrument's value, recorded;
4. :meth:`~TrackedStep.finish_update` after the optimizer step, for the instruments of the
   update θ_{t+1} − θ_t (UpdateSize, Alpha), recorded.

Recording goes one way, :meth:`~TrackedStep._hand_over`: the step's values, then the values
its instruments completed for earlier steps (Alpha's of step t − 1) and their warnings.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cockpit.engine.capture.batch_gradients import same_layout
from cockpit.engine.readout import Later
from cockpit.engine.reduction.step_reduction import StepReduction
from cockpit.engine.request import StepRequest
from cockpit.engine.rules.batchnorm_frozen import APPROXIMATION, FROZEN_STATISTICS
from cockpit.engine.statistics import GRAM_MEAN, PER_SAMPLE_STATS, BackwardStatistics
from cockpit.loop_checks import (
    BATCH,
    JOINING,
    MODEL,
    STEPPED_BEFORE_BACKWARD,
    HeldGradients,
    backward_problems,
    check_losses,
    first_problem,
    gradient_mismatch,
    nonfinite_warning,
    parameters_changed,
    ranks_step_apart,
    report_backward_outside,
    step_problems,
)
from cockpit.quantities import hessian_operator
from cockpit.quantities.base import FormedNorms, Quantity, StepData, Value, finite_witness
from cockpit.step import instruments
from cockpit.step.instrument_traits import describes_the_batch, problem_of, reads_gradient
from cockpit.step.watched_run import WatchedRun


def _holds_copy_of(buffer: Tensor, param: Tensor) -> bool:
    """Whether ``buffer`` (a batch gradient Cockpit owns) can hold a copy of ``param``:
    plain tensors of the same layout, memory apart from the parameter and its gradient."""
    if not (type(buffer) is Tensor and type(param) in (Tensor, torch.nn.Parameter)
            and same_layout(buffer, param)):
        return False
    address = buffer.untyped_storage().data_ptr()
    grad = param.grad
    return (address != param.untyped_storage().data_ptr()
            and (grad is None or grad.is_sparse or address != grad.untyped_storage().data_ptr()))


@dataclass
class BlockChecks:
    """What the checks at a block's start found (see :func:`check_block`)."""

    losses: Tensor | None
    finite: Tensor | None  # finite iff the losses are (finite_witness): read later
    problems: list[tuple[str, str]]  # (scope, reason): see cockpit.loop_checks
    gradient_held: HeldGradients | None  # GradientHeld, at a step's first block


def check_block(run: WatchedRun, step: int, tracked: list[Quantity], losses: Tensor | None,
                continued: TrackedStep | None, check_held: bool) -> BlockChecks:
    """The checks before a block of ``step`` opens (``continued``: the step it adds a
    micro-batch to); raises where the losses passed cannot be used."""
    finite = None
    needing = [q.name for q in tracked if q.needs_losses]
    if needing:
        losses = check_losses(losses, step, needing)
        finite = finite_witness(losses)
    changed = parameters_changed(run.tracker.model, run.tracker.param_names, run.params)
    problems = step_problems(step, losses, changed,
                             None if continued is None else continued.forwards, run.warn)
    held = HeldGradients(step, run.stepped_params()) if check_held else None
    return BlockChecks(losses, finite, problems, held)


def _raising(error: Exception) -> Callable[[], dict]:
    """A :class:`Later`'s function that raises ``error`` when the numbers are read: the
    value is recorded as failed, with the error in its note and a warning."""

    def fail() -> dict:
        raise error

    return fail


class TrackedStep:
    """A tracked step: its backward passes (micro-batches) come in, then it is finished."""

    def __init__(self, run: WatchedRun, step: int, tracked: list[Quantity],
                 joined: bool = False):
        self.run, self.step, self.tracked = run, step, tracked
        self.joined = joined  # under DistributedDataParallel's join(): this process alone
        self.elapsed = time.perf_counter() - run.start_time
        self.request: StepRequest | None = None  # of the first backward pass
        self.reduction: StepReduction | None = None
        self.in_block = False  # inside one of its ``with`` blocks
        self.prepare_failures: dict[str, str] = {}
        self.weights: list[float | None] = []  # loss weight w of each backward pass
        self.mismatch: Later | None = None  # GradientMismatch, set at optimizer.step()
        # ‖g_B‖ per parameter as the gradient check formed them (GradNorm reads them)
        self._mean_norms: list[FormedNorms] = []
        self.checks: list[Later] = []  # misuse checks decided when the numbers are read
        # GradientHeld: looked at when the first block opens, decided when it closes
        self._held: HeldGradients | None = None
        self.gradient_held: Later | None = None
        # the first block's losses' finite witness (finite iff they are), read only where
        # a warning depends on it (:meth:`losses_were_finite`)
        self.finite_losses: Tensor | None = None
        self.problems: list[tuple[str, str]] = []  # (scope, reason): see loop_checks
        self.stepped = False  # optimizer.step() ran inside a block, before its backward
        self.forwards: set = set()  # the losses' graph nodes backpropagated in its blocks
        # how its individual gradients are defined, where they are not the exact ones
        self.approximation: str | None = run.tracker.precision_note
        # after finish: what the instruments of the update need until the optimizer step
        self._update: tuple[StepData, dict[str, Tensor], list[Quantity]] | None = None

    def losses_were_finite(self) -> bool:
        """Whether the first block's losses were finite (reads the device; True without
        losses)."""
        return self.finite_losses is None or math.isfinite(float(self.finite_losses))

    @property
    def micro_batches(self) -> int:
        return 0 if self.reduction is None else self.reduction.micro_batches

    # ------------------------------------------------------------------ blocks
    def open_block(self, checks: BlockChecks) -> None:
        """A ``with`` block of this step opens: the tracker is told what to collect in the
        coming backward pass, the instruments prepare."""
        run, tracker, losses = self.run, self.run.tracker, checks.losses
        problems = checks.problems
        recorded = tracker.num_calls  # forward calls before those of other graphs go
        graph = None  # the losses' graph, walked once for the tracker
        if losses is not None and losses.requires_grad:
            losses.register_hook(tracker.losses_hook)
            graph = tracker.drop_calls_outside(losses)
        captured = tracker.num_calls
        if self.reduction is None:
            request = self._first_request()
            self._held = checks.gradient_held
            if checks.finite is not None:
                self.finite_losses = checks.finite
        else:
            # the previous backward's gradient copies belong to the step being merged
            tracker.drop_spare_gradients()
            request = self._next_request()
        assert self.reduction is not None
        self.problems.extend(problems)
        if losses is not None:
            self.forwards.add(losses.grad_fn)
        if checks.finite is not None:
            self.checks.append(Later(nonfinite_warning(self.step), checks.finite))
        stats = tracker.begin(request, losses, graph)
        self.in_block = True
        if (tracker.sharded and losses is not None
                and any(q.differentiates_graph for q in self.tracked)):
            # fully_shard: all-gathers, here where every rank passes alike (the instruments
            # themselves may stop early on one rank: a non-finite loss, a loop problem)
            try:
                tracker.graph_params()
            except Exception:
                if run.warn.strict:
                    raise
                # (each instrument's own call fails again, and its failure is recorded)
        for quantity in self.tracked:
            if problem_of(quantity, problems) is None:  # (else it records None anyway)
                instruments.prepare(quantity, self.step, tracker, run.optimizer, losses,
                                    self.prepare_failures, run.warn)
            elif quantity.differentiates_graph and run.ranks > 1 and self.reduction is not None:
                # (its products are summed over the processes: the others must learn it)
                hessian_operator.decline(tracker)
        if request.needs & PER_SAMPLE_STATS or GRAM_MEAN in self.reduction.needs:
            stats.problems.extend(tracker.check_batch_norm()[:1])
            if (run.batchnorm == FROZEN_STATISTICS and losses is not None and captured
                    and losses.requires_grad and not problems
                    and tracker.has_training_batch_norm()):
                tracker.run_frozen_pass(losses)
                self.approximation = APPROXIMATION
            if captured == 0 and not problems:
                stats.problems.append(
                    "the `losses` passed to cockpit(step, losses=...) do not depend on the "
                    "forward pass Cockpit recorded: pass the individual losses of the batch "
                    "you backpropagate" if recorded else
                    "Cockpit did not see this step's forward pass (create the forward pass "
                    "after the previous cockpit(...) context and call cockpit(step) with "
                    "consecutive step numbers)"
                )

    def _first_request(self) -> StepRequest:
        run = self.run
        needs = frozenset().union(*(q.needs for q in self.tracked))
        # mixed precision (fully_shard): ḡ is summed from the g_n after the backward pass,
        # so g_nᵀḡ is formed at the reduction point as for a split batch
        split = run.accumulating or run.ranks > 1 or bool(run.tracker.compute_dtypes)
        # one backward per process: the layers can wait for the synchronized gradient
        defer = run.ranks > 1 and not run.accumulating
        request = StepRequest(needs, gradient_scale=run.gradient_scale(), split=split,
                              defer=defer)
        if split and GRAM_MEAN in needs:
            # g_nᵀḡ needs the whole step's ḡ: formed from kept calls at the reduction point
            request.needs, request.union_gram = needs - {GRAM_MEAN}, True
        self.request = request
        self.reduction = StepReduction(run.tracker, needs, request,
                                       instruments.sample_sum_keys(self.tracked),
                                       ranks=run.ranks,
                                       projection_keys=instruments.projection_keys(self.tracked))
        return request

    def _next_request(self) -> StepRequest:
        """The request of one more backward pass of this step: the same statistics; the
        instruments register their directions again in ``prepare``."""
        first = self.request
        assert first is not None
        return StepRequest(first.needs, gradient_scale=self.run.gradient_scale(),
                           split=first.split, union_gram=first.union_gram, defer=first.defer)

    def close_block(self, failed: bool) -> bool:
        """The block's backward pass is done: its statistics join the step's. False where
        the user's backward raised (``failed``): the step cannot be completed."""
        run, tracker = self.run, self.run.tracker
        assert self.reduction is not None
        self.in_block = False
        stats = tracker.end()
        self.problems.extend(backward_problems(self.step, tracker, stats.losses,
                                               bool(stats.batch_grads), run.warn))
        calls = tracker.take_kept_calls()
        # the same step may bring more micro-batches: keep recording forward passes
        tracker.capturing = True
        request = tracker.request
        if failed:
            request.release_directions()
            return False
        if self.reduction.micro_batches == 1 and not run.accumulating:
            run.accumulating = True
            run.warn(
                f"step {self.step}: several backward passes with the same step number "
                "(gradient accumulation); every instrument describes their union. Cockpit now "
                "keeps each micro-batch's layer inputs until the optimizer step (pass "
                "Cockpit(..., grad_accumulation=True) to say so from the start)",
                key="accumulation-learned")
        self.reduction.add(stats, calls, request)
        request.release_directions()
        if self._held is not None:  # (the first block: zero_grad may have run inside it)
            held, self._held = self._held, None
            self.gradient_held = held.later(run.stepped_params())
        self.weights.append(tracker.loss_weight)
        # until the optimizer step (or the next block): see backward passes outside a block
        reached = list(self.reduction.stats.batch_grads) if self.reduction.stats else []
        run.watch.arm(blocks_saw_gradient=bool(reached), candidates=reached)
        return True

    def stepped_before_backward(self) -> None:
        """optimizer.step() ran inside an open block before its backward pass: θ moved
        under the block (every instrument that reads the model is None, with the reason)."""
        self.stepped = True
        reason = STEPPED_BEFORE_BACKWARD.format(step=self.step)
        if (MODEL, reason) not in self.problems:
            self.problems.append((MODEL, reason))

    def measure_gradient_mismatch(self) -> None:
        """GradientMismatch: the gradient the optimizer is about to step on against the
        batch gradient of the backward passes Cockpit saw (single process)."""
        if self.in_block or self.run.ranks != 1 or self.reduction is None:
            return
        reduced = self.reduction.stats
        mean = {} if reduced is None else reduced.batch_grads
        stepped = self.run.stepped_params()
        mean = {k: g for k, g in mean.items() if k in stepped}
        self._mean_norms = []
        try:
            self.mismatch = gradient_mismatch(stepped, mean, self.weights, self._mean_norms)
        except Exception as error:  # (inside optimizer.step(): never raised into it)
            if self.run.warn.strict:
                raise
            self._mean_norms = []
            self.mismatch = Later(_raising(error), name="GradientMismatch")

    # ------------------------------------------------------------------ values
    def finish(self, capture_next: Callable[[int], bool]) -> bool:
        """Reduce the step's backward passes (micro-batches, then processes), compute its
        instruments and record them. True where instruments of the update wait for the
        optimizer step (:meth:`finish_update`). ``capture_next``: whether the forward pass
        after a step must be recorded (the schedule's)."""
        run = self.run
        evidence = run.watch.evidence
        run.watch.reset()
        if self.reduction is None or self.reduction.micro_batches == 0:
            return False
        assert self.request is not None
        run.tracker.capturing = capture_next(self.step)
        step = self.step
        stats = self.reduction.finish()
        if stats.micro_batches > 1 and not run.accumulating:
            # another process split its batch (with several processes each process's
            # blocks go the same way: the requests and their collectives must match)
            run.accumulating = True
        run.hist.settle(stats)
        not_global = (JOINING if self.joined else None if run.ranks == 1 else ranks_step_apart(
            step, run.stepped_params(), next(iter(run.params.values())).device, run.warn))
        data = self._step_data(stats)
        data.project = self.reduction.project_samples if self.reduction.keeps_calls else None
        data.unmerged = self.reduction.unmerged
        values: dict[str, Value] = {}
        chunking = run.tracker.chunking_note()
        if chunking is not None:
            data.notes["Cockpit"] = chunking
        laters: list[Later] = list(self.checks)
        model_problem = first_problem(self.problems, (MODEL,))
        batch_problem = first_problem(self.problems, (BATCH,))
        if model_problem is not None:
            data.notes["LearningRate"] = model_problem
        elif data.learning_rate is not None:  # one rate for the model's parameters
            values["LearningRate"] = data.learning_rate
        if stats.losses is not None and not_global is None:
            values["BatchSize"] = None if batch_problem is not None else float(stats.num_samples)
            if batch_problem is not None:
                data.notes["BatchSize"] = batch_problem
        if self.mismatch is not None and model_problem is None:
            laters.append(self.mismatch)
        if self.gradient_held is not None and model_problem is None:
            laters.append(self.gradient_held)
        split = self.request.split or stats.micro_batches > 1 or stats.ranks > 1
        if self.approximation is not None:
            run.recorder.approximated(step, self.approximation)
        no_gradient = report_backward_outside(step, evidence, not stats.batch_grads, run.warn)
        skipped = set()
        for quantity in self.tracked:
            reason = (not_global if not_global is not None and describes_the_batch(quantity)
                      else no_gradient if no_gradient and reads_gradient(quantity)
                      else problem_of(quantity, self.problems))
            if reason is not None:
                data.notes[quantity.name] = reason
                values[quantity.name] = None
                skipped.add(quantity.name)
                continue
            instruments.collect(
                instruments.compute(quantity, data, stats, split, self.prepare_failures,
                                    run.quantities, run.warn), values, laters)
        self._hand_over(values, data, laters)
        later = [q for q in self.tracked if q.name not in skipped and q.needs_update_at(step)]
        if not later:
            return False
        self._update = (data, self._snapshot(data, stats), later)
        return True

    def _snapshot(self, data: StepData, stats: BackwardStatistics) -> dict[str, Tensor]:
        """θ_t, copied before the optimizer step for s_t = θ_{t+1} − θ_t. Every instrument
        has read the batch gradients by now, so the copy goes into Cockpit's copies of them
        where they fit: through the optimizer step and after it (s_t is kept for α_t until
        the next step's backward pass) Cockpit holds one parameter-sized copy less, and no
        copies are kept for the next step (its batch gradients are copied afresh). The
        batch gradients are then gone from the step's data."""
        run = self.run
        params, grads = run.params, stats.batch_grads
        reused = {k: g for k, p in params.items()
                  if (g := grads.get(k)) is not None and _holds_copy_of(g, p)}
        rest = [k for k in params if k not in reused]
        with torch.no_grad():
            if reused:  # one fused copy
                torch._foreach_copy_(list(reused.values()), [params[k] for k in reused])
            # (x·1 = x exactly: one fused kernel for the copies that fit nowhere)
            fresh = dict(zip(rest, torch._foreach_mul([params[k] for k in rest], 1.0)
                             if rest else [], strict=True))
        if reused:
            run.tracker.drop_spare_gradients()  # (they hold θ_t now)
            stats.batch_grads = data.batch_grads = {}
        return {k: reused[k] if k in reused else fresh[k] for k in params}

    def finish_update(self) -> None:
        """After the optimizer step: the instruments of the update θ_{t+1} − θ_t, recorded."""
        if self._update is None:
            return
        data, before, quantities = self._update
        self._update = None
        params = self.run.params
        # θ_{t+1} − θ_t written over the snapshot (a fresh parameter-sized tensor costs page
        # faults: as much as the subtraction itself)
        with torch.no_grad():  # −(θ_t − θ_{t+1}) = θ_{t+1} − θ_t exactly
            snapshots = [before[k] for k in params]
            torch._foreach_sub_(snapshots, list(params.values()))
            torch._foreach_neg_(snapshots)
        update = dict(zip(params, snapshots, strict=True))
        data.notes.clear()
        values: dict[str, Value] = {}
        laters: list[Later] = []
        for quantity in quantities:
            instruments.collect(instruments.compute_after_update(
                quantity, data, update, self.run.warn.strict), values, laters)
        self._hand_over(values, data, laters)

    def _hand_over(self, values: dict[str, Value], data: StepData, laters: list[Later]
                   ) -> None:
        """Record the step's values, then those its instruments computed now for earlier
        steps (Alpha's), then warn what they asked to."""
        recorder = self.run.recorder
        recorder.record(self.step, values, data.notes, laters, send=False)
        for step in sorted({*data.late, *data.late_values}):
            recorder.record(step, data.late.get(step, {}), data.late_notes.get(step, {}),
                            data.late_values.get(step, ()), send=False)
        recorder.send()  # the records' device values in one copy
        data.late.clear()
        data.late_notes.clear()
        data.late_values.clear()
        for message in data.warnings:
            self.run.warn(message)
        data.warnings.clear()

    def _step_data(self, stats: BackwardStatistics) -> StepData:
        run = self.run
        data = StepData(
            step=self.step,
            losses=stats.losses,
            stats=stats,
            batch_grads=stats.batch_grads,
            params=run.detached_params(),
            initial_params=run.initial,
            learning_rate=run.learning_rate(),
            hist_spec=run.hist.spec,
            hist2d_specs=run.hist2d_specs,
            time=self.elapsed,
            engine=run.tracker,
            optimizer_steps=run.optimizer_steps,
        )
        for formed in self._mean_norms:
            data.reuse_grad_norms(formed)
        self._mean_norms = []
        return data
