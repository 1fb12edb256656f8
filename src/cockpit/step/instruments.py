"""One instrument at one step: its work before the user's backward pass (``prepare``), its
value after it (``compute``), and after the optimizer step (``compute_after_update``). A
failure is recorded as None with the reason and warned about, never raised (unless
``strict``)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from cockpit.engine.readout import Later
from cockpit.engine.statistics import GRAM_MEAN, PER_SAMPLE_STATS, BackwardStatistics
from cockpit.quantities.base import Quantity, StepData, Value
from cockpit.step.warn_once import WarnOnce


def prepare(quantity: Quantity, step: int, tracker: Any, optimizer: Any,
            losses: Tensor | None, failures: dict[str, str], warn: WarnOnce) -> None:
    """Work before the user's backward pass; a failure goes to ``failures`` (name →
    reason), never raised."""
    try:
        quantity.prepare(step, tracker, optimizer, losses)
    except Exception as error:
        if warn.strict:
            raise
        message = str(error)
        if "scaled_dot_product" in message:
            message += (
                " — second derivatives through attention need PyTorch's math kernel: run "
                "the forward pass under torch.nn.attention.sdpa_kernel(SDPBackend.MATH)"
            )
        failures[quantity.name] = f"failed: {message}"
        warn(f"{quantity.name} failed at step {step}: {message}", key=quantity.name)


def compute(quantity: Quantity, data: StepData, stats: BackwardStatistics, split: bool,
            failures: dict[str, str], quantities: list[Quantity], warn: WarnOnce
            ) -> dict[str, Value] | Later:
    """The instrument's value at the step (or its Later), or None with the reason in
    ``data.notes``: it failed in ``prepare`` (``failures``), the statistics it reads are
    not defined at this step, or its computation failed. ``quantities``: every instrument
    (named together in the warning about undefined per-sample statistics)."""
    if quantity.name in failures:
        data.notes[quantity.name] = failures[quantity.name]
        return {quantity.name: None}
    if data.unmerged is not None and GRAM_MEAN in quantity.needs:
        data.notes[quantity.name] = data.unmerged
        return {quantity.name: None}
    # (one backward pass per process: the instrument sums its products over the processes)
    if quantity.whole_batch_graph and (stats.micro_batches > 1 or (split and stats.ranks == 1)):
        data.notes[quantity.name] = (
            "needs the whole batch's graph in one backward pass (per process); not formed "
            "when the batch is split over micro-batches")
        return {quantity.name: None}
    if (quantity.needs & PER_SAMPLE_STATS and not stats.valid
            and not quantity.handles_invalid_statistics):
        reason = "; ".join(stats.problems)
        data.notes[quantity.name] = reason
        names = [q.name for q in quantities
                 if q.needs & PER_SAMPLE_STATS and not q.handles_invalid_statistics]
        warn(f"{', '.join(names)} not computed at step {data.step}: {reason}",
             key=f"per-sample:{reason}")
        return {quantity.name: None}
    try:
        return named(quantity.compute(data), quantity.name)
    except Exception as error:
        if warn.strict:
            raise
        data.notes[quantity.name] = f"failed: {error}"
        warn(f"{quantity.name} failed at step {data.step}: {error}", key=quantity.name)
        return {quantity.name: None}


def compute_after_update(quantity: Quantity, data: StepData, update: dict[str, Tensor],
                         strict: bool) -> dict[str, Value] | Later:
    """The instrument's value from the update θ_{t+1} − θ_t (UpdateSize, Alpha), or None
    with the reason in ``data.notes``."""
    try:
        return named(quantity.compute_after_update(data, update), quantity.name)
    except Exception as error:
        if strict:
            raise
        data.notes[quantity.name] = f"failed: {error}"
        return {quantity.name: None}


def named(result: dict[str, Value] | Later, name: str) -> dict[str, Value] | Later:
    if isinstance(result, Later) and result.name is None:
        result.name = name
    return result


def collect(result: dict[str, Value] | Later, values: dict[str, Value],
            laters: list[Later]) -> None:
    """A result into the step's values, or its Later into the step's laters."""
    if isinstance(result, Later):
        laters.append(result)
    else:
        values.update(result)


def sample_sum_keys(quantities: list[Quantity]) -> tuple[str, ...]:
    return tuple(sorted({key for q in quantities for key in q.sample_sum_keys}))


def projection_keys(quantities: list[Quantity]) -> tuple[str, ...]:
    return tuple(sorted({key for q in quantities for key in q.projection_keys}))
