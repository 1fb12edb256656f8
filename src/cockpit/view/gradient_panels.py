"""The gradient column of the cockpit view: the gradient tests with their geometry, the
gradient noise scale, and the histograms of individual gradient elements (1-D, and 2-D
against the parameters). Registered for their panels' keys
(:func:`cockpit.view.instruments.draws`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec
from matplotlib.patches import Circle, Patch
from matplotlib.ticker import MaxNLocator

from cockpit.engine.histograms.exact import symmetric_fast_spec
from cockpit.view import _style as S
from cockpit.view._data import Output, finite_part, is_tracked, scalar_series, structured_at
from cockpit.view._hist import Histogram, ever_counted, histogram_at, last_recorded_step
from cockpit.view.instruments import draws
from cockpit.view.panel_parts import (
    _LOG_BASELINE,
    Notes,
    _auto_log,
    _corner_note,
    _missing_message,
    _new_axes,
    _no_data,
    _time_axis,
    _wrap,
    legend_above,
    note_for,
    plot_series,
)

__all__ = ["EMA_WEIGHT", "draw_grad_hist_1d", "draw_grad_hist_2d", "draw_gradient_noise_scale",
           "draw_gradient_tests", "ema", "hist_range_notes", "share_text"]


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


def _no_histogram_text(output: Output, name: str, step: int | None,
                       notes: Notes | None) -> str:
    """What the histogram panel says where it has no histogram to draw."""
    recorded = last_recorded_step(output, name)
    reason = note_for(notes, [name])
    if recorded is None:
        return _wrap(f"not computed: {reason}") if reason else "no histogram yet"
    if step is not None:
        return (f"no histogram recorded at step {step}" if histogram_at(output, name, step)
                is None else f"no finite gradient element recorded at step {step}")
    if ever_counted(output, name):  # finite elements, but never all of them
        return f"no step with finite gradients (last recorded step {recorded})"
    return f"no finite gradient element recorded (last recorded step {recorded})"


@draws("GradHist1d")
def draw_grad_hist_1d(fig: Figure, spec: SubplotSpec, output: Output, *,
                      hist_range: tuple[float, float] | str | None = "auto",
                      step: int | None = None, name: str = "GradHist1d",
                      title: str | None = None, compact: bool = False,
                      notes: Notes | None = None, **_: Any) -> Axes:
    """Histogram of the |B|×D individual gradient elements (eq. 15), log count axis, at
    ``step`` (default: the last step whose gradient elements were all finite, so a run
    whose gradients became NaN, in part or all, shows its last finite step and says so).

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
        _no_data(ax, _no_histogram_text(output, name, step, notes))
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
    if step is None and recorded is not None and recorded > hist.step:
        _corner_note(ax, f"step {hist.step} is the last with finite gradients:\nsteps "
                     f"{hist.step + 1}–{recorded} have non-finite elements (not counted)",
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
