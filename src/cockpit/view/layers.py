"""The layer-wise view (paper §3.2, Figure 4): histograms of individual gradient elements
per parameter tensor, from the recorded ``GradHist1d/<param>`` values.

The whole-network histogram is the sum of these; a layer whose gradients vanish (e.g. the
first layers of a deep sigmoid network) disappears in the sum but stands out here, as a
narrow spike next to the wide histograms of the other layers.

* :func:`plot_layers` — a figure with one panel per parameter (``cockpit plot DIR --layers``);
* :func:`draw_layers_panel` — the compact per-layer panel of the cockpit view: one row per
  parameter, one column per bin, log counts as colors.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec

from cockpit.view import _style as S
from cockpit.view._data import Output, normalize_output, per_param_names
from cockpit.view._hist import Histogram, histogram_at, last_complete_step, last_recorded_step
from cockpit.view._source import load_run
from cockpit.view.figure_file import save_figure
from cockpit.view.panel_parts import note_for

__all__ = ["draw_layers_panel", "layer_histograms", "model_order", "plot_layer_histograms",
           "plot_layers"]

_LOG_BASELINE = 0.5
HistRange = tuple[float, float] | str | None


def model_order(meta: Mapping[str, Any] | None) -> list[str]:
    """Parameter names in the model's order, from the run metadata (``"parameters"``)."""
    params = (meta or {}).get("parameters")
    return [str(p) for p in params] if isinstance(params, Mapping | list | tuple) else []


def layer_histograms(output: Mapping, step: int | None = None,
                     order: Sequence[str] = ()) -> dict[str, Histogram]:
    """Parameter name → its recorded histogram at ``step``, default the last step at which
    every layer's histogram counted all its elements (:func:`_layer_step`), so all layers
    show one step; empty if there is no such step. Parameters in ``order`` first (the
    model's order), then the others in the order the run recorded them."""
    out = normalize_output(output)
    recorded = per_param_names(out, "GradHist1d")
    rank = {p: i for i, p in enumerate(order)}
    recorded.sort(key=lambda p: rank.get(p, len(rank)))  # stable: unknown ones keep order
    if step is None:
        step = _layer_step(out)
    found = {}
    for param in recorded if step is not None else ():
        hist = histogram_at(out, f"GradHist1d/{param}", step)
        if hist is not None:
            found[param] = hist
    return found


def _layer_step(output: Output) -> int | None:
    """The last step at which the histogram of every layer recorded there counted all of
    its elements (gradients all finite); None if there is none."""
    return last_complete_step(output, [f"GradHist1d/{p}"
                                       for p in per_param_names(output, "GradHist1d")])


def _no_layer_text(output: Output) -> str | None:
    """Why the layer views show no histogram although layers were recorded (every step has
    a non-finite gradient element in some layer); None where nothing was recorded."""
    steps = [last_recorded_step(output, f"GradHist1d/{p}")
             for p in per_param_names(output, "GradHist1d")]
    last = max((s for s in steps if s is not None), default=None)
    return None if last is None else (
        f"no step with finite gradients in every layer (last recorded step {last})")


def _shared_range(hists: Mapping[str, Histogram], hist_range: HistRange) -> tuple[float, float]:
    """x range shared by all layer panels: the recorded edges (the paper's reference,
    default), ``"data"`` (the span of all non-empty bins) or an explicit ``(lo, hi)``."""
    if isinstance(hist_range, tuple):
        return hist_range
    if hist_range == "data":
        spans = [h.occupied() for h in hists.values() if h.total > 0]
        if spans:
            return min(s[0] for s in spans), max(s[1] for s in spans)
    if hist_range not in (None, "data"):
        raise ValueError(f"hist_range must be None, 'data' or (lo, hi), got {hist_range!r}")
    return (min(float(h.edges[0]) for h in hists.values()),
            max(float(h.edges[-1]) for h in hists.values()))


def describe_layer(hist: Histogram, lo: float, hi: float) -> list[str]:
    """The notes of one layer panel: elements, spread and what lies outside the view."""
    notes = [f"{hist.total:,} elements", f"99 % within ±{hist.central():.3g}"]
    edge = hist.edge_bins()
    beyond = (f"{edge:,} beyond ±{hist.inner:.3g}" if hist.inner is not None else
              f"≤{edge:,} beyond ±{max(abs(hist.edges[0]), abs(hist.edges[-1])):g}")
    if (lo, hi) == (hist.edges[0], hist.edges[-1]):
        if edge:
            notes.append(beyond + " (edge bins)")
    else:
        hidden = hist.outside(lo, hi)
        if hidden:
            notes.append(f"{hidden:,} outside view")
    return notes


def _draw_layer(ax: Axes, param: str, hist: Histogram, lo: float, hi: float,
                top: float) -> None:
    ax.set_title(param, fontsize=S.FONT_SIZES["small"] + 0.5, loc="left")
    ax.tick_params(labelsize=S.FONT_SIZES["small"])
    ax.set_yscale("log")
    ax.set_ylim(0.8, top)
    ax.set_xlim(lo, hi)
    ax.grid(True, axis="y", alpha=0.3, linewidth=0.6)
    if hist.total == 0:
        ax.text(0.5, 0.5, f"no finite element (step {hist.step})", transform=ax.transAxes,
                ha="center", va="center", color=S.GRAY, style="italic",
                fontsize=S.FONT_SIZES["small"])
        return
    ax.stairs(hist.counts, hist.edges, fill=True, baseline=_LOG_BASELINE,
              color=S.COLORS["GradHist1d"], alpha=0.85, linewidth=0)
    ax.text(0.98, 0.96, "\n".join(describe_layer(hist, lo, hi)), transform=ax.transAxes,
            ha="right", va="top", color=S.GRAY, fontsize=S.FONT_SIZES["small"] - 0.5,
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8})


def plot_layer_histograms(output: Mapping, step: int | None = None, *,
                          fig: Figure | None = None, hist_range: HistRange = None,
                          max_cols: int = 4, order: Sequence[str] = ()) -> Figure:
    """Per-layer histograms of individual gradient elements (paper Figure 4) of an output.

    One panel per parameter ``p`` with a ``"GradHist1d/p"`` entry, log counts, all panels on
    one x range (see :func:`_shared_range`) and one count axis, so layers compare at a
    glance; each panel notes its number of elements, the half-width holding 99 % of them
    and (an upper bound of) the elements beyond the recorded range.
    """
    hists = layer_histograms(output, step, order)
    n = len(hists)
    ncols = max(1, min(max_cols, n))
    nrows = max(1, math.ceil(n / ncols))
    if fig is None:
        fig = Figure(figsize=(3.3 * ncols + 0.4, 2.3 * nrows + 0.9), dpi=100)
    else:
        fig.clear()
    fig.set_layout_engine("constrained")
    steps = sorted({h.step for h in hists.values()})
    where = (f"step {steps[0]}" if len(steps) == 1 else
             f"steps {steps[0]}–{steps[-1]}" if steps else "")
    fig.suptitle("Individual gradient elements per layer" + (f" ({where})" if where else ""),
                 fontsize=S.FONT_SIZES["title"] + 1, fontweight="bold")
    if n == 0:
        text = ((step is None and _no_layer_text(normalize_output(output)))
                or "no per-parameter GradHist1d values in this run")
        fig.text(0.5, 0.5, text, ha="center", va="center", color=S.GRAY,
                 fontsize=S.FONT_SIZES["title"])
        return fig
    lo, hi = _shared_range(hists, hist_range)
    top = max(h.counts.max() for h in hists.values()) * 40.0  # room for the notes
    grid = fig.add_gridspec(nrows, ncols)
    for k, (param, hist) in enumerate(hists.items()):
        ax = fig.add_subplot(grid[k // ncols, k % ncols])
        _draw_layer(ax, param, hist, lo, hi, max(top, 10.0))
        if k // ncols == nrows - 1 or k + ncols >= n:
            ax.set_xlabel("gradient element value", fontsize=S.FONT_SIZES["small"], labelpad=1)
    return fig


def plot_layers(source: Any, path: str | Path | None = None, *, step: int | None = None,
                hist_range: HistRange = None, max_cols: int = 4) -> Figure:
    """The layer-wise view of a run (paper Figure 4): a run directory, a JSON export, an
    output dict or a :class:`~cockpit.Cockpit`; saved to ``path`` (.png/.pdf/.svg) if given.

    Args:
        step: the step to show (default: the last step at which every layer's gradient
            elements were finite).
        hist_range: shared x range; default the recorded edges (the paper's [−2, 2]),
            ``"data"`` zooms to the span of all non-empty bins, or ``(lo, hi)``.
    """
    output, meta = load_run(source)
    fig = plot_layer_histograms(output, step, hist_range=hist_range, max_cols=max_cols,
                                order=model_order(meta))
    if path is not None:
        save_figure(fig, path)
    return fig


def draw_layers_panel(fig: Figure, spec: SubplotSpec, output: Output, *,
                      step: int | None = None, meta: Mapping[str, Any] | None = None,
                      notes: Mapping[int, Mapping[str, str]] | None = None,
                      **_: Any) -> Axes:
    """Compact per-layer panel: rows are parameters, columns the recorded bins, colors the
    log counts (white: empty bin); all rows at the last step at which every layer's
    gradient elements were finite. A vanishing layer is a row with all its counts in the
    central bins."""
    ax = fig.add_subplot(spec)
    ax.set_title(S.PANEL_TITLES["Layers"], fontsize=S.FONT_SIZES["title"], loc="left")
    ax.tick_params(labelsize=S.FONT_SIZES["small"])
    hists = layer_histograms(output, step, model_order(meta))
    hists = {p: h for p, h in hists.items() if h.total > 0}
    edges = {tuple(h.edges) for h in hists.values()}
    if not hists or len(edges) != 1:
        reason = note_for(notes, ["GradHist1d"])
        empty = ((step is None and _no_layer_text(output)) or
                 ("\n".join(textwrap.wrap(f"not computed: {reason}", 60)) if reason else
                  "no per-layer histogram yet"))
        ax.text(0.5, 0.5, empty if not hists else
                "layers recorded with different bins: see plot_layers()",
                transform=ax.transAxes, ha="center", va="center", color=S.GRAY,
                style="italic", fontsize=S.FONT_SIZES["base"])
        ax.set_xticks([])
        ax.set_yticks([])
        return ax
    names = list(hists)
    counts = np.stack([hists[p].counts for p in names])
    x = np.asarray(next(iter(edges)))
    y = np.arange(len(names) + 1) - 0.5
    mesh = ax.pcolormesh(x, y, np.ma.masked_less_equal(counts, 0), shading="flat",
                         cmap="Blues", norm=LogNorm(vmin=1, vmax=max(counts.max(), 2)))
    bar = fig.colorbar(mesh, ax=ax, pad=0.01, fraction=0.04, aspect=25)
    bar.set_label("count", fontsize=S.FONT_SIZES["small"], labelpad=1)
    bar.ax.tick_params(labelsize=S.FONT_SIZES["small"] - 1)
    ax.set_yticks(np.arange(len(names)))
    ax.set_yticklabels(names, fontsize=max(S.FONT_SIZES["small"] - (len(names) > 12), 5.5))
    ax.set_ylim(len(names) - 0.5, -0.5)  # first layer on top
    ax.set_xlabel("gradient element value (log counts)", fontsize=S.FONT_SIZES["small"],
                  labelpad=1)
    steps = sorted({h.step for h in hists.values()})
    ax.text(0.98, 0.96, f"step {steps[-1]}" if len(steps) == 1 else
            f"steps {steps[0]}–{steps[-1]}", transform=ax.transAxes, ha="right", va="top",
            color=S.GRAY, fontsize=S.FONT_SIZES["small"],
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.75})
    return ax
