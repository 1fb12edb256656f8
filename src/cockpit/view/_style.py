"""Colors, fonts and panel titles of the cockpit view. An instrument's colour and its
panel's title, column and place come from its descriptor
(:mod:`cockpit.quantities.descriptor`); the view adds its own panels (per-layer histograms,
the diagnosis), fonts and the gradient tests' thresholds."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from cockpit.quantities.descriptor import (
    BLUE,
    DARK,
    GRAY,
    GREEN,
    ORANGE,
    PURPLE,
    RED,
    Panel,
    registry,
)

__all__ = ["BLUE", "COLORS", "DARK", "GRAY", "GREEN", "LIGHT_GRAY_FACE", "ORANGE",
           "PANEL_TITLES", "PURPLE", "RED", "VIEW_PANELS", "panels"]

LIGHT_GRAY_FACE = "#ececec"  # the "gray panels": what most practitioners track already

# Panels of the view's own, not of one instrument.
VIEW_PANELS = (
    Panel("Layers", "gradients", "Individual gradient elements per layer", order=4, size=0.8),
    Panel("Findings", "gray", "Diagnosis: what the instruments say", order=9, size=1.7),
)
# Colours of what the view draws beside the instruments.
_VIEW_COLORS = {"AlphaRecent": ORANGE}


def panels() -> dict[str, tuple[Panel, tuple[str, ...]]]:
    """Panel key → (the panel, the recorded names that make it appear), the instruments'
    panels (from their descriptors) and the view's own (:data:`VIEW_PANELS`)."""
    found: dict[str, tuple[Panel, tuple[str, ...]]] = {p.key: (p, ()) for p in VIEW_PANELS}
    for name, desc in registry().items():
        if desc.panel is None:
            continue
        panel, names = found.get(desc.panel.key, (desc.panel, ()))
        found[desc.panel.key] = (panel, (*names, name, *desc.records))
    return found


class _FromDescriptors(Mapping[str, str]):
    """A read-only mapping computed from the instruments' descriptors at each look-up (an
    instrument defined after this module was imported is found too)."""

    def __init__(self, build) -> None:
        self._build = build

    def __getitem__(self, key: str) -> str:
        return self._build()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())


def _colors() -> dict[str, str]:
    found = {}
    for name, desc in registry().items():
        if desc.color:  # what an instrument records beside its value: in its colour
            found.update(dict.fromkeys((name, *desc.records), desc.color))
    return {**found, **_VIEW_COLORS}


# One colour per instrument, used wherever the instrument appears.
COLORS: Mapping[str, str] = _FromDescriptors(_colors)

FONT_SIZES = {"base": 8.5, "title": 10.0, "suptitle": 13.0, "small": 7.5}

# Panel key -> title. A panel key is the instrument (or instrument group) it shows.
PANEL_TITLES: Mapping[str, str] = _FromDescriptors(
    lambda: {key: panel.title for key, (panel, _) in panels().items()})

# Titles of parts of a panel (not panels of their own).
SUB_TITLES: dict[str, str] = {
    "TestGeometry": "Test geometry",
    "HistZoom": "Zoom on the data",
}

# Thresholds of the gradient tests used by Bollapragada et al. (paper App. B.6).
THETA_NORM = 0.9
THETA_INNER = 0.9
NU_ORTHO = 5.84  # tan(80°)

ALPHA_RANGE = 1.5  # α axis shows [-1.5, 1.5]; values outside are clipped into the edge bins
GRAD_HIST_RANGE = (-2.0, 2.0)  # x range of GradHist1d when its edges reach further
