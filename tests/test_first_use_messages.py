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
        cockpit = Cockpit(model, configuration("business"), optimizer=opt)
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
    # the general path of Alpha needs individual gradients too: no switch announced
    assert "switches to the general path" not in messages
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


def test_gradient_tests_show_a_running_average_over_thin_steps_and_the_threshold_on_top():
    import numpy as np

    from cockpit.view.synthetic import synthetic_output

    output = synthetic_output("economy", num_steps=100, every=2, seed=4)
    fig = plot_cockpit(output)
    ax = next(a for a in fig.axes
              if a.get_title(loc="left") == S.PANEL_TITLES["GradientTests"])
    steps = sorted(s for s in output if isinstance(output[s].get("NormTest"), float))
    values = [output[s]["NormTest"] for s in steps]
    expected, m = [], 0.0
    for t, x in enumerate(values):  # m_t = 0.8 m_(t−1) + 0.2 x_t, bias-corrected
        m = 0.8 * m + 0.2 * x
        expected.append(m / (1 - 0.8 ** (t + 1)))
    (bold,) = [ln for ln in ax.get_lines() if ln.get_label() == "norm"]
    np.testing.assert_allclose(bold.get_ydata(), expected, rtol=1e-12)
    thin = [ln for ln in ax.get_lines() if ln.get_linewidth() < 1 and
            list(ln.get_ydata()) == values]
    assert thin and thin[0].get_alpha() < 0.5
    (threshold,) = [ln for ln in ax.get_lines() if ln.get_label() == "threshold"]
    assert threshold.get_zorder() > max(ln.get_zorder() for ln in ax.get_lines()
                                        if ln is not threshold)


def test_2d_histogram_zooms_on_the_occupied_bins_and_counts_the_edge_bins():
    import numpy as np

    eg, ep = np.linspace(-1, 1, 41), np.linspace(-2, 2, 51)
    counts = np.zeros((40, 50), dtype=np.int64)
    counts[15:25, 15:35] = 3  # θ within about ±0.8, g within about ±0.25
    counts[0, 20] = 7  # clamped: beyond the gradient range
    output = {0: {"GradHist2d": {"counts": counts, "edges_grad": eg, "edges_param": ep}}}
    fig = plot_cockpit(output)
    main = next(a for a in fig.axes if a.get_xlabel() == "parameter value θ_j")
    assert main.get_xlim() == (ep[14], ep[36])
    assert main.get_ylim() == (eg[0], eg[26])
    assert any("≤7 pairs" in t.get_text() and "edge bins" in t.get_text() for t in main.texts)
