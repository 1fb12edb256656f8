"""Figures of the benchmark analysis (matplotlib, written as PNG / PDF)."""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, stem: str, formats) -> list[Path]:
    paths = []
    for fmt in formats:
        path = out / f"{stem}.{fmt}"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        paths.append(path)
    _plt().close(fig)
    return paths


def _curves(runs: list[dict[str, Any]], key: str) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in r[key]] for r in runs], float)


LEGEND_FONTSIZE = 9


def _integer_epochs(ax) -> None:
    """Epoch axes get whole-number ticks only (no half epochs)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def learning_curves(best_runs: dict[tuple, list[dict]], out: Path, formats) -> list[Path]:
    """Per problem: test and train-eval loss (and accuracy) per epoch of every optimizer's
    best setting — line: mean over seeds, band: min to max over seeds."""
    by_problem: dict[str, dict[tuple, list[dict]]] = defaultdict(dict)
    for key, runs in best_runs.items():
        by_problem[key[0]][key] = runs
    paths = []
    for problem, groups in sorted(by_problem.items()):
        fig = learning_curve_figure(problem, groups)
        paths += _save(fig, out, f"learning_curves_{problem}", formats)
    return paths


def learning_curve_figure(problem: str, groups: dict[tuple, list[dict]]):
    """The learning-curve figure of one problem (see :func:`learning_curves`)."""
    plt = _plt()
    has_acc = any(r[0]["metric"] == "accuracy" for r in groups.values())
    panels = [("test_losses", "test loss"), ("train_losses", "train-eval loss")]
    if has_acc:
        panels += [("test_accuracies", "test accuracy"),
                   ("train_accuracies", "train-eval accuracy")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 1.6, 3.3),
                             squeeze=False, layout="constrained")
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        for (_, optimizer, schedule), runs in sorted(groups.items()):
            curves = _curves(runs, key)
            if np.all(np.isnan(curves)):
                continue
            epochs = np.arange(curves.shape[1])
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # epochs all seeds missed
                mean = np.nanmean(curves, 0)
                low, high = np.nanmin(curves, 0), np.nanmax(curves, 0)
            label = optimizer if schedule == "constant" else f"{optimizer} ({schedule})"
            seeds = "1 seed" if len(runs) == 1 else f"{len(runs)} seeds"
            line, = ax.plot(epochs, mean, label=f"{label} ({seeds})")
            ax.fill_between(epochs, low, high, color=line.get_color(), alpha=0.25)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        _integer_epochs(ax)
        if "loss" in key:
            ax.set_yscale("log")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=LEGEND_FONTSIZE)
    fig.suptitle(f"{problem}: best settings, mean and min–max over seeds")
    return fig


def lr_sensitivity(runs, out: Path, formats) -> list[Path]:
    """Per problem: final test metric of every setting (mean over its seeds) against its
    learning rate; diverged settings as crosses at the bottom."""
    plt = _plt()
    paths = []
    problems = sorted(runs["problem"].unique())
    fig, axes = plt.subplots(1, len(problems), figsize=(4.4 * len(problems), 3.4),
                             squeeze=False, layout="constrained")
    for ax, problem in zip(axes[0], problems, strict=True):
        frame = runs[runs["problem"] == problem]
        metric = frame["metric"].iloc[0]
        if metric == "loss" and (frame["final_test"].dropna() > 0).all():
            ax.set_yscale("log")
        for optimizer, group in frame.groupby("optimizer"):
            per_setting = group.groupby("setting").agg(
                lr=("lr", "first"), value=("final_test", "mean"), n=("seed", "count"))
            ok = per_setting["value"].notna()
            pts = ax.scatter(per_setting["lr"][ok], per_setting["value"][ok], label=optimizer,
                             s=18 + 6 * per_setting["n"][ok])
            if (~ok).any():
                bottom = np.nanmin(frame["final_test"]) if ok.any() else 0.0
                ax.scatter(per_setting["lr"][~ok], [bottom] * int((~ok).sum()), marker="x",
                           color=pts.get_facecolor()[0])
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel(f"final test {metric}")
        ax.set_title(problem)
        ax.legend(fontsize=LEGEND_FONTSIZE)
    fig.suptitle("learning-rate sensitivity (marker size: seeds; ×: diverged)")
    paths += _save(fig, out, "lr_sensitivity", formats)
    return paths


def alpha_vs_performance(runs, out: Path, formats, stem: str = "alpha_vs_performance",
                         ) -> list[Path]:
    """Cockpit paper Fig. 5: final test metric against the run's mean α, one panel per
    problem, colour = log10 learning rate. α < 0: steps stop short of the minimum of the
    local quadratic fit; α ≈ 0: they reach it; α > 0: they overshoot."""
    plt = _plt()
    frame = runs[runs["mean_alpha"].notna()]
    problems = sorted(frame["problem"].unique())
    fig, axes = plt.subplots(1, len(problems), figsize=(4.4 * len(problems) + 1, 3.6),
                             squeeze=False, layout="constrained")
    markers = "osD^v<>"
    lrs = np.log10(frame["lr"].astype(float))
    vmin, vmax = float(np.nanmin(lrs)), float(np.nanmax(lrs))
    scatter = None
    for ax, problem in zip(axes[0], problems, strict=True):
        part = frame[frame["problem"] == problem]
        for i, (optimizer, group) in enumerate(part.groupby("optimizer")):
            scatter = ax.scatter(group["mean_alpha"], group["final_test"], marker=markers[i % 7],
                                 c=np.log10(group["lr"].astype(float)), cmap="viridis",
                                 vmin=vmin, vmax=vmax, label=optimizer, edgecolors="k",
                                 linewidths=0.4)
        ax.axvline(0.0, color="grey", lw=0.8, ls="--")
        if part["mean_alpha"].abs().max() > 5:  # a few runs far uphill: keep [-1, 1] legible
            ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlabel("mean α")
        metric = part["metric"].iloc[0]
        if metric == "loss" and (part["final_test"].dropna() > 0).all():
            ax.set_yscale("log")
        ax.set_ylabel(f"final test {metric}")
        ax.set_title(problem)
        ax.legend(fontsize=LEGEND_FONTSIZE)
    if scatter is not None:
        fig.colorbar(scatter, ax=axes[0].tolist(), label="log10 learning rate")
    fig.suptitle("final performance against mean α (Cockpit paper, Fig. 5)")
    return _save(fig, out, stem, formats)


def crowded_valley(best_runs: dict[tuple, list[dict]], out: Path, formats,
                   stem: str = "crowded_valley") -> list[Path]:
    """The comparison of *Descending through a Crowded Valley* (Schmidt et al., 2021): one
    panel per problem, one column per tuned optimizer (and schedule) — its best setting's
    final test metric, mean ± standard deviation over seeds (bar), every seed as a dot."""
    fig = crowded_valley_figure(best_runs)
    return _save(fig, out, stem, formats)


def crowded_valley_figure(best_runs: dict[tuple, list[dict]]):
    """The figure of :func:`crowded_valley`."""
    from cockpit.benchmark.selection import final_metric, performance

    plt = _plt()
    by_problem: dict[str, dict[tuple, list[dict]]] = defaultdict(dict)
    for key, runs in best_runs.items():
        by_problem[key[0]][key] = runs
    problems = sorted(by_problem)
    fig, axes = plt.subplots(1, len(problems), figsize=(max(3.4, 1.0 + 0.75 * max(
        len(g) for g in by_problem.values())) * len(problems), 3.8), squeeze=False,
        layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    optimizers = sorted({(k[1], k[2]) for k in best_runs})
    for ax, problem in zip(axes[0], problems, strict=True):
        groups = by_problem[problem]
        metric = next(iter(groups.values()))[0]["metric"]
        scale = 100.0 if metric == "accuracy" else 1.0
        labels = []
        for x, ((_, optimizer, schedule), runs) in enumerate(sorted(groups.items())):
            color = colors[optimizers.index((optimizer, schedule)) % len(colors)]
            values = scale * np.array([np.nan if v is None else v
                                       for v in map(final_metric, runs)])
            mean, std, n = performance(runs)
            mean, std = scale * mean, scale * std
            offsets = np.linspace(-0.15, 0.15, len(values)) if len(values) > 1 else [0.0]
            ax.scatter(x + np.asarray(offsets), values, s=14, color=color, alpha=0.45,
                       linewidths=0)
            ax.errorbar([x], [mean], yerr=[std] if n > 1 else None, fmt="o", color=color,
                        markersize=7, capsize=5, elinewidth=2)
            name = optimizer if schedule == "constant" else f"{optimizer}\n{schedule}"
            labels.append(f"{name}\n{n} seed{'s' if n > 1 else ''}")
        ax.set_xticks(range(len(labels)), labels, fontsize=9)
        ax.set_xlim(-0.6, len(labels) - 0.4)
        ax.set_ylabel("final test accuracy (%), higher is better" if metric == "accuracy"
                      else "final test loss, lower is better")
        if metric == "loss":
            finite = [v for r in groups.values() for v in map(final_metric, r) if v is not None]
            if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
                ax.set_yscale("log")
        ax.set_title(problem)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("tuned optimizers: best setting by validation (tuning seed), "
                 "test metric mean ± std over seeds")
    return fig
