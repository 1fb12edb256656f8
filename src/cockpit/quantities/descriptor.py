"""What an instrument says about itself: its panel in the cockpit view, its colour, and what
Cockpit must know of it (does it read the gradient, does it describe the batch, ...).

Every instrument class sets ``descriptor = Descriptor(...)``. The views, the live page and
the diagnosis read a run log, not Quantity objects, so they look descriptors up by the
recorded name (:func:`descriptor_of`, :func:`registry`); Cockpit asks the functions at the
end of this module (:func:`reads_gradient`, :func:`describes_the_batch`, ...).

Adding a drawn instrument: its quantity file with a descriptor that names a :class:`Panel`,
and — unless the panel is a plain series over steps, which the view draws by default — one
drawing function registered for the panel's key (``@draws(key)``, e.g. in
:mod:`cockpit.view.gradient_panels`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Colours, one per instrument wherever it appears (the view's palette).
BLUE = "#1f5fa8"
ORANGE = "#e07b00"
GREEN = "#2e8b57"
PURPLE = "#7b3fa0"
RED = "#d62728"
GRAY = "#6e6e6e"
DARK = "#333333"

# Columns of the cockpit view, left to right, then the gray row below them.
COLUMNS = ("step size", "gradients", "curvature", "gray")

# Scopes of the problems that keep a step from being described (cockpit.loop_checks).
MODEL, BATCH, GRADIENT = "model", "batch", "gradient"

PENDING_OTHER = "the instrument completes this step's value at a later step"


@dataclass(frozen=True)
class Panel:
    """A panel of the cockpit view. Several instruments may share one (the same object).

    Attributes:
        key: the panel's name (``png_provenance``, the live page's panels).
        column: one of :data:`COLUMNS`.
        title: the title drawn at its top left.
        order: position within the column (smaller: higher up, or further left in the
            gray row).
        size: relative height within its column (width within the gray row).
        readout: recorded names read out under the pointer on the live page (panels over
            steps; ``"<name>/*"``: every ``"<name>/<parameter>"`` recorded); empty for
            panels without a step axis.
        only_if_varying: shown only when its value changes during the run (a constant one
            is written into the loss panel instead).
    """

    key: str
    column: str
    title: str
    order: float
    size: float = 1.0
    readout: tuple[str, ...] = ()
    only_if_varying: bool = False

    def __post_init__(self) -> None:
        if self.column not in COLUMNS:
            raise ValueError(f"Panel {self.key!r}: column must be one of {COLUMNS}, "
                             f"got {self.column!r}")


@dataclass(frozen=True)
class Descriptor:
    """What an instrument (or a value Cockpit records beside them) says about itself.

    Attributes:
        panel: where the cockpit view draws it (None: no panel of its own).
        color: its colour wherever it is drawn.
        records: the names it records besides its own (and ``"<name>/<parameter>"``).
        per_parameter: it records ``"<name>/<parameter>"`` values too.
        reads_gradient: it reads the user's backward pass (the batch gradient or the
            individual gradients): nothing to describe without one.
        describes_batch: it describes the step's mini-batch; False for instruments of this
            process's own parameters, update and clock (Distance, UpdateSize, ...), which
            hold on every process even where the batch is not the global one.
        problems: scopes of step problems (:data:`MODEL`, :data:`BATCH`, :data:`GRADIENT`)
            that void its value; None: from ``reads_gradient`` and ``describes_batch``.
        pending: why a step's value comes only at a later step (None: the general reason).
        needs_initial_parameters: it reads θ₀, which Cockpit then copies at the start.
    """

    panel: Panel | None = None
    color: str | None = None
    records: tuple[str, ...] = ()
    per_parameter: bool = False
    reads_gradient: bool = False
    describes_batch: bool = True
    problems: tuple[str, ...] | None = None
    pending: str | None = None
    needs_initial_parameters: bool = False


# Values Cockpit records itself at every tracked step, beside the instruments.
LEARNING_RATE_PANEL = Panel("LearningRate", "gray", "Learning rate", order=2,
                            readout=("LearningRate",), only_if_varying=True)
BATCH_SIZE_PANEL = Panel("BatchSize", "gray", "Batch size", order=3, readout=("BatchSize",),
                         only_if_varying=True)
RECORDED_BY_COCKPIT: dict[str, Descriptor] = {
    "LearningRate": Descriptor(panel=LEARNING_RATE_PANEL, color=GRAY),
    "BatchSize": Descriptor(panel=BATCH_SIZE_PANEL, color=GRAY),
}


def registry(*, package_only: bool = False) -> dict[str, Descriptor]:
    """Recorded name → descriptor: every instrument class that sets its own descriptor
    (the package's first, then — unless ``package_only`` — user-defined subclasses of
    Quantity; a name is the package's where both define it), and the values Cockpit
    records beside them (:data:`RECORDED_BY_COCKPIT`)."""
    import cockpit.quantities  # noqa: F401  (defines the package's instruments)
    from cockpit.quantities.base import Quantity

    found: dict[str, Descriptor] = dict(RECORDED_BY_COCKPIT)
    for own in (True, False) if not package_only else (True,):
        for cls in _subclasses(Quantity):
            if "descriptor" in vars(cls) and _is_packaged(cls) == own:
                found.setdefault(cls.__name__, cls.descriptor)
    return found


def _is_packaged(cls: type) -> bool:
    return cls.__module__.startswith("cockpit.quantities.")


def _subclasses(cls: type) -> Iterator[type]:
    """Subclasses of ``cls``, depth first."""
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def descriptor_of(name: str) -> Descriptor:
    """The descriptor of the instrument recorded as ``name`` (an empty one if unknown)."""
    return registry().get(name, Descriptor())


def owner_of(name: str) -> str | None:
    """The instrument that records ``name`` (itself, one of its ``records``, or
    ``"<instrument>/<parameter>"``), or None."""
    found = registry()
    if name in found:
        return name
    for owner, desc in found.items():
        if name in desc.records:
            return owner
    head = name.split("/", 1)[0]
    return owner_of(head) if head != name else None


# ------------------------------------------------- Cockpit's questions about an instrument
def _descriptor(quantity: Any) -> Descriptor:
    return getattr(quantity, "descriptor", None) or Descriptor()


def reads_gradient(quantity: Any) -> bool:
    """Whether an instrument reads the user's backward pass (the batch gradient or the
    individual gradients), so it has nothing to describe without one: its descriptor says
    so, or it asks for per-sample statistics."""
    from cockpit.engine.tracker import PER_SAMPLE_STATS

    needs = getattr(quantity, "needs", frozenset())
    return _descriptor(quantity).reads_gradient or bool(needs & PER_SAMPLE_STATS)


def describes_the_batch(quantity: Any) -> bool:
    """Whether an instrument describes the step's mini-batch (not only this process's own
    parameters, update or clock)."""
    return _descriptor(quantity).describes_batch


def problem_scopes(quantity: Any) -> tuple[str, ...]:
    """The scopes of step problems that void the instrument's value at a step."""
    desc = _descriptor(quantity)
    if desc.problems is not None:
        return desc.problems
    if reads_gradient(quantity):
        return (MODEL, BATCH, GRADIENT)
    return (MODEL, BATCH) if desc.describes_batch else (MODEL,)


def needs_initial_parameters(quantity: Any) -> bool:
    """Whether the instrument reads θ₀ (Cockpit copies the parameters at its start)."""
    return _descriptor(quantity).needs_initial_parameters


def pending_reason(name: str) -> str:
    """Why instrument ``name`` has no value yet at a step it tracks."""
    return descriptor_of(name).pending or PENDING_OTHER
