"""The analyzer's tables hold exactly the numbers of the result files: results with known
curves are written here in the runner's JSON format, and every entry of summary.csv is
computed again by hand below (selection by the final validation metric of each setting's
tuning seed, a diverged setting, a best setting with one seed, speed and tuneability
thresholds)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from cockpit.benchmark.analyzer import analyze
from cockpit.benchmark.results import RESULT_SCHEMA, result_path, setting_name, write_result


def _write(root, problem, optimizer, lr, seed, valid, test, metric="accuracy"):
    hyperparameters = {"lr": lr}
    setting = setting_name(hyperparameters)
    n = len(test)
    diverged = any(v is None for v in test)
    kind = "accuracies" if metric == "accuracy" else "losses"
    other = "losses" if metric == "accuracy" else "accuracies"
    result = {
        "schema": RESULT_SCHEMA, "problem": problem, "optimizer": optimizer,
        "hyperparameters": hyperparameters, "seed": seed, "schedule": "constant",
        "setting": setting, "metric": metric, "diverged": diverged,
        f"valid_{kind}": valid, f"test_{kind}": test, f"train_{kind}": test,
        f"valid_{other}": [1.0] * n if metric == "accuracy" else [None] * n,
        f"test_{other}": [1.0] * n if metric == "accuracy" else [None] * n,
        f"train_{other}": [1.0] * n if metric == "accuracy" else [None] * n,
        "wall_time": 1.0, "cockpit_logdir": None,
    }
    write_result(result_path(root, problem, optimizer, setting, seed), result)


@pytest.fixture
def results_dir(tmp_path):
    w = _write
    # problem pA (accuracy), sgd: S1 two seeds, S2 one seed but the best validation, S3 diverged
    w(tmp_path, "pA", "sgd", 0.1, 0, [.1, .5, .7, .80], [.1, .5, .72, .82])
    w(tmp_path, "pA", "sgd", 0.1, 1, [.1, .4, .6, .78], [.1, .45, .70, .80])
    w(tmp_path, "pA", "sgd", 0.01, 0, [.1, .3, .6, .85], [.1, .3, .5, .6])
    w(tmp_path, "pA", "sgd", 1.0, 0, [.1, None, None, None], [.1, None, None, None])
    # pA, adam: T1 three seeds (best), T2 one seed
    w(tmp_path, "pA", "adam", 1e-3, 0, [.1, .6, .8, .90], [.1, .6, .85, .88])
    w(tmp_path, "pA", "adam", 1e-3, 1, [.1, .6, .8, .92], [.1, .7, .86, .90])
    w(tmp_path, "pA", "adam", 1e-3, 2, [.1, .6, .8, .94], [.1, .8, .90, .95])
    w(tmp_path, "pA", "adam", 1e-2, 0, [.1, .3, .4, .50], [.1, .3, .4, .45])
    # problem pL (loss), sgd: U1 two seeds (best: lower validation loss), U2 one seed
    w(tmp_path, "pL", "sgd", 0.1, 0, [2.0, 1.0, 0.5], [2.0, 1.0, 0.6], "loss")
    w(tmp_path, "pL", "sgd", 0.1, 1, [2.0, 1.2, 0.7], [2.0, 1.2, 0.8], "loss")
    w(tmp_path, "pL", "sgd", 0.01, 0, [2.0, 1.5, 0.9], [2.0, 1.5, 1.0], "loss")
    # problem pD: V1 is the best at its tuning seed 0 (0.90 > 0.85) but validates at 0.60 with
    # seeds 1 and 2, so a seed-mean of the validation metric (0.70) would choose V2
    w(tmp_path, "pD", "sgd", 0.1, 0, [.1, .90], [.1, .80])
    w(tmp_path, "pD", "sgd", 0.1, 1, [.1, .60], [.1, .70])
    w(tmp_path, "pD", "sgd", 0.1, 2, [.1, .60], [.1, .75])
    w(tmp_path, "pD", "sgd", 0.03, 0, [.1, .85], [.1, .86])
    return tmp_path


def test_summary_holds_the_numbers_of_the_results(results_dir):
    report = analyze(results_dir, results_dir / "out", formats=("png",))
    table = pd.read_csv(results_dir / "out" / "summary.csv").set_index(["problem", "optimizer"])
    assert len(table) == 4

    best_pa = 0.91  # adam's (0.88 + 0.90 + 0.95) / 3 beats sgd's 0.6
    threshold_pa = 0.95 * best_pa
    sgd = table.loc[("pA", "sgd")]
    assert sgd.best_setting == "lr=0.01__schedule=constant"  # valid 0.85 > (0.80 + 0.78) / 2
    assert sgd.performance == pytest.approx(0.6) and sgd.performance_std == 0 and sgd.seeds == 1
    assert math.isnan(sgd.speed)  # [.1, .3, .5, .6] never reaches 0.8645
    assert sgd.settings == 3 and sgd.good_share == 0  # 0.81, 0.6 and a diverged setting
    assert sgd.spread == pytest.approx(np.std([0.81, 0.6]))
    assert sgd.best_lr == 0.01

    adam = table.loc[("pA", "adam")]
    assert adam.best_setting == "lr=0.001__schedule=constant"
    assert adam.performance == pytest.approx(best_pa)
    assert adam.performance_std == pytest.approx(np.std([0.88, 0.90, 0.95]))
    assert adam.seeds == 3
    # seed-mean test curve [.1, .7, .87, .91]: 0.87 >= 0.8645 first at epoch 2
    assert 0.87 >= threshold_pa > 0.7 and adam.speed == 2
    assert adam.good_share == 0.5 and adam.spread == pytest.approx(np.std([0.91, 0.45]))

    loss = table.loc[("pL", "sgd")]
    assert loss.metric == "loss" and loss.best_setting == "lr=0.1__schedule=constant"
    assert loss.performance == pytest.approx(0.7) and loss.performance_std == pytest.approx(0.1)
    # threshold 0.7 + 0.05 * 0.7 = 0.735; seed-mean curve [2.0, 1.1, 0.7]
    assert loss.speed == 2 and loss.good_share == 0.5

    tuned = table.loc[("pD", "sgd")]
    assert tuned.best_setting == "lr=0.1__schedule=constant" and tuned.seeds == 3
    assert tuned.performance == pytest.approx(0.75)
    assert tuned.performance_std == pytest.approx(np.std([0.80, 0.70, 0.75]))

    runs = pd.read_csv(results_dir / "out" / "runs.csv")
    assert len(runs) == 15 and runs["diverged"].sum() == 1
    assert ("| pA | adam | constant | 91.00% ± 2.94 (accuracy, mean ± std over 3 seeds) |"
            in report.markdown)
    # one seed: said plainly, no "± 0.00" and no "1 seeds"
    assert "| pA | sgd | constant | 60.00% (accuracy, one seed: no spread) |" in report.markdown
    assert "± 0.00" not in report.markdown and "1 seeds" not in report.markdown
    names = {p.name for p in report.files}
    assert {"learning_curves_pA.png", "learning_curves_pL.png", "lr_sensitivity.png"} <= names
    assert "alpha_vs_performance.png" not in names  # no Cockpit logs here


def test_no_results_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no benchmark results"):
        analyze(tmp_path)


def test_learning_curves_have_whole_epoch_ticks_and_a_readable_legend(results_dir):
    """3 epochs used to get ticks at 0, 0.5, 1, …; the legend was 7 pt inside a panel."""
    from cockpit.benchmark.analyzer import summarize
    from cockpit.benchmark.figures import learning_curve_figure
    from cockpit.benchmark.results import iter_results

    _, best_runs = summarize(list(iter_results(results_dir)))
    groups = {k: v for k, v in best_runs.items() if k[0] == "pA"}
    fig = learning_curve_figure("pA", groups)
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["adam (3 seeds)", "sgd (1 seed)"]
    assert all(t.get_fontsize() >= 9 for t in legend.get_texts())
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_crowded_valley_figure_shows_mean_and_std_of_the_best_settings(results_dir):
    """Per problem one panel; per optimizer a marker at the seed mean of the best setting's
    final test metric (accuracy in %) with an error bar of ± the std over seeds, and one dot
    per seed — the numbers of summary.csv."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    from cockpit.benchmark.analyzer import summarize
    from cockpit.benchmark.figures import crowded_valley_figure
    from cockpit.benchmark.results import iter_results

    _, best_runs = summarize(list(iter_results(results_dir)))
    fig = crowded_valley_figure(best_runs)
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert sorted(axes) == ["pA", "pD", "pL"]
    ax = axes["pA"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["adam\n3 seeds", "sgd\n1 seed"]
    means = [line.get_ydata()[0] for line in ax.lines if line.get_marker() == "o"]
    assert means == pytest.approx([91.0, 60.0])
    (bar,) = [c for c in ax.collections if isinstance(c, LineCollection)]  # adam's only
    (low, high) = sorted(p[1] for p in bar.get_segments()[0])
    std = 100 * np.std([0.88, 0.90, 0.95])
    assert (low, high) == pytest.approx((91.0 - std, 91.0 + std))
    dots = [c for c in ax.collections if not isinstance(c, LineCollection)]
    assert [sorted(d.get_offsets()[:, 1]) for d in dots] == [
        pytest.approx([88.0, 90.0, 95.0]), pytest.approx([60.0])]
    assert axes["pL"].get_ylabel() == "final test loss, lower is better"
    plt.close(fig)


def test_readme_shows_the_crowded_valley_figure_and_its_command_parses():
    """The figure is checked in and shown; the script's sweep and analyze arguments are
    accepted by the command-line parser (the script itself runs for minutes)."""
    import importlib.util
    from pathlib import Path

    from cockpit.benchmark.cli import _parser

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    assert "](docs/crowded_valley.png)" in readme
    assert "python docs/make_crowded_valley_figure.py" in readme
    assert (root / "docs" / "crowded_valley.png").stat().st_size > 10_000
    spec = importlib.util.spec_from_file_location(
        "make_crowded_valley_figure", root / "docs" / "make_crowded_valley_figure.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = _parser().parse_args(["sweep", *script.PROBLEMS, "--optimizers", *script.OPTIMIZERS,
                                 *script.SWEEP, "--output", "x"])
    assert args.problems == ["digits_logreg", "digits_mlp", "quadratic_deep"]
    assert len(args.optimizers) == 5 and args.seeds == 5


def test_diverged_seeds_are_counted_and_named(tmp_path):
    # pA: seed 3 diverged, so mean and std are over the other three seeds
    for seed, test in enumerate([.8, .9, .7, None]):
        _write(tmp_path, "pA", "sgd", 0.1, seed, [.1, .8 if test else None], [.1, test])
    # pB: one finite seed of two; pC: every seed diverged
    _write(tmp_path, "pB", "sgd", 0.1, 0, [.1, .6], [.1, .5])
    _write(tmp_path, "pB", "sgd", 0.1, 1, [.1, None], [.1, None])
    _write(tmp_path, "pC", "sgd", 0.1, 0, [.1, None], [.1, None])
    _write(tmp_path, "pC", "sgd", 0.1, 1, [.1, None], [.1, None])
    report = analyze(tmp_path, tmp_path / "out", formats=("png",))
    table = pd.read_csv(tmp_path / "out" / "summary.csv").set_index("problem")
    assert table.loc["pA", "seeds"] == 4 and table.loc["pA", "diverged"] == 1
    assert table.loc["pA", "performance"] == pytest.approx(0.8)
    std = 100 * np.std([.8, .9, .7])
    assert (f"| pA | sgd | constant | 80.00% ± {std:.2f} (accuracy, mean ± std over 3 of 4 "
            "seeds; 1 diverged) |") in report.markdown
    assert table.loc["pB", "seeds"] == 2 and table.loc["pB", "diverged"] == 1
    assert ("| pB | sgd | constant | 50.00% (accuracy, 1 of 2 seeds: no spread; 1 diverged) |"
            in report.markdown)
    assert table.loc["pC", "diverged"] == 2 and math.isnan(table.loc["pC", "performance"])
    assert "| pC | sgd | constant | – (accuracy: all 2 seeds diverged) |" in report.markdown
    assert "nan" not in report.markdown
