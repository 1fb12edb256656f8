"""Live cockpit views: a figure redrawn in place (:class:`LivePlot`) and a small web
page served with the standard library only (:func:`serve`).

The web view reads the run log of another process (training writes it, the viewer only
reads), so it works during training, after a crash and for finished runs. Routes:

* ``/``              an HTML page: the cockpit view (``/view.png``) fitted to the window
                     (a button shows it at full size, the page then scrolls), and beside
                     it the diagnosis and a read-out of the values under the pointer; an
                     inline script polls ``/status.json`` and reloads what changed,
* ``/view.png``      the last finished drawing of the cockpit view (never waits for one),
* ``/status.json``   ``{"last_step", "num_steps", "run", "rendered", "rendering"}``; the
                     page sends the size of its figure area (``?w=…&h=…``, CSS pixels),
                     and the view is drawn at that size,
* ``/panels.json``   where each panel of ``/view.png`` is (fractions of the image) with its
                     x range and instruments, the recorded values of those instruments,
                     and the histogram shown, for the hover read-out,
* ``/findings.json`` :func:`cockpit.diagnose.diagnose` of the run log.

Nothing else is served (no files at all); every other path is a 404.

Drawing the view takes seconds on a busy CPU, longer than a poll. One renderer thread draws
it: at most once per new run-log state (a state that changed while drawing is drawn next,
the steps in between are skipped), never two drawings at once, and again when the page's
size changed. Requests never wait for it: ``/view.png`` and ``/panels.json`` give the last
finished drawing, ``/status.json`` reads only the run log's step count.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import math
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from matplotlib.figure import Figure

from cockpit.view import _style as S
from cockpit.view._data import is_tracked, normalize_output, per_param_names, scalar_series
from cockpit.view._hist import histogram_at
from cockpit.view._source import load_notes, load_run, run_status
from cockpit.view.cockpit_view import figure_size, plot_cockpit, save_figure
from cockpit.view.findings_panel import run_diagnosis

__all__ = ["LivePlot", "findings_data", "hover_data", "make_server", "panel_readouts",
           "readout_names", "render_png", "serve"]


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


# ------------------------------------------------------------------------ web view
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


def panel_readouts() -> dict[str, tuple[str, ...]]:
    """Panel key → the recorded names read out when the pointer is over it (panels with a
    step axis), from the instruments' descriptors (``Panel.readout``)."""
    return {key: panel.readout for key, (panel, _) in S.panels().items() if panel.readout}


def readout_names(output: Mapping, readout: tuple[str, ...]) -> list[str]:
    """The recorded names of a panel's read-out: ``"<name>/*"`` stands for every
    ``"<name>/<parameter>"`` recorded."""
    names: list[str] = []
    for name in readout:
        if name.endswith("/*"):
            prefix = name[:-2]
            names += [f"{prefix}/{p}" for p in per_param_names(output, prefix)]
        elif is_tracked(output, name):
            names.append(name)
    return names


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)  # "nan", "inf": JSON has no such numbers


def hover_data(fig: Figure, output: Mapping) -> dict[str, Any]:
    """Where the panels of a drawn cockpit view are and what to read out under the pointer.

    ``panels``: ``{key, title, box: [left, top, right, bottom]}`` as fractions of the image
    (origin top left), with ``xlim`` and ``instruments`` for panels over steps, or
    ``hist: {step, edges, counts}`` for the gradient-element histogram. ``series``: the
    recorded values of those instruments (steps with a number; non-finite as strings).
    """
    out = normalize_output(output)
    keys = {title: key for key, title in S.PANEL_TITLES.items()}
    readouts = panel_readouts()
    panels, names = [], set()
    for ax in fig.axes:
        key = keys.get(ax.get_title(loc="left"))
        if key is None:
            continue
        pos = ax.get_position()
        entry: dict[str, Any] = {"key": key, "title": S.PANEL_TITLES[key],
                                 "box": [pos.x0, 1 - pos.y1, pos.x1, 1 - pos.y0]}
        if key in readouts:
            shown = readout_names(out, readouts[key])
            entry.update(xlim=list(ax.get_xlim()), instruments=shown)
            names.update(shown)
        elif key == "GradHist1d":
            hist = histogram_at(out, "GradHist1d")
            if hist is not None and hist.total > 0:
                entry.update(xlim=list(ax.get_xlim()), hist={
                    "step": hist.step, "edges": hist.edges.tolist(),
                    "counts": [int(c) for c in hist.counts]})
        panels.append(entry)
    series = {}
    for name in sorted(names):
        steps, vals = scalar_series(out, name)
        series[name] = {"steps": steps.tolist(), "values": [_json_float(v) for v in vals]}
    return {"panels": panels, "series": series}


def findings_data(logdir: str | Path) -> dict[str, Any]:
    """``{"findings": [...], "error"}``: the diagnosis of the run log as plain data."""
    if not run_status(logdir)["num_steps"]:
        return {"findings": [], "error": None}
    findings, error = run_diagnosis(logdir)
    return {"findings": [{"code": f.code, "severity": f.severity, "message": f.message,
                          "advice": f.advice, "parameters": list(f.parameters),
                          "evidence": [str(e) for e in f.evidence]} for f in findings],
            "error": error}


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Cockpit · {run}</title>
<style>
 html, body {{ margin: 0; }}
 body {{ font-family: system-ui, sans-serif; background: #f6f6f6; color: #222;
        display: flex; flex-direction: column; }}
 body.fit {{ height: 100vh; overflow: hidden; }}
 header {{ flex: none; padding: 6px 16px; background: #1f5fa8; color: white; display: flex;
          gap: 24px; align-items: baseline; }}
 header h1 {{ font-size: 18px; margin: 0; }}
 header button {{ font: inherit; font-size: 13px; padding: 1px 8px; cursor: pointer; }}
 #conn {{ margin-left: auto; font-size: 13px; opacity: 0.9; }}
 main {{ flex: 1; min-height: 0; display: flex; gap: 10px; padding: 8px;
        box-sizing: border-box; }}
 #figure {{ flex: 1; min-width: 0; position: relative; }}
 body.fit #figure {{ display: flex; justify-content: center; align-items: flex-start; }}
 body.full #figure {{ overflow-x: auto; }}
 #view {{ display: block; background: white; box-shadow: 0 1px 4px #0003; }}
 body.fit #view {{ max-width: 100%; max-height: 100%; width: auto; height: auto; }}
 #hair {{ position: absolute; width: 0; border-left: 1px solid #d62728; pointer-events: none;
         display: none; }}
 aside {{ flex: 0 0 320px; display: flex; flex-direction: column; gap: 10px; min-height: 0; }}
 body.fit aside {{ overflow-y: auto; }}
 aside section {{ background: white; box-shadow: 0 1px 4px #0003; padding: 8px 10px;
                 font-size: 13px; }}
 aside h2 {{ font-size: 14px; margin: 0 0 6px 0; }}
 #readout table {{ border-collapse: collapse; width: 100%; }}
 #readout td {{ padding: 1px 4px; }} #readout td.v {{ text-align: right;
   font-variant-numeric: tabular-nums; }}
 #findings {{ list-style: none; padding: 0; margin: 0; }}
 #findings li {{ margin-bottom: 8px; }} #findings .error {{ color: #d62728; }}
 #findings .warning {{ color: #b35f00; }} #findings .info, .muted {{ color: #6e6e6e; }}
 #findings .ok {{ color: #2e8b57; font-weight: bold; }}
 #findings .advice {{ color: #444; display: block; margin-left: 1em; }}
</style></head>
<body class="fit">
<header><h1>Cockpit · {run}</h1>
 <span>last step: <b id="last-step">{last_step}</b></span>
 <span>tracked steps: <b id="num-steps">{num_steps}</b></span>
 <button id="size" type="button" title="fit the view to the window or show it at full size">
 full size</button>
 <span id="conn">live, refreshing every {refresh:g} s</span></header>
<main>
 <div id="figure"><img id="view" src="view.png?v={key}" alt="Cockpit view of {run}">
  <div id="hair"></div></div>
 <aside>
  <section><h2>Under the pointer</h2>
   <div id="readout" class="muted">Point at a panel to read its values.</div></section>
  <section><h2>Diagnosis</h2><ul id="findings"><li class="muted">…</li></ul></section>
 </aside>
</main>
<script>
const REFRESH_MS = {refresh_ms};
let shown = {key_json};
window.cockpitHover = {{panels: [], series: {{}}}};
const img = document.getElementById("view");
const hair = document.getElementById("hair");
const readout = document.getElementById("readout");

document.getElementById("size").addEventListener("click", (ev) => {{
  const fit = document.body.classList.toggle("fit");
  document.body.classList.toggle("full", !fit);
  ev.target.textContent = fit ? "full size" : "fit to window";
}});

function el(tag, text, cls) {{
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}}
function fmt(v) {{
  if (typeof v === "string") return v;
  const a = Math.abs(v);
  return (a !== 0 && (a < 1e-3 || a >= 1e5)) ? v.toExponential(3) : String(+v.toPrecision(4));
}}
function nearestIndex(steps, x) {{
  let lo = 0, hi = steps.length - 1;
  while (hi - lo > 1) {{
    const mid = (lo + hi) >> 1;
    if (steps[mid] <= x) lo = mid; else hi = mid;
  }}
  return Math.abs(steps[hi] - x) < Math.abs(steps[lo] - x) ? hi : lo;
}}
function showRows(title, caption, rows) {{
  readout.className = "";
  readout.replaceChildren(el("b", title), el("div", caption, "muted"));
  const table = el("table");
  for (const [name, value] of rows) {{
    const tr = el("tr"); tr.dataset.name = name;
    tr.append(el("td", name), el("td", value, "v"));
    table.append(tr);
  }}
  readout.append(table);
}}
function hover(ev) {{
  const r = img.getBoundingClientRect();
  const fx = (ev.clientX - r.left) / r.width, fy = (ev.clientY - r.top) / r.height;
  const data = window.cockpitHover;
  const p = data.panels.find(q => fx >= q.box[0] && fx <= q.box[2] && fy >= q.box[1]
                                  && fy <= q.box[3]);
  if (!p || !p.xlim) {{ hair.style.display = "none"; return; }}
  const w = p.box[2] - p.box[0];
  const x = p.xlim[0] + (fx - p.box[0]) / w * (p.xlim[1] - p.xlim[0]);
  let at = x;
  if (p.instruments) {{
    let best = null;
    for (const n of p.instruments) {{
      const s = data.series[n];
      if (!s || !s.steps.length) continue;
      const st = s.steps[nearestIndex(s.steps, x)];
      if (best === null || Math.abs(st - x) < Math.abs(best - x)) best = st;
    }}
    if (best === null) return;
    at = best;
    readout.dataset.step = best;
    showRows(p.title, "step " + best, p.instruments.map(n => {{
      const s = data.series[n];
      const i = s ? s.steps.indexOf(best) : -1;
      return [n, i < 0 ? "—" : fmt(s.values[i])];
    }}));
  }} else if (p.hist) {{
    const e = p.hist.edges;
    let k = 0;
    while (k < e.length - 2 && e[k + 1] <= x) k++;
    delete readout.dataset.step;
    showRows(p.title, "step " + p.hist.step, [["bin", "[" + fmt(e[k]) + ", " + fmt(e[k + 1])
      + ")"], ["elements", String(p.hist.counts[k])]]);
  }}
  const box = document.getElementById("figure").getBoundingClientRect();
  const px = r.left + (p.box[0] + (at - p.xlim[0]) / (p.xlim[1] - p.xlim[0]) * w) * r.width;
  hair.style.left = (px - box.left) + "px";
  hair.style.top = (r.top - box.top + p.box[1] * r.height) + "px";
  hair.style.height = ((p.box[3] - p.box[1]) * r.height) + "px";
  hair.style.display = "block";
}}
img.addEventListener("mousemove", hover);
img.addEventListener("mouseleave", () => {{ hair.style.display = "none"; }});

async function loadPanels() {{
  const r = await fetch("panels.json?v=" + encodeURIComponent(shown), {{cache: "no-store"}});
  window.cockpitHover = await r.json();
}}
async function loadFindings() {{
  const r = await fetch("findings.json?v=" + encodeURIComponent(shown), {{cache: "no-store"}});
  const d = await r.json();
  const list = document.getElementById("findings");
  const items = [];
  if (d.error) items.push(el("li", d.error, "info"));
  const problems = d.findings.filter(f => f.severity !== "info");
  const skipped = d.findings.filter(f => f.code === "checks_skipped");
  if (!d.error && !problems.length && !skipped.length)
    items.push(el("li", "✓ no problem named by diagnose()", "ok"));
  for (const f of d.findings) {{
    const li = el("li", undefined, f.severity);
    li.dataset.code = f.code;
    const where = f.parameters.length ? " (" + f.parameters.join(", ") + ")" : "";
    li.append(el("b", f.code + where + ": "), document.createTextNode(f.message));
    if (f.code === "checks_skipped") li.append(el("span", f.evidence.join("; "), "advice"));
    else if (f.advice) li.append(el("span", "try: " + f.advice, "advice"));
    li.title = f.evidence.join("\\n");
    items.push(li);
  }}
  list.replaceChildren(...items);
}}
img.addEventListener("load", () => {{ loadPanels(); }});
function figureSize() {{
  // the area the view is fitted into; at full size the view keeps its last drawn size
  const box = document.getElementById("figure");
  if (!document.body.classList.contains("fit")) return "";
  return "?w=" + Math.round(box.clientWidth) + "&h=" + Math.round(box.clientHeight);
}}
async function poll() {{
  try {{
    const response = await fetch("status.json" + figureSize(), {{cache: "no-store"}});
    const s = await response.json();
    document.getElementById("last-step").textContent = s.last_step === null ? "–" : s.last_step;
    document.getElementById("num-steps").textContent = s.num_steps;
    if (s.rendered !== null && s.rendered !== shown) {{
      shown = s.rendered;
      img.src = "view.png?v=" + encodeURIComponent(shown);
      loadFindings();
    }}
    document.getElementById("conn").textContent = s.rendering !== null
      ? "live · drawing step " + s.rendering.split(":")[0] + " …"
      : "live, refreshing every {refresh:g} s";
  }} catch (err) {{
    document.getElementById("conn").textContent = "viewer not reachable, retrying …";
  }}
  setTimeout(poll, REFRESH_MS);
}}
loadPanels(); loadFindings();
poll();
</script>
</body></html>
"""


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

    def _stale(self, state: tuple, size: tuple[int, int] | None) -> bool:
        drawn = self.drawn
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
            drawn = self.drawn
            if drawn is not None and not self._stale(self._key(self.status()), self.size_px):
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
