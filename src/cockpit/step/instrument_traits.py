"""What the step pipeline needs to know about particular instruments, by name: which
describe the batch, which read the backward pass, which problems touch which, and why a
value is still pending. Kept together so that each instrument can later describe itself."""

from __future__ import annotations

from cockpit.engine.tracker import PER_SAMPLE_STATS
from cockpit.loop_checks import BATCH, GRADIENT, MODEL, first_problem
from cockpit.quantities.base import Quantity

# instruments of this process's own parameters, update and clock, not of the batch
OWN_PROCESS = frozenset({"Distance", "UpdateSize", "Parameters", "Time"})

PENDING = {
    "Alpha": "α at step t fits the loss and its slope at θ_t and θ_(t+1), and the latter are "
             "measured at the next step",
}
PENDING_OTHER = "the instrument completes this step's value at a later step"


def pending_reason(name: str) -> str:
    """Why instrument ``name`` has no value yet at a step it is scheduled at."""
    return PENDING.get(name, PENDING_OTHER)


def needs_initial_params(quantity: Quantity) -> bool:
    """Whether the instrument reads θ_0 (kept from construction on)."""
    return quantity.name == "Distance"


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
    if quantity.name in ("Loss", "Time"):
        scopes: tuple[str, ...] = (BATCH,) if quantity.name == "Loss" else ()
    elif reads_gradient(quantity):
        scopes = (MODEL, BATCH, GRADIENT)
    elif describes_the_batch(quantity):
        scopes = (MODEL, BATCH)
    else:
        scopes = (MODEL,)
    return first_problem(problems, scopes)


def describes_the_batch(quantity: Quantity) -> bool:
    return quantity.name not in OWN_PROCESS


def reads_gradient(quantity: Quantity) -> bool:
    """Whether an instrument reads the user's backward pass (the batch gradient or the
    individual gradients), so it has nothing to describe without one."""
    return bool(quantity.needs & PER_SAMPLE_STATS) or quantity.name == "GradNorm"
