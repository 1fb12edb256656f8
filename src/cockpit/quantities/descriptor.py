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

A run log's metadata carries the drawing part of the recorded instruments' descriptors
(:func:`describe_instruments`); a view reading the run takes them in
(:func:`remember_descriptions`), so an instrument whose class the viewing process never
imported still gets its panel.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields
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

# Scopes of the problems that keep a step from being described (cockpit.loop_checks):
GRADIENT = "gradient"  # the instruments reading the backward pass (individual gradients, ‖g‖)
BATCH = "batch"  # those and the instruments of the individual losses (Loss, BatchSize, …)
MODEL = "model"  # every instrument but Loss and Time

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
                found.setdefault(cls.__name__, vars(cls)["descriptor"])
    if not package_only:
        for name, desc in _FROM_RUN_LOGS.items():
            found.setdefault(name, desc)
    return found


# ------------------------------------------ descriptors carried by a run log's metadata
#: The run log's metadata key that holds :func:`describe_instruments` of the run.
METADATA_KEY = "descriptors"
# What a run log carries of a descriptor: what the views need to draw the instrument.
_CARRIED = ("color", "records", "per_parameter")
_PANEL_TYPES = {"key": str, "column": str, "title": str, "order": int | float,
                "size": int | float, "only_if_varying": bool}
# Descriptors read from run logs (:func:`remember_descriptions`): the instruments of a run
# whose classes this process has not imported. Replaced, never changed in place, so a
# thread that reads it meanwhile sees the old or the new mapping.
_FROM_RUN_LOGS: dict[str, Descriptor] = {}


def describe_instruments(quantities: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Recorded name → what the cockpit view needs to draw it (its panel, colour, the names it
    records besides its own, per-parameter values), JSON-able, for the run log's metadata
    (:data:`METADATA_KEY`): a view of the run in a process that has not imported an
    instrument's class still draws its panel. Instruments without a panel are left out."""
    found = {}
    for quantity in quantities:
        desc = _descriptor(quantity)
        if desc.panel is not None:
            found[quantity.name] = {"panel": asdict(desc.panel),
                                    **{k: getattr(desc, k) for k in _CARRIED}}
    return found


def descriptor_from_description(described: Mapping[str, Any]) -> Descriptor:
    """The :class:`Descriptor` (its drawing part) that :func:`describe_instruments` wrote;
    ValueError, saying what is wrong, for anything else."""
    if not isinstance(described, Mapping) or not isinstance(described.get("panel"), Mapping):
        raise ValueError("expected {'panel': {...}, 'color': ..., 'records': [...], "
                         f"'per_parameter': ...}}, got {described!r}")
    names = {f.name for f in fields(Panel)}
    panel = dict(described["panel"])
    if not names >= set(panel) or not {"key", "column", "title", "order"} <= set(panel):
        raise ValueError(f"a panel has the fields {sorted(names)} (key, column, title and "
                         f"order required), got {sorted(panel)}")
    readout, records = panel.get("readout") or (), described.get("records") or ()
    color = described.get("color")
    wrong = [f"{k}={panel[k]!r}" for k, kind in _PANEL_TYPES.items()
             if k in panel and not isinstance(panel[k], kind)]
    wrong += [f"{k}={v!r} (a list of names)" for k, v in (("readout", readout),
              ("records", records)) if not isinstance(v, list | tuple)
              or not all(isinstance(r, str) for r in v)]
    wrong += [f"color={color!r}"] if color is not None and not isinstance(color, str) else []
    if wrong:
        raise ValueError("of the wrong type: " + ", ".join(wrong))
    panel["readout"] = tuple(readout)
    try:
        return Descriptor(panel=Panel(**panel), color=color, records=tuple(records),
                          per_parameter=bool(described.get("per_parameter")))
    except TypeError as err:
        raise ValueError(str(err)) from None


def remember_descriptions(meta: Mapping[str, Any] | None) -> None:
    """Take the descriptors a run log's metadata carries (:data:`METADATA_KEY`) into
    :func:`registry`, below those of the imported instrument classes (the code in this
    process wins). An entry that cannot be read is left out with a warning that names it."""
    global _FROM_RUN_LOGS
    described = meta.get(METADATA_KEY) if isinstance(meta, Mapping) else None
    if not isinstance(described, Mapping) or not described:
        return
    found = dict(_FROM_RUN_LOGS)
    for name, entry in described.items():
        try:
            found[str(name)] = descriptor_from_description(entry)
        except ValueError as err:
            warnings.warn(f"the run log's description of instrument {name!r} cannot be read "
                          f"({err}); its panel is left out of the view", RuntimeWarning,
                          stacklevel=2)
    _FROM_RUN_LOGS = found


def _is_packaged(cls: type) -> bool:
    return cls.__module__.startswith("cockpit.quantities.")


def _subclasses(cls: type) -> Iterator[type]:
    """Subclasses of ``cls``, depth first."""
    sub: type
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
    from cockpit.engine.statistics import PER_SAMPLE_STATS

    needs: frozenset[str] = getattr(quantity, "needs", frozenset())
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
