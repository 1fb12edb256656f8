"""The ``cockpit`` command: demo, plot, view, export."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: cockpit COMMAND [ARGS]

commands:
  demo     train a small CNN on scikit-learn's digits with Cockpit attached
  plot     draw the cockpit view of a run:   cockpit plot RUN -o view.png
  view     serve the live cockpit view:       cockpit view RUN [--port 8050]
  export   export a run log:                  cockpit export RUN --format json|csv|parquet
  diagnose say what is wrong with a run:      cockpit diagnose RUN
  bench    DeepOBS problems, runs, sweeps:    cockpit bench run|sweep|analyze ...

'cockpit COMMAND --help' describes each command; 'cockpit --version' prints the version."""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # a command is required: usage on stderr, exit status 2 (as argparse)
        print(USAGE, file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if args[0] in ("-V", "--version", "version"):
        import cockpit

        print(f"cockpit {cockpit.__version__}")
        return 0
    command, rest = args[0], args[1:]
    from cockpit.store._schema import RunLogFormatError

    try:
        return _run(command, rest)
    except RunLogFormatError as error:  # (what to do is in the message: no traceback)
        print(f"cockpit {command}: {error}", file=sys.stderr)
        return 2


def _run(command: str, rest: list[str]) -> int:
    if command == "demo":
        from cockpit.demo import run_demo

        return run_demo(rest)
    if command == "plot":
        from cockpit.view import main_plot

        return main_plot(rest)
    if command == "view":
        from cockpit.view import main_view

        return main_view(rest) or 0
    if command == "export":
        from cockpit.store import main_export

        return main_export(rest)
    if command == "diagnose":
        from cockpit.diagnose.cli import main_diagnose

        return main_diagnose(rest)
    if command == "bench":
        from cockpit.benchmark.cli import main_bench

        return main_bench(rest)
    print(f"cockpit: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
