"""The step-size column of the cockpit view: the α-gauge, the distance from the start with
the update size, the gradient norm (with a changing learning rate) and the update-to-weight
ratios per parameter tensor. Registered for their panels' keys
(:func:`cockpit.view.instruments.draws`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec

from cockpit.quantities.update_ratio import RULE_OF_THUMB
from cockpit.view import _style as S
from cockpit.view._data import Output, finite_part, is_tracked, scalar_series
from cockpit.view.instruments import draws
from cockpit.view.panel_parts import (
    Notes,
    _auto_log,
    _corner_note,
    _from_zero,
    _missing_message,
    _new_axes,
    _no_data,
    _series_panel,
    _time_axis,
    legend_above,
    note_for,
    plot_series,
    varies,
)
from cockpit.view.parameter_lines import _per_parameter_panel

__all__ = ["draw_alpha", "draw_distances", "draw_grad_norm", "draw_update_ratio"]


def _last_fraction(steps: np.ndarray, fraction: float = 0.1) -> np.ndarray:
    """Mask of the steps in the last ``fraction`` of the run's step range (at least one)."""
    if steps.size == 0:
        return np.zeros(0, dtype=bool)
    first, last = steps.min(), steps.max()
    mask = steps >= last - fraction * (last - first)
    return mask


def _kde(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Gaussian kernel density estimate on ``grid`` (Silverman's bandwidth, ≥ 0.05)."""
    if x.size == 0:
        return np.zeros_like(grid)
    std = float(np.std(x)) if x.size > 1 else 0.0
    bw = max(0.9 * std * x.size ** (-0.2), 0.05) if std > 0 else 0.12
    z = (grid[:, None] - x[None, :]) / bw
    return np.exp(-0.5 * z**2).sum(axis=1) / (x.size * bw * np.sqrt(2 * np.pi))


@draws("Alpha")
def draw_alpha(fig: Figure, spec: SubplotSpec, output: Output, *,
               notes: Notes | None = None, **_: Any) -> Axes:
    """α-gauge (paper Sec. 2.1, eq. 10): distribution of α over the run and its last 10 %.

    α = −1: the step ended where it started on the local parabola (no progress),
    α = 0: it landed in the minimum, α = 1: it jumped to the opposite wall.
    Values outside [−1.5, 1.5] are clipped into the outermost bins.
    """
    ax = _new_axes(fig, spec, "Alpha")
    steps, vals = finite_part(*scalar_series(output, "Alpha"))
    if vals.size == 0:
        reason = note_for(notes, ["Alpha"])
        _no_data(ax, f"α not computed: {reason}" if reason else
                 "α not computed yet (needs the step after a tracked step)")
        return ax
    r = S.ALPHA_RANGE
    bins = np.linspace(-r, r, 25)
    clipped = np.clip(vals, -r, r)
    mask = _last_fraction(steps)
    recent = clipped[mask]
    recent_mean = float(np.mean(vals[mask]))  # means of unclipped α
    h_all, _ = np.histogram(clipped, bins=bins, density=True)
    grid = np.linspace(-r, r, 301)
    k_all, k_rec = _kde(clipped, grid), _kde(recent, grid)
    top = max(h_all.max(), k_all.max(), k_rec.max()) * 1.4
    # The local parabola along the step: start (−1) and opposite point (1) at equal height.
    ax.plot(grid, 0.55 * top * (grid / r) ** 2 + 0.02 * top, color=S.GRAY, linewidth=1,
            linestyle=":", zorder=1)
    ax.stairs(h_all, bins, fill=True, color=S.COLORS["Alpha"], alpha=0.2, zorder=2)
    # the median beside the mean: a few steps far outside (clipped into the edge bins)
    # can move the mean away from where the curves peak
    ax.plot(grid, k_all, color=S.COLORS["Alpha"], linewidth=1.8, zorder=3,
            label=f"all steps (n={vals.size}, median {np.median(vals):+.2f}, "
                  f"mean {vals.mean():+.2f})")
    ax.fill_between(grid, k_rec, color=S.COLORS["AlphaRecent"], alpha=0.15, zorder=3, lw=0)
    ax.plot(grid, k_rec, color=S.COLORS["AlphaRecent"], linewidth=1.8, zorder=4,
            label=f"last 10 % (n={recent.size}, median {np.median(vals[mask]):+.2f}, "
                  f"mean {recent_mean:+.2f})")
    for mark in (-1, 0, 1):
        ax.axvline(mark, color="black", linewidth=0.8, linestyle="--", alpha=0.6, zorder=1)
    ax.set_xlim(-r, r)
    ax.set_ylim(0, top)
    ax.set_xticks([-1.5, -1, -0.5, 0, 0.5, 1, 1.5])
    ax.tick_params(labelsize=S.FONT_SIZES["small"])
    ax.set_ylabel("density", fontsize=S.FONT_SIZES["small"])
    ax.set_xlabel("α  (−1: back at start · 0: at minimum · 1: opposite wall)",
                  fontsize=S.FONT_SIZES["small"], labelpad=1)
    ax.text(0.02, 0.96, "◀ undershoot", transform=ax.transAxes, ha="left", va="top",
            fontsize=S.FONT_SIZES["base"], color=S.GRAY)
    ax.text(0.98, 0.96, "overshoot ▶", transform=ax.transAxes, ha="right", va="top",
            fontsize=S.FONT_SIZES["base"], color=S.GRAY)
    legend_above(ax)
    outside = int(np.sum(np.abs(vals) > r))
    if outside:  # at the top, clear of the edge bins' bars
        _corner_note(ax, f"{outside} beyond ±{r:g} (in the edge bins)", loc="upper center",
                     y=0.84)
    return ax


@draws("Distances")
def draw_distances(fig: Figure, spec: SubplotSpec, output: Output, *,
                   xlim: tuple[float, float] | None = None, notes: Notes | None = None,
                   **_: Any) -> Axes:
    """Distance ‖θ_t − θ_0‖ (left axis) and update size ‖θ_t+1 − θ_t‖ (right axis)."""
    ax = _new_axes(fig, spec, "Distances")
    have_dist, have_upd = is_tracked(output, "Distance"), is_tracked(output, "UpdateSize")
    if have_dist:
        d = plot_series(ax, output, "Distance", label="distance")
        ax.set_ylabel("distance", color=S.COLORS["Distance"], fontsize=S.FONT_SIZES["small"])
        del d  # linear axes: the distance starts at 0, a log axis would only show the start
    if not any(finite_part(*scalar_series(output, n))[0].size
               for n in ("Distance", "UpdateSize")):
        _no_data(ax, _missing_message(output, ["Distance", "UpdateSize"], notes))
        return ax
    if have_upd:
        target = ax.twinx() if have_dist else ax
        u = plot_series(target, output, "UpdateSize", label="update size")
        target.set_ylabel("update size", color=S.COLORS["UpdateSize"],
                          fontsize=S.FONT_SIZES["small"])
        target.tick_params(labelsize=S.FONT_SIZES["small"])
        _auto_log(target, [u])
        if have_dist:
            ax.plot([], [], color=S.COLORS["UpdateSize"], label="update size (right axis)")
            ax.get_lines()[0].set_label("distance (left axis)")
            legend_above(ax)
    _time_axis(ax, xlim)
    return ax


@draws("GradNorm")
def draw_grad_norm(fig: Figure, spec: SubplotSpec, output: Output, *,
                   xlim: tuple[float, float] | None = None, notes: Notes | None = None,
                   **_: Any) -> Axes:
    """Mini-batch gradient norm ‖g_B‖; a learning rate that changes during the run is
    drawn as a thin gray step line on the right axis (a constant one is not drawn: a flat
    line would read like a threshold)."""
    ax = _series_panel(fig, spec, output, "GradNorm", ["GradNorm"], xlim=xlim, notes=notes)
    ax.set_ylabel("‖g_B‖", color=S.COLORS["GradNorm"], fontsize=S.FONT_SIZES["small"])
    if is_tracked(output, "LearningRate") and varies(output, "LearningRate"):
        twin = ax.twinx()
        lr = plot_series(twin, output, "LearningRate", drawstyle="steps-post",
                         label="learning rate (right axis)")
        for line in twin.get_lines():
            line.set_alpha(0.6)
            line.set_linewidth(1.0)
        _auto_log(twin, [lr])
        _from_zero(twin, output, "LearningRate")
        twin.set_ylabel("learning rate", color=S.COLORS["LearningRate"],
                        fontsize=S.FONT_SIZES["small"])
        twin.tick_params(labelsize=S.FONT_SIZES["small"])
        ax.plot([], [], color=S.COLORS["LearningRate"], alpha=0.6, linewidth=1.0,
                label="learning rate (right axis)")
        ax.get_lines()[0].set_label("‖g_B‖ (left axis)")
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
