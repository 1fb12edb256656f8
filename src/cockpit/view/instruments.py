"""The cockpit view's instruments: one drawing function per panel.

Every function has the signature ``draw_x(fig, spec, output, **options) -> Axes``, is
registered for its panel's key (``@draws(key)``, the key of the instrument descriptor's
:class:`~cockpit.quantities.descriptor.Panel`; a panel without one is drawn by
:func:`series_drawer`) and draws into the ``SubplotSpec`` it is given (some panels use
several axes, e.g. the 2-D histogram with its marginals); the returned axes carries the
panel's title (:data:`~cockpit.view._style.PANEL_TITLES`). ``None`` values (not computed)
and NaNs are left out of lines; non-finite values are marked by red crosses at the top of
the panel.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec
from matplotlib.patches import Circle, Patch
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import blended_transform_factory

from cockpit.engine.histogram import symmetric_fast_spec
from cockpit.view import _style as S
from cockpit.view._data import (
    Output,
    finite_part,
    is_tracked,
    scalar_series,
    spans_decades,
    structured_at,
)
from cockpit.view._hist import Histogram, histogram_at, last_recorded_step

# ---------------------------------------------------------------------------- helpers
Notes = Mapping[int, Mapping[str, str]]  # step -> instrument -> why it has no value
Drawer = Callable[..., Axes]
_LOG_BASELINE = 0.5  # histogram baseline on log count axes (which start at 0.8)

# panel key -> its drawing function
DRAWERS: dict[str, Drawer] = {}


def draws(key: str) -> Callable[[Drawer], Drawer]:
    """Register the decorated function as the drawing of panel ``key``."""

    def register(draw: Drawer) -> Drawer:
        DRAWERS[key] = draw
        return draw

    return register


def series_drawer(key: str, names: tuple[str, ...]) -> Drawer:
    """The drawing of a panel without a function of its own: the scalar values of its
    instruments ``names`` over steps (log axis where they span decades)."""

    def draw(fig: Figure, spec: SubplotSpec, output: Output, *,
             xlim: tuple[float, float] | None = None, notes: Notes | None = None,
             **_: Any) -> Axes:
        return _series_panel(fig, spec, output, key, list(names), xlim=xlim, notes=notes,
                             gray=S.panels()[key][0].column == "gray")

    return draw


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


# ------------------------------------------------------------------- step-size column
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


def varies(output: Output, name: str) -> bool:
    """Whether a scalar instrument takes more than one finite value over the run."""
    vals = finite_part(*scalar_series(output, name))[1]
    return bool(vals.size) and bool(np.ptp(vals) > 1e-12 * max(abs(vals).max(), 1e-300))


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


# -------------------------------------------------------------------- gradient column
EMA_WEIGHT = 0.8  # the gradient tests' running average: m_t = 0.8·m_(t−1) + 0.2·x_t


def ema(values: np.ndarray, weight: float = EMA_WEIGHT) -> np.ndarray:
    """Bias-corrected exponential moving average over the tracked steps:
    m_t = w·m_(t−1) + (1 − w)·x_t, shown as m_t / (1 − w^(t+1))."""
    out = np.empty(len(values))
    m = 0.0
    for t, x in enumerate(values):
        m = weight * m + (1 - weight) * float(x)
        out[t] = m / (1 - weight ** (t + 1))
    return out


_TESTS = (("NormTest", "norm", S.THETA_NORM), ("InnerTest", "inner product",
          S.THETA_INNER), ("OrthoTest", "orthogonality", S.NU_ORTHO))


def _draw_test_geometry(ax: Axes, last: dict[str, float], step: int) -> None:
    """Figure 9b: the mini-batch gradient must lie in a ball (norm test) and bands
    parallel (inner product test) and orthogonal (orthogonality test) to the mean
    gradient, drawn normalized to ‖g‖ = 1 along the x axis."""
    r_norm, r_inner, r_ortho = (last.get(n) for n, _, _ in _TESTS)
    if r_ortho is not None:
        ax.axhspan(-r_ortho, r_ortho, color=S.COLORS["OrthoTest"], alpha=0.18, lw=0)
    if r_inner is not None:
        ax.axvspan(1 - r_inner, 1 + r_inner, color=S.COLORS["InnerTest"], alpha=0.22, lw=0)
    if r_norm is not None:
        ax.add_patch(Circle((1, 0), r_norm, facecolor=S.COLORS["NormTest"], alpha=0.25,
                            edgecolor=S.COLORS["NormTest"], linewidth=1.4))
    ax.annotate("", xy=(1, 0), xytext=(0, 0),
                arrowprops={"arrowstyle": "-|>", "color": "black", "lw": 1.4})
    ax.plot([1], [0], "ko", markersize=3)
    half_x = max(r_norm or 0, r_inner or 0, 1.0) * 1.15
    half_y = max(r_norm or 0, r_ortho or 0, 1.0) * 1.15
    half = max(half_x, half_y)
    ax.set_xlim(1 - half, 1 + half)
    ax.set_ylim(-half, half)
    ax.set_aspect("equal", adjustable="box")
    ax.set_xticks([0, 1])
    ax.set_xticklabels(["0", "g_B/‖g_B‖"], fontsize=S.FONT_SIZES["small"])
    ax.tick_params(labelsize=S.FONT_SIZES["small"])
    ax.set_title(f"{S.SUB_TITLES['TestGeometry']}, step {step}",
                 fontsize=S.FONT_SIZES["small"] + 0.5, loc="left")
    ax.set_anchor("N")  # at the top of its cell, level with the series' axes
    shapes = [(n, lab, c) for n, lab, c in (
        ("NormTest", "ball: norm test", S.COLORS["NormTest"]),
        ("InnerTest", "band ∥ g: inner product test", S.COLORS["InnerTest"]),
        ("OrthoTest", "band ⊥ g: orthogonality test", S.COLORS["OrthoTest"])) if n in last]
    ax.legend(handles=[Patch(facecolor=c, alpha=0.3, label=lab) for _, lab, c in shapes],
              loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False,
              fontsize=S.FONT_SIZES["small"] - 0.5, handlelength=1.2, borderaxespad=0)


@draws("GradientTests")
def draw_gradient_tests(fig: Figure, spec: SubplotSpec, output: Output, *,
                        xlim: tuple[float, float] | None = None, notes: Notes | None = None,
                        **_: Any) -> Axes:
    """Gradient tests gauge (paper Fig. 9b; eqs. 19c, 22c, 25b): the test geometry at
    the last step (left, titled) and the three standardized widths over steps (right), with
    the thresholds θ_norm = θ_inner = 0.9 and ν_ortho = tan 80° ≈ 5.84 of Bollapragada et
    al. Values above a threshold mean the mini-batch gradient is too noisy for that test.
    The norm test is drawn on top (the others slightly transparent), so it stays visible
    where the lines are close; the legend sits above the axes, off the data."""
    tracked = [(n, lab, thr) for n, lab, thr in _TESTS if is_tracked(output, n)]
    if not any(finite_part(*scalar_series(output, n))[0].size for n, _, _ in tracked):
        # nothing to draw a geometry of: the panel's whole width says why
        ax = _new_axes(fig, spec, "GradientTests")
        for name, label, _ in tracked:
            plot_series(ax, output, name, label=label)  # red crosses of non-finite values
        _no_data(ax, _missing_message(output, [n for n, _, _ in tracked], notes))
        return ax
    sub = spec.subgridspec(1, 2, width_ratios=[1.0, 2.1], wspace=0.12)
    geo = fig.add_subplot(sub[0, 0])
    ax = _new_axes(fig, sub[0, 1], "GradientTests")
    drawn, last, last_step = [], {}, None
    for name, label, _ in tracked:
        first = len(ax.get_lines())
        vals = plot_series(ax, output, name)
        line = ax.get_lines()[first]  # the finite values (red crosses come after)
        line.set_alpha(0.3)  # each step, thin; the running average bold
        line.set_linewidth(0.8)
        line.set_marker("")
        fsteps, fvals = finite_part(*scalar_series(output, name))
        if fvals.size:
            ax.plot(fsteps, ema(fvals), color=line.get_color(), linewidth=1.7,
                    zorder=3.5 if name == "NormTest" else 3, label=label)
        drawn.append(vals)
        steps, allv = finite_part(*scalar_series(output, name))
        if steps.size:
            last[name] = float(allv[-1])
            last_step = int(steps[-1]) if last_step is None else max(last_step, int(steps[-1]))
    _auto_log(ax, drawn)
    _time_axis(ax, xlim)
    lo, hi = ax.get_ylim()
    shown = set()
    for _, _, thr in tracked:
        if lo <= thr <= hi and thr not in shown:
            shown.add(thr)
            ax.axhline(thr, color="black", linestyle=":", linewidth=1.3, zorder=5,
                       alpha=0.8, label="threshold" if len(shown) == 1 else "_nolegend_")
    ax.set_ylim(lo, hi)
    legend_above(ax)
    ax.set_ylabel("standardized width", fontsize=S.FONT_SIZES["small"])
    ax.set_xlabel(f"step   (bold: running average, EMA {EMA_WEIGHT:g}; thin: each step)",
                  fontsize=S.FONT_SIZES["small"], labelpad=1)
    _draw_test_geometry(geo, last, last_step if last_step is not None else 0)
    return ax


def share_text(part: float, total: float) -> str:
    """A share as a percentage that is not rounded to 0 (or 100) when it is not."""
    share = part / total if total else 0.0
    if 0 < share < 1e-4:
        return "<0.01%"
    if 0.9999 < share < 1:
        return ">99.99%"
    return f"{share:.2%}"


def hist_range_notes(hist: Histogram, lo: float, hi: float) -> list[str]:
    """What the whole-network histogram says about elements outside its x range [lo, hi].

    With the recorded range shown, elements beyond it were clamped into the two edge bins,
    so their number is *at most* the edge bins' counts (exactly 0 if those are empty). A
    narrower view hides the bins wholly outside it, counted exactly."""
    notes = []
    e0, e1 = float(hist.edges[0]), float(hist.edges[-1])
    reach = f"±{e1:g}" if e0 == -e1 else f"[{e0:g}, {e1:g}]"
    edge = hist.edge_bins()
    if hist.inner is not None and lo <= e0 and hi >= e1:
        notes.append(f"{edge:,} elements ({share_text(edge, hist.total)}) beyond "
                     f"±{hist.inner:.3g}, in the edge bins")
    elif lo <= e0 and hi >= e1:
        notes.append(f"≤{edge:,} elements ({edge / hist.total:.2%}) beyond {reach}, "
                     "in the edge bins" if edge else f"no element beyond {reach}")
    else:
        hidden = hist.outside(lo, hi)
        notes.append(f"{hidden:,} elements ({hidden / hist.total:.2%}) outside the view"
                     if hidden else "no element outside the view")
        if edge:
            notes.append(f"(≤{edge:,} of them beyond {reach}: edge bins)")
    return notes


def _draw_zoom(ax: Axes, hist: Histogram, lo: float, hi: float) -> Axes | None:
    """Inset on the data's own range (the span of the non-empty bins, one bin either side)
    when that span is under 40 % of the shown range; it says when the data fill so few
    bins that their shape is below the recorded resolution."""
    occ_lo, occ_hi, n_bins = hist.occupied()
    if n_bins == 0 or (occ_hi - occ_lo) >= 0.4 * (hi - lo):
        return None
    w = hist.bin_width
    inset = ax.inset_axes((0.60, 0.30, 0.38, 0.50))
    inset.stairs(hist.counts, hist.edges, fill=True, baseline=_LOG_BASELINE,
                 color=S.COLORS["GradHist1d"], alpha=0.85, linewidth=0)
    inset.set_yscale("log")
    inset.set_ylim(0.8, hist.counts.max() * 2.5)
    inset.set_xlim(max(occ_lo - w, hist.edges[0]), min(occ_hi + w, hist.edges[-1]))
    inset.tick_params(labelsize=S.FONT_SIZES["small"] - 1)
    inset.xaxis.set_major_locator(MaxNLocator(4))  # labels that do not run together
    inset.set_title(f"{S.SUB_TITLES['HistZoom']}: [{occ_lo:.3g}, {occ_hi:.3g})",
                    fontsize=S.FONT_SIZES["small"], loc="left", pad=2)
    if n_bins <= 3:
        reach = symmetric_fast_spec(max(abs(occ_lo), abs(occ_hi), 1e-30)).hi
        inset.set_xlabel(f"all in {n_bins} bin{'s' * (n_bins > 1)} of width {w:.3g}: finer "
                         f"shape not recorded;\nfor it: Cockpit(..., hist_bins=cockpit."
                         f"BinSpec({-reach!r}, {reach!r}, 100))",
                         fontsize=S.FONT_SIZES["small"] - 1.5, labelpad=1, color=S.GRAY)
    marked = ax.indicate_inset((occ_lo, 0.8, occ_hi - occ_lo, float(hist.counts.max())),
                               inset, edgecolor=S.GRAY, alpha=0.6)
    for line in getattr(marked, "connectors", None) or marked[1]:
        line.set_visible(False)  # they crossed the inset's labels; the box says enough
    return inset


@draws("GradHist1d")
def draw_grad_hist_1d(fig: Figure, spec: SubplotSpec, output: Output, *,
                      hist_range: tuple[float, float] | str | None = "auto",
                      step: int | None = None, name: str = "GradHist1d",
                      title: str | None = None, compact: bool = False,
                      notes: Notes | None = None, **_: Any) -> Axes:
    """Histogram of the |B|×D individual gradient elements (eq. 15), log count axis, at
    ``step`` (default: the last step with any finite element, so a run whose gradients
    became NaN shows its last finite step and says so).

    ``hist_range`` is the x range: ``"auto"`` (default) the recorded edges where Cockpit set
    the range from the data, else the paper's deliberate [−2, 2], so badly scaled data stand
    out; None: the recorded edges; or (lo, hi). The panel says how many elements lie
    beyond that range (:func:`hist_range_notes`) and zooms on the data's own range in an
    inset when the data occupy a small part of it (:func:`_draw_zoom`)."""
    ax = fig.add_subplot(spec)
    ax.set_title(title or S.PANEL_TITLES["GradHist1d"],
                 fontsize=S.FONT_SIZES["small" if compact else "title"], loc="left")
    ax.tick_params(labelsize=S.FONT_SIZES["small"])
    hist = histogram_at(output, name, step)
    if hist is None or hist.total == 0:
        recorded = last_recorded_step(output, name)
        reason = note_for(notes, [name])
        _no_data(ax, _wrap(f"not computed: {reason}") if recorded is None and reason else
                 "no histogram yet" if recorded is None else
                 f"no finite gradient element recorded (last recorded step {recorded})")
        return ax
    # One step artist (not one bar per bin): empty bins fall to the baseline below the axis.
    ax.stairs(hist.counts, hist.edges, fill=True, baseline=_LOG_BASELINE,
              color=S.COLORS["GradHist1d"], alpha=0.85, linewidth=0)
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.8, top=hist.counts.max() * 60)  # headroom for the notes
    lo, hi = float(hist.edges[0]), float(hist.edges[-1])
    if hist_range == "auto":
        hist_range = None if hist.inner is not None else S.GRAD_HIST_RANGE
    if hist_range is not None:
        lo, hi = hist_range
    ax.set_xlim(lo, hi)
    ax.grid(True, axis="y", alpha=0.3, linewidth=0.6)
    if not compact:
        ax.set_xlabel("gradient element value", fontsize=S.FONT_SIZES["small"], labelpad=1)
        ax.set_ylabel("count", fontsize=S.FONT_SIZES["small"])
    recorded = last_recorded_step(output, name)
    lines = [f"step {hist.step}  ·  {hist.total:,} elements", *hist_range_notes(hist, lo, hi)]
    _corner_note(ax, "\n".join(lines), loc="upper left")
    if recorded is not None and recorded > hist.step:
        _corner_note(ax, f"step {hist.step} is the last with finite gradients:\nthe "
                     f"histograms of steps {hist.step + 1}–{recorded} hold no finite element",
                     loc="upper left", color=S.RED, y=0.80)
    if not compact:
        _draw_zoom(ax, hist, lo, hi)
    return ax


@draws("GradHist2d")
def draw_grad_hist_2d(fig: Figure, spec: SubplotSpec, output: Output, *,
                      step: int | None = None, notes: Notes | None = None, **_: Any) -> Axes:
    """2-D histogram of (θ_j, g_n,j) pairs (eq. 16) with both marginals, log colors."""
    sub = spec.subgridspec(2, 2, width_ratios=[4, 1], height_ratios=[1.4, 3],
                           wspace=0.04, hspace=0.06)
    top = fig.add_subplot(sub[0, 0])
    top.set_title(S.PANEL_TITLES["GradHist2d"], fontsize=S.FONT_SIZES["title"], loc="left")
    fields = ("counts", "edges_grad", "edges_param")
    found = structured_at(output, "GradHist2d", fields, step)
    if found is None:
        reason = note_for(notes, ["GradHist2d"])
        _no_data(top, _wrap(f"not computed: {reason}") if reason else "no histogram yet")
        return top
    at, hist = found
    counts = np.asarray(hist["counts"], dtype=np.float64)
    eg = np.asarray(hist["edges_grad"], dtype=np.float64).ravel()
    ep = np.asarray(hist["edges_param"], dtype=np.float64).ravel()
    if counts.shape != (eg.size - 1, ep.size - 1) or counts.sum() <= 0:
        _no_data(top, "empty histogram")
        return top
    main = fig.add_subplot(sub[1, 0], sharex=top)
    right = fig.add_subplot(sub[1, 1], sharey=main)
    masked = np.ma.masked_less_equal(counts, 0)
    main.pcolormesh(ep, eg, masked, norm=LogNorm(vmin=1, vmax=counts.max()), cmap="Blues",
                    shading="flat")
    main.set_xlabel("parameter value θ_j", fontsize=S.FONT_SIZES["small"], labelpad=1)
    main.set_ylabel("gradient element g_n,j", fontsize=S.FONT_SIZES["small"])
    marg_param, marg_grad = counts.sum(axis=0), counts.sum(axis=1)
    top.stairs(marg_param, ep, fill=True, baseline=_LOG_BASELINE,
               color=S.COLORS["GradHist2d"], alpha=0.8, linewidth=0)
    top.set_yscale("log")
    top.set_ylim(0.8, marg_param.max() * 2.5)
    right.stairs(marg_grad, eg, fill=True, baseline=_LOG_BASELINE, orientation="horizontal",
                 color=S.COLORS["GradHist2d"], alpha=0.8, linewidth=0)
    right.set_xscale("log")
    right.set_xlim(0.8, marg_grad.max() * 2.5)
    # zoom on the occupied bins (one bin of margin): the recorded range may be far wider
    # than the data (θ within ±0.8 on the default ±2)
    cols, rows = np.flatnonzero(marg_param > 0), np.flatnonzero(marg_grad > 0)
    main.set_xlim(ep[max(cols[0] - 1, 0)], ep[min(cols[-1] + 2, ep.size - 1)])
    main.set_ylim(eg[max(rows[0] - 1, 0)], eg[min(rows[-1] + 2, eg.size - 1)])
    edge = int(counts[0].sum() + counts[-1].sum() + counts[1:-1, 0].sum()
               + counts[1:-1, -1].sum())
    if edge:  # values beyond the range were clamped into the edge bins: say how many
        _corner_note(main, f"≤{edge:,} pairs ({share_text(edge, counts.sum())}) beyond "
                     f"the range, in the edge bins", loc="lower left")
    for a in (top, main, right):
        a.tick_params(labelsize=S.FONT_SIZES["small"])
    top.tick_params(labelbottom=False)
    right.tick_params(labelleft=False)
    top.set_ylabel("count", fontsize=S.FONT_SIZES["small"])
    right.set_xlabel("count", fontsize=S.FONT_SIZES["small"], labelpad=1)
    _corner_note(main, f"step {at}")
    return top


# ------------------------------------------------------------------------ gray panels
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


def _from_zero(ax: Axes, output: Output, name: str) -> None:
    """Start a linear y axis of positive values at 0 (a constant then reads as constant)."""
    vals = finite_part(*scalar_series(output, name))[1]
    if vals.size and vals.min() > 0 and ax.get_yscale() == "linear":
        ax.set_ylim(0, vals.max() * 1.15)
