"""What the step pipeline asks of an instrument beyond its descriptor
(:mod:`cockpit.quantities.descriptor`): whether it predicts the coming update, whether its
schedule gives it a value at a step, and which of a step's problems voids its value."""

from __future__ import annotations

from cockpit.loop_checks import first_problem
from cockpit.quantities.base import Quantity
from cockpit.quantities.descriptor import (
    describes_the_batch,
    needs_initial_parameters,
    pending_reason,
    problem_scopes,
    reads_gradient,
)

__all__ = ["describes_the_batch", "needs_initial_parameters", "pending_reason",
           "predicts_update", "problem_of", "reads_gradient", "scheduled"]


def predicts_update(quantity: Quantity) -> bool:
    """Whether the instrument predicts the coming update from the batch gradient's
    individual shares (a ``predict`` switch it can be told to turn off)."""
    return isinstance(getattr(type(quantity), "predict", None), property)


def scheduled(quantity: Quantity, step: int) -> bool:
    """Whether the instrument's schedule gives it a value at ``step`` (Alpha also tracks
    the step after each of its steps, for the fit: ``starts``)."""
    starts = getattr(quantity, "starts", None)
    return bool(starts(step)) if callable(starts) else quantity.should_track(step)


def problem_of(quantity: Quantity, problems: list[tuple[str, str]]) -> str | None:
    """The reason ``quantity`` cannot describe the step, if one of ``problems`` touches it."""
    return first_problem(problems, problem_scopes(quantity)) if problems else None
