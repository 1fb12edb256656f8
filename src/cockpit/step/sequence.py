"""The steps in the order the loop brings them: which tracked step a ``with cockpit(step,
...)`` block belongs to, the step numbering, and the transitions of each
:class:`~cockpit.step.tracked_step.TrackedStep`.

A block with the step number of the open tracked step adds a micro-batch to it; a block
with a new number completes the open step first (its values are recorded). A step is also
completed at ``optimizer.step()`` (its pre-hook), by ``end_step()``, and before values are
read (``get_output``, ``close``); the instruments of its update follow the optimizer step
(its post-hook), or the next step's first block.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from cockpit.diagnose.live import LiveDiagnosis
from cockpit.engine import gc_pause
from cockpit.engine.workspace import release_workspace
from cockpit.loop_checks import STEP_BACKWARDS, every_rank_attached
from cockpit.quantities.base import Quantity
from cockpit.step.tracked_step import TrackedStep, check_block
from cockpit.step.watched_run import WatchedRun

#: After step numbers jump, every forward pass is recorded until this many steps in a row
#: came with consecutive numbers again; then only the forward passes the schedule needs.
CONSECUTIVE_TO_PREDICT = 8


class StepSequence:
    """Opens and completes the tracked steps of one Cockpit.

    Args:
        run: what the steps share.
        tracked: the schedule: the instruments tracked at a step.
        last_step: the last step seen (a resumed run log's), None at the start: a step at
            or below it is not recorded (never overwritten).
        attachment: with combined processes, this process's attachment, checked at the
            first tracked step (every process must run Cockpit); None: nothing to check.
        diagnosis: the live diagnosis, fed before each new step.
    """

    def __init__(self, run: WatchedRun, tracked: Callable[[int], list[Quantity]],
                 last_step: int | None, attachment: int | None,
                 diagnosis: LiveDiagnosis | None):
        self.run, self.tracked = run, tracked
        self.last_step = last_step
        self._in_a_row = CONSECUTIVE_TO_PREDICT  # consecutive numbers since the last jump
        self._predicts = True  # False for good once a jump met an unrecorded forward pass
        self.attachment = attachment
        self.diagnosis = diagnosis
        self.open: TrackedStep | None = None  # the tracked step whose blocks come in
        self.awaiting_update: TrackedStep | None = None  # finished, before optimizer.step()
        # inside optimizer.step() (set by its hooks): a block there is a closure's evaluation
        # (LBFGS), and the step number whose first evaluation ended its tracked step there
        self.stepping = False
        self.evaluated: int | None = None
        self._keep_activations_for(run.quantities)  # (the first step is not known yet)

    @property
    def in_block(self) -> bool:
        return self.open is not None and self.open.in_block

    @property
    def consecutive(self) -> bool:
        """Whether the next step is expected to be step + 1: at the start, and once the
        numbers were consecutive :data:`CONSECUTIVE_TO_PREDICT` times in a row after a jump
        (a skipped batch, a resumed counter); never again after a jump reached a tracked
        step whose forward pass was not recorded."""
        return self._predicts and self._in_a_row >= CONSECUTIVE_TO_PREDICT

    def capture_next(self, step: int) -> bool:
        """Whether the coming forward pass must be recorded. Skipped only when the next
        step is expected to be step + 1 (:attr:`consecutive`) and the schedule leaves it
        untracked. Sets whether it keeps the activations: where step + 1's instruments read
        them (any instrument's, if the next step is not known)."""
        upcoming = self.tracked(step + 1) if self.consecutive else self.run.quantities
        self._keep_activations_for(upcoming)
        return not self.consecutive or bool(upcoming)

    def _keep_activations_for(self, quantities: list[Quantity]) -> None:
        """The coming forward passes keep what the diagonal curvature reads (the smooth
        activations' calls, the layers' inputs as given and their outputs) where one of
        ``quantities`` reads it."""
        self.run.tracker.records_activations = any(q.needs_activations for q in quantities)

    # ------------------------------------------------------------------ transitions
    def enter(self, step: int, losses: Tensor | None) -> None:
        """A ``with cockpit(step, losses=...)`` block opens."""
        last = self.last_step
        try:
            self._open_block(step, losses)
        except BaseException:
            self.last_step = last  # a block refused at its start saw no step
            raise

    def _open_block(self, step: int, losses: Tensor | None) -> None:
        if self.in_block:
            raise RuntimeError("cockpit(step) blocks cannot be nested; close the previous one")
        self.run.watch.disarm()  # a block is open: its backward passes are seen
        if self.stepping and step == self.evaluated:
            # the closure evaluated again at the optimizer's next trial point (LBFGS): not
            # the batch at θ_t the step describes
            self.run.tracker.clear_calls()
            self.run.tracker.drop_spare_gradients()
            return
        # what the forward pass before the block recorded: its calls, their activations
        recorded = self.run.tracker.capturing, self.run.tracker.records_activations
        current = self.open
        continues = current is not None and current.step == step
        unstepped = False  # the previous tracked step had no optimizer step
        if current is not None and not continues:
            if (self.run.optimizer is not None and self.run.grad_scaler is None
                    and not current.stepped  # (inside the block, before its backward pass)
                    and current.losses_were_finite()):  # (a non-finite loss: skipping is right)
                unstepped = True
                self.run.warn(
                    f"step {current.step} was not followed by optimizer.step() before step "
                    f"{step} began: if these backward passes are micro-batches of one "
                    "optimizer step, give them the same step number (their values were "
                    f"recorded as step {current.step} alone)", key="step-without-optimizer")
            self.finish()
        if not continues and not self._number(step, recorded):
            return
        tracked = self.tracked(step)
        if tracked and self.attachment is not None:
            index, self.attachment = self.attachment, None
            if not every_rank_attached(index):
                self.run.ranks = self.run.group_ranks = 1
        joined = bool(tracked) and not continues and self.run.ranks_at_step()
        tracker = self.run.tracker
        if not tracked:
            if recorded[0]:  # (its forward pass held the collector back)
                gc_pause.release()
            tracker.clear_calls()
            tracker.drop_spare_gradients()
            tracker.capturing = self.capture_next(step)
            return
        gc_pause.hold()  # until the step's work ends (the module says why)
        checks = check_block(self.run, step, tracked, losses, current if continues else None,
                             check_held=not continues and not unstepped)
        if current is None or not continues:
            current = self.open = TrackedStep(self.run, step, tracked, joined)
        current.open_block(checks)

    def _number(self, step: int, recorded: tuple[bool, bool]) -> bool:
        """A block with a new step number: the previous step's update and numbers first;
        False where the step is not recorded (a repeated or earlier number). ``recorded``:
        whether the forward pass before the block was recorded, and its activations."""
        self.finish_update()
        self.run.recorder.read_back()  # the previous step's numbers, one wait for all of them
        if self.diagnosis is not None:
            self.diagnosis.feed()
        tracker = self.run.tracker
        if step == self.last_step and not self.tracked(step):
            # another micro-batch of an untracked step: nothing to record, the next
            # forward passes stay unrecorded (a compiled model stays compiled)
            tracker.clear_calls()
            tracker.capturing = self.capture_next(step)
            return False
        if self.last_step is not None and step <= self.last_step:
            self.run.warn(STEP_BACKWARDS.format(step=step, last=self.last_step),
                          key="step-backwards")
            tracker.clear_calls()
            tracker.drop_spare_gradients()
            self._in_a_row = 0
            tracker.capturing = True
            self._keep_activations_for(self.run.quantities)
            return False
        if self.last_step is None or step == self.last_step + 1:
            self._in_a_row += 1
        else:
            self._in_a_row = 0
            calls, activations = recorded
            upcoming = self.tracked(step)
            needs_activations = any(q.needs_activations for q in upcoming)
            if upcoming and (not calls or (needs_activations and not activations)):
                self._predicts = False  # its forward pass is lost: record every one from now
        self.last_step = step
        return True

    def exit(self, failed: bool) -> None:
        """The block closes (``failed``: the user's backward pass raised)."""
        current = self.open
        if current is None or not current.in_block:
            return
        if not current.close_block(failed):
            self.open = None  # the step cannot be completed
            gc_pause.release()
        elif self.stepping:
            # a closure's first evaluation inside optimizer.step() (LBFGS): at θ_t, before
            # the optimizer moves θ; its further evaluations are the optimizer's own
            self.evaluated = current.step
            self.end_step()
            self.run.watch.disarm()

    def end_step(self) -> None:
        """The open step's backward passes are all done: measured against the gradient
        the optimizer is about to step on, then finished. ``optimizer.step()`` inside the
        block closes the block here where its backward pass ran: its backward passes are
        done, and the update must be measured from the parameters before the step."""
        current = self.open
        if current is not None and current.in_block:
            if self.run.tracker.state.weights is not None:
                self.exit(failed=False)
            else:  # the optimizer moves θ before the block's backward pass
                current.stepped_before_backward()
        if self.open is not None:
            self.open.measure_gradient_mismatch()
        self.finish()

    def finish(self) -> None:
        """The open step is complete: its values are recorded (not inside a block: nothing
        is complete there yet)."""
        current = self.open
        if current is None or current.in_block:
            return
        self.open = None
        try:
            awaits_update = current.finish(self.capture_next)
        except Exception as error:
            self._failed(current.step, error, "at the end of its backward passes")
            awaits_update = False
        if awaits_update:
            self.awaiting_update = current
        else:
            del current  # (the step's objects go first: the next collection skips them)
            _work_ended()

    def finish_update(self) -> None:
        """After the optimizer step: the finished step's instruments of the update."""
        awaiting, self.awaiting_update = self.awaiting_update, None
        if awaiting is not None:
            try:
                awaiting.finish_update()
            except Exception as error:
                self._failed(awaiting.step, error, "after its optimizer step")
            del awaiting  # (the step's objects go first: the next collection skips them)
            _work_ended()

    def _failed(self, step: int, error: Exception, when: str) -> None:
        """Cockpit's work for ``step`` failed where the user's loop is waiting on it (inside
        ``optimizer.step()`` or a block's start): out of memory on a GPU, a failure of
        Cockpit's own. Warned about, and the step's instruments that get no value are
        recorded with the reason; never raised into the training (raised with
        ``strict=True``)."""
        if self.run.warn.strict:
            raise error
        reason = f"Cockpit's work {when} failed ({type(error).__name__}: {error})"
        self.run.recorder.failed(step, reason)
        self.run.warn(f"step {step}: {reason}; its unfinished instruments are not recorded, "
                      "training and the next steps go on",
                      key=f"step-failed:{type(error).__name__}")


def _work_ended() -> None:
    """A step's work is done: its scratch buffers off the CPU go back, and the collector is
    no longer held back (:mod:`cockpit.engine.gc_pause`)."""
    release_workspace(off_cpu_only=True)
    gc_pause.release()
