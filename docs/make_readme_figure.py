"""Regenerate the README's figure ``docs/cockpit_view_demo.png`` from the demo.

Runs ``cockpit demo`` with its default arguments (into a temporary run directory) and
copies the figure the demo wrote, byte for byte. The PNG carries the hash of the view's
drawing code; ``tests/test_readme_figure.py`` fails when that code changed since, so run
this again after changing the view:

    python docs/make_readme_figure.py
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

TARGET = Path(__file__).resolve().parent / "cockpit_view_demo.png"


def main() -> int:
    from cockpit.demo import run_demo

    with tempfile.TemporaryDirectory(prefix="cockpit-readme-") as tmp:
        logdir = Path(tmp) / "demo"
        status = run_demo(["--logdir", str(logdir)])
        figure = logdir / "cockpit_view.png"
        if status != 0 or not figure.is_file():
            print("the demo did not write its figure", file=sys.stderr)
            return 1
        shutil.copyfile(figure, TARGET)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
