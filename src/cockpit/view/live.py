"""Live cockpit views: a figure redrawn in place (:class:`LivePlot`) and a small web
page served with the standard library only (:func:`serve`).

The web view reads the run log of another process (training writes it, the viewer only
reads), so it works during training, after a crash and for finished runs. Routes:

* ``/``            an HTML page showing ``/view.png``; an inline script polls
                   ``/status.json`` and reloads the image when the last step changes,
* ``/view.png``    the cockpit view rendered from the run log (cached per run-log state),
* ``/status.json`` ``{"last_step", "num_steps", "run"}``.

Nothing else is served (no files at all); every other path is a 404.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from matplotlib.figure import Figure

from cockpit.view import _style as S
from cockpit.view._source import load_run, run_status
from cockpit.view.cockpit_view import figure_size, plot_cockpit, save_figure

__all__ = ["LivePlot", "make_server", "render_png", "serve"]


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
        size = figure_size(output)
        if self.fig is None:
            import matplotlib.pyplot as plt

            self.fig = plt.figure(figsize=size)
            if plt.isinteractive():
                plt.show(block=False)
        elif tuple(self.fig.get_size_inches()) != size:
            self.fig.set_size_inches(*size, forward=True)
        plot_cockpit(output, meta, fig=self.fig, **self.plot_kwargs)
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


# ------------------------------------------------------------------------ web view
def render_png(logdir: str | Path, *, dpi: int = 90) -> bytes:
    """PNG bytes of the cockpit view of ``logdir`` (a message figure if it has no log)."""
    try:
        output, meta = load_run(logdir)
    except FileNotFoundError:
        fig = Figure(figsize=(8, 3))
        fig.text(0.5, 0.5, f"Waiting for a run log in {Path(logdir).name!r} …", ha="center",
                 va="center", fontsize=S.FONT_SIZES["title"], color=S.GRAY)
    else:
        fig = plot_cockpit(output, meta)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Cockpit · {run}</title>
<style>
 body {{ font-family: system-ui, sans-serif; margin: 0; background: #f6f6f6; color: #222; }}
 header {{ padding: 8px 16px; background: #1f5fa8; color: white; display: flex;
          gap: 24px; align-items: baseline; }}
 header h1 {{ font-size: 18px; margin: 0; }}
 #conn {{ margin-left: auto; font-size: 13px; opacity: 0.9; }}
 main {{ padding: 8px; text-align: center; }}
 img {{ max-width: 100%; height: auto; background: white; box-shadow: 0 1px 4px #0003; }}
</style></head>
<body>
<header><h1>Cockpit · {run}</h1>
 <span>last step: <b id="last-step">{last_step}</b></span>
 <span>tracked steps: <b id="num-steps">{num_steps}</b></span>
 <span id="conn">live, refreshing every {refresh:g} s</span></header>
<main><img id="view" src="view.png?v={key}" alt="Cockpit view of {run}"></main>
<script>
const REFRESH_MS = {refresh_ms};
let shown = {key_json};
async function poll() {{
  try {{
    const response = await fetch("status.json", {{cache: "no-store"}});
    const s = await response.json();
    document.getElementById("last-step").textContent = s.last_step === null ? "–" : s.last_step;
    document.getElementById("num-steps").textContent = s.num_steps;
    const key = s.last_step + ":" + s.num_steps;
    if (key !== shown) {{
      shown = key;
      document.getElementById("view").src = "view.png?v=" + encodeURIComponent(key);
    }}
    document.getElementById("conn").textContent = "live, refreshing every {refresh:g} s";
  }} catch (err) {{
    document.getElementById("conn").textContent = "viewer not reachable, retrying …";
  }}
  setTimeout(poll, REFRESH_MS);
}}
setTimeout(poll, REFRESH_MS);
</script>
</body></html>
"""


class _ViewState:
    """What the server knows: the run directory and the last rendered PNG."""

    def __init__(self, logdir: Path, refresh_seconds: float) -> None:
        self.logdir = logdir
        self.refresh_seconds = refresh_seconds
        self.lock = threading.Lock()
        self.cache_key: tuple | None = None
        self.cache_png: bytes | None = None
        self.renders = 0

    def status(self) -> dict[str, Any]:
        return run_status(self.logdir)

    def png(self) -> bytes:
        """The cockpit view for the run log's current state, rendered once per state."""
        with self.lock:
            status = self.status()
            key = (status["last_step"], status["num_steps"], status["version"])
            if key != self.cache_key or self.cache_png is None:
                self.cache_png = render_png(self.logdir)
                self.cache_key = key
                self.renders += 1
            return self.cache_png

    def page(self) -> str:
        status = self.status()
        key = f"{status['last_step']}:{status['num_steps']}"
        return _PAGE.format(
            run=html.escape(self.logdir.name or str(self.logdir)),
            last_step="–" if status["last_step"] is None else status["last_step"],
            num_steps=status["num_steps"], refresh=self.refresh_seconds,
            refresh_ms=max(100, round(1000 * self.refresh_seconds)),
            key=html.escape(key, quote=True), key_json=json.dumps(key),
        )


def _make_handler(state: _ViewState) -> type[BaseHTTPRequestHandler]:
    class CockpitViewHandler(BaseHTTPRequestHandler):
        server_version = "CockpitView/1"

        def _send(self, code: int, body: bytes, content_type: str, head: bool) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _route(self, head: bool) -> None:
            path = urlsplit(self.path).path
            try:
                if path in ("/", "/index.html"):
                    self._send(200, state.page().encode(), "text/html; charset=utf-8", head)
                elif path == "/view.png":
                    self._send(200, state.png(), "image/png", head)
                elif path == "/status.json":
                    status = state.status()
                    body = {"last_step": status["last_step"], "num_steps": status["num_steps"],
                            "run": state.logdir.name}
                    self._send(200, json.dumps(body).encode(), "application/json", head)
                else:
                    self._send(404, b"Not found\n", "text/plain; charset=utf-8", head)
            except (BrokenPipeError, ConnectionResetError):
                pass
            except Exception as err:  # a broken run log must not kill the viewer
                msg = f"Cockpit view error: {type(err).__name__}: {err}\n".encode()
                with contextlib.suppress(OSError):
                    self._send(500, msg, "text/plain; charset=utf-8", head)

        def do_GET(self) -> None:
            self._route(head=False)

        def do_HEAD(self) -> None:
            self._route(head=True)

        def log_message(self, format: str, *args: Any) -> None:
            """Stay quiet: the viewer prints only its URL."""

    return CockpitViewHandler


def make_server(logdir: str | Path, host: str = "127.0.0.1", port: int = 8050,
                refresh_seconds: float = 2.0) -> ThreadingHTTPServer:
    """A ready (bound, not yet serving) HTTP server for the live view of ``logdir``."""
    state = _ViewState(Path(logdir), refresh_seconds)
    server = ThreadingHTTPServer((host, port), _make_handler(state))
    server.daemon_threads = True
    server.view_state = state  # type: ignore[attr-defined]
    return server


def serve(logdir: str | Path, host: str = "127.0.0.1", port: int = 8050,
          refresh_seconds: float = 2.0) -> None:
    """Serve the live cockpit view of ``logdir`` until interrupted (Ctrl+C).

    Binds to ``host`` (default 127.0.0.1: this machine only); ``port=0`` picks a free
    port. The URL is printed (and flushed) once the server listens.
    """
    server = make_server(logdir, host, port, refresh_seconds)
    bound_host, bound_port = server.server_address[:2]
    shown_host = f"[{bound_host}]" if ":" in str(bound_host) else bound_host
    if not run_status(logdir)["num_steps"]:
        print(f"No steps in {str(logdir)!r} yet; the page updates once training writes them.",
              flush=True)
    print(f"Cockpit live view of {str(logdir)!r}: http://{shown_host}:{bound_port}/ "
          "(Ctrl+C to stop)", flush=True)
    try:
        server.serve_forever(poll_interval=0.25)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
