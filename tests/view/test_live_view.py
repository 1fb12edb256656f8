"""Live views: LivePlot redraws in place, the web view serves only its three routes and a
headless Chromium sees the page follow a run log that grows while it is open."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest

from cockpit.store import RunLogWriter
from cockpit.view import LivePlot, main_plot, plot_run
from cockpit.view import _style as S
from cockpit.view.live import make_server
from cockpit.view.synthetic import synthetic_meta, synthetic_output

SRC = Path(__file__).resolve().parents[2] / "src"


def write_run(logdir: Path, output: dict, meta: dict | None = None) -> None:
    """Write ``output`` as steps of the run in ``logdir``; a later call continues that run
    (as a live run grows)."""
    writer = RunLogWriter(logdir, meta=meta, resume=True)
    for step, values in output.items():
        writer.write_step(step, values)
    writer.close()


def small_output(first: int, last: int) -> dict:
    """Cheap-to-draw instruments (loss, gradient norm, distances) over steps first..last."""
    full = synthetic_output("economy", num_steps=200, every=5, seed=11,
                            instruments=("Loss", "GradNorm", "Distance", "UpdateSize"))
    return {t: v for t, v in full.items() if first <= t <= last}


def panel_titles(fig) -> set[str]:
    return {ax.get_title(loc="left") for ax in fig.axes} - {""}


# ----------------------------------------------------------------- store-based entry points
def test_plot_run_and_main_plot_read_the_run_log(tmp_path) -> None:
    run = tmp_path / "run"
    output = synthetic_output("economy", num_steps=40, every=10, seed=3, per_param=True)
    write_run(run, output, synthetic_meta())
    fig = plot_run(run)
    assert "cifar10_3c3d" in fig._suptitle.get_text()
    assert S.PANEL_TITLES["GradientTests"] in panel_titles(fig)
    loss_line = next(ax for ax in fig.axes if ax.get_title(loc="left") == S.PANEL_TITLES[
        "Loss"]).get_lines()[0]
    assert list(loss_line.get_ydata()) == [output[t]["Loss"] for t in sorted(output)]

    small = tmp_path / "small"
    write_run(small, synthetic_output("economy", num_steps=20, every=10, seed=4,
                                      instruments=("Loss", "GradHist1d")))
    assert main_plot([str(small), "--layers", str(tmp_path / "layers.pdf"), "--dpi", "40"]) == 0
    assert (tmp_path / "layers.pdf").read_bytes().startswith(b"%PDF")
    assert not (small / "cockpit_view.png").exists()  # --layers draws only the layers
    assert main_plot([str(small), "--dpi", "40"]) == 0
    assert (small / "cockpit_view.png").read_bytes().startswith(b"\x89PNG")
    assert main_plot([str(tmp_path / "missing")]) == 2
    assert main_plot([str(small), "-o", str(tmp_path / "v.gif")]) == 2


def test_plot_options_act_or_are_refused(tmp_path, capsys) -> None:
    """--step draws the run as at that step (with or without --layers); a step that was
    not tracked, a missing run and a run without steps are refused with what to do."""
    from cockpit.store import read_output

    run = tmp_path / "run"
    output = synthetic_output("economy", num_steps=40, every=10, seed=3, per_param=True)
    write_run(run, output, synthetic_meta())
    assert main_plot([str(run), "-o", str(tmp_path / "last.png"), "--dpi", "40"]) == 0
    assert main_plot([str(run), "--step", "10", "-o", str(tmp_path / "s10.png"),
                      "--dpi", "40"]) == 0
    assert (tmp_path / "s10.png").read_bytes() != (tmp_path / "last.png").read_bytes()
    from cockpit.view import plot_cockpit

    recorded = read_output(run)
    fig = plot_cockpit({s: v for s, v in recorded.items() if s <= 10})
    loss = next(ax for ax in fig.axes if ax.get_title(loc="left") == S.PANEL_TITLES["Loss"])
    assert list(loss.get_lines()[0].get_xdata()) == [0, 10]
    assert main_plot([str(run), "--layers", str(tmp_path / "l10.png"), "--step", "10",
                      "--dpi", "40"]) == 0
    assert main_plot([str(run), "--layers", str(tmp_path / "l40.png"), "--dpi", "40"]) == 0
    assert (tmp_path / "l10.png").read_bytes() != (tmp_path / "l40.png").read_bytes()
    capsys.readouterr()
    assert main_plot([str(run), "--step", "15"]) == 2
    assert "step 15 was not tracked" in capsys.readouterr().err
    assert main_plot([str(tmp_path / "nonexist")]) == 2
    assert "no such run directory or file: " in capsys.readouterr().err
    empty = tmp_path / "empty"
    write_run(empty, {})
    assert main_plot([str(empty)]) == 1
    assert "holds no tracked step yet" in capsys.readouterr().err
    assert not (empty / "cockpit_view.png").exists()


def test_live_plot_redraws_the_same_figure(tmp_path) -> None:
    run = tmp_path / "run"
    write_run(run, small_output(0, 50))
    live = LivePlot(run)
    fig = live.update()
    first = fig.axes[0].get_lines()[0].get_xdata()
    write_run(run, small_output(55, 100))
    assert live.update() is fig and live.num_updates == 2
    loss_ax = next(a for a in fig.axes if a.get_title(loc="left") == S.PANEL_TITLES["Loss"])
    assert loss_ax.get_lines()[0].get_xdata()[-1] == 100 and len(first) == 11
    assert panel_titles(fig) == {S.PANEL_TITLES[k] for k in ("Distances", "GradNorm", "Loss",
                                                             "Findings")}
    live.save(tmp_path / "live.png")
    assert (tmp_path / "live.png").read_bytes()[:4] == b"\x89PNG"
    live.close()

    class FakeCockpit:  # the live object a training script holds
        def meta(self):
            return {"model": "tiny", "optimizer": "SGD"}

        def get_output(self):
            return {0: {"Loss": 2.0}, 1: {"Loss": 1.5}}

    fig2 = LivePlot(FakeCockpit()).update()
    assert panel_titles(fig2) == {S.PANEL_TITLES["Loss"], S.PANEL_TITLES["Findings"]}
    assert fig2._suptitle.get_text() == "Cockpit · tiny · SGD"


# ----------------------------------------------------------------------- the HTTP server
@pytest.fixture
def served_run(tmp_path):
    run = tmp_path / "run"
    write_run(run, small_output(0, 20))
    (tmp_path / "secret.txt").write_text("do not serve")
    server = make_server(run, port=0, refresh_seconds=0.5)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield run, server
    server.shutdown()
    server.server_close()


def fetch(server, path: str, method: str = "GET") -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    conn.request(method, path)  # the path is sent as is (no client-side normalization)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), body


def test_server_routes_status_and_png_cache(served_run) -> None:
    run, server = served_run
    assert server.server_address[0] == "127.0.0.1"
    state = server.view_state
    assert state.wait_drawn() is not None
    status, headers, body = fetch(server, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'id="last-step">20<' in body and b'src="view.png?v=20:5"' in body
    status, _, body = fetch(server, "/status.json")
    assert json.loads(body) == {"last_step": 20, "num_steps": 5, "run": "run",
                                "rendered": "20:5", "rendering": None}
    status, headers, png = fetch(server, "/view.png?v=20:5")
    assert status == 200 and headers["Content-Type"] == "image/png"
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    time.sleep(1.2)  # the renderer wakes every 0.5 s: nothing new, nothing drawn
    assert fetch(server, "/view.png")[2] == png and state.renders == 1
    write_run(run, small_output(25, 30))
    assert json.loads(fetch(server, "/status.json")[2])["last_step"] == 30
    assert state.wait_drawn()["key"] == "30:7"
    assert fetch(server, "/view.png")[2] != png and state.renders == 2
    status, headers, body = fetch(server, "/status.json", method="HEAD")
    assert status == 200 and body == b""


def test_requests_never_wait_for_a_drawing_and_one_is_drawn_at_a_time(served_run,
                                                                      monkeypatch) -> None:
    """While a drawing takes long, status, the image (the last finished one) and the page
    answer at once; new steps during a drawing give one more drawing, not one per
    request; the view is drawn at the size the page asks for."""
    import cockpit.view.live.renderer as live

    run, server = served_run
    state = server.view_state
    state.wait_drawn()
    first = fetch(server, "/view.png")[2]
    slow, active, most = threading.Event(), [0], [0]
    real = live._render

    def slow_render(*args, **kwargs):
        active[0] += 1
        most[0] = max(most[0], active[0])
        slow.wait(20)
        try:
            return real(*args, **kwargs)
        finally:
            active[0] -= 1

    monkeypatch.setattr(live, "_render", slow_render)
    write_run(run, small_output(25, 30))
    _wait_for(lambda: state.rendering == "30:7", 10, "a drawing of step 30")
    for step in (35, 40):
        write_run(run, small_output(step, step))
        for path in ("/status.json?w=1300&h=900", "/view.png", "/", "/panels.json"):
            started = time.monotonic()
            status, _, body = fetch(server, path)
            assert status == 200 and time.monotonic() - started < 2.0, path
        assert fetch(server, "/view.png")[2] == first  # the last finished drawing
        body = json.loads(fetch(server, "/status.json?w=1300&h=900")[2])
        assert body["last_step"] == step and body["rendered"] == "20:5"
        assert body["rendering"] == "30:7"
    slow.set()
    drawn = state.wait_drawn()
    assert drawn["key"] == "40:9" and most[0] == 1
    assert state.renders == 3  # 20, 30 and (skipping 35) 40
    from PIL import Image

    width, height = Image.open(io.BytesIO(drawn["png"])).size
    assert (width, height) == (1300, 900)


@pytest.mark.parametrize("path", [
    "/../secret.txt", "/..%2fsecret.txt", "/%2e%2e/secret.txt", "//etc/passwd",
    "/view.png/../../secret.txt", "/cockpit.sqlite", "/run/cockpit.sqlite", "/etc/passwd",
    "/favicon.ico", "/status.json/..", "/../../../../etc/passwd"])
def test_server_serves_no_files(served_run, path: str) -> None:
    _, server = served_run
    status, _, body = fetch(server, path)
    assert status == 404 and body == b"Not found\n"
    assert fetch(server, path, method="POST")[0] == 501


def test_server_waits_for_a_missing_run_log(tmp_path) -> None:
    server = make_server(tmp_path / "not-yet", port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert json.loads(fetch(server, "/status.json")[2])["num_steps"] == 0
        status, _, png = fetch(server, "/view.png")
        assert status == 200 and png[:4] == b"\x89PNG"
        assert b'id="last-step">\xe2\x80\x93<' in fetch(server, "/")[2]
        findings = json.loads(fetch(server, "/findings.json")[2])
        assert [f["code"] for f in findings["findings"]] == ["checks_skipped"]
        assert findings["error"] is None and findings["all_clear"] is False
        assert json.loads(fetch(server, "/panels.json")[2]) == {"panels": [], "series": {}}
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------- end to end in a browser
def _chromium() -> str | None:
    for cand in ("/usr/lib/chromium/chromium", "chromium", "chromium-browser",
                 "google-chrome"):
        path = shutil.which(cand) or (cand if os.path.isfile(cand) else None)
        if path:
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wd(base: str, method: str, path: str, payload: dict | None = None) -> dict:
    """One W3C WebDriver call to chromedriver (plain HTTP + JSON, standard library)."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=90) as resp:
        return json.loads(resp.read())


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")


BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

PAGE_STATE = """
const img = document.getElementById("view");
return {last: document.getElementById("last-step").textContent,
        steps: document.getElementById("num-steps").textContent,
        src: img.getAttribute("src"), loaded: img.complete && img.naturalWidth > 0,
        width: img.naturalWidth};
"""


@contextlib.contextmanager
def _viewer_in_browser(run: Path):
    """``cockpit view RUN`` in a subprocess and a headless Chromium session on its page:
    yields ``(base, session, url)`` for WebDriver calls, or ``(None, None, url)`` where
    chromedriver is missing."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "MPLBACKEND": "Agg"}
    viewer = subprocess.Popen(
        [sys.executable, "-m", "cockpit.view.commands", "view", str(run), "--port", "0",
         "--refresh", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env)
    driver = None
    profile = tempfile.mkdtemp(prefix="cockpit-chromium-")
    try:
        line = viewer.stdout.readline()
        assert "http://127.0.0.1:" in line, line + viewer.stderr.read()
        url = "http://" + line.split("http://", 1)[1].split()[0]
        chromedriver = shutil.which("chromedriver")
        if chromedriver is None:
            yield None, profile, url
            return
        port = _free_port()
        driver = subprocess.Popen([chromedriver, f"--port={port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        _wait_for(lambda: _try(lambda: _wd(base, "GET", "/status")["value"]["ready"]), 30,
                  "chromedriver")
        caps = {"capabilities": {"alwaysMatch": {"goog:chromeOptions": {
            "binary": _chromium(), "args": [*BROWSER_FLAGS, f"--user-data-dir={profile}"]}}}}
        session = _wd(base, "POST", "/session", caps)["value"]["sessionId"]
        try:
            _wd(base, "POST", f"/session/{session}/url", {"url": url})
            yield base, session, url
        finally:
            _wd(base, "DELETE", f"/session/{session}")
    finally:
        for proc in (driver, viewer):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if viewer.stdout:
            viewer.stdout.close()
        if viewer.stderr:
            viewer.stderr.close()
        shutil.rmtree(profile, ignore_errors=True)


def _script(base: str, session: str, script: str):
    return _wd(base, "POST", f"/session/{session}/execute/sync",
               {"script": script, "args": []})["value"]


needs_chromium = pytest.mark.skipif(
    _chromium() is None, reason="chromium not found (apt-get install chromium chromium-driver)")


@needs_chromium
def test_browser_follows_a_growing_run(tmp_path) -> None:
    run = tmp_path / "run"
    write_run(run, small_output(0, 20))
    with _viewer_in_browser(run) as (base, session, url):
        if base is None:  # no WebDriver: a one-shot DOM dump still runs the page
            _dump_dom_check(url, run, session)
            return

        def state() -> dict:
            return _script(base, session, PAGE_STATE)

        title = _wd(base, "GET", f"/session/{session}/title")["value"]
        assert title == "Cockpit · run"
        first = _wait_for(lambda: (s := state())["loaded"] and "20" in s["src"] and s, 90,
                          "the first image")
        assert first["last"] == "20" and first["steps"] == "5" and first["width"] > 500
        _check_layout_and_hover(base, session)
        write_run(run, small_output(25, 45))
        new = _wait_for(lambda: (s := state())["last"] == "45" and s["loaded"]
                        and "45" in s["src"] and s, 90, "the page to show step 45")
        assert new["steps"] == "10" and new["src"] == "view.png?v=45%3A10"


DRAWN_STATE = """
const img = document.getElementById("view");
const box = document.getElementById("figure");
return {last: Number(document.getElementById("last-step").textContent),
        src: img.getAttribute("src"), natural: [img.naturalWidth, img.naturalHeight],
        shown: [img.clientWidth, img.clientHeight], box: [box.clientWidth, box.clientHeight]};
"""


@needs_chromium
def test_browser_page_stays_live_while_a_run_writes(tmp_path) -> None:
    """A run writes a step every 0.3 s (every instrument of the economy view, so a drawing
    takes a while) while the page is open at 1600×1000: the header follows the run, the
    image follows it too (screenshots at least 10 s apart differ), it is drawn at the size of the
    page's figure area (not scaled), and after the run the page shows its last step."""
    run = tmp_path / "run"
    full = synthetic_output("economy", num_steps=800, every=2, seed=5, per_param=True)
    steps = sorted(full)
    write_run(run, {t: full[t] for t in steps[:10]}, synthetic_meta())
    stop = threading.Event()

    def training() -> None:
        writer = RunLogWriter(run, resume=True)
        for t in steps[10:]:
            if stop.wait(0.3):
                break
            writer.write_step(t, full[t])
        writer.close()

    with _viewer_in_browser(run) as (base, session, _):
        if base is None:
            pytest.skip("chromedriver not found")
        _wd(base, "POST", f"/session/{session}/window/rect", {"width": 1600, "height": 1000})
        _wait_for(lambda: "v=18" in _script(base, session, DRAWN_STATE)["src"], 60,
                  "the first drawing")
        writer = threading.Thread(target=training)
        writer.start()
        try:
            time.sleep(3)
            shot = _wd(base, "GET", f"/session/{session}/screenshot")["value"]
            shots, states = [shot], [_script(base, session, DRAWN_STATE)]
            for _ in range(2):
                # at least 10 s apart; a busy machine (a drawing takes a few seconds per
                # core) may need longer: the page must change within 45 s while the run writes
                time.sleep(10)
                deadline = time.monotonic() + 35
                while True:
                    shot = _wd(base, "GET", f"/session/{session}/screenshot")["value"]
                    if shot != shots[-1] or time.monotonic() > deadline:
                        break
                    time.sleep(1)
                shots.append(shot)
                states.append(_script(base, session, DRAWN_STATE))
        finally:
            stop.set()
            writer.join()
        assert shots[0] != shots[1] != shots[2]
        lasts = [s["last"] for s in states]
        assert lasts[0] < lasts[1] < lasts[2], states  # the header follows the run
        shown = [int(s["src"].split("v=")[1].split("%3A")[0]) for s in states]
        assert shown[0] < shown[1] < shown[2], states  # and so does the image
        final = max(_run_steps(run))
        done = _wait_for(lambda: (s := _script(base, session, DRAWN_STATE))["src"].startswith(
            f"view.png?v={final}%3A") and s, 60, "the last step's drawing")
        (w, h), (bw, bh) = done["natural"], done["box"]
        assert abs(w - bw) <= 0.05 * bw or abs(h - bh) <= 0.05 * bh, done  # drawn to fit
        assert done["shown"][0] >= 0.95 * w, done  # shown at its own size, not scaled down


def _run_steps(run: Path) -> list[int]:
    from cockpit.store import RunLogReader

    with RunLogReader(run) as reader:
        return reader.steps()


FIT_STATE = """
const img = document.getElementById("view").getBoundingClientRect();
const aside = document.querySelector("aside").getBoundingClientRect();
return {inner: [window.innerWidth, window.innerHeight], img: [img.left, img.right, img.bottom],
        aside: [aside.left, aside.right], scroll: document.documentElement.scrollHeight,
        findings: document.querySelectorAll("#findings li").length,
        panels: window.cockpitHover.panels.length};
"""

HOVER_LOSS = """
const p = window.cockpitHover.panels.find(q => q.key === "Loss");
const img = document.getElementById("view");
const r = img.getBoundingClientRect();
const fx = (p.box[0] + p.box[2]) / 2, fy = (p.box[1] + p.box[3]) / 2;
img.dispatchEvent(new MouseEvent("mousemove", {clientX: r.left + fx * r.width,
                                               clientY: r.top + fy * r.height, bubbles: true}));
const rd = document.getElementById("readout");
return {step: rd.dataset.step, xlim: p.xlim,
        rows: [...rd.querySelectorAll("tr")].map(t => [t.dataset.name, t.children[1].textContent]),
        hair: document.getElementById("hair").style.display};
"""


def _check_layout_and_hover(base: str, session: str) -> None:
    """At 1400×1000 the whole view (bottom row included) and the side panel fit without
    scrolling; pointing at the middle of the loss panel reads out the loss there."""
    _wd(base, "POST", f"/session/{session}/window/rect", {"width": 1400, "height": 1000})

    def run(script: str) -> dict:
        return _wd(base, "POST", f"/session/{session}/execute/sync",
                   {"script": script, "args": []})["value"]

    fit = _wait_for(lambda: (s := run(FIT_STATE))["panels"] > 0 and s["findings"] > 0 and s,
                    60, "hover data and findings")
    width, height = fit["inner"]
    assert fit["img"][2] <= height + 1 and fit["scroll"] <= height + 1, fit
    assert fit["img"][1] <= fit["aside"][0] and fit["aside"][1] <= width + 1, fit
    hovered = run(HOVER_LOSS)
    middle = sum(hovered["xlim"]) / 2
    steps = sorted(small_output(0, 20))
    nearest = min(steps, key=lambda t: abs(t - middle))
    assert hovered["step"] == str(nearest) and hovered["hair"] == "block"
    (loss,) = [v for name, v in hovered["rows"] if name == "Loss"]
    assert float(loss) == pytest.approx(small_output(0, 20)[nearest]["Loss"], rel=1e-3)


def _try(fn):
    try:
        return fn()
    except OSError:
        return None


def _dump_dom_check(url: str, run: Path, profile: str) -> None:
    def dump() -> str:
        return subprocess.run(
            [_chromium(), *BROWSER_FLAGS, f"--user-data-dir={profile}",
             "--virtual-time-budget=4000", "--dump-dom", url],
            capture_output=True, text=True, timeout=120).stdout

    assert 'id="last-step">20<' in dump()
    write_run(run, small_output(25, 45))
    assert 'id="last-step">45<' in dump()


def test_hover_data_locates_panels_and_reads_recorded_values(tmp_path) -> None:
    """panels.json: boxes are the axes' positions in the image (top-left origin), series
    the recorded values, the histogram the recorded counts; findings.json is diagnose()."""
    from cockpit.diagnose import diagnose
    from cockpit.view.live import hover_data

    run = tmp_path / "run"
    output = synthetic_output("economy", num_steps=40, every=5, seed=12)
    output[20]["GradNorm"] = float("nan")
    write_run(run, output, synthetic_meta())
    server = make_server(run, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        server.view_state.wait_drawn()
        data = json.loads(fetch(server, "/panels.json")[2])
        findings = json.loads(fetch(server, "/findings.json")[2])
    finally:
        server.shutdown()
        server.server_close()
    fig = plot_run(run, diagnosis=False)
    fig.savefig(io.BytesIO(), format="png", dpi=90)  # as the server renders it
    expected = hover_data(fig, output)
    assert [p["key"] for p in expected["panels"]] == [p["key"] for p in data["panels"]]
    for mine, served in zip(expected["panels"], data["panels"], strict=True):
        assert served["box"] == pytest.approx(mine["box"], abs=1e-9)
    assert expected["series"] == data["series"]
    by_key = {p["key"]: p for p in data["panels"]}
    loss_ax = next(a for a in fig.axes if a.get_title(loc="left") == S.PANEL_TITLES["Loss"])
    pos = loss_ax.get_position()
    assert by_key["Loss"]["box"] == pytest.approx([pos.x0, 1 - pos.y1, pos.x1, 1 - pos.y0])
    assert by_key["Loss"]["xlim"] == [0, 40]
    assert by_key["GradientTests"]["instruments"] == ["NormTest", "InnerTest", "OrthoTest"]
    gn = data["series"]["GradNorm"]
    assert gn["steps"] == sorted(output) and gn["values"][4] == "nan"
    assert gn["values"][3] == output[15]["GradNorm"]
    assert by_key["GradHist1d"]["hist"]["counts"] == output[40]["GradHist1d"]["counts"].tolist()
    assert "Findings" not in by_key  # the page lists the findings beside the image
    assert [f["code"] for f in findings["findings"]] == [f.code for f in diagnose(run)]
