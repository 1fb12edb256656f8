"""A run without steps gets no all-clear: every check is skipped, as when the instruments
a check reads hold no value, in diagnose(), the CLI's text and its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cockpit import Cockpit, diagnose
from cockpit.diagnose import CHECKS_SKIPPED, CODES, Diagnoser
from cockpit.diagnose.cli import main_diagnose
from tests.models import recorded_run


def _only_skipped(findings: list, why: str) -> None:
    """One finding: every check of the vocabulary skipped, each for ``why``."""
    (skipped,) = findings
    assert skipped.code == CHECKS_SKIPPED and skipped.severity == "info"
    assert skipped.message == f"Nothing could be checked: all {len(CODES)} checks were skipped"
    assert {e.instrument: e.summary for e in skipped.evidence} == dict.fromkeys(CODES, why)


@pytest.fixture(scope="module")
def empty_run(tmp_path_factory, one_thread) -> tuple[Path, Cockpit]:
    logdir = tmp_path_factory.mktemp("runs") / "empty"
    return logdir, recorded_run(logdir, 0)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, one_thread) -> Path:
    logdir = tmp_path_factory.mktemp("runs") / "short"
    recorded_run(logdir, 3)
    return logdir


def test_a_run_log_without_steps_skips_every_check(empty_run) -> None:
    logdir, cockpit = empty_run
    _only_skipped(diagnose(logdir), "no tracked step recorded")
    _only_skipped(diagnose(cockpit), "no tracked step recorded")
    _only_skipped(diagnose({}), "no tracked step recorded")


def test_since_past_the_last_step_skips_every_check(short_run) -> None:
    assert len(diagnose(short_run)) >= 1  # (steps 0–2: checks skipped for too few steps)
    _only_skipped(diagnose(short_run, since_step=2), "no tracked step recorded after step 2")
    skipped = [f for f in diagnose(short_run, since_step=1) if f.code == CHECKS_SKIPPED]
    assert "non_finite" not in {e.instrument for e in skipped[0].evidence}  # step 2 is read


def test_cli_text_and_json_of_a_run_without_steps(empty_run, short_run, capsys) -> None:
    logdir, _ = empty_run
    assert main_diagnose([str(logdir)]) == 0  # nothing is wrong, and nothing was checked
    text = capsys.readouterr().out
    assert "No problem found" not in text
    assert f"Nothing could be checked: all {len(CODES)} checks were skipped." in text
    assert text.count(": no tracked step recorded\n") == len(CODES)
    assert main_diagnose([str(logdir), "--json"]) == 0
    (skipped,) = json.loads(capsys.readouterr().out)
    assert skipped["code"] == CHECKS_SKIPPED
    assert [e["summary"] for e in skipped["evidence"]] == ["no tracked step recorded"] * len(
        CODES)
    assert main_diagnose([str(short_run), "--since", "2"]) == 0
    text = capsys.readouterr().out
    assert "No problem found" not in text and "no tracked step recorded after step 2" in text


def test_incremental_diagnosis_turns_from_skipped_to_checks_when_steps_arrive() -> None:
    diagnoser = Diagnoser()
    assert diagnoser.update({}) == []  # the skipped checks are no new finding to warn of
    _only_skipped(diagnoser.findings, "no tracked step recorded")
    diagnoser.update({0: {"Loss": 1.0, "GradNorm": 0.5}})
    assert "non_finite" not in diagnoser.skipped  # Loss and GradNorm now hold values
    assert diagnoser.skipped["vanishing_gradients"] == (
        "GradNorm at 1 tracked step, the check needs 8")
