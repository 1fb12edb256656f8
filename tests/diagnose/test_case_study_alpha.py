"""Case study (c) — Cockpit paper Fig. 5 on a small scale: over a learning-rate
sweep of SGD, the mean α grows with the learning rate on every problem; the smallest
learning rate understeps (α well below 0) and is not the best; the best run sits between
understepping and going uphill (−0.5 ≤ α ≤ 1, closer to 0 than the smallest learning rate).
The full-size script (examples/case_studies/alpha_vs_accuracy.py) finds the best runs at
α > 0 on all three problems, as the paper does (numbers in benchmarks/RESULTS.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples/case_studies/alpha_vs_accuracy.py"


def _case_study():
    spec = importlib.util.spec_from_file_location("alpha_vs_accuracy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mean_alpha_grows_with_lr_and_best_runs_do_not_understep(tmp_path):
    case = _case_study()
    runs = case.run_sweep(tmp_path, case.QUICK_SWEEPS, progress=False,
                          max_steps_per_epoch=case.QUICK_STEPS_PER_EPOCH)  # --quick
    assert runs["mean_alpha"].notna().all()
    facts = case.findings(runs)
    assert set(facts) == {"digits_logreg", "quadratic_deep"}
    for problem, f in facts.items():
        assert f["spearman_lr_alpha"] >= 0.9, (problem, f)
        assert f["alpha_smallest_lr"] < -0.5, (problem, f)
        assert -0.5 <= f["alpha_best"] <= 1.0, (problem, f)
        assert abs(f["alpha_best"]) < abs(f["alpha_smallest_lr"]), (problem, f)
        smallest = runs[runs["problem"] == problem].sort_values("lr").iloc[0]
        assert smallest["lr"] != f["lr_best"]
    from cockpit.benchmark import figures

    (png,) = figures.alpha_vs_performance(runs, tmp_path, ("png",))
    assert png.stat().st_size > 10_000
