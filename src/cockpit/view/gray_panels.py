"""The gray row of the cockpit view: what most practitioners track already (mini-batch loss,
learning rate, batch size, parameter norms per tensor). Registered for their panels' keys
(:func:`cockpit.view.instruments.draws`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec

from cockpit.view import _style as S
from cockpit.view._data import Output, finite_part, scalar_series
from cockpit.view.instruments import draws
from cockpit.view.panel_parts import (
    Notes,
    _corner_note,
    _from_zero,
    _series_panel,
    legend_above,
    varies,
)
from cockpit.view.parameter_lines import _per_parameter_panel

__all__ = ["constant_settings", "draw_batch_size", "draw_learning_rate", "draw_loss",
           "draw_param_norm"]


@draws("Loss")
def draw_loss(fig: Figure, spec: SubplotSpec, output: Output, *,
              xlim: tuple[float, float] | None = None, **_: Any) -> Axes:
    """Mini-batch loss over steps; non-finite losses are marked in red with a note. A
    learning rate or batch size that stays constant is written here (no panel of its own)."""
    ax = _series_panel(fig, spec, output, "Loss", ["Loss"], gray=True, xlim=xlim)
    constant = constant_settings(output)
    if constant:  # under the axis, where it never covers the curve
        ax.set_xlabel(f"step          {constant}", fontsize=S.FONT_SIZES["small"], labelpad=1)
    steps, vals = scalar_series(output, "Loss")
    bad = steps[~np.isfinite(vals)]
    if bad.size:
        _corner_note(ax, f"non-finite loss at step {bad[0]}"
                     + (f" and {bad.size - 1} more" if bad.size > 1 else ""),
                     loc="upper right", color=S.RED, y=0.88)
    return ax


def constant_settings(output: Output) -> str:
    """"learning rate 0.05 · batch size 64 (constant)" for the tracked ones that never
    change (empty if none)."""
    parts = []
    for name, label in (("LearningRate", "learning rate"), ("BatchSize", "batch size")):
        vals = finite_part(*scalar_series(output, name))[1]
        if vals.size and not varies(output, name):
            parts.append(f"{label} {vals[0]:g}")
    return " · ".join(parts) + " (constant)" if parts else ""


@draws("LearningRate")
def draw_learning_rate(fig: Figure, spec: SubplotSpec, output: Output, *,
                       xlim: tuple[float, float] | None = None, **_: Any) -> Axes:
    """Learning rate over steps."""
    ax = _series_panel(fig, spec, output, "LearningRate", ["LearningRate"], gray=True,
                       xlim=xlim, drawstyle="steps-post")
    _from_zero(ax, output, "LearningRate")
    return ax


@draws("BatchSize")
def draw_batch_size(fig: Figure, spec: SubplotSpec, output: Output, *,
                    xlim: tuple[float, float] | None = None, **_: Any) -> Axes:
    """Batch size over steps (the y axis starts at 0, so a constant batch reads as such)."""
    ax = _series_panel(fig, spec, output, "BatchSize", ["BatchSize"], gray=True,
                       xlim=xlim, drawstyle="steps-post")
    _from_zero(ax, output, "BatchSize")
    return ax


@draws("ParamNorm")
def draw_param_norm(fig: Figure, spec: SubplotSpec, output: Output, *,
                    xlim: tuple[float, float] | None = None, notes: Notes | None = None,
                    meta: Mapping[str, Any] | None = None, **_: Any) -> Axes:
    """‖θ_t‖ of each parameter tensor (thin) and of all parameters (bold), log axis."""
    ax = _per_parameter_panel(fig, spec, output, "ParamNorm", "ParamNorm", xlim=xlim,
                              notes=notes, meta=meta)
    legend_above(ax)
    return ax
