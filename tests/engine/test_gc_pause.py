"""Python's cyclic collector held back while a tracked step's work runs
(``cockpit.engine.gc_pause``): no collection runs between a tracked step's recorded forward
pass and the end of its update's instruments, the thresholds are back as the user had them
after every step (also after a failed backward pass, an untracked step and ``close()``), and
nothing changes where the collector is off, its threshold was changed meanwhile, or
``COCKPIT_GC_PAUSE=0``."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from cockpit import Cockpit, configuration
from cockpit.engine import gc_pause
from cockpit.schedules import every


@pytest.fixture(autouse=True)
def _thresholds():
    saved, enabled = gc.get_threshold(), gc.isenabled()
    gc_pause.release()
    yield
    gc_pause.release()
    gc.set_threshold(*saved)
    (gc.enable if enabled else gc.disable)()


def test_hold_raises_the_youngest_threshold_until_release():
    gc.set_threshold(700, 10, 10)
    gc_pause.hold()
    assert gc.get_threshold() == (gc_pause.HELD_THRESHOLD, 10, 10) and gc_pause.held()
    gc_pause.hold()  # (once)
    gc_pause.release()
    assert gc.get_threshold() == (700, 10, 10) and not gc_pause.held()
    gc_pause.release()
    assert gc.get_threshold() == (700, 10, 10)


def test_nothing_changes_where_the_collector_is_off_or_changed_or_switched_off(monkeypatch):
    gc.set_threshold(700, 10, 10)
    gc.disable()
    gc_pause.hold()
    assert gc.get_threshold() == (700, 10, 10) and not gc_pause.held()
    gc.enable()
    gc.set_threshold(0, 10, 10)  # (collections off by threshold)
    gc_pause.hold()
    assert gc.get_threshold() == (0, 10, 10)
    gc.set_threshold(700, 10, 10)
    gc_pause.hold()
    gc.set_threshold(5000, 10, 10)  # the user's own setting meanwhile is theirs
    gc_pause.release()
    assert gc.get_threshold() == (5000, 10, 10)
    monkeypatch.setenv("COCKPIT_GC_PAUSE", "0")
    gc_pause.hold()
    assert gc.get_threshold() == (5000, 10, 10) and not gc_pause.held()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(6, 6), nn.Tanh())],
                         nn.Linear(6, 3))


def test_no_collection_runs_inside_a_tracked_step_and_thresholds_come_back():
    """Economy on 26 parameter tensors tracked every 4th step, with the youngest generation
    collected every 50 allocations (so that a tracked step without the hold would be
    collected many times): the tracked steps (0, 4) are held from their recorded forward
    pass through their backward pass, a step no instrument reads (2) is not; collections run,
    none while held; after each step the thresholds are the user's."""
    gc.set_threshold(50, 10, 10)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, configuration("economy", every(4)), optimizer=opt)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    collections = {True: 0, False: 0}

    def watch(phase, info):
        if phase == "start":
            collections[gc_pause.held()] += 1

    gc.callbacks.append(watch)
    try:
        for step in range(6):
            opt.zero_grad()
            losses = nn.functional.cross_entropy(model(x), y, reduction="none")
            if step in (0, 4):
                assert gc_pause.held()  # (from the recorded forward pass)
            with cockpit(step, losses=losses):
                losses.mean().backward()
                if step in (0, 4):
                    assert gc_pause.held()
                if step == 2:
                    assert not gc_pause.held()
            opt.step()
            assert gc.get_threshold() == (50, 10, 10) and not gc_pause.held()
    finally:
        gc.callbacks.remove(watch)
    cockpit.close()
    assert collections[False] > 0 and collections[True] == 0, collections
    assert gc.get_threshold() == (50, 10, 10)


def test_a_failed_backward_pass_and_close_give_the_thresholds_back():
    gc.set_threshold(700, 10, 10)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    assert gc_pause.held()
    with pytest.raises(RuntimeError, match="user's"), cockpit(0, losses=losses):
        raise RuntimeError("the user's backward pass failed")
    assert gc.get_threshold() == (700, 10, 10)
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")  # (held again)
    assert gc_pause.held()
    cockpit.close()
    assert gc.get_threshold() == (700, 10, 10) and not gc_pause.held()
