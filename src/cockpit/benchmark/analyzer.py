"""Analysis of benchmark results, as DeepOBS reports them (Schneider et al., 2019) plus
Cockpit's α (paper Fig. 5).

Per problem and optimizer (and schedule), from the result files below a directory:

* **best setting** and **performance**: the rule of :mod:`cockpit.benchmark.selection`
  (the one the sweep uses): the setting whose tuning-seed run has the best final
  *validation* metric; its final *test* metric, mean ± standard deviation over its seeds
  (``ddof=0``), the number of seeds and how many of them diverged (no finite final
  metric: left out of mean and std, which the text says: "over 3 of 4 seeds; 1 diverged").
* **speed**: the first epoch at which the best setting's seed-mean test curve reaches the
  fraction ``f`` (``speed_fraction``, default 0.95) of the best performance any optimizer
  reached on the problem: accuracy ≥ f·best, or loss ≤ best + (1 − f)·|best|. Empty when
  never reached.
* **tuneability**: the best setting's hyperparameters; ``settings`` tried; ``good_share``,
  the share of settings whose seed-mean final test metric meets the same threshold (how
  easy the optimizer is to tune); ``spread``, the standard deviation of the settings'
  seed-mean final test metrics (finite ones).

Tables: ``summary.csv`` / ``summary.md`` (one row per problem × optimizer × schedule) and
``runs.csv`` (one row per run, with its mean α when a Cockpit run log is there). Figures
(PNG and PDF): the Crowded Valley comparison (``crowded_valley``: per problem, every
optimizer's best setting, test metric mean ± std over seeds and each seed), learning curves
of every best setting with their seed spread (min–max band),
the final metric against the learning rate of every setting, and with Cockpit logs the final
metric against the run's mean α (``alpha_vs_performance``).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cockpit.benchmark.results import iter_results
from cockpit.benchmark.selection import best_setting, final_metric, performance

SUMMARY_COLUMNS = ["problem", "optimizer", "schedule", "metric", "performance",
                   "performance_std", "seeds", "diverged", "speed", "best_setting", "best_lr",
                   "settings", "good_share", "spread"]


@dataclass
class AnalysisReport:
    summary: Any  # pandas.DataFrame, columns SUMMARY_COLUMNS
    runs: Any  # pandas.DataFrame, one row per run
    markdown: str
    files: list[Path] = field(default_factory=list)


def mean_alpha(result: dict[str, Any]) -> float | None:
    """Mean of the finite α values in the run's Cockpit log (None without a log or α)."""
    name = result.get("cockpit_logdir")
    if not name:
        return None
    logdir = Path(result["path"]).parent / name
    if not logdir.exists():
        return None
    from cockpit.store import RunLogReader

    with RunLogReader(logdir) as reader:
        if "Alpha" not in reader.names():
            return None
        values = reader.scalars(["Alpha"])["Alpha"].to_numpy()
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else None


def _mean(values: list[float | None]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(finite)) if finite else math.nan


def _threshold(metric: str, best: float, fraction: float) -> float:
    return fraction * best if metric == "accuracy" else best + (1 - fraction) * abs(best)


def _meets(metric: str, value: float, threshold: float) -> bool:
    if not math.isfinite(value):
        return False
    return value >= threshold if metric == "accuracy" else value <= threshold


def _curve_mean(runs: list[dict[str, Any]], key: str) -> np.ndarray:
    rows = np.array([[np.nan if v is None else v for v in r[key]] for r in runs], float)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # epochs every seed diverged before
        return np.nanmean(rows, axis=0) if rows.size else rows


def _group(results: list[dict[str, Any]]):
    groups: dict[tuple[str, str, str], dict[str, list[dict]]] = defaultdict(
        lambda: defaultdict(list))
    for r in results:
        groups[(r["problem"], r["optimizer"], r["schedule"])][r["setting"]].append(r)
    return groups


def summarize(results: list[dict[str, Any]], speed_fraction: float = 0.95):
    """The summary table (pandas DataFrame, columns ``SUMMARY_COLUMNS``) and, per group,
    the best setting's runs (for the figures)."""
    import pandas as pd

    groups = _group(results)
    rows, best_runs = [], {}
    for key in sorted(groups):
        settings = groups[key]
        best = best_setting(settings)
        runs = sorted(settings[best], key=lambda r: r["seed"])
        mean, std, n_seeds = performance(runs)
        best_runs[key] = runs
        rows.append({
            "problem": key[0], "optimizer": key[1], "schedule": key[2],
            "metric": runs[0]["metric"],
            "performance": mean, "performance_std": std,
            "seeds": n_seeds, "diverged": _diverged_seeds(runs), "best_setting": best,
            "best_lr": runs[0]["hyperparameters"].get("lr", math.nan),
            "settings": len(settings),
            "_setting_means": [_mean([final_metric(r) for r in settings[s]])
                               for s in sorted(settings)],
            "_curve": _curve_mean(runs, f"test_{_kind(runs[0])}"),
        })
    # speed and tuneability need the best performance on each problem
    best_on_problem: dict[str, float] = {}
    for row in rows:
        perf, prob = row["performance"], row["problem"]
        if math.isnan(perf):
            continue
        better = (max if row["metric"] == "accuracy" else min)
        best_on_problem[prob] = better(best_on_problem.get(prob, perf), perf)
    for row in rows:
        best = best_on_problem.get(row["problem"], math.nan)
        threshold = _threshold(row["metric"], best, speed_fraction)
        reached = [e for e, v in enumerate(row.pop("_curve"))
                   if _meets(row["metric"], v, threshold)]
        row["speed"] = reached[0] if reached else math.nan
        means = row.pop("_setting_means")
        row["good_share"] = float(np.mean([_meets(row["metric"], m, threshold) for m in means]))
        finite = [m for m in means if math.isfinite(m)]
        row["spread"] = float(np.std(finite)) if finite else math.nan
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS), best_runs


def _diverged_seeds(runs: list[dict[str, Any]]) -> int:
    """Runs left out of the performance: no finite final test metric (diverged)."""
    return sum(1 for r in runs if final_metric(r) is None or not math.isfinite(final_metric(r)))


def _kind(result: dict[str, Any]) -> str:
    return "accuracies" if result["metric"] == "accuracy" else "losses"


def runs_table(results: list[dict[str, Any]]):
    """One row per run: identity, lr, final metrics, diverged, mean α."""
    import pandas as pd

    rows = []
    for r in results:
        rows.append({
            "problem": r["problem"], "optimizer": r["optimizer"], "schedule": r["schedule"],
            "setting": r["setting"], "seed": r["seed"],
            "lr": r["hyperparameters"].get("lr", math.nan), "metric": r["metric"],
            "final_test": final_metric(r, "test"), "final_valid": final_metric(r, "valid"),
            "final_test_loss": r["test_losses"][-1], "diverged": r["diverged"],
            "mean_alpha": mean_alpha(r), "wall_time": r["wall_time"],
            "path": r["path"],
        })
    return pd.DataFrame(rows)


def _performance_text(mean: float, std: float, unit: str, metric: str, seeds: int,
                      diverged: int = 0) -> str:
    """``91.00% ± 2.94 (accuracy, mean ± std over 3 seeds)``; with diverged seeds (left out)
    ``… over 3 of 4 seeds; 1 diverged``; one seed has no spread to show."""
    used = seeds - diverged
    if used == 0:
        return f"– ({metric}: {'the seed' if seeds == 1 else f'all {seeds} seeds'} diverged)"
    if diverged == 0:
        if seeds == 1:
            return f"{mean:.2f}{unit} ({metric}, one seed: no spread)"
        return f"{mean:.2f}{unit} ± {std:.2f} ({metric}, mean ± std over {seeds} seeds)"
    if used == 1:
        return (f"{mean:.2f}{unit} ({metric}, 1 of {seeds} seeds: no spread; "
                f"{diverged} diverged)")
    return (f"{mean:.2f}{unit} ± {std:.2f} ({metric}, mean ± std over {used} of {seeds} "
            f"seeds; {diverged} diverged)")


def _markdown(summary) -> str:
    header = ("| problem | optimizer | schedule | performance | speed (epochs) | best setting "
              "| settings | good share |")
    lines = [header, "|" + "---|" * 8]
    for row in summary.itertuples():
        unit = "%" if row.metric == "accuracy" else ""
        scale = 100 if row.metric == "accuracy" else 1
        perf = _performance_text(row.performance * scale, row.performance_std * scale, unit,
                                 row.metric, row.seeds, row.diverged)
        speed = "–" if math.isnan(row.speed) else f"{row.speed:g}"
        lines.append(f"| {row.problem} | {row.optimizer} | {row.schedule} | {perf} | {speed} "
                     f"| `{row.best_setting}` | {row.settings} | {row.good_share:.2f} |")
    return "\n".join(lines) + "\n"


def analyze(results_dir: str | Path, output: str | Path | None = None, *,
            speed_fraction: float = 0.95, formats: tuple[str, ...] = ("png", "pdf"),
            ) -> AnalysisReport:
    """Write the tables and figures for the results below ``results_dir``."""
    results = list(iter_results(results_dir))
    if not results:
        raise FileNotFoundError(
            f"no benchmark results (seed_*.json) below {results_dir}; run "
            "'cockpit bench run' or 'cockpit bench sweep' with --output there first")
    out = Path(output) if output is not None else Path(results_dir) / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    summary, best_runs = summarize(results, speed_fraction)
    runs = runs_table(results)
    markdown = _markdown(summary)
    files = [out / "summary.csv", out / "summary.md", out / "runs.csv"]
    summary.to_csv(files[0], index=False)
    files[1].write_text(markdown)
    runs.to_csv(files[2], index=False)
    from cockpit.benchmark import figures

    files += figures.crowded_valley(best_runs, out, formats)
    files += figures.learning_curves(best_runs, out, formats)
    files += figures.lr_sensitivity(runs, out, formats)
    if runs["mean_alpha"].notna().any():
        files += figures.alpha_vs_performance(runs, out, formats)
    return AnalysisReport(summary, runs, markdown, files)
