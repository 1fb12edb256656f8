"""The live view's drawings: the cockpit view of a run log as PNG with its read-out data
(:func:`_render`), and :class:`_ViewState`, which holds the last finished drawings and runs
the one renderer thread that makes them (at most once per new run-log state or page size;
requests never wait for it)."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from cockpit.view import _style as S
from cockpit.view._source import load_notes, load_run, run_status
from cockpit.view.cockpit_view import plot_cockpit
from cockpit.view.live.page import page_html
from cockpit.view.live.readout import findings_data, hover_data

__all__ = ["render_png"]

# Smallest drawing (CSS pixels at DPI): below it the panels get too cramped to read, and a
# smaller window shows the drawing scaled down instead.
_MIN_SIZE_PX = (1000, 640)


def _render(logdir: str | Path, *, dpi: int = 90,
            size_px: tuple[int, int] | None = None) -> tuple[bytes, dict[str, Any]]:
    """PNG bytes of the cockpit view of ``logdir`` and its hover data (panels.json);
    ``size_px``: draw at this size in pixels (at least _MIN_SIZE_PX), default the size
    that gives every panel a readable size."""
    try:
        output, meta = load_run(logdir)
    except FileNotFoundError:
        fig = Figure(figsize=(8, 3))
        fig.text(0.5, 0.5, f"Waiting for a run log in {Path(logdir).name!r} …", ha="center",
                 va="center", fontsize=S.FONT_SIZES["title"], color=S.GRAY)
        output = {}
    else:
        figure = None
        if size_px is not None:
            w, h = (max(a, b) for a, b in zip(size_px, _MIN_SIZE_PX, strict=True))
            figure = Figure(figsize=(w / dpi, h / dpi), dpi=dpi)
        # the findings are shown beside the image (findings.json), not inside it
        fig = plot_cockpit(output, meta, fig=figure, notes=load_notes(logdir),
                           diagnosis=False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)  # lays the figure out: positions are final
    return buf.getvalue(), hover_data(fig, output)


def render_png(logdir: str | Path, *, dpi: int = 90) -> bytes:
    """PNG bytes of the cockpit view of ``logdir`` (a message figure if it has no log)."""
    return _render(logdir, dpi=dpi)[0]


def _placeholder_png(text: str) -> bytes:
    fig = Figure(figsize=(8, 1.2))
    fig.text(0.5, 0.5, text, ha="center", va="center", fontsize=S.FONT_SIZES["title"],
             color=S.GRAY)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


class _ViewState:
    """What the server knows: the run directory, the last finished drawing of its view
    (PNG and hover data, keyed ``"last_step:num_steps"``) and the findings, and the one
    renderer thread that makes the drawings (see the module docstring)."""

    def __init__(self, logdir: Path, refresh_seconds: float) -> None:
        self.logdir = logdir
        self.refresh_seconds = refresh_seconds
        self.lock = threading.Lock()  # guards the finished drawings, never held to draw
        self.findings_lock = threading.Lock()
        self.size_px: tuple[int, int] | None = None  # the page's figure area
        self.drawn: dict[str, Any] | None = None  # {"key", "state", "size", "png", "hover"}
        self.earlier: dict[str, dict[str, Any]] = {}  # the last few drawings by key
        self.rendering: str | None = None
        self.renders = 0
        self.findings_key: tuple | None = None
        self.cache_findings: dict[str, Any] | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._placeholder: bytes | None = None

    # ------------------------------------------------------------------ the renderer
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._draw_loop, name="cockpit-view-render",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def _draw_loop(self) -> None:
        while not self._stop.is_set():
            # a broken run log must not end the renderer; it is retried at the next wake
            with contextlib.suppress(Exception):
                self.draw_if_stale()
            self._wake.wait(timeout=self.refresh_seconds)
            self._wake.clear()

    def _stale(self, state: tuple, size: tuple[int, int] | None,
               drawn: dict[str, Any] | None = None) -> bool:
        """Whether ``drawn`` (default: the last drawing) no longer shows ``state`` at
        ``size``."""
        drawn = self.drawn if drawn is None else drawn
        if drawn is None or drawn["state"] != state:
            return True
        old = drawn["size"]
        if size is None or old is None:
            return size != old
        return any(abs(a - b) > 0.08 * b for a, b in zip(size, old, strict=True))

    def draw_if_stale(self) -> bool:
        """Draw the view if the run log or the page's size changed since the last
        drawing (called by the renderer thread; one caller at a time)."""
        status = self.status()
        state, size = self._key(status), self.size_px
        if not self._stale(state, size):
            return False
        key = f"{status['last_step']}:{status['num_steps']}"
        self.rendering = key
        try:
            png, hover = _render(self.logdir, size_px=size)
        finally:
            self.rendering = None
        with self.lock:
            self.drawn = {"key": key, "state": state, "size": size, "png": png,
                          "hover": hover}
            self.earlier[key] = self.drawn
            while len(self.earlier) > 3:
                self.earlier.pop(next(iter(self.earlier)))
            self.renders += 1
        return True

    def wait_drawn(self, timeout: float = 60.0) -> dict[str, Any] | None:
        """Wait until the drawing shows the run log's current state (for tests)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            drawn = self.drawn  # (judged as read: the renderer may replace it meanwhile)
            if drawn is not None and not self._stale(self._key(self.status()), self.size_px,
                                                     drawn):
                return drawn
            self.wake()
            time.sleep(0.05)
        return None

    # ------------------------------------------------------------------ requests
    def status(self) -> dict[str, Any]:
        return run_status(self.logdir)

    @staticmethod
    def _key(status: dict[str, Any]) -> tuple:
        return (status["last_step"], status["num_steps"], status["version"])

    def set_size(self, width: int, height: int) -> None:
        if width > 0 and height > 0:
            self.size_px = (min(width, 4000), min(height, 3000))

    def png(self) -> bytes:
        """The last finished drawing; before the first, a note that it is being drawn."""
        drawn = self.drawn
        if drawn is not None:
            return drawn["png"]
        self.wake()
        if self._placeholder is None:
            self._placeholder = _placeholder_png("Drawing the cockpit view …")
        return self._placeholder

    def hover(self, key: str | None = None) -> dict[str, Any]:
        """Panel positions and values of the drawing ``key`` (default the last one)."""
        with self.lock:
            drawn = self.earlier.get(key) if key is not None else None
            drawn = drawn or self.drawn
        return drawn["hover"] if drawn is not None else {"panels": [], "series": {}}

    def findings(self) -> dict[str, Any]:
        """The diagnosis of the run log's current state (once per state)."""
        with self.findings_lock:
            key = self._key(self.status())
            if key != self.findings_key or self.cache_findings is None:
                self.cache_findings = findings_data(self.logdir)
                self.findings_key = key
            return self.cache_findings

    def status_body(self) -> dict[str, Any]:
        status = self.status()
        drawn = self.drawn
        if drawn is None or self._stale(self._key(status), self.size_px):
            self.wake()
        return {"last_step": status["last_step"], "num_steps": status["num_steps"],
                "run": self.logdir.name, "rendered": None if drawn is None else drawn["key"],
                "rendering": self.rendering}

    def page(self) -> str:
        status = self.status()
        drawn = self.drawn
        key = "" if drawn is None else drawn["key"]
        return page_html(self.logdir.name or str(self.logdir), status["last_step"],
                         status["num_steps"], self.refresh_seconds, key)
