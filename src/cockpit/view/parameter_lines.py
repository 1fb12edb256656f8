"""One line per parameter tensor: the drawing shared by the per-tensor panels (the parameter
norms in the gray row, the update-to-weight ratios in the step-size column), first layer
dark to last layer light, with the bold line of all parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec

from cockpit.view import _style as S
from cockpit.view._data import Output, finite_part, per_param_names, scalar_series
from cockpit.view.layers import model_order
from cockpit.view.panel_parts import (
    Notes,
    _corner_note,
    _missing_message,
    _new_axes,
    _no_data,
    _time_axis,
    plot_series,
)

__all__ = ["parameter_lines"]


def parameter_lines(ax: Axes, output: Output, name: str,
                    meta: Mapping[str, Any] | None = None) -> list[str]:
    """One thin line per parameter tensor ``p`` of the values ``"<name>/p"`` (positive,
    finite ones: the axis is logarithmic), first layer dark to last layer light, each
    line's gid ``"<name>/p"``; returns the parameters drawn, model order."""
    params = per_param_names(output, name)
    rank = {p: i for i, p in enumerate(model_order(meta))}
    params.sort(key=lambda p: rank.get(p, len(rank)))
    cmap = matplotlib.colormaps["viridis"]
    drawn = []
    for i, param in enumerate(params):
        steps, vals = finite_part(*scalar_series(output, f"{name}/{param}"))
        keep = vals > 0
        if not keep.any():
            continue
        ax.plot(steps[keep], vals[keep], color=cmap(0.9 * i / max(len(params) - 1, 1)),
                linewidth=0.8, alpha=0.75, gid=f"{name}/{param}")
        drawn.append(param)
    return drawn


def _name_top_line(ax: Axes, output: Output, name: str, params: list[str]) -> None:
    """The parameter with the largest value at its last step, named at that point."""
    last = {}
    for param in params:
        steps, vals = finite_part(*scalar_series(output, f"{name}/{param}"))
        if steps.size and vals[-1] > 0:
            last[param] = (int(steps[-1]), float(vals[-1]))
    if len(last) > 1:
        top = max(last, key=lambda p: last[p][1])
        ax.annotate(top, last[top], xytext=(-3, 3), textcoords="offset points", ha="right",
                    va="bottom", fontsize=S.FONT_SIZES["small"] - 1, color=S.GRAY)


def _per_parameter_panel(fig: Figure, spec: SubplotSpec, output: Output, key: str,
                         name: str, *, xlim: tuple[float, float] | None,
                         notes: Notes | None, meta: Mapping[str, Any] | None) -> Axes:
    ax = _new_axes(fig, spec, key, gray=S.panels()[key][0].column == "gray")
    params = parameter_lines(ax, output, name, meta)
    total = plot_series(ax, output, name, label="all parameters")
    if not params and not (total > 0).any():
        _no_data(ax, _missing_message(output, [name], notes))
        _time_axis(ax, xlim)
        return ax
    ax.set_yscale("log")
    _time_axis(ax, xlim)
    _name_top_line(ax, output, name, params)
    if params:
        cmap = matplotlib.colormaps["viridis"]
        ax.plot([], [], color=cmap(0.0), linewidth=0.8,
                label=f"{len(params)} tensors: first layer dark, last light")
    recorded = per_param_names(output, name)
    if len(recorded) > len(params):
        _corner_note(ax, f"{len(recorded) - len(params)} tensors without a positive value "
                     "(not on the log axis)", loc="lower right")
    return ax
