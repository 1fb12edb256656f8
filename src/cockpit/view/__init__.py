"""Cockpit views: the cockpit figure (paper Figure 2), per-layer histograms, live views."""

from cockpit.view.cockpit_view import (
    plot_cockpit,
    plot_layer_histograms,
    plot_layers,
    plot_run,
    save_figure,
    show,
)
from cockpit.view.commands import main_plot, main_view
from cockpit.view.live import LivePlot, serve

__all__ = [
    "LivePlot",
    "main_plot",
    "main_view",
    "plot_cockpit",
    "plot_layer_histograms",
    "plot_layers",
    "plot_run",
    "save_figure",
    "serve",
    "show",
]
