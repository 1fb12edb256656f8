"""Instruments describe themselves: the answers of their descriptors are the rules Cockpit
applied by name lists (kept here, verbatim, as the reference), and every panel, colour and
title of the view comes from them."""

from __future__ import annotations

import pytest

from cockpit import loop_checks
from cockpit import quantities as q
from cockpit.engine.statistics import PER_SAMPLE_STATS
from cockpit.quantities.descriptor import (
    BATCH,
    COLUMNS,
    GRADIENT,
    MODEL,
    PENDING_OTHER,
    Descriptor,
    Panel,
    descriptor_of,
    owner_of,
    registry,
)

# The lists Cockpit held before its instruments described themselves.
OWN_PROCESS = frozenset({"Distance", "UpdateSize", "ParamNorm", "UpdateRatio", "Parameters",
                         "Time"})
PENDING = {"Alpha": "α at step t fits the loss and its slope at θ_t and θ_(t+1), and the "
                    "latter are measured at the next step"}


def old_reads_gradient(quantity) -> bool:
    return bool(quantity.needs & PER_SAMPLE_STATS) or quantity.name == "GradNorm"


def old_scopes(quantity) -> tuple[str, ...]:
    if quantity.name in ("Loss", "Time"):
        return (BATCH,) if quantity.name == "Loss" else ()
    if old_reads_gradient(quantity):
        return (MODEL, BATCH, GRADIENT)
    if quantity.name not in OWN_PROCESS:
        return (MODEL, BATCH)
    return (MODEL,)


INSTRUMENTS = [name for name in q.__all__ if isinstance(getattr(q, name), type)
               and issubclass(getattr(q, name), q.Quantity) and name != "Quantity"]


def test_every_instrument_of_the_package_has_its_own_descriptor() -> None:
    assert len(INSTRUMENTS) == 25
    for name in INSTRUMENTS:
        assert "descriptor" in vars(getattr(q, name)), name
        assert registry()[name] is getattr(q, name).descriptor


@pytest.mark.parametrize("name", INSTRUMENTS)
def test_descriptor_answers_what_the_name_lists_said(name) -> None:
    quantity = getattr(q, name)()
    assert q.reads_gradient(quantity) == old_reads_gradient(quantity)
    assert q.describes_the_batch(quantity) == (name not in OWN_PROCESS)
    assert q.problem_scopes(quantity) == old_scopes(quantity)
    assert q.needs_initial_parameters(quantity) == (name == "Distance")
    assert q.pending_reason(name) == PENDING.get(name, PENDING_OTHER)


def test_scopes_are_the_loop_checks_scopes() -> None:
    assert (MODEL, BATCH, GRADIENT) == (loop_checks.MODEL, loop_checks.BATCH,
                                        loop_checks.GRADIENT)


def test_a_user_instrument_without_descriptor_keeps_the_defaults() -> None:
    class Custom(q.Quantity):
        needs = frozenset({"sq_norms"})

    custom = Custom()
    assert q.reads_gradient(custom)  # asks for per-sample statistics
    assert q.describes_the_batch(custom) and not q.needs_initial_parameters(custom)
    assert q.problem_scopes(custom) == (MODEL, BATCH, GRADIENT)
    assert q.pending_reason("Custom") == PENDING_OTHER
    assert "Custom" not in registry()


def test_panels_shared_by_instruments_are_one_panel() -> None:
    by_key: dict[str, Panel] = {}
    for name, desc in registry().items():
        if desc.panel is not None:
            assert by_key.setdefault(desc.panel.key, desc.panel) == desc.panel, name
            assert desc.panel.column in COLUMNS
    assert {k for k, p in by_key.items() if p.key == "Distances"} == {"Distances"}
    assert descriptor_of("Distance").panel is descriptor_of("UpdateSize").panel


def test_recorded_names_find_their_instrument() -> None:
    assert owner_of("GradientNoiseScaleEMA") == "GradientNoiseScale"
    assert owner_of("GradientNoiseScaleEMA/fc.weight") == "GradientNoiseScale"
    assert owner_of("UpdateRatio/0.bias") == "UpdateRatio"
    assert owner_of("LearningRate") == "LearningRate"
    assert owner_of("Nothing/x") is None
    assert descriptor_of("Nothing") == Descriptor()


def test_a_panel_names_a_known_column() -> None:
    with pytest.raises(ValueError, match="column must be one of"):
        Panel("X", "left", "X", order=1)
