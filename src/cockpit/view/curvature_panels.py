"""The curvature column of the cockpit view: λ_max, the top eigenvalues, Tr(H), the TIC
and the Hessian's eigenvalue density. Registered for their panels' keys
(:func:`cockpit.view.instruments.draws`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec

from cockpit.view import _style as S
from cockpit.view._data import Output, is_tracked
from cockpit.view.instruments import draws
from cockpit.view.panel_parts import (
    Notes,
    _auto_log,
    _corner_note,
    _missing_message,
    _new_axes,
    _no_data,
    _series_panel,
    _time_axis,
    legend_above,
)

__all__ = ["draw_hess_density", "draw_hess_max_ev", "draw_hess_top_ev", "draw_hess_trace",
           "draw_tic"]


@draws("HessMaxEV")
def draw_hess_max_ev(fig: Figure, spec: SubplotSpec, output: Output, *,
                     xlim: tuple[float, float] | None = None, **_: Any) -> Axes:
    """λ_max(H_B) over steps (eq. 26)."""
    ax = _series_panel(fig, spec, output, "HessMaxEV", ["HessMaxEV"], xlim=xlim)
    ax.set_ylabel("λ_max", fontsize=S.FONT_SIZES["small"])
    return ax


@draws("HessTrace")
def draw_hess_trace(fig: Figure, spec: SubplotSpec, output: Output, *,
                    xlim: tuple[float, float] | None = None, **_: Any) -> Axes:
    """Tr(H_B) over steps (App. B.8)."""
    ax = _series_panel(fig, spec, output, "HessTrace", ["HessTrace"], xlim=xlim)
    # recorded beside the value when it is the GGN's trace (curvature="diag_ggn_*")
    ggn = any(values.get("HessTrace.ggn") == 1.0 for values in output.values())
    if ggn:
        ax.set_title("GGN trace Tr(GGN) (not the Hessian's)", fontsize=S.FONT_SIZES["title"],
                     loc="left")
    ax.set_ylabel("Tr(GGN)" if ggn else "Tr(H_B)", fontsize=S.FONT_SIZES["small"])
    return ax


@draws("TIC")
def draw_tic(fig: Figure, spec: SubplotSpec, output: Output, *,
             xlim: tuple[float, float] | None = None, **_: Any) -> Axes:
    """Mini-batch TIC approximations over steps: TICDiag (eq. 29), TICTrace (eq. 28)."""
    names = [n for n in ("TICDiag", "TICTrace") if is_tracked(output, n)]
    labels = {"TICDiag": "TIC (diagonal, eq. 29)", "TICTrace": "TIC (trace, eq. 28)"}
    return _series_panel(fig, spec, output, "TIC", names, labels=[labels[n] for n in names],
                         xlim=xlim)


@draws("HessTopEV")
def draw_hess_top_ev(fig: Figure, spec: SubplotSpec, output: Output, *,
                     xlim: tuple[float, float] | None = None, notes: Notes | None = None,
                     **_: Any) -> Axes:
    """λ_1 ≥ … ≥ λ_k over steps, each a line of its lower bounds ν_i with the certified
    bracket [ν_i, upper_i] shaded (:mod:`cockpit.quantities.hess_top_ev`)."""
    ax = _new_axes(fig, spec, "HessTopEV")
    steps, lower, upper = [], [], []
    for step, values in output.items():
        value = values.get("HessTopEV")
        if isinstance(value, Mapping) and "values" in value:
            steps.append(step)
            lower.append(np.asarray(value["values"], dtype=float).ravel())
            upper.append(np.asarray(value.get("upper", value["values"]), dtype=float).ravel())
    k = min((v.size for v in lower), default=0)
    if k == 0:
        _no_data(ax, _missing_message(output, ["HessTopEV"], notes))
        _time_axis(ax, xlim)
        return ax
    x = np.asarray(steps)
    lo = np.stack([v[:k] for v in lower])
    hi = np.stack([v[:k] for v in upper])
    cmap = matplotlib.colormaps["Purples"]
    for i in range(k):
        color = cmap(0.9 - 0.5 * i / max(k - 1, 1))
        ax.fill_between(x, lo[:, i], hi[:, i], color=color, alpha=0.2, linewidth=0)
        ax.plot(x, lo[:, i], color=color, linewidth=1.4, marker="o" if x.size <= 40 else None,
                markersize=2.5, label=f"λ_{i + 1}", gid=f"HessTopEV/{i}")
    _auto_log(ax, [lo.ravel()])
    _time_axis(ax, xlim)
    ax.set_ylabel("eigenvalue", fontsize=S.FONT_SIZES["small"])
    legend_above(ax, ncol=min(k, 6))
    return ax


@draws("HessDensity")
def draw_hess_density(fig: Figure, spec: SubplotSpec, output: Output, **_: Any) -> Axes:
    """The Hessian's spectral density at the last step that recorded it (stochastic Lanczos
    quadrature, :mod:`cockpit.quantities.hess_density`): the nodes θ_{p,j} with weights
    τ_{p,j}/P, each smoothed by a Gaussian of width 2 % of the spectrum's range, on a log
    density axis as PyHessian draws it."""
    ax = _new_axes(fig, spec, "HessDensity")
    steps = [s for s, values in output.items()
             if isinstance(values.get("HessDensity"), Mapping)
             and "nodes" in values["HessDensity"]]
    if not steps:
        _no_data(ax)
        return ax
    step = max(steps)
    value = output[step]["HessDensity"]
    nodes = np.asarray(value["nodes"], dtype=float).ravel()
    weights = np.asarray(value["weights"], dtype=float).ravel()
    weights = weights / max(np.asarray(value["weights"]).shape[0], 1)
    lo, hi = float(nodes.min()), float(nodes.max())
    width = 0.02 * (hi - lo) if hi > lo else max(abs(hi), 1.0) * 0.02
    grid = np.linspace(lo - 5 * width, hi + 5 * width, 400)
    density = (weights[None, :] * np.exp(-0.5 * ((grid[:, None] - nodes[None, :]) / width) ** 2)
               ).sum(1) / (width * np.sqrt(2 * np.pi))
    ax.semilogy(grid, np.maximum(density, 1e-12), color=S.COLORS["HessMaxEV"], linewidth=1.2)
    ax.set_ylim(bottom=max(density.max() * 1e-8, 1e-12))
    ax.set_xlabel("eigenvalue λ", fontsize=S.FONT_SIZES["small"])
    ax.set_ylabel("density", fontsize=S.FONT_SIZES["small"])
    _corner_note(ax, f"step {step}")
    return ax
