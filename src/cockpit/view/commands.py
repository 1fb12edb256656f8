"""Command-line entry points of the views (wired into ``cockpit`` by the CLI):

* ``cockpit plot RUN [-o FILE] [--layers [FILE]] [--step N]`` → :func:`main_plot`
* ``cockpit view RUN [--host H] [--port P] [--refresh S]`` → :func:`main_view`
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cockpit.view._source import load_notes, load_run


def _plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cockpit plot",
                                description="Draw the cockpit view of a run into a file.")
    p.add_argument("run", nargs="?", help="run directory (with cockpit.sqlite) or a JSON export")
    p.add_argument("-o", "--output", help="figure file, .png/.pdf/.svg "
                   "(default: <run>/cockpit_view.png, with --layers <run>/cockpit_layers.png)")
    p.add_argument("--layers", metavar="FILE", nargs="?", const="",
                   help="draw the layer-wise view (per-parameter gradient histograms, paper "
                   "Fig. 4) instead of the cockpit view, into FILE (default: -o, else "
                   "<run>/cockpit_layers.png)")
    p.add_argument("--step", type=int, default=None,
                   help="draw the run as at this tracked step: the cockpit view of the steps "
                   "up to it (histograms of that step), or the layer-wise view of that step "
                   "(default: the last tracked step)")
    p.add_argument("--dpi", type=int, default=110, help="resolution of PNG files")
    return p


def main_plot(argv: Sequence[str] | None = None) -> int:
    """``cockpit plot``: write the cockpit view (and optionally per-layer histograms)."""
    from cockpit.view.cockpit_view import plot_cockpit, plot_layer_histograms, save_figure
    from cockpit.view.layers import model_order

    parser = _plot_parser()
    args = parser.parse_args(argv)
    if args.run is None:
        # `cockpit plot --layers RUN`: argparse hands RUN to --layers' optional FILE
        if args.layers and _is_run(Path(args.layers)):
            args.run, args.layers = args.layers, ""
        else:
            parser.error("the following arguments are required: run")
    run = Path(args.run)
    if not run.exists():
        print(f"cockpit plot: no such run directory or file: {args.run}", file=sys.stderr)
        return 2
    try:
        output, meta = load_run(run)
    except FileNotFoundError as err:
        print(f"cockpit plot: {err}", file=sys.stderr)
        return 2
    if not output:
        print(f"cockpit plot: {args.run} holds no tracked step yet (while training runs, "
              f"`cockpit view {args.run}` follows it)", file=sys.stderr)
        return 1
    if args.step is not None:
        if args.step not in output:
            near = min(output, key=lambda s: abs(s - args.step))
            print(f"cockpit plot: step {args.step} was not tracked in {args.run} (tracked: "
                  f"{min(output)}–{max(output)}, {len(output)} steps; nearest {near})",
                  file=sys.stderr)
            return 2
        output = {s: v for s, v in output.items() if s <= args.step}
    try:
        if args.layers is not None:
            default = (run.with_name(run.stem + "_layers.png") if run.is_file()
                       else run / "cockpit_layers.png")
            fig = plot_layer_histograms(output, step=args.step, order=model_order(meta))
            target = Path(args.layers or args.output or default)
        else:
            default = run.with_suffix(".png") if run.is_file() else run / "cockpit_view.png"
            fig = plot_cockpit(output, meta, notes=load_notes(run))
            target = Path(args.output) if args.output else default
        written = [save_figure(fig, target, dpi=args.dpi)]
    except ValueError as err:
        print(f"cockpit plot: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


def _is_run(path: Path) -> bool:
    """A run directory or a JSON export (never a figure file to write)."""
    return path.is_dir() or (path.is_file() and path.suffix == ".json")


def _view_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cockpit view",
                                description="Serve a live web view of a (running) run.")
    p.add_argument("run", help="run directory (with cockpit.sqlite, maybe not yet written)")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8050, help="port (0: pick a free one)")
    p.add_argument("--refresh", type=float, default=2.0, help="seconds between page polls")
    return p


def main_view(argv: Sequence[str] | None = None) -> int:
    """``cockpit view``: serve the live cockpit view until Ctrl+C."""
    from cockpit.view.live import serve

    args = _view_parser().parse_args(argv)
    if args.refresh <= 0:
        print("cockpit view: --refresh must be positive", file=sys.stderr)
        return 2
    try:
        serve(args.run, host=args.host, port=args.port, refresh_seconds=args.refresh)
    except OSError as err:
        print(f"cockpit view: cannot listen on {args.host}:{args.port}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # python -m cockpit.view.commands plot|view ...
    command, *rest = sys.argv[1:] or ["--help"]
    raise SystemExit({"plot": main_plot, "view": main_view}.get(command, main_plot)(rest))
