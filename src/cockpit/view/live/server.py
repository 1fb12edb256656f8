"""The live view's HTTP server: the routes of the page (:mod:`cockpit.view.live`'s
docstring lists them; nothing else is served) and :func:`serve`, which serves until
interrupted."""

from __future__ import annotations

import contextlib
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cockpit.view._source import run_status
from cockpit.view.live.renderer import _ViewState

__all__ = ["make_server", "serve"]


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
            parts = urlsplit(self.path)
            path, query = parts.path, parse_qs(parts.query)
            try:
                if path in ("/", "/index.html"):
                    self._send(200, state.page().encode(), "text/html; charset=utf-8", head)
                elif path == "/view.png":
                    self._send(200, state.png(), "image/png", head)
                elif path == "/panels.json":
                    body = json.dumps(state.hover(query.get("v", [None])[0])).encode()
                    self._send(200, body, "application/json", head)
                elif path == "/findings.json":
                    body = json.dumps(state.findings()).encode()
                    self._send(200, body, "application/json", head)
                elif path == "/status.json":
                    with contextlib.suppress(KeyError, ValueError):
                        state.set_size(int(float(query["w"][0])), int(float(query["h"][0])))
                    body = state.status_body()
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
    server = _ViewServer((host, port), _make_handler(state))
    server.daemon_threads = True
    server.view_state = state
    state.start()
    return server


class _ViewServer(ThreadingHTTPServer):
    """The HTTP server; closing it also ends the renderer thread."""

    view_state: _ViewState

    def server_close(self) -> None:
        self.view_state.stop()
        super().server_close()


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
