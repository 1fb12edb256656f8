"""Panels of instruments over steps with several lines each: the gradient noise scale with
its moving average and one line per parameter tensor (ParamNorm, UpdateRatio). Registered
for their panels' keys like :mod:`cockpit.view.instruments`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec

from cockpit.quantities.update_ratio import RULE_OF_THUMB
from cockpit.view import _style as S
from cockpit.view._data import Output, finite_part, is_tracked, per_param_names, scalar_series
from cockpit.view.instruments import (
    Notes,
    _corner_note,
    _missing_message,
    _new_axes,
    _no_data,
    _time_axis,
    draws,
    legend_above,
    plot_series,
)
from cockpit.view.layers import model_order

__all__ = ["draw_gradient_noise_scale", "draw_param_norm", "draw_update_ratio",
           "parameter_lines"]


@draws("GradientNoiseScale")
def draw_gradient_noise_scale(fig: Figure, spec: SubplotSpec, output: Output, *,
                              xlim: tuple[float, float] | None = None,
                              notes: Notes | None = None, **_: Any) -> Axes:
    """B_simple = tr(Σ)/‖G‖² of each step (thin) and the ratio of its moving averages
    (bold) on a log axis, beside the batch size: a batch well below B_simple is noise
    dominated, one far above it wastes samples (McCandlish et al. 2018). Steps whose
    estimate of ‖G‖² was ≤ 0 (no finite noise scale: NaN, also at non-finite gradients,
    which the gradient norm's panel marks red) are gray crosses at the top."""
    ax = _new_axes(fig, spec, "GradientNoiseScale")
    names = ["GradientNoiseScale", "GradientNoiseScaleEMA"]
    if not any(finite_part(*scalar_series(output, n))[0].size for n in names):
        _no_data(ax, _missing_message(output, names, notes))
        _time_axis(ax, xlim)
        return ax
    first = len(ax.get_lines())
    raw = plot_series(ax, output, "GradientNoiseScale", label="B_simple, each step",
                      bad_color=S.GRAY)
    line = ax.get_lines()[first]
    line.set_alpha(0.35)
    line.set_linewidth(0.8)
    line.set_marker("")
    smooth = plot_series(ax, output, "GradientNoiseScaleEMA", label="ratio of moving averages",
                         bad_color=S.GRAY)
    drawn = [raw[raw > 0], smooth[smooth > 0]]
    if is_tracked(output, "BatchSize"):
        size = plot_series(ax, output, "BatchSize", label="batch size |B|", linestyle="--",
                           drawstyle="steps-post")
        drawn.append(size[size > 0])
    if any(v.size for v in drawn):
        ax.set_yscale("log")
    _time_axis(ax, xlim)
    ax.set_ylabel("samples", fontsize=S.FONT_SIZES["small"])
    vals = scalar_series(output, "GradientNoiseScale")[1]
    nan, nonpositive = int(np.sum(~np.isfinite(vals))), int(np.sum(vals <= 0))
    said = [f"× {_steps(nan)} without a finite B_simple\n(‖G‖² estimate ≤ 0: noise hides the "
            "signal; or non-finite gradients)" if nan else "",
            f"{_steps(nonpositive)} ≤ 0, off the log axis" if nonpositive else ""]
    if nan or nonpositive:
        _corner_note(ax, "\n".join(s for s in said if s), loc="upper right", y=0.9)
    legend_above(ax)
    return ax


def _steps(n: int) -> str:
    return f"{n} step{'s' * (n != 1)}"


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


@draws("ParamNorm")
def draw_param_norm(fig: Figure, spec: SubplotSpec, output: Output, *,
                    xlim: tuple[float, float] | None = None, notes: Notes | None = None,
                    meta: Mapping[str, Any] | None = None, **_: Any) -> Axes:
    """‖θ_t‖ of each parameter tensor (thin) and of all parameters (bold), log axis."""
    ax = _per_parameter_panel(fig, spec, output, "ParamNorm", "ParamNorm", xlim=xlim,
                              notes=notes, meta=meta)
    legend_above(ax)
    return ax


@draws("UpdateRatio")
def draw_update_ratio(fig: Figure, spec: SubplotSpec, output: Output, *,
                      xlim: tuple[float, float] | None = None, notes: Notes | None = None,
                      meta: Mapping[str, Any] | None = None, **_: Any) -> Axes:
    """‖θ_t+1 − θ_t‖ / ‖θ_t‖ of each parameter tensor (thin) and of all (bold), log axis,
    with the rule of thumb 1e-3 of a healthy layer (dotted); the tensor with the largest
    ratio at its last step is named."""
    ax = _per_parameter_panel(fig, spec, output, "UpdateRatio", "UpdateRatio", xlim=xlim,
                              notes=notes, meta=meta)
    if ax.get_yscale() == "log":
        ax.axhline(RULE_OF_THUMB, color="black", linestyle=":", linewidth=1.2, alpha=0.8,
                   label=f"rule of thumb {RULE_OF_THUMB:g}")
    legend_above(ax)
    return ax
