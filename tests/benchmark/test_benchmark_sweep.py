"""Tuning sweeps end to end: 2 optimizers × 3 trials × 2 seeds on a 2-D function and on
digits, in the local process pool and on a local Ray instance; a sweep killed mid-way
resumes without rerunning finished runs. Counts and the best setting are checked against
the Optuna storage and the result files, the analyzer's table against numbers computed here
from the JSON files."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
import pytest

from cockpit.benchmark.analyzer import analyze
from cockpit.benchmark.sweep import STORAGE_NAME, sweep

ROOT = Path(__file__).resolve().parents[2]
RUN = {"epochs": 1, "max_steps_per_epoch": 3}


def _results(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) | {"path": str(p)} for p in sorted(out.rglob("seed_*.json"))]


def _final(result: dict, split: str) -> float | None:
    kind = "accuracies" if result["metric"] == "accuracy" else "losses"
    return result[f"{split}_{kind}"][-1]


def _check_sweep(out: Path, problems, optimizers, trials: int, seeds: int) -> None:
    """Every study has ``trials`` complete trials; the best by final validation metric has
    ``seeds`` result files; nothing else was run."""
    storage = f"sqlite:///{out / STORAGE_NAME}"
    by_group = defaultdict(lambda: defaultdict(list))
    for r in _results(out):
        by_group[(r["problem"], r["optimizer"])][r["setting"]].append(r["seed"])
    for problem in problems:
        for optimizer in optimizers:
            name = next(s.study_name for s in optuna.get_all_study_summaries(storage)
                        if s.study_name.startswith(f"{problem}/{optimizer}/"))
            study = optuna.load_study(study_name=name, storage=storage)
            states = [t.state.name for t in study.trials]
            assert states == ["COMPLETE"] * trials, states
            settings = by_group[(problem, optimizer)]
            assert len(settings) == trials
            seed0 = {s: next(r for r in _results(out) if r["setting"] == s and r["seed"] == 0
                             and r["optimizer"] == optimizer and r["problem"] == problem)
                     for s in settings}

            def oriented(r):
                v = _final(r, "valid")
                if r["diverged"] or v is None:
                    return -math.inf
                return v if r["metric"] == "accuracy" else -v

            best = max(sorted(seed0), key=lambda s: oriented(seed0[s]))
            assert sorted(settings[best]) == list(range(seeds))
            assert all(v == [0] for s, v in settings.items() if s != best)
            assert study.best_value == pytest.approx(oriented(seed0[best]))


def _check_summary_against_json(out: Path) -> None:
    report = analyze(out, out / "analysis", formats=("png",))
    table = pd.read_csv(out / "analysis" / "summary.csv")
    results = _results(out)
    assert len(table) == len({(r["problem"], r["optimizer"]) for r in results})
    for row in table.itertuples():
        runs = [r for r in results if r["problem"] == row.problem
                and r["optimizer"] == row.optimizer]
        multi = [r for r in runs if r["setting"] == row.best_setting]
        assert len(multi) == row.seeds == 2  # the best setting is the one with more seeds
        tests = [_final(r, "test") for r in multi]
        assert row.performance == pytest.approx(sum(tests) / len(tests), rel=1e-9)
        assert row.settings == 3
    assert all(p.exists() for p in report.files)


def test_sweep_in_process_pool_and_analysis(tmp_path):
    problems, optimizers = ["two_d_branin", "digits_logreg"], ["sgd", "adam"]
    summary = sweep(problems, optimizers, output=str(tmp_path), budget=3, seeds=2,
                    workers=2, data="real", progress=False, **RUN)
    assert summary.failures == [] and summary.executed == 2 * 2 * 4
    _check_sweep(tmp_path, problems, optimizers, trials=3, seeds=2)
    _check_summary_against_json(tmp_path)
    # running the same sweep again runs nothing
    again = sweep(problems, optimizers, output=str(tmp_path), budget=3, seeds=2,
                  workers=1, data="real", progress=False, **RUN)
    assert again.executed == 0


def test_sweep_on_local_ray(tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        summary = sweep(["two_d_branin", "digits_logreg"], ["sgd", "adam"],
                        output=str(tmp_path), budget=3, seeds=2, executor="ray", data="real",
                        progress=False, **RUN)
    finally:
        ray.shutdown()
    assert summary.failures == [] and summary.executed == 2 * 2 * 4
    _check_sweep(tmp_path, ["two_d_branin", "digits_logreg"], ["sgd", "adam"], trials=3,
                 seeds=2)


def test_killed_sweep_resumes(tmp_path):
    optimizer = "tests.benchmark.bench_helpers:SlowSGD"  # 0.05 s per step: slow enough to interrupt
    args = ["digits_logreg", "--data", "real", "--optimizers", optimizer, "--space",
            "lr=LU(1e-3,1)", "--budget", "4", "--seeds", "2", "--epochs", "1",
            "--max-steps-per-epoch", "8", "--output", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "cockpit.cli", "bench", "sweep", *args],
                               env=env, cwd=ROOT, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while len(list(tmp_path.rglob("seed_*.json"))) < 2:
            assert process.poll() is None, "the sweep ended before it could be interrupted"
            assert time.time() < deadline
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in tmp_path.rglob("seed_*.json")}
    assert 2 <= len(before) < 5, "interrupted too late to test resuming"
    from cockpit.benchmark.search_spaces import Dist

    summary = sweep(["digits_logreg"], [optimizer], output=str(tmp_path), budget=4, seeds=2,
                    data="real", space_overrides={"lr": Dist(1e-3, 1.0)}, progress=False,
                    **{**RUN, "max_steps_per_epoch": 8})
    assert summary.failures == []
    for path, (mtime, content) in before.items():  # finished results untouched
        assert path.stat().st_mtime_ns == mtime and path.read_bytes() == content
    assert summary.executed + len(before) == 4 + 1  # 4 tuning runs + seed 1 of the best
    _check_sweep(tmp_path, ["digits_logreg"], [optimizer], trials=4, seeds=2)


def test_a_trial_stopped_before_its_settings_were_recorded_is_run_on_resume(tmp_path):
    """A sweep killed between the sampler's ask() and recording the trial's settings leaves
    a RUNNING trial without them (the resumed sweep failed with KeyError): it never ran, so
    the resumed sweep draws its settings and runs it; every trial ends COMPLETE."""
    sweep(["two_d_branin"], ["sgd"], output=str(tmp_path), budget=2, seeds=1, data="real",
          progress=False, **RUN)
    storage = f"sqlite:///{(tmp_path / STORAGE_NAME).resolve()}"
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    study.ask()  # the kill: asked, nothing recorded
    # the same sweep again (its study name holds the budget); the stray trial is run even
    # though the two others already fill the budget (in a real kill it is one of them)
    resumed = sweep(["two_d_branin"], ["sgd"], output=str(tmp_path), budget=2, seeds=1,
                    data="real", progress=False, **RUN)
    assert resumed.failures == [] and resumed.executed == 1
    _check_sweep(tmp_path, ["two_d_branin"], ["sgd"], trials=3, seeds=1)


def test_pool_replaces_a_dead_worker_and_retries_its_run(tmp_path):
    from cockpit.benchmark.executors import PoolExecutor
    from cockpit.benchmark.runner import RunSpec

    spec = RunSpec("two_d_branin", "tests.benchmark.bench_helpers:SlowSGD",
                   {"lr": 1e-3, "delay": 0.2}, epochs=1, output=str(tmp_path),
                   max_steps_per_epoch=5)
    pool = PoolExecutor(1)
    try:
        pool.submit("run", spec)
        time.sleep(1.0)
        for process in list(pool._pool._processes.values()):
            process.kill()  # the worker dies while importing or running
        ((key, outcome),) = pool.wait()
    finally:
        pool.close()
    assert key == "run" and isinstance(outcome, dict), outcome
    assert outcome["minibatch_train_losses"] and spec.path.exists()


def test_sweep_and_analysis_pick_the_same_best_setting(tmp_path, monkeypatch):
    """One rule for both (Crowded Valley): the setting with the best final validation metric
    of its tuning-seed run; its performance is the mean ± std of the test metric over all
    seeds. Runs are replaced by results written here: the setting best at seed 0 validates
    at 0 with seeds 1 and 2, so a seed-mean of the validation metric (the analyzer's old
    rule) would pick another setting, with one seed."""
    from cockpit.benchmark import executors
    from cockpit.benchmark.results import RESULT_SCHEMA, write_result
    from cockpit.benchmark.search_spaces import Dist

    def fake_run(spec):
        lr = spec.hyperparameters["lr"]
        valid = 0.5 + 0.4 * lr if spec.seed == 0 else 0.0
        test = 0.6 + 0.1 * spec.seed
        curves = {f"{split}_{kind}": [0.1, value]
                  for split, value in (("train", test), ("valid", valid), ("test", test))
                  for kind in ("losses", "accuracies")}
        result = {"schema": RESULT_SCHEMA, "problem": spec.problem,
                  "optimizer": spec.optimizer, "hyperparameters": spec.hyperparameters,
                  "seed": spec.seed, "schedule": spec.schedule, "setting": spec.setting,
                  "metric": "accuracy", "diverged": False, "wall_time": 0.0,
                  "cockpit_logdir": None, **curves}
        write_result(spec.path, result)
        return result | {"path": str(spec.path)}

    monkeypatch.setattr(executors, "run_quietly", fake_run)
    summary = sweep(["digits_logreg"], ["sgd"], output=str(tmp_path), budget=4, seeds=3,
                    executor="serial", data="real", progress=False, epochs=1,
                    space_overrides={"lr": Dist(1e-3, 1.0)})
    assert summary.failures == [] and summary.executed == 4 + 2
    results = _results(tmp_path)
    tuning = {r["setting"]: r for r in results if r["seed"] == 0}
    expected = max(tuning, key=lambda s: tuning[s]["hyperparameters"]["lr"])
    assert {r["setting"] for r in results if r["seed"] == 2} == {expected}  # rerun by sweep
    best = summary.best["digits_logreg/sgd"]
    assert best["hyperparameters"] == tuning[expected]["hyperparameters"]
    assert best["score"] == pytest.approx(_final(tuning[expected], "valid"))

    analyze(tmp_path, tmp_path / "analysis", formats=("png",))
    (row,) = pd.read_csv(tmp_path / "analysis" / "summary.csv").itertuples()
    assert row.best_setting == expected and row.seeds == 3
    assert row.performance == pytest.approx(0.7)  # tests 0.6, 0.7, 0.8
    assert row.performance_std == pytest.approx(np.std([0.6, 0.7, 0.8]))


def test_space_overrides_go_only_to_optimizers_with_that_hyperparameter(tmp_path):
    from cockpit.benchmark.search_spaces import BETA1, LR, Dist
    from cockpit.benchmark.sweep import overrides_by_optimizer

    momentum = Dist(0.8, 0.99, log=False)
    assert overrides_by_optimizer(["sgd", "momentum", "adam"], {"momentum": momentum}) == {
        "sgd": {}, "momentum": {"momentum": momentum}, "adam": {}}
    # an optimizer without a protocol space takes what its class accepts
    assert overrides_by_optimizer(["adamax"], {"lr": LR}) == {"adamax": {"lr": LR}}
    with pytest.raises(ValueError, match=r"--space momentum: no optimizer of this sweep "
                                         r"\(sgd, adam\) has hyperparameter 'momentum'"):
        sweep(["digits_logreg"], ["sgd", "adam"], output=str(tmp_path / "refused"),
              space_overrides={"momentum": momentum}, progress=False, **RUN)
    assert not (tmp_path / "refused" / "digits_logreg").exists()  # nothing ran

    out = tmp_path / "sweep"
    summary = sweep(["digits_logreg"], ["momentum", "adam"], output=str(out), budget=2,
                    seeds=1, executor="serial", data="real", progress=False,
                    space_overrides={"momentum": momentum}, **RUN)
    assert summary.failures == [] and summary.executed == 4
    runs = _results(out)
    hps = {r["optimizer"]: [] for r in runs}
    for r in runs:
        hps[r["optimizer"]].append(r["hyperparameters"])
    assert len(hps["momentum"]) == len(hps["adam"]) == 2
    assert all(0.8 <= h["momentum"] <= 0.99 for h in hps["momentum"])
    for h in hps["adam"]:
        assert "momentum" not in h and BETA1.low <= h["beta1"] <= BETA1.high

    # the same directory with other data: refused before any run, nothing changed
    before = {p: p.read_text() for p in out.rglob("seed_*.json")}
    with pytest.raises(ValueError, match=r"made with --data real .*not --data synthetic"):
        sweep(["digits_logreg"], ["momentum", "adam"], output=str(out), budget=2, seeds=1,
              executor="serial", data="synthetic", progress=False,
              space_overrides={"momentum": momentum}, **RUN)
    assert {p: p.read_text() for p in out.rglob("seed_*.json")} == before
    again = sweep(["digits_logreg"], ["momentum", "adam"], output=str(out), budget=2, seeds=1,
                  executor="serial", data="real", progress=False,
                  space_overrides={"momentum": momentum}, **RUN)
    assert again.executed == 0 and again.failures == []


def test_a_sweep_asked_for_cockpit_writes_the_logs_earlier_runs_lack(tmp_path):
    options = {"budget": 2, "seeds": 2, "executor": "serial", "data": "real",
               "progress": False, **RUN}
    first = sweep(["digits_logreg"], ["sgd"], output=str(tmp_path), **options)
    assert first.executed == 3 and first.failures == []
    before = {r["path"]: r for r in _results(tmp_path)}
    assert all(r["cockpit_logdir"] is None for r in before.values())
    again = sweep(["digits_logreg"], ["sgd"], output=str(tmp_path), cockpit="Loss", **options)
    assert again.failures == [] and again.executed == 3 and again.reused == 0
    for r in _results(tmp_path):
        logdir = Path(r["path"]).with_suffix(".cockpit")
        assert r["cockpit_logdir"] == logdir.name and (logdir / "cockpit.sqlite").exists()
        assert r["test_losses"] == before[r["path"]]["test_losses"]  # the same training
    third = sweep(["digits_logreg"], ["sgd"], output=str(tmp_path), cockpit="Loss", **options)
    assert third.executed == 0 and third.reused == 1  # the seed-1 run, from its file
