"""Every script in examples/ (subfolders too) runs with its default arguments, in a fresh
process whose working directory is a temporary one (so default output paths land there).

An example too slow for the test suite declares shorter arguments in one line of its
source, e.g. ``# test-arguments: --steps 40``; everything else runs exactly as a user
would start it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# every script under examples/, subfolders too (modules named _*.py are imported by them)
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.py") if not p.name.startswith("_"))
TEST_ARGUMENTS = re.compile(r"^#\s*test-arguments:(.*)$", re.MULTILINE)


def test_arguments(source: str) -> list[str]:
    """The arguments an example declares for the test suite (none: its defaults)."""
    found = TEST_ARGUMENTS.search(source)
    return shlex.split(found.group(1)) if found else []


test_arguments.__test__ = False  # a helper, not a test


def test_examples_are_found():
    names = {p.relative_to(ROOT / "examples").as_posix() for p in EXAMPLES}
    assert {"training_loop.py", "case_studies/alpha_vs_accuracy.py",
            "case_studies/data_scaling.py", "case_studies/activations.py"} <= names
    assert test_arguments("x = 1\n# test-arguments: --steps 3 --x 'a b'\n") == [
        "--steps", "3", "--x", "a b"]


@pytest.mark.parametrize("path", EXAMPLES,
                         ids=lambda p: p.relative_to(ROOT / "examples").as_posix())
def test_example_runs_with_its_defaults(path: Path, tmp_path: Path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("MPLBACKEND", "Agg")
    # the examples are small: more threads only spin against each other on a shared CPU
    # (10x the CPU time of one thread measured for training_loop.py on 2 busy cores)
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, str(path), *test_arguments(path.read_text())], cwd=tmp_path,
        env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, f"{path.name} failed:\n{result.stderr[-4000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
