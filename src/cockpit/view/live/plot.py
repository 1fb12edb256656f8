"""A cockpit view redrawn in place as a run goes on (:class:`LivePlot`), in a window of an
interactive backend or a figure to save."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from cockpit.view._source import load_notes, load_run
from cockpit.view.cockpit_view import figure_size, plot_cockpit, save_figure

__all__ = ["LivePlot"]


class LivePlot:
    """A cockpit view that :meth:`update` redraws in place, e.g. every few steps::

        plt.ion()
        live = LivePlot("runs/exp1")   # a run directory, or the Cockpit object itself
        for step ...:
            ...
            if step % 50 == 0:
                live.update()

    Works with interactive backends (the window refreshes) and with Agg (then call
    :meth:`save` or use :attr:`fig`).
    """

    def __init__(self, source: Any, *, meta: dict | None = None, **plot_kwargs: Any) -> None:
        self.source = source
        self.meta = meta
        self.plot_kwargs = plot_kwargs
        self.fig: Figure | None = None
        self.num_updates = 0

    def update(self) -> Figure:
        """Re-read the data and redraw the figure (created through pyplot on first use)."""
        output, meta = load_run(self.source, self.meta)
        size = figure_size(output, diagnosis=self.plot_kwargs.get("diagnosis", True))
        if self.fig is None:
            import matplotlib.pyplot as plt

            self.fig = plt.figure(figsize=size)
            if plt.isinteractive():
                plt.show(block=False)
        elif tuple(self.fig.get_size_inches()) != size:
            self.fig.set_size_inches(*size, forward=True)
        kwargs = {"notes": load_notes(self.source), **self.plot_kwargs}
        plot_cockpit(output, meta, fig=self.fig, **kwargs)
        self.fig.canvas.draw_idle()
        self.fig.canvas.flush_events()
        self.num_updates += 1
        return self.fig

    def save(self, path: str | Path) -> Path:
        """Save the current figure (PNG, PDF or SVG by extension); draws it first if needed."""
        return save_figure(self.fig if self.fig is not None else self.update(), path)

    def close(self) -> None:
        """Close the figure's window (if pyplot manages it)."""
        if self.fig is not None:
            import matplotlib.pyplot as plt

            plt.close(self.fig)
            self.fig = None
