"""The cockpit view (paper Figure 2) as one matplotlib figure.

Layout, left to right: the *step-size* column (α-gauge, distances, gradient norm,
update-to-weight ratios), the *gradient* column (gradient tests, gradient noise scale, 1-D
and 2-D histograms of individual gradients) and the *curvature* column (λ_max, top
eigenvalues, Tr(H), TIC, eigenvalue density); below them the gray panels with what most
practitioners already track (mini-batch loss, learning rate, batch size, parameter norms).
Each instrument's descriptor names its panel, column and place
(:mod:`cockpit.quantities.descriptor`). Panels of instruments that were not tracked are
left out and the grid closes up.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from cockpit.quantities.descriptor import COLUMNS as COLUMN_ORDER
from cockpit.quantities.descriptor import remember_descriptions
from cockpit.view import _style as S
from cockpit.view import (  # noqa: F401  (register the instruments' drawings)
    curvature_panels,
    gradient_panels,
    gray_panels,
    step_size_panels,
)
from cockpit.view import instruments as I
from cockpit.view._data import Output, is_tracked, normalize_output, per_param_names
from cockpit.view._source import load_notes, load_run
from cockpit.view.figure_file import (
    CODE_KEY,
    DRAWING_MODULES,
    PANELS_KEY,
    RUN_KEY,
    RUN_KEY_STEPS,
    drawing_code_hash,
    png_provenance,
    read_png_text,
    save_figure,
)
from cockpit.view.findings_panel import draw_findings, run_diagnosis
from cockpit.view.layers import draw_layers_panel, plot_layer_histograms, plot_layers
from cockpit.view.panel_parts import varies

__all__ = [
    "CODE_KEY",
    "DRAWING_MODULES",
    "PANELS_KEY",
    "RUN_KEY",
    "RUN_KEY_STEPS",
    "active_panels",
    "columns",
    "describe_run",
    "drawing_code_hash",
    "figure_size",
    "plot_cockpit",
    "plot_layer_histograms",
    "plot_layers",
    "plot_run",
    "png_provenance",
    "read_png_text",
    "save_figure",
    "show",
]

Drawer = Callable[..., Any]
# drawing functions of the view's own panels (S.VIEW_PANELS); the instruments' are in
# instruments.DRAWERS
_VIEW_DRAWERS: dict[str, Drawer] = {"Layers": draw_layers_panel, "Findings": draw_findings}
_COLUMN_WIDTH = {"step size": 1.0, "gradients": 1.3, "curvature": 1.0}


def columns() -> dict[str, list[tuple[str, Drawer, tuple[str, ...]]]]:
    """Column → [(panel key, drawing function, recorded names that make the panel appear)]
    in the order drawn, from the instruments' descriptors (:data:`S.panels`). A panel
    without a drawing function of its own draws its instruments as series over steps."""
    found: dict[str, list] = {column: [] for column in COLUMN_ORDER}
    for key, (panel, names) in sorted(S.panels().items(), key=lambda kv: kv[1][0].order):
        drawer = _VIEW_DRAWERS.get(key) or I.DRAWERS.get(key) or I.series_drawer(key, names)
        found[panel.column].append((key, drawer, names))
    return found


def _shown(out: Output, key: str, names: tuple[str, ...], diagnosis: bool) -> bool:
    if key == "Layers":
        return bool(per_param_names(out, "GradHist1d"))
    if key == "Findings":
        return diagnosis and bool(out)
    if S.panels()[key][0].only_if_varying:
        return any(is_tracked(out, n) and varies(out, n) for n in names)
    return any(is_tracked(out, n) for n in names)


def active_panels(output: Mapping, *, diagnosis: bool = True) -> dict[str, list[str]]:
    """Column → keys of the panels shown for this output: instruments that were tracked
    (learning rate and batch size only if they change), the per-layer panel if per-layer
    histograms were recorded, and the diagnosis panel if ``diagnosis``."""
    out = normalize_output(output)
    return {
        column: [key for key, _, names in panels if _shown(out, key, names, diagnosis)]
        for column, panels in columns().items()
    }


def _first(meta: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if meta.get(key) not in (None, "", {}):
            return meta[key]
    return None


def describe_run(meta: Mapping[str, Any] | None) -> str:
    """One line naming the run's model and optimizer (with learning rate) from metadata."""
    if not meta:
        return ""
    parts = []
    model = meta.get("model")
    if not (isinstance(model, str) and "\n" not in model.strip()):
        model = None  # a multi-line repr(model): its class name reads better
    model = _first(meta, "model_name", "problem") or model or _first(
        meta, "model_class", "model", "model_summary")
    if isinstance(model, Mapping):
        model = _first(model, "name", "class", "summary")
    if model is not None:
        parts.append(str(model).strip().splitlines()[0][:80])
    opt = _first(meta, "optimizer", "optimizer_class", "optimizer_name")
    hyper = _first(meta, "optimizer_hyperparameters", "hyperparameters", "optimizer_params")
    if isinstance(opt, Mapping):
        hyper = hyper or opt.get("hyperparameters") or opt
        opt = _first(opt, "class", "name", "type")
    if isinstance(hyper, list | tuple) and hyper and isinstance(hyper[0], Mapping):
        hyper = hyper[0]  # param groups: show the first one
    if opt is not None:
        text = str(opt)
        if isinstance(hyper, Mapping):
            shown = [f"{k}={hyper[k]:g}" if isinstance(hyper[k], float) else f"{k}={hyper[k]}"
                     for k in ("lr", "momentum", "weight_decay") if k in hyper]
            if shown:
                text += "(" + ", ".join(shown) + ")"
        parts.append(text)
    n = _first(meta, "num_parameters", "num_params", "n_parameters")
    if isinstance(n, int | float):
        parts.append(f"{int(n):,} parameters")
    if meta.get("batchnorm"):  # Cockpit(..., batchnorm="frozen_statistics")
        parts.append("per-sample instruments approximate: BatchNorm statistics frozen")
    return " · ".join(parts)


def _step_range(output: Output) -> tuple[float, float] | None:
    if not output:
        return None
    steps = list(output)
    lo, hi = min(steps), max(steps)
    if lo == hi:
        return (lo - 0.5, hi + 0.5)
    return (lo, hi)


def figure_size(output: Mapping, *, diagnosis: bool = True) -> tuple[float, float]:
    """Size in inches that gives every panel of the cockpit view a readable size."""
    panels = active_panels(output, diagnosis=diagnosis)
    upper = [c for c in ("step size", "gradients", "curvature") if panels[c]]
    rows = max((len(panels[c]) for c in upper), default=0)
    width = max(8.0, sum(5.4 * _COLUMN_WIDTH[c] for c in upper) + 0.8)
    height = 2.9 * rows + (2.6 if panels["gray"] else 0.0) + 1.0
    return width, max(height, 3.5)


def plot_cockpit(output: Mapping, meta: Mapping[str, Any] | None = None, *,
                 fig: Figure | None = None,
                 hist_range: tuple[float, float] | str | None = "auto",
                 title: str | None = None, notes: Mapping[int, Mapping[str, str]] | None = None,
                 diagnosis: bool = True, findings: Sequence[Any] | None = None) -> Figure:
    """Draw the cockpit view of a run's output ``{step: {name: value}}``.

    Args:
        output: Cockpit output (``Cockpit.get_output()``, ``read_output(logdir)``, a
            loaded JSON export with string steps works too).
        meta: Run metadata; the model and optimizer go into the figure's title, the
            instruments' descriptors it carries give their panels (also where this
            process has not imported an instrument's class).
        fig: Figure to draw into (it is cleared); default a new figure sized to the
            panels (not registered with pyplot, so it is safe in threads and servers).
        hist_range: x range of the gradient-element histogram: ``"auto"`` its edges where
            Cockpit set the range from the data, else the paper's [−2, 2]; None: its edges.
        title: Overrides the title made from ``meta``.
        notes: ``{step: {name: reason}}`` (``Cockpit.get_notes()``, the run log's notes):
            a panel without values says why.
        diagnosis: show the diagnosis panel (findings of :func:`cockpit.diagnose.diagnose`
            on ``output``, or the given ``findings``).
    """
    remember_descriptions(meta)  # panels of instruments known only from the run log
    out = normalize_output(output)
    panels = active_panels(out, diagnosis=diagnosis)
    upper = [c for c in ("step size", "gradients", "curvature") if panels[c]]
    gray = panels["gray"]
    rows = max((len(panels[c]) for c in upper), default=0)
    if fig is None:
        fig = Figure(figsize=figure_size(out), dpi=100)
    else:
        fig.clear()
    fig.set_layout_engine("constrained", h_pad=0.06, w_pad=0.06, hspace=0.03, wspace=0.03)

    heading = title if title is not None else describe_run(meta)
    steps = list(out)
    info = (f"{len(steps)} tracked steps ({steps[0]}–{steps[-1]})" if steps
            else "no tracked steps yet")
    fig.suptitle(f"Cockpit · {heading}" if heading else "Cockpit",
                 fontsize=S.FONT_SIZES["suptitle"], fontweight="bold")
    if not upper and not gray:
        fig.text(0.5, 0.5, f"{info}: nothing to show", ha="center", va="center",
                 fontsize=S.FONT_SIZES["title"], color=S.GRAY)
        return fig

    xlim = _step_range(out)
    drawers = {key: fn for column in columns().values() for key, fn, _ in column}
    sizes = {key: panel.size for key, (panel, _) in S.panels().items()}
    options: dict[str, Any] = {"xlim": xlim, "hist_range": hist_range, "notes": notes,
                               "meta": meta}
    if "Findings" in gray:
        options["findings"], options["diagnosis_error"] = (
            (list(findings), None) if findings is not None else run_diagnosis(out, notes))
    if upper and gray:
        outer = fig.add_gridspec(2, 1, height_ratios=[2.9 * rows, 2.3])
        top_spec, bottom_spec = outer[0], outer[1]
    else:
        top_spec = bottom_spec = fig.add_gridspec(1, 1)[0]
    if upper:
        cols = top_spec.subgridspec(1, len(upper), width_ratios=[_COLUMN_WIDTH[c] for c in upper])
        for i, column in enumerate(upper):
            keys = panels[column]
            sub = cols[i].subgridspec(len(keys), 1,
                                      height_ratios=[sizes[k] for k in keys])
            for j, key in enumerate(keys):
                drawers[key](fig, sub[j], out, **options)
    if gray:
        sub = bottom_spec.subgridspec(1, len(gray), width_ratios=[sizes[k] for k in gray])
        for j, key in enumerate(gray):
            drawers[key](fig, sub[j], out, **options)
    restarts = _restart_steps(meta)
    if restarts and xlim is not None:
        _mark_restarts(fig, xlim, restarts)
        info += f" · run resumed after step {', '.join(map(str, restarts))} (dotted line)"
    fig.text(0.995, 0.005, info, ha="right", va="bottom", fontsize=S.FONT_SIZES["small"],
             color=S.GRAY)
    return fig


def _restart_steps(meta: Mapping[str, Any] | None) -> list[int]:
    """The last logged step before each restart of a resumed run (``meta["restarts"]``,
    written by ``RunLogWriter(..., resume=True)``)."""
    restarts = (meta or {}).get("restarts") or []
    return [int(r["after_step"]) for r in restarts
            if isinstance(r, Mapping) and isinstance(r.get("after_step"), int | float)]


def _mark_restarts(fig: Figure, xlim: tuple[float, float], restarts: list[int]) -> None:
    """A dotted line between the last step before a restart and the next one, on every
    panel whose x axis is the run's steps."""
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        if abs(lo - xlim[0]) > 1e-9 * max(1.0, abs(xlim[0])) or abs(hi - xlim[1]) > 1e-9 * max(
                1.0, abs(xlim[1])):
            continue
        for step in restarts:
            if xlim[0] <= step + 0.5 <= xlim[1]:
                ax.axvline(step + 0.5, color=S.GRAY, linestyle=":", linewidth=0.9, zorder=0)


def plot_run(logdir: str | Path, out_path: str | Path | None = None, **kwargs: Any) -> Figure:
    """Cockpit view of the run in ``logdir`` (or a JSON export); saved if ``out_path``."""
    output, meta = load_run(logdir)
    kwargs.setdefault("notes", load_notes(logdir))
    fig = plot_cockpit(output, meta, **kwargs)
    if out_path is not None:
        steps = sorted(output)[:RUN_KEY_STEPS]
        losses = [output[s].get("Loss") if isinstance(output[s], Mapping) else None
                  for s in steps]
        save_figure(fig, out_path, extra={RUN_KEY: json.dumps(losses)})
    return fig


def show(source: Any, meta: Mapping[str, Any] | None = None, **kwargs: Any) -> Figure:
    """The cockpit view for Jupyter: a run directory, JSON export, output dict or Cockpit.

    The figure is returned (not registered with pyplot), so a notebook shows it once,
    inline, as the cell's result.
    """
    output, run_meta = load_run(source, meta)
    kwargs.setdefault("notes", load_notes(source))
    _register_inline_png()
    return plot_cockpit(output, run_meta, **kwargs)


def _register_inline_png() -> None:
    """In IPython, make sure a returned Figure is shown as PNG even if pyplot was never
    imported (its inline backend registers that formatter only on first use)."""
    try:
        from IPython import get_ipython
        from IPython.core.pylabtools import select_figure_formats
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and hasattr(shell, "display_formatter"):
        formatter = shell.display_formatter.formatters.get("image/png")
        if formatter is not None and Figure not in formatter.type_printers:
            select_figure_formats(shell, {"png"})
