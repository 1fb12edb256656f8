"""What the cockpit view's panels are drawn with: a titled axes (:func:`_new_axes`), the
note of a panel without values (:func:`note_for`, :func:`_missing_message`), a scalar
instrument over steps with its non-finite values marked (:func:`plot_series`,
:func:`_series_panel`), a log axis where the values span decades, and the legend above the
axes (:func:`legend_above`). The panels themselves are in the column modules
(:mod:`cockpit.view.step_size_panels`, ``gradient_panels``, ``curvature_panels``,
``gray_panels``), registered with :func:`cockpit.view.instruments.draws`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec
from matplotlib.transforms import blended_transform_factory

from cockpit.view import _style as S
from cockpit.view._data import Output, finite_part, is_tracked, scalar_series, spans_decades

Notes = Mapping[int, Mapping[str, str]]  # step -> instrument -> why it has no value
_LOG_BASELINE = 0.5  # histogram baseline on log count axes (which start at 0.8)


def _new_axes(fig: Figure, spec: SubplotSpec, key: str, *, gray: bool = False) -> Axes:
    ax = fig.add_subplot(spec)
    ax.set_title(S.PANEL_TITLES[key], fontsize=S.FONT_SIZES["title"], loc="left")
    ax.tick_params(labelsize=S.FONT_SIZES["small"])
    ax.grid(True, alpha=0.3, linewidth=0.6)
    if gray:
        ax.set_facecolor(S.LIGHT_GRAY_FACE)
    return ax


def _no_data(ax: Axes, message: str = "tracked, but not computed yet") -> None:
    ax.text(0.5, 0.5, _wrap(message), transform=ax.transAxes, ha="center", va="center",
            color=S.GRAY, fontsize=S.FONT_SIZES["base"], style="italic")
    ax.set_xticks([])
    ax.set_yticks([])


def note_for(notes: Notes | None, names: list[str] | tuple[str, ...]) -> str | None:
    """The recorded reason why ``names`` have no value: the most frequent note of these
    instruments over the run (ties: the latest; without a leading "not computed: "), or
    None without notes."""
    if not notes:
        return None
    seen: dict[str, tuple[int, int]] = {}
    for step in sorted(notes):
        for name in names:
            reason = notes[step].get(name)
            if reason:
                count, _ = seen.get(reason, (0, step))
                seen[reason] = (count + 1, step)
    if not seen:
        return None
    reason = max(seen.items(), key=lambda kv: kv[1])[0]
    return reason.removeprefix("not computed: ")  # the panels say "not computed" themselves


def _missing_message(output: Output, names: list[str], notes: Notes | None) -> str:
    """What an instrument panel without finite values says: non-finite values, the
    recorded reason (notes), or that nothing was computed yet."""
    if any(scalar_series(output, n)[0].size for n in names):
        return "only non-finite values (red ×)"
    reason = note_for(notes, names)
    if reason:
        return "not computed: " + reason
    return "tracked, but not computed yet"


def _wrap(text: str, width: int = 48) -> str:
    return "\n".join(textwrap.wrap(text, width)) or text


def _corner_note(ax: Axes, text: str, *, loc: str = "upper right", color: str = S.GRAY,
                 y: float | None = None) -> None:
    x, ha = ((0.98, "right") if "right" in loc else (0.5, "center") if "center" in loc
             else (0.02, "left"))
    y_default, va = (0.96, "top") if "upper" in loc else (0.04, "bottom")
    y = y_default if y is None else y
    ax.text(x, y, text, transform=ax.transAxes, ha=ha, va=va, color=color,
            fontsize=S.FONT_SIZES["small"],
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.75})


def plot_series(ax: Axes, output: Output, name: str, *, label: str | None = None,
                color: str | None = None, linestyle: str = "-",
                drawstyle: str = "default", bad_color: str = S.RED) -> np.ndarray:
    """Draw the finite values of scalar instrument ``name`` over steps; mark non-finite ones
    (crosses in ``bad_color`` at the top of the panel).

    Returns the finite values (for the caller's choice of a log axis).
    """
    steps, vals = scalar_series(output, name)
    fsteps, fvals = finite_part(steps, vals)
    color = color or S.COLORS.get(name, S.BLUE)
    marker = "o" if 0 < fsteps.size <= 40 and drawstyle == "default" else None
    ax.plot(fsteps, fvals, color=color, linestyle=linestyle, linewidth=1.4, marker=marker,
            markersize=2.5, label=label, drawstyle=drawstyle)
    bad = steps[~np.isfinite(vals)]
    if bad.size:
        trans = blended_transform_factory(ax.transData, ax.transAxes)
        ax.plot(bad, np.full(bad.size, 0.97), linestyle="none", marker="x", color=bad_color,
                markersize=6, markeredgewidth=1.8, transform=trans, clip_on=False)
    return fvals


def _auto_log(ax: Axes, values: list[np.ndarray]) -> None:
    vals = np.concatenate([v for v in values if v.size] or [np.zeros(0)])
    if spans_decades(vals):
        ax.set_yscale("log")


def _time_axis(ax: Axes, xlim: tuple[float, float] | None) -> None:
    ax.set_xlabel("step", fontsize=S.FONT_SIZES["small"], labelpad=1)
    if xlim is not None and xlim[1] > xlim[0]:
        ax.set_xlim(*xlim)


def _series_panel(fig: Figure, spec: SubplotSpec, output: Output, key: str,
                  names: list[str], *, labels: list[str] | None = None, gray: bool = False,
                  xlim: tuple[float, float] | None = None,
                  drawstyle: str = "default", notes: Notes | None = None) -> Axes:
    ax = _new_axes(fig, spec, key, gray=gray)
    names = [n for n in names if is_tracked(output, n)]
    labels = labels or names
    drawn = [plot_series(ax, output, n, label=lab, drawstyle=drawstyle)
             for n, lab in zip(names, labels, strict=False)]
    if not any(v.size for v in drawn):
        _no_data(ax, _missing_message(output, names, notes))
        _time_axis(ax, xlim)
        return ax
    _auto_log(ax, drawn)
    _time_axis(ax, xlim)
    if len(names) > 1:
        legend_above(ax)
    return ax


def legend_above(ax: Axes, ncol: int | None = None) -> None:
    """The legend in one row between the panel's title and its axes: never on the data."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    ax.legend(handles, labels, loc="lower left", bbox_to_anchor=(0.0, 1.0),
              ncol=ncol or len(handles), fontsize=S.FONT_SIZES["small"], frameon=False,
              borderaxespad=0.1, handlelength=1.6, columnspacing=1.0, borderpad=0.1)
    ax.set_title(ax.get_title(loc="left"), loc="left", fontsize=S.FONT_SIZES["title"],
                 pad=16)


def varies(output: Output, name: str) -> bool:
    """Whether a scalar instrument takes more than one finite value over the run."""
    vals = finite_part(*scalar_series(output, name))[1]
    return bool(vals.size) and bool(np.ptp(vals) > 1e-12 * max(abs(vals).max(), 1e-300))


def _from_zero(ax: Axes, output: Output, name: str) -> None:
    """Start a linear y axis of positive values at 0 (a constant then reads as constant)."""
    vals = finite_part(*scalar_series(output, name))[1]
    if vals.size and vals.min() > 0 and ax.get_yscale() == "linear":
        ax.set_ylim(0, vals.max() * 1.15)
