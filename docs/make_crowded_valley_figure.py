"""Regenerate ``docs/crowded_valley.png``: the Crowded Valley comparison (Schmidt, Schneider
& Hennig, ICML 2021) on the digits problems and DeepOBS's noisy quadratic.

Five optimizers (SGD, heavy-ball momentum, Adam, RMSProp, Adagrad), each tuned by random
search over the protocol's spaces (the small budget scaled to 7 settings, seed 0), the best
setting by final validation metric rerun with 5 seeds in all, every problem at its default
batch size and epochs; then ``cockpit bench analyze`` and its ``crowded_valley.png`` copied
here. The sweep and the analysis are the documented commands
(``cockpit bench sweep`` / ``cockpit bench analyze``) with these arguments; a rerun of this
script reuses finished runs. About 5 minutes on two busy CPU cores:

    python docs/make_crowded_valley_figure.py [--output runs/crowded_valley]
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path

TARGET = Path(__file__).resolve().parent / "crowded_valley.png"
PROBLEMS = ["digits_logreg", "digits_mlp", "quadratic_deep"]
OPTIMIZERS = ["sgd", "momentum", "adam", "rmsprop", "adagrad"]
SWEEP = ["--data", "real", "--budget", "small", "--scale", "0.28", "--seeds", "5",
         "--executor", "serial"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/crowded_valley", help="results directory")
    args = parser.parse_args(argv)
    import torch

    from cockpit.benchmark.cli import main_bench

    torch.set_num_threads(1)
    code = main_bench(["sweep", *PROBLEMS, "--optimizers", *OPTIMIZERS, *SWEEP,
                       "--output", args.output])
    if code:
        return code
    code = main_bench(["analyze", args.output, "--formats", "png"])
    if code:
        return code
    shutil.copyfile(Path(args.output) / "analysis" / "crowded_valley.png", TARGET)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
