"""Regenerate the README's figure ``docs/cockpit_view_demo.png`` from the demo.

Runs ``cockpit demo`` with its default arguments (into a temporary run directory, or
``--keep DIR``) and copies the figure the demo wrote, byte for byte. ``--redraw DIR``
instead redraws a kept demo run log the way the demo draws it (``plot_run``), which takes
seconds instead of minutes. The PNG carries the hash of the view's drawing code;
``tests/view/test_readme_figure.py`` fails when that code changed since, so run this again after
changing the view:

    python docs/make_readme_figure.py [--keep DIR | --redraw DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

TARGET = Path(__file__).resolve().parent / "cockpit_view_demo.png"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--keep", metavar="DIR", help="run the demo into DIR and keep it")
    group.add_argument("--redraw", metavar="DIR", help="redraw a kept demo run log")
    args = parser.parse_args(argv)
    if args.redraw:
        from cockpit.view import plot_run

        logdir = Path(args.redraw)
        plot_run(logdir, logdir / "cockpit_view.png")  # as cockpit.demo draws its figure
        shutil.copyfile(logdir / "cockpit_view.png", TARGET)
        print(f"wrote {TARGET}")
        return 0
    from cockpit.demo import run_demo

    with tempfile.TemporaryDirectory(prefix="cockpit-readme-") as tmp:
        logdir = Path(args.keep) if args.keep else Path(tmp) / "demo"
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
