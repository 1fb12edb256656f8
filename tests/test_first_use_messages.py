"""What a new user reads: warnings at their own line, panels that say the recorded reason
once, and figures whose scales can be read."""

from __future__ import annotations

import warnings

import matplotlib

matplotlib.use("Agg")

import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, configuration
from cockpit.view import _style as S
from cockpit.view import plot_cockpit


def _batchnorm_run(steps: int = 4, zero_grad: bool = True) -> tuple[Cockpit, list]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit = Cockpit(model, configuration("economy"), optimizer=opt)
        for step in range(steps):
            if zero_grad or step == 0:
                opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()
    return cockpit, caught


def test_warnings_name_the_users_line():
    _, caught = _batchnorm_run(zero_grad=False)
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    messages = " ".join(str(w.message) for w in ours)
    assert "BatchNorm1d" in messages and "zero_grad" in messages
    for w in ours:
        assert w.filename == __file__, (w.filename, w.lineno, str(w.message)[:80])


def _texts(fig) -> str:
    return " ".join(t.get_text() for ax in fig.axes for t in ax.texts)


def test_panels_say_the_recorded_reason_once():
    cockpit, _ = _batchnorm_run()
    fig = plot_cockpit(cockpit.get_output(), notes=cockpit.get_notes())
    text = _texts(fig).replace("\n", " ")
    assert "α not computed: BatchNorm1d" in text
    assert "not computed: not computed" not in text
    hist = next(ax for ax in fig.axes
                if ax.get_title(loc="left") == S.PANEL_TITLES["GradHist1d"])
    shown = " ".join(t.get_text() for t in hist.texts).replace("\n", " ")
    assert "not computed: BatchNorm1d" in shown and "no histogram yet" not in shown


def test_per_layer_strip_has_a_colorbar():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt)
    for step in range(3):
        opt.zero_grad()
        losses = F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,)),
                                 reduction="none")
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    fig = plot_cockpit(cockpit.get_output())
    assert any(ax.get_ylabel() == "count" and ax.get_label() == "<colorbar>"
               for ax in fig.axes)
