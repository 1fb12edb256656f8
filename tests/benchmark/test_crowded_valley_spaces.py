"""The Crowded Valley search spaces and defaults against the authors' runs.

Reference: the hyperparameter settings of the authors' tuning and one-shot runs, read from
the result paths of their public results repository and committed in
``benchmarks/data/crowded_valley_settings.txt`` (provenance in its header); the evidence
table ``benchmarks/data/crowded_valley_spaces.csv`` is derived from them by
``benchmarks/crowded_valley_spaces.py``.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from cockpit.benchmark.search_spaces import (
    DEFAULTS,
    SEARCH_SPACES,
    Dist,
    parse_dist,
    search_space,
)

ROOT = Path(__file__).resolve().parents[2]


def _load_evidence_module():
    path = ROOT / "benchmarks" / "crowded_valley_spaces.py"
    spec = importlib.util.spec_from_file_location("crowded_valley_spaces", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


cv = _load_evidence_module()
ROWS = cv.evidence_table(cv.read_settings())
TUNED = [r for r in ROWS if r.tuned]
FIXED = [r for r in ROWS if not r.tuned]


def _value(text: str):
    return {"True": True, "False": False}[text] if text in ("True", "False") else float(text)


def test_the_evidence_covers_nine_optimizers_with_enough_runs():
    assert {r.optimizer for r in ROWS} == set(SEARCH_SPACES) - {"adamw"}
    assert len(TUNED) == 19 and min(r.n_distinct for r in TUNED) >= 14
    assert sum(r.n_tune_runs for r in ROWS if r.hyperparameter == "lr") == 375  # settings


def test_committed_table_is_what_the_committed_settings_give():
    committed = cv.read_table()
    derived = [{f.name: str(getattr(r, f.name)) for f in fields(r)} for r in ROWS]
    assert committed == derived


def test_every_tuned_value_is_a_seed_42_draw_under_the_authors_bounds():
    for row in TUNED:
        assert row.draws_matched == row.n_distinct, row
        assert row.runs_consistent == row.n_tune_runs, row  # run i: draws k·i … k·i+k−1


def test_wrong_bounds_do_not_match_the_draws(monkeypatch):
    """Negative control: the ranges written from memory before (lr LU(1e-5, 1), momentum
    LU(0.5, 0.999)) or a bound one decade off match (almost) none of the values."""
    monkeypatch.setitem(cv.AUTHORS_LOG10_BOUNDS, "learning_rate", (-5.0, 0.0))
    monkeypatch.setitem(cv.AUTHORS_LOG10_BOUNDS, "momentum", (math.log10(0.5),
                                                              math.log10(0.999)))
    monkeypatch.setitem(cv.AUTHORS_LOG10_BOUNDS, "rho", (-4.0, 0.0))
    rows = {(r.optimizer, r.hyperparameter): r for r in cv.evidence_table(cv.read_settings())}
    for key in [("sgd", "lr"), ("adam", "lr"), ("adadelta", "rho")]:
        assert rows[key].draws_matched <= 1 and rows[key].runs_consistent <= 1
    # momentum LU(0.5, 0.999) cannot even hold the values: u < 0 for most of them
    assert rows[("momentum", "momentum")].draws_matched <= 1


@pytest.mark.parametrize("row", TUNED, ids=lambda r: f"{r.optimizer}-{r.hyperparameter}")
def test_our_space_is_the_authors_distribution(row):
    dist = SEARCH_SPACES[row.optimizer][row.hyperparameter]
    low, high = float(row.observed_min), float(row.observed_max)
    assert dist.log  # log-uniform: the draws above are uniform in log x
    assert dist.low <= low and high <= dist.high  # holds every sampled value
    # equal to the bounds the draws pin (the authors wrote the beta bounds as rounded log10
    # values: 10^-0.301 = 0.50003 for 0.5, 10^-0.00043 = 0.99901 for 0.999)
    assert math.log(dist.low) == pytest.approx(math.log(float(row.authors_low)), abs=1e-4)
    assert math.log(dist.high) == pytest.approx(math.log(float(row.authors_high)), abs=1e-4)
    # and, without the draws: not wider than the samples allow. For n values log-uniform on
    # [a, b], the gap between a and the smallest one exceeds a share g of the log-width with
    # probability (1 − g)^n; g = 1 − 0.001^(1/n) makes a true bound fail with p = 0.001, so
    # a bound that leaves a larger gap at either end is wider than the evidence supports.
    width = math.log(dist.high / dist.low)
    allowed = 1 - 0.001 ** (1 / row.n_distinct)
    assert math.log(low / dist.low) / width <= allowed
    assert math.log(dist.high / high) / width <= allowed


@pytest.mark.parametrize("row", FIXED, ids=lambda r: f"{r.optimizer}-{r.hyperparameter}")
def test_untuned_hyperparameters_are_fixed_at_the_authors_value(row):
    assert row.hyperparameter not in SEARCH_SPACES[row.optimizer]
    assert cv.our_fixed_value(row.optimizer, row.hyperparameter) == _value(row.fixed_value)


def test_no_epsilon_is_tuned():
    assert all("eps" not in space for space in SEARCH_SPACES.values())


@pytest.mark.parametrize("row", [r for r in ROWS if r.oneshot_value],
                         ids=lambda r: f"{r.optimizer}-{r.hyperparameter}")
def test_one_shot_defaults_are_the_authors_one_shot_run(row):
    assert cv.our_fixed_value(row.optimizer, row.hyperparameter) == _value(row.oneshot_value)


def test_adamw_copies_adam_and_every_default_builds_its_optimizer():
    assert SEARCH_SPACES["adamw"] == SEARCH_SPACES["adam"]
    import torch

    from cockpit.benchmark.optimizers import build_optimizer

    for name in SEARCH_SPACES:
        for end in ("low", "high"):
            corner = {k: getattr(d, end) for k, d in SEARCH_SPACES[name].items()}
            parameter = torch.ones(3, dtype=torch.float64, requires_grad=True)
            optimizer = build_optimizer(name, [parameter], {**DEFAULTS[name], **corner})
            parameter.grad = torch.full((3,), 0.5, dtype=torch.float64)
            optimizer.step()  # every key is a constructor argument the optimizer accepts
            assert torch.isfinite(parameter).all() and (parameter < 1).all(), (name, end)


def test_space_overrides_replace_and_add_and_unknown_optimizers_need_one():
    space = search_space("Adam", {"lr": parse_dist("LU(1e-3, 1e-1)"),
                                  "eps": parse_dist("LU(1e-10,1e-6)")})
    assert space["lr"] == Dist(1e-3, 1e-1) and space["eps"] == Dist(1e-10, 1e-6)
    assert space["beta1"] == Dist(0.5, 0.999) and SEARCH_SPACES["adam"]["lr"] == Dist(1e-4, 1)
    assert search_space("pkg.mod:MySGD", {"lr": Dist(0.01, 0.1, log=False)}) == {
        "lr": Dist(0.01, 0.1, log=False)}
    with pytest.raises(ValueError, match="no search space for optimizer"):
        search_space("pkg.mod:MySGD")


def test_scaled_budgets_round_as_meant():
    from cockpit.benchmark.search_spaces import budget_trials

    assert budget_trials("small", 0.28) == 7  # 25 · 0.28 = 7.000000000000001 in floats
    assert budget_trials("small", 0.2) == 5 and budget_trials("medium", 0.21) == 11
    assert budget_trials("large", 0.001) == 1 and budget_trials(12) == 12
