"""``cockpit bench``: run one benchmark run, a tuning sweep, or analyze results.

    cockpit bench list
    cockpit bench run PROBLEM --optimizer adam --lr 1e-3 [--hp key=value ...] --seed 0
        [--epochs N] [--batch-size B] [--data synthetic|real] [--data-dir DIR]
        [--schedule constant|cosine|cosine_restarts|trapezoidal] [--cockpit CONFIG]
        [--cockpit-every K] [--batchnorm frozen_statistics|none] [--output DIR]
    cockpit bench sweep PROBLEM [PROBLEM ...] --optimizers sgd adam [--budget small]
        [--scale 1] [--seeds 10] [--sampler random|tpe|qmc] [--workers N]
        [--executor pool|ray] [--ray-address ADDR] [--space lr=LU(1e-5,1)] [run options]
    cockpit bench analyze RESULTS_DIR [-o OUT] [--speed-fraction 0.95]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Sequence
from typing import Any


def _parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        return text


def parse_hyperparameters(items: Sequence[str]) -> dict[str, Any]:
    """``["momentum=0.9", "nesterov=True"]`` → ``{"momentum": 0.9, "nesterov": True}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--hp takes key=value, got {item!r}")
        out[key.strip()] = _parse_value(value.strip())
    return out


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, help="default: the problem's epochs")
    parser.add_argument("--batch-size", type=int, help="default: the problem's batch size")
    parser.add_argument("--max-steps-per-epoch", type=int,
                        help="cap the steps of every epoch (quick trials)")
    parser.add_argument("--data", default="synthetic", choices=["synthetic", "real"])
    parser.add_argument("--data-dir", help="directory of the real data files")
    parser.add_argument("--schedule", default="constant",
                        choices=["constant", "cosine", "cosine_restarts", "trapezoidal"])
    parser.add_argument("--cockpit", metavar="CONFIG",
                        help="attach Cockpit: economy|business|full or instruments, "
                             "e.g. Alpha,Loss; the run log is written beside the result")
    parser.add_argument("--cockpit-every", type=int, default=1,
                        help="track every K-th step (default 1)")
    parser.add_argument("--batchnorm", default="frozen_statistics",
                        choices=["frozen_statistics", "none"],
                        help="BatchNorm in training mode: per-sample instruments with the batch "
                             "statistics held constant (an approximation, labelled), or none "
                             "(those instruments are None)")
    parser.add_argument("--output", "-o", default="results", help="results directory")
    parser.add_argument("--device", default="cpu")


def _run_options(args) -> dict[str, Any]:
    return {
        "epochs": args.epochs, "batch_size": args.batch_size, "data": args.data,
        "data_dir": args.data_dir, "schedule": args.schedule, "cockpit": args.cockpit,
        "cockpit_every": args.cockpit_every, "device": args.device,
        "batchnorm": None if args.batchnorm == "none" else args.batchnorm,
        "max_steps_per_epoch": args.max_steps_per_epoch,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cockpit bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the test problems")

    run = sub.add_parser("run", help="train one optimizer setting on one problem")
    run.add_argument("problem")
    run.add_argument("--optimizer", required=True,
                     help="torch.optim name (sgd, adam, …), momentum, nag, or pkg.mod:Class")
    run.add_argument("--lr", type=float, help="learning rate")
    run.add_argument("--hp", nargs="*", default=[], metavar="KEY=VALUE",
                     help="further hyperparameters, e.g. momentum=0.9 beta1=0.8")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--overwrite", action="store_true", help="rerun an existing result")
    _add_run_options(run)

    sw = sub.add_parser("sweep", help="tune optimizers (Crowded Valley protocol)")
    sw.add_argument("problems", nargs="+")
    sw.add_argument("--optimizers", nargs="+", required=True)
    sw.add_argument("--budget", default="small",
                    help="one-shot | small (25) | medium (50) | large (75) | a number")
    sw.add_argument("--scale", type=float, default=1.0,
                    help="multiply the budget's number of runs (e.g. 0.2: small = 5)")
    sw.add_argument("--seeds", type=int, default=10,
                    help="seeds of the best setting, incl. the tuning seed 0 (default 10)")
    sw.add_argument("--sampler", default="random", choices=["random", "tpe", "qmc"])
    sw.add_argument("--sampler-seed", type=int, default=0)
    sw.add_argument("--workers", type=int, default=1)
    sw.add_argument("--executor", default="pool", choices=["pool", "serial", "ray"])
    sw.add_argument("--ray-address", help="Ray cluster address (default: local instance)")
    sw.add_argument("--space", nargs="*", default=[], metavar="NAME=DIST",
                    help="override search spaces, e.g. lr=LU(1e-4,1) momentum=U(0.8,0.99)")
    _add_run_options(sw)

    an = sub.add_parser("analyze", help="tables and figures from a results directory")
    an.add_argument("results")
    an.add_argument("-o", "--output", help="default: RESULTS/analysis")
    an.add_argument("--speed-fraction", type=float, default=0.95)
    an.add_argument("--formats", nargs="+", default=["png", "pdf"])
    return parser


def main_bench(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return _dispatch(args)
    except (ValueError, ImportError, FileNotFoundError) as error:
        print(f"cockpit bench {args.command}: {error}", file=sys.stderr)
        return 2


def _problem_table() -> str:
    """One line per test problem: name, data set, model, trainable parameters, default batch
    size and epochs (``ours``: settings DeepOBS does not define)."""
    from cockpit.benchmark.problems import list_problems
    from cockpit.benchmark.problems.registry import describe

    rows = [describe(name) for name in list_problems()]
    header = ("problem", "data set", "model", "parameters", "batch", "epochs", "")
    lines = [(r["problem"], r["data"], r["model"], f"{r['parameters']:,}", str(r["batch_size"]),
              str(r["epochs"]), "ours" if "ours" in str(r["source"]) else "")
             for r in rows]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]
    right = {3, 4, 5}

    def fmt(line) -> str:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        return "  ".join(cells).rstrip()

    note = ("\nbatch size and epochs: DeepOBS's defaults; 'ours' where DeepOBS defines none "
            "(see cockpit/benchmark/problems/registry.py)")
    return "\n".join([fmt(header), *map(fmt, lines)]) + note


def _dispatch(args) -> int:
    if args.command == "list":
        print(_problem_table())
        return 0
    if args.command == "run":
        from cockpit.benchmark.runner import RunSpec, run
        from cockpit.benchmark.selection import final_metric

        hyperparameters = parse_hyperparameters(args.hp)
        if args.lr is not None:
            hyperparameters["lr"] = args.lr
        spec = RunSpec(problem=args.problem, optimizer=args.optimizer,
                       hyperparameters=hyperparameters, seed=args.seed,
                       output=args.output, **_run_options(args))
        spec.validate()
        result = run(spec, overwrite=args.overwrite)
        if result.get("rerun_reason"):
            print(result["rerun_reason"])
        print(f"final test {result['metric']}: {final_metric(result)}  "
              f"({'diverged, ' if result['diverged'] else ''}{result['wall_time']:.1f} s)")
        if result.get("reused"):
            print(f"result: {result['path']} (reused: made earlier with the same settings; "
                  "--overwrite trains it again)")
        else:
            print(f"result: {result['path']}")
        return 0
    if args.command == "sweep":
        from cockpit.benchmark.search_spaces import parse_dist
        from cockpit.benchmark.sweep import sweep

        overrides = {}
        for item in args.space:
            name, sep, dist = item.partition("=")
            if not sep:
                raise ValueError(f"--space takes name=LU(low,high), got {item!r}")
            overrides[name] = parse_dist(dist)
        summary = sweep(args.problems, args.optimizers, output=args.output,
                        budget=args.budget, scale=args.scale, seeds=args.seeds,
                        sampler=args.sampler, sampler_seed=args.sampler_seed,
                        executor=args.executor, workers=args.workers,
                        ray_address=args.ray_address, space_overrides=overrides,
                        **_run_options(args))
        print(f"runs executed: {summary.executed}, reused from earlier: {summary.reused}, "
              f"failed: {len(summary.failures)}")
        for key, best in summary.best.items():
            print(f"best {key}: {best['hyperparameters']} (score {best['score']:.4g})")
        for failure in summary.failures:
            print(f"FAILED {failure}", file=sys.stderr)
        return 1 if summary.failures else 0
    if args.command == "analyze":
        from cockpit.benchmark.analyzer import analyze

        report = analyze(args.results, args.output, speed_fraction=args.speed_fraction,
                         formats=tuple(args.formats))
        print(report.markdown)
        print("written:", *map(str, report.files), sep="\n  ")
        return 0
    raise AssertionError(args.command)
