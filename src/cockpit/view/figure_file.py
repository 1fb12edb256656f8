"""Saving a cockpit view, and what a saved PNG says about the code that drew it.

A PNG carries the hash of the view's drawing modules and of the instruments' descriptors
(their panels and colours), and the panels drawn, so a figure can be checked against the
code that should have made it (the README's figure, ``tests/view/test_readme_figure.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from matplotlib.figure import Figure

from cockpit.quantities.descriptor import registry
from cockpit.view import _style as S

_FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg"}

#: The modules that decide what the cockpit view draws (hashed into every saved PNG, with
#: the instruments' descriptors).
DRAWING_MODULES = ("cockpit_view.py", "instruments.py", "panel_parts.py", "parameter_lines.py",
                   "step_size_panels.py", "gradient_panels.py", "curvature_panels.py",
                   "gray_panels.py", "layers.py", "findings_panel.py", "_style.py", "_hist.py",
                   "_data.py")
CODE_KEY = "cockpit-view-code"
PANELS_KEY = "cockpit-panels"
# The losses of the run's first tracked steps (JSON): which run a saved figure shows.
RUN_KEY = "cockpit-run-start"
RUN_KEY_STEPS = 8


def drawing_code_hash(root: Path | None = None) -> str:
    """SHA-256 (first 16 hex digits) of the view's drawing modules (in ``root``, default
    this package) and of what the instruments' descriptors say about drawing them (panels,
    colours, recorded names): two PNGs with the same hash were drawn by the same code
    (line endings normalized)."""
    here = Path(__file__).resolve().parent if root is None else Path(root)
    digest = hashlib.sha256()
    for name in DRAWING_MODULES:
        digest.update(name.encode())
        digest.update((here / name).read_bytes().replace(b"\r\n", b"\n"))
    digest.update(descriptors_text().encode())
    return digest.hexdigest()[:16]


def descriptors_text() -> str:
    """The drawing part of the descriptor of every instrument of the package (not of
    user-defined ones), one line each, sorted."""
    return "\n".join(sorted(f"{name}: {desc.panel!r} {desc.color} {desc.records}"
                            for name, desc in registry(package_only=True).items()))


def png_provenance(fig: Figure) -> dict[str, str]:
    """PNG text chunks of a saved cockpit view: the drawing code's hash and the panels."""
    keys = {v: k for k, v in S.PANEL_TITLES.items()}
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
