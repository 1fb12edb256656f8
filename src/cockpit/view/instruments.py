"""The cockpit view's instruments: one drawing function per panel, registered here.

Every function has the signature ``draw_x(fig, spec, output, **options) -> Axes``, is
registered for its panel's key (``@draws(key)``, the key of the instrument descriptor's
:class:`~cockpit.quantities.descriptor.Panel`; a panel without one is drawn by
:func:`series_drawer`) and draws into the ``SubplotSpec`` it is given (some panels use
several axes, e.g. the 2-D histogram with its marginals); the returned axes carries the
panel's title (:data:`~cockpit.view._style.PANEL_TITLES`). ``None`` values (not computed)
and NaNs are left out of lines; non-finite values are marked by red crosses at the top of
the panel (:mod:`cockpit.view.panel_parts`).

The drawing functions are grouped as the view's columns: :mod:`cockpit.view.step_size_panels`,
:mod:`cockpit.view.gradient_panels`, :mod:`cockpit.view.curvature_panels` and
:mod:`cockpit.view.gray_panels`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.gridspec import SubplotSpec

from cockpit.view import _style as S
from cockpit.view._data import Output
from cockpit.view.panel_parts import Notes, _series_panel

Drawer = Callable[..., Axes]

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
