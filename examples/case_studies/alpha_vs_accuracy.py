"""Case study (Cockpit paper §3.3, Fig. 5): final performance against mean α over a
learning-rate sweep on several problems.

α (paper eq. 9–10) places each step on a noise-informed quadratic fit of the loss along the
update: α ≈ −1 means the step barely moved down the local parabola (too short), α ≈ 0 that
it stopped at the parabola's minimum, α ≈ 1 that it jumped to the same height on the other
side, α > 1 that it went uphill. The paper's finding: small learning rates give mean α near
−1 and poor results, mean α grows with the learning rate, and the best final performance is
reached with α > 0 — training that "understeps" (α < 0) is never the best; the best runs
overshoot the local minimum a little.

Each run goes through the benchmark runner with Cockpit tracking α at every step
(``cockpit bench run PROBLEM --optimizer sgd --lr LR --cockpit Alpha``); the figure is the
benchmark analyzer's ``alpha_vs_performance``.

    python examples/case_studies/alpha_vs_accuracy.py [--output runs/alpha_case] [--quick]

(the full sweep takes a few minutes on two cores; ``--quick`` seconds)
"""

# test-arguments: --quick

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

# problem → (data, learning rates of plain SGD, epochs)
SWEEPS = {
    "digits_logreg": ("real", np.logspace(-3, 0.5, 8), 8),
    "digits_mlp": ("real", np.logspace(-3, 0, 7), 8),
    "quadratic_deep": ("synthetic", np.logspace(-3, -1, 5), 3),
}
# --quick: a few learning rates per problem, 8 steps per epoch (seconds, not minutes); the
# trend (mean α grows with the learning rate, the smallest understeps) already shows.
QUICK_SWEEPS = {
    "digits_logreg": ("real", [1e-3, 0.1, 0.3, 3.0], 2),
    "quadratic_deep": ("synthetic", [1e-3, 1e-2, 0.03, 0.1], 1),
}
QUICK_STEPS_PER_EPOCH = 8


def run_sweep(output: str | Path, problems: dict | None = None, progress: bool = True,
              max_steps_per_epoch: int | None = None):
    """Train every (problem, lr) with SGD and Cockpit's Alpha; return the runs table
    (:func:`cockpit.benchmark.analyzer.runs_table`) with ``mean_alpha``."""
    from cockpit.benchmark.analyzer import runs_table
    from cockpit.benchmark.runner import RunSpec, run

    results = []
    for problem, (data, lrs, epochs) in (problems or SWEEPS).items():
        for lr in lrs:
            spec = RunSpec(problem=problem, optimizer="sgd", hyperparameters={"lr": float(lr)},
                           data=data, epochs=epochs, cockpit="Alpha", output=str(output),
                           max_steps_per_epoch=max_steps_per_epoch)
            results.append(run(spec, progress=progress))
    return runs_table(results)


def findings(runs) -> dict[str, dict[str, float]]:
    """Per problem: Spearman correlation of lr and mean α, mean α of the smallest lr, and
    mean α of the best run (highest final test accuracy, or lowest final test loss)."""
    from scipy.stats import spearmanr

    out = {}
    for problem, part in runs.groupby("problem"):
        part = part.sort_values("lr")
        ok = part[part["final_test"].notna() & part["mean_alpha"].notna()]
        best = (ok["final_test"].idxmax() if ok["metric"].iloc[0] == "accuracy"
                else ok["final_test"].idxmin())
        out[problem] = {
            "spearman_lr_alpha": float(spearmanr(ok["lr"], ok["mean_alpha"]).statistic),
            "alpha_smallest_lr": float(ok["mean_alpha"].iloc[0]),
            "alpha_best": float(ok.loc[best, "mean_alpha"]),
            "lr_best": float(ok.loc[best, "lr"]),
            "best_final_test": float(ok.loc[best, "final_test"]),
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="runs/alpha_vs_accuracy",
                        help="directory of the runs, the table and the figure")
    parser.add_argument("--quick", action="store_true",
                        help="a small sweep (2 problems, 3–4 learning rates, 8 steps per "
                             "epoch): seconds instead of minutes")
    args = parser.parse_args(argv)
    from cockpit.benchmark import figures

    runs = (run_sweep(args.output, QUICK_SWEEPS, max_steps_per_epoch=QUICK_STEPS_PER_EPOCH)
            if args.quick else run_sweep(args.output))
    out = Path(args.output)
    runs.to_csv(out / "alpha_vs_accuracy.csv", index=False)
    paths = figures.alpha_vs_performance(runs, out, ("png", "pdf"), stem="alpha_vs_accuracy")
    for problem, facts in findings(runs).items():
        print(problem, {k: round(v, 4) for k, v in facts.items()})
    print("figure:", *map(str, paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
