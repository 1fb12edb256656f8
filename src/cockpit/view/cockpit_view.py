"""The cockpit view (paper Figure 2) as one matplotlib figure.

Layout, left to right: the *step-size* column (α-gauge, distances, gradient norm), the
*gradient* column (gradient tests, 1-D and 2-D histograms of individual gradients) and
the *curvature* column (λ_max, Tr(H), TIC); below them the gray panels with what most
practitioners already track (mini-batch loss, learning rate, batch size). Panels of
instruments that were not tracked are left out and the grid closes up.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from cockpit.view import _style as S
from cockpit.view import instruments as I
from cockpit.view._data import Output, is_tracked, normalize_output, per_param_names
from cockpit.view._source import load_notes, load_run
from cockpit.view.findings_panel import draw_findings, run_diagnosis
from cockpit.view.layers import draw_layers_panel, plot_layer_histograms, plot_layers

__all__ = [
    "COLUMNS",
    "active_panels",
    "describe_run",
    "figure_size",
    "plot_cockpit",
    "plot_layer_histograms",
    "plot_layers",
    "plot_run",
    "save_figure",
    "show",
]

Drawer = Callable[..., Any]

# column -> [(panel key, drawing function, instruments that make the panel appear)]
COLUMNS: dict[str, list[tuple[str, Drawer, tuple[str, ...]]]] = {
    "step size": [
        ("Alpha", I.draw_alpha, ("Alpha",)),
        ("Distances", I.draw_distances, ("Distance", "UpdateSize")),
        ("GradNorm", I.draw_grad_norm, ("GradNorm",)),
    ],
    "gradients": [
        ("GradientTests", I.draw_gradient_tests, ("NormTest", "InnerTest", "OrthoTest")),
        ("GradHist1d", I.draw_grad_hist_1d, ("GradHist1d",)),
        ("Layers", draw_layers_panel, ()),  # shown when GradHist1d/<param> was recorded
        ("GradHist2d", I.draw_grad_hist_2d, ("GradHist2d",)),
    ],
    "curvature": [
        ("HessMaxEV", I.draw_hess_max_ev, ("HessMaxEV",)),
        ("HessTrace", I.draw_hess_trace, ("HessTrace",)),
        ("TIC", I.draw_tic, ("TICDiag", "TICTrace")),
        ("HessDensity", I.draw_hess_density, ("HessDensity",)),
    ],
    "gray": [
        ("Loss", I.draw_loss, ("Loss",)),
        ("LearningRate", I.draw_learning_rate, ("LearningRate",)),
        ("BatchSize", I.draw_batch_size, ("BatchSize",)),
        ("Findings", draw_findings, ()),  # shown when diagnosis=True and steps exist
    ],
}
# Gray panels shown only when their instrument changes during the run; a constant learning
# rate or batch size is written into the loss panel instead of taking a third of the row.
_ONLY_IF_VARYING = {"LearningRate", "BatchSize"}
_PANEL_HEIGHT = {"Layers": 0.8, "GradHist2d": 1.25}  # relative heights within a column
_GRAY_WIDTH = {"Loss": 1.6, "LearningRate": 1.0, "BatchSize": 1.0, "Findings": 1.7}
_COLUMN_WIDTH = {"step size": 1.0, "gradients": 1.3, "curvature": 1.0}


def _shown(out: Output, key: str, names: tuple[str, ...], diagnosis: bool) -> bool:
    if key == "Layers":
        return bool(per_param_names(out, "GradHist1d"))
    if key == "Findings":
        return diagnosis and bool(out)
    if key in _ONLY_IF_VARYING:
        return is_tracked(out, key) and I.varies(out, key)
    return any(is_tracked(out, n) for n in names)


def active_panels(output: Mapping, *, diagnosis: bool = True) -> dict[str, list[str]]:
    """Column → keys of the panels shown for this output: instruments that were tracked
    (learning rate and batch size only if they change), the per-layer panel if per-layer
    histograms were recorded, and the diagnosis panel if ``diagnosis``."""
    out = normalize_output(output)
    return {
        column: [key for key, _, names in panels if _shown(out, key, names, diagnosis)]
        for column, panels in COLUMNS.items()
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
        meta: Run metadata; the model and optimizer go into the figure's title.
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
    drawers = {key: fn for column in COLUMNS.values() for key, fn, _ in column}
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
                                      height_ratios=[_PANEL_HEIGHT.get(k, 1.0) for k in keys])
            for j, key in enumerate(keys):
                drawers[key](fig, sub[j], out, **options)
    if gray:
        sub = bottom_spec.subgridspec(1, len(gray), width_ratios=[_GRAY_WIDTH[k] for k in gray])
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


_FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg"}

#: The modules that decide what the cockpit view draws (hashed into every saved PNG).
DRAWING_MODULES = ("cockpit_view.py", "instruments.py", "layers.py", "findings_panel.py",
                   "_style.py", "_hist.py", "_data.py")
CODE_KEY = "cockpit-view-code"
PANELS_KEY = "cockpit-panels"
# The losses of the run's first tracked steps (JSON): which run a saved figure shows.
RUN_KEY = "cockpit-run-start"
RUN_KEY_STEPS = 8


def drawing_code_hash(root: Path | None = None) -> str:
    """SHA-256 (first 16 hex digits) of the view's drawing modules (in ``root``, default
    this package): two PNGs with the same hash were drawn by the same code (line endings
    normalized)."""
    here = Path(__file__).resolve().parent if root is None else Path(root)
    digest = hashlib.sha256()
    for name in DRAWING_MODULES:
        digest.update(name.encode())
        digest.update((here / name).read_bytes().replace(b"\r\n", b"\n"))
    return digest.hexdigest()[:16]


def png_provenance(fig: Figure) -> dict[str, str]:
    """PNG text chunks of a saved cockpit view: the drawing code's hash and the panels."""
    from cockpit.view import _style as style

    keys = {v: k for k, v in style.PANEL_TITLES.items()}
    panels = [keys[ax.get_title(loc="left")] for ax in fig.axes
              if ax.get_title(loc="left") in keys]
    return {"Software": "cockpit.view", CODE_KEY: drawing_code_hash(),
            PANELS_KEY: ",".join(panels)}


def read_png_text(path: str | Path) -> dict[str, str]:
    """The tEXt chunks of a PNG file (what :func:`save_figure` wrote into it)."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{str(path)!r} is not a PNG file")
    found, pos = {}, 8
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind = data[pos + 4:pos + 8]
        if kind == b"tEXt":
            key, _, value = data[pos + 8:pos + 8 + length].partition(b"\0")
            found[key.decode("latin-1")] = value.decode("latin-1")
        if kind == b"IEND":
            break
        pos += 12 + length
    return found


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 110,
                extra: Mapping[str, str] | None = None) -> Path:
    """Save ``fig`` as PNG, PDF or SVG, chosen by the file extension. A PNG carries the
    hash of the drawing code and the panels drawn (:func:`png_provenance`), so a figure
    can be checked against the code that should have made it (README's figure)."""
    path = Path(path)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"Unsupported figure format {path.suffix!r} for {str(path)!r}: "
            f"use one of {', '.join(_FORMATS)}."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {**png_provenance(fig), **(extra or {})} if fmt == "png" else None
    fig.savefig(path, format=fmt, dpi=dpi, metadata=metadata)
    return path


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
