"""The live view's HTML page: the cockpit view fitted to the window, the read-out under the
pointer and the diagnosis beside it, and the inline script that polls ``/status.json`` and
reloads what changed (:func:`page_html`)."""

from __future__ import annotations

import html
import json

__all__ = ["page_html"]

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
  if (d.all_clear) items.push(el("li", "✓ no problem named by diagnose()", "ok"));
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


def page_html(run: str, last_step: int | None, num_steps: int, refresh_seconds: float,
              key: str) -> str:
    """The page of run ``run`` showing the drawing ``key`` ("last_step:num_steps", empty
    before the first), polling every ``refresh_seconds``."""
    return _PAGE.format(
        run=html.escape(run),
        last_step="–" if last_step is None else last_step,
        num_steps=num_steps, refresh=refresh_seconds,
        refresh_ms=max(100, round(1000 * refresh_seconds)),
        key=html.escape(key, quote=True), key_json=json.dumps(key),
    )
