"""The evidence behind ``cockpit.benchmark.search_spaces``: the Crowded Valley tuning runs.

Reads the hyperparameter settings transcribed from the result paths of the authors' results
repository (``benchmarks/data/crowded_valley_settings.txt``, provenance in its header) and
derives, per optimizer and hyperparameter of that repository:

* whether it was tuned (more than one value among the tuning runs) or fixed, and its value
  in the one-shot (default) run;
* the number of tuning runs and of distinct values, the smallest and largest value;
* ``draws_matched``: how many distinct values are the image of a draw of numpy's
  ``RandomState(42)`` under log-uniform bounds ``[10^lo, 10^hi]`` (``AUTHORS_LOG10_BOUNDS``),
  within 10⁻⁹ of the uniform draw u = (log10 x − lo) / (hi − lo). A wrong bound moves u by
  far more than that for almost every value, so n of n matches pins the bounds. The draws
  are also checked to follow one scheme: run i of an optimizer with k tuned
  hyperparameters takes draws k·i … k·i+k−1 (learning rate first, then the others by name);
  ``runs_consistent`` counts the tuning settings whose draws do;
* ``ks_stat`` / ``ks_p``: Kolmogorov–Smirnov statistic of those u against U(0, 1) and its
  asymptotic p-value (u uniform ⇔ the values are log-uniform between the bounds).

Run from the repository root: ``python benchmarks/crowded_valley_spaces.py`` prints the
table and compares it with ``SEARCH_SPACES`` / ``DEFAULTS``; ``--write`` (re)writes
``benchmarks/data/crowded_valley_spaces.csv``. Offline; needs only numpy.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SETTINGS = HERE / "data" / "crowded_valley_settings.txt"
TABLE = HERE / "data" / "crowded_valley_spaces.csv"

#: repository optimizer → (our optimizer, repository hyperparameter → ours)
OPTIMIZERS: dict[str, tuple[str, dict[str, str]]] = {
    "GradientDescentOptimizer": ("sgd", {"learning_rate": "lr"}),
    "MomentumOptimizer": ("momentum", {"learning_rate": "lr", "momentum": "momentum",
                                       "use_nesterov": "nesterov"}),
    "NAGOptimizer": ("nag", {"learning_rate": "lr", "momentum": "momentum",
                             "use_nesterov": "nesterov"}),
    "AdamOptimizer": ("adam", {"learning_rate": "lr", "beta1": "beta1", "beta2": "beta2",
                               "epsilon": "eps"}),
    "NadamOptimizer": ("nadam", {"learning_rate": "lr", "beta1": "beta1", "beta2": "beta2",
                                 "epsilon": "eps"}),
    "RAdamOptimizer": ("radam", {"learning_rate": "lr", "beta1": "beta1", "beta2": "beta2",
                                 "epsilon": "eps"}),
    "RMSPropOptimizer": ("rmsprop", {"learning_rate": "lr", "decay": "alpha", "epsilon": "eps",
                                     "momentum": "momentum", "centered": "centered"}),
    "AdagradOptimizer": ("adagrad", {"learning_rate": "lr",
                                     "initial_accumulator_value": "initial_accumulator_value"}),
    "AdadeltaOptimizer": ("adadelta", {"learning_rate": "lr", "rho": "rho", "epsilon": "eps"}),
}

#: log10 bounds of the authors' log-uniform distributions, as the draws reveal them
AUTHORS_LOG10_BOUNDS: dict[str, tuple[float, float]] = {
    "learning_rate": (-4.0, 0.0),
    "momentum": (-3.0, 0.0),
    "decay": (-3.0, 0.0),
    "rho": (-3.0, 0.0),
    "beta1": (-0.301, -0.00043),
    "beta2": (-0.0969, -0.00043),
}
#: order in which one run takes its draws
DRAW_ORDER = ["learning_rate", "beta1", "beta2", "decay", "momentum", "rho"]
MATCH_TOLERANCE = 1e-9
N_DRAWS = 1000


@dataclass(frozen=True)
class Setting:
    """One line of the settings file."""

    budget: str
    schedule: str
    problem: str
    optimizer: str
    kind: str  # tune / best / oneshot
    values: dict[str, str]


@dataclass
class Row:
    """One line of the evidence table."""

    repo_optimizer: str
    optimizer: str
    repo_hyperparameter: str
    hyperparameter: str
    tuned: bool
    n_tune_runs: int
    n_distinct: int
    observed_min: str
    observed_max: str
    fixed_value: str
    oneshot_value: str
    authors_low: str
    authors_high: str
    draws_matched: int
    runs_consistent: int
    ks_stat: str
    ks_p: str


def read_settings(path: Path = SETTINGS) -> list[Setting]:
    """The settings file's lines (comments and blank lines skipped)."""
    settings = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        budget, schedule, problem, optimizer, kind, *pairs = line.split()
        if kind not in ("tune", "best", "oneshot") or not all("=" in p for p in pairs):
            raise ValueError(f"{path}:{number}: cannot read {line!r}")
        settings.append(Setting(budget, schedule, problem, optimizer, kind,
                                dict(p.split("=", 1) for p in pairs)))
    return settings


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def uniform_draw(name: str, value: float) -> float:
    """u ∈ [0, 1] with value = 10^(lo + u (hi − lo)) under the authors' bounds of ``name``."""
    low, high = AUTHORS_LOG10_BOUNDS[name]
    return (math.log10(value) - low) / (high - low)


def draw_index(u: float, draws: np.ndarray) -> int | None:
    """Index of the draw equal to ``u`` (within ``MATCH_TOLERANCE``), or None."""
    distance = np.abs(draws - u)
    index = int(distance.argmin())
    return index if distance[index] < MATCH_TOLERANCE else None


def ks_uniform(u: list[float]) -> tuple[float, float]:
    """Kolmogorov–Smirnov statistic of ``u`` against U(0, 1) and its asymptotic p-value
    p = 2 Σ_k (−1)^(k−1) exp(−2 k² n D²)."""
    x = np.sort(np.asarray(u))
    n = len(x)
    grid = np.arange(1, n + 1) / n
    stat = float(max((grid - x).max(), (x - (grid - 1 / n)).max()))
    t = n * stat * stat
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * t) for k in range(1, 101))
    return stat, float(min(max(p, 0.0), 1.0))


def tuned_names(setting: Setting, tuned: set[str]) -> list[str]:
    """The tuned hyperparameters of ``setting`` in their draw order."""
    return sorted((k for k in setting.values if k in tuned), key=DRAW_ORDER.index)


def evidence_table(settings: list[Setting]) -> list[Row]:
    """The evidence table (see the module docstring)."""
    draws = np.random.RandomState(42).rand(N_DRAWS)
    by_optimizer: dict[str, list[Setting]] = defaultdict(list)
    for setting in settings:
        by_optimizer[setting.optimizer].append(setting)
    rows = []
    for repo_optimizer, (optimizer, names) in OPTIMIZERS.items():
        unique = {(s.budget, s.schedule, s.problem, tuple(sorted(s.values.items()))): s
                  for s in by_optimizer.get(repo_optimizer, []) if s.kind in ("tune", "best")}
        runs = list(unique.values())  # distinct tuning settings per folder
        oneshot = next((s for s in by_optimizer.get(repo_optimizer, [])
                        if s.kind == "oneshot"), None)
        keys = sorted({k for s in runs for k in s.values})
        distinct = {k: {s.values[k] for s in runs} for k in keys}
        tuned = {k for k in keys if len({_float(v) or v for v in distinct[k]}) > 1}
        consistent = 0
        for run in runs:  # run i with k tuned hyperparameters: draws k·i … k·i+k−1
            order = tuned_names(run, tuned)
            index = [draw_index(uniform_draw(k, float(run.values[k])), draws) for k in order]
            if (None not in index and index[0] % len(order) == 0
                    and index == list(range(index[0], index[0] + len(order)))):
                consistent += 1
        for key in keys:
            values = sorted(distinct[key], key=lambda v: (_float(v) is None, _float(v) or 0))
            row = Row(repo_optimizer, optimizer, key, names.get(key, ""), key in tuned,
                      len(runs), len(values), "", "", "", "",
                      "", "", 0, 0, "", "")
            row.oneshot_value = oneshot.values.get(key, "") if oneshot else ""
            if key in tuned:
                numbers = [float(v) for v in values]
                row.observed_min, row.observed_max = f"{min(numbers):.10e}", f"{max(numbers):.10e}"
                low, high = AUTHORS_LOG10_BOUNDS[key]
                row.authors_low, row.authors_high = f"{10 ** low:.10g}", f"{10 ** high:.10g}"
                u = [uniform_draw(key, x) for x in numbers]
                row.draws_matched = sum(draw_index(x, draws) is not None for x in u)
                row.runs_consistent = consistent
                stat, p = ks_uniform(u)
                row.ks_stat, row.ks_p = f"{stat:.3f}", f"{p:.3f}"
            else:
                row.fixed_value = values[0]
            rows.append(row)
    return rows


def write_table(rows: list[Row], path: Path = TABLE) -> None:
    """Write ``rows`` as CSV with a provenance comment."""
    with path.open("w", newline="") as stream:
        stream.write("# Evidence table of cockpit.benchmark.search_spaces, derived by "
                     "benchmarks/crowded_valley_spaces.py\n# from benchmarks/data/"
                     "crowded_valley_settings.txt (Crowded Valley results repository)\n")
        writer = csv.writer(stream)
        writer.writerow([f.name for f in fields(Row)])
        for row in rows:
            writer.writerow([getattr(row, f.name) for f in fields(Row)])


def read_table(path: Path = TABLE) -> list[dict[str, str]]:
    """The committed evidence table as dicts of strings."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    return list(csv.DictReader(lines))


def our_fixed_value(optimizer: str, name: str):
    """The value a sweep of ours gives ``name`` when it is not tuned: ``DEFAULTS``, else the
    optimizer alias's fixed value, else the torch constructor's default."""
    import inspect

    from cockpit.benchmark.optimizers import resolve_optimizer
    from cockpit.benchmark.search_spaces import defaults

    if name in defaults(optimizer):
        return defaults(optimizer)[name]
    cls, fixed = resolve_optimizer(optimizer)
    if name in fixed:
        return fixed[name]
    return inspect.signature(cls.__init__).parameters[name].default


def compare(rows: list[Row]) -> list[str]:
    """Lines comparing the evidence with ``SEARCH_SPACES`` / ``DEFAULTS``."""
    from cockpit.benchmark.search_spaces import SEARCH_SPACES

    out = []
    for row in rows:
        space = SEARCH_SPACES.get(row.optimizer, {})
        ours = space.get(row.hyperparameter)
        default = our_fixed_value(row.optimizer, row.hyperparameter)
        if row.tuned:
            verdict = (f"ours {ours}" if ours else "NOT TUNED BY US") + (
                f"; observed [{float(row.observed_min):.4g}, {float(row.observed_max):.4g}]"
                f" in {row.n_distinct} values, {row.draws_matched} match draws of "
                f"LU({row.authors_low}, {row.authors_high}), KS p={row.ks_p}")
        else:
            verdict = (f"fixed at {row.fixed_value}; ours "
                       + (f"TUNED {ours}" if ours else f"fixed at {default}"))
        out.append(f"{row.optimizer:9s} {row.hyperparameter or row.repo_hyperparameter:26s} "
                   f"one-shot {row.oneshot_value or '-':9s} ours {default!s:8s} | {verdict}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {TABLE.name}")
    args = parser.parse_args(argv)
    settings = read_settings()
    rows = evidence_table(settings)
    tune = sum(s.kind == "tune" for s in settings)
    print(f"{len(settings)} lines ({tune} seed-42 tuning runs) from {SETTINGS.name}; "
          "columns: optimizer, hyperparameter, one-shot value (theirs, ours) | verdict")
    for line in compare(rows):
        print(line)
    if args.write:
        write_table(rows)
        print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
