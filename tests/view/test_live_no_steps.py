"""The live page says that nothing was checked, not that nothing is wrong, while the run
log holds no step (a run that has not finished its first step, or none started yet)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest

from cockpit import diagnose
from cockpit.diagnose import CHECKS_SKIPPED, CODES
from cockpit.view.live import findings_data, make_server
from tests.models import recorded_run

ALL_CLEAR = "✓ no problem named by diagnose()"


@pytest.fixture(scope="module")
def empty_run(tmp_path_factory, one_thread) -> Path:
    logdir = tmp_path_factory.mktemp("runs") / "empty"
    recorded_run(logdir, 0)
    return logdir


def test_findings_of_a_run_without_steps_are_the_skipped_checks(empty_run, tmp_path) -> None:
    for logdir in (empty_run, tmp_path / "not-yet"):
        data = findings_data(logdir)
        assert data["error"] is None and data["all_clear"] is False
        (skipped,) = data["findings"]
        assert skipped["code"] == CHECKS_SKIPPED
        assert skipped["evidence"] == [f"{code} — no tracked step recorded" for code in CODES]


def test_all_clear_only_where_the_checks_ran_and_named_nothing(tmp_path, one_thread) -> None:
    recorded_run(tmp_path / "short", 3)  # too few steps for most checks
    data = findings_data(tmp_path / "short")
    assert [f["code"] for f in data["findings"]] == [f.code for f in diagnose(tmp_path / "short")]
    assert CHECKS_SKIPPED in [f["code"] for f in data["findings"]]
    assert data["all_clear"] is False


@contextmanager
def _served(logdir: Path) -> Iterator[str]:
    server = make_server(logdir, port=0, refresh_seconds=0.5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert server.view_state.wait_drawn(60) is not None
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _chromium() -> str | None:
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                "google-chrome"))), None)


@pytest.mark.skipif(_chromium() is None, reason="needs a headless Chromium")
def test_the_page_of_a_run_without_steps_shows_no_all_clear(empty_run) -> None:
    """The page as a browser renders it (its script fetches findings.json)."""
    profile = tempfile.mkdtemp(prefix="cockpit-chromium-")
    try:
        with _served(empty_run) as url:
            dom = subprocess.run(
                [_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                 "--no-first-run", f"--user-data-dir={profile}",
                 "--virtual-time-budget=6000", "--dump-dom", url],
                capture_output=True, text=True, timeout=180).stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    findings = dom.split('id="findings"', 1)[1].split("</ul>", 1)[0]
    assert 'data-code="checks_skipped"' in findings
    assert "Nothing could be checked" in findings and ALL_CLEAR not in findings


def test_findings_json_of_the_server(empty_run) -> None:
    import urllib.request

    with _served(empty_run) as url, urllib.request.urlopen(url + "findings.json",
                                                           timeout=60) as resp:
        data = json.loads(resp.read())
    assert data == findings_data(empty_run) and data["all_clear"] is False
