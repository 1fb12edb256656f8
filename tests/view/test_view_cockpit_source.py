"""Views drawn from a Cockpit object read the run metadata its run log is given: the layers
in the model's order and the model and optimizer in the title, as from its run directory
(also for a Cockpit without a ``logdir``)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, configuration
from cockpit.store import read_meta
from cockpit.view import _style as S
from cockpit.view import plot_layers, plot_run
from cockpit.view._source import load_run
from cockpit.view.cockpit_view import describe_run
from cockpit.view.live import LivePlot

LAYERS = 6
MODEL_ORDER = [f"{2 * i}.{kind}" for i in range(LAYERS) for kind in ("weight", "bias")]


def _run(logdir: str | None) -> Cockpit:
    """Three steps of a deep tanh MLP: its gradients are recorded last layer first."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(4, 4), nn.Tanh())])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    x, y = torch.randn(16, 4), torch.randint(0, 4, (16,))
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt, logdir=logdir)
    for step in range(3):
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    return cockpit


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    logdir = tmp_path_factory.mktemp("runs") / "order"
    logged = _run(str(logdir))
    logged.close()
    unlogged = _run(None)
    return logdir, logged, unlogged


def test_the_recorded_order_is_not_the_models(runs) -> None:
    logdir, logged, _ = runs
    recorded = [k.split("/", 1)[1] for k in logged.get_output()[0] if k.startswith("GradNorm/")]
    assert sorted(recorded) == sorted(MODEL_ORDER) and recorded != MODEL_ORDER
    assert list(read_meta(logdir)["parameters"]) == MODEL_ORDER


def test_a_cockpit_gives_the_metadata_of_its_run_log(runs) -> None:
    logdir, logged, unlogged = runs
    stored = read_meta(logdir)
    for cockpit in (logged, unlogged):
        _, meta = load_run(cockpit)
        for key in ("model", "model_class", "num_parameters", "parameters", "optimizer",
                    "optimizer_hyperparameters", "quantities", "schedules", "batchnorm"):
            assert meta[key] == stored[key], key
        assert describe_run(meta) == describe_run(stored)
    assert describe_run(stored) == ("Sequential · SGD(lr=0.1, momentum=0.5, weight_decay=0) · "
                                    "120 parameters")


def test_plot_layers_of_a_cockpit_lists_the_layers_in_the_models_order(runs) -> None:
    logdir, logged, unlogged = runs

    def panel_titles(source) -> list[str]:
        return [ax.get_title(loc="left") for ax in plot_layers(source).axes]

    assert panel_titles(logdir) == MODEL_ORDER
    assert panel_titles(logged) == MODEL_ORDER
    assert panel_titles(unlogged) == MODEL_ORDER


def test_live_plot_of_a_cockpit_has_the_title_and_layer_order_of_its_run(runs) -> None:
    logdir, logged, _ = runs
    live = LivePlot(logged)
    fig = live.update()
    expected = plot_run(logdir)
    assert fig._suptitle.get_text() == expected._suptitle.get_text()
    assert fig._suptitle.get_text() == "Cockpit · " + describe_run(read_meta(logdir))

    def layer_rows(figure) -> list[str]:
        (ax,) = [a for a in figure.axes if a.get_title(loc="left") == S.PANEL_TITLES["Layers"]]
        return [t.get_text() for t in ax.get_yticklabels()]

    assert layer_rows(fig) == layer_rows(expected) == MODEL_ORDER
    live.close()
