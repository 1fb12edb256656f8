"""Tuning sweeps in the Crowded Valley protocol, with Optuna for search and storage.

For each problem and optimizer, a study (Optuna, SQLite storage ``<output>/sweep.sqlite3``,
named ``problem/optimizer/schedule/budget``) proposes settings; each is trained with seed 0
and scored by its final validation metric (accuracy, or −loss for problems ranked by loss;
a run that diverged scores −∞). Each study's sampler is seeded with ``sampler_seed`` plus a
hash of the study's name (plus the number of trials already stored, when resuming).
The one-shot budget runs the optimizer's defaults. When the
budget is spent, the best setting — chosen by the rule the analyzer uses
(:mod:`cockpit.benchmark.selection`: the best final validation metric of the tuning seed) —
is rerun with seeds 1 … ``seeds`` − 1, so it has ``seeds`` runs in all.

Search: ``sampler="random"`` (Optuna's ``RandomSampler``) is the protocol's random search;
``"tpe"`` and ``"qmc"`` are alternatives. All Optuna calls happen in this process; runs go to
an executor (:mod:`cockpit.benchmark.executors`), so only one process writes the storage.

Resuming: run the same command again. Finished trials stay as they are; a trial that was
running when the sweep stopped is finished from its result file if the run completed, and
run again with the same hyperparameters otherwise; new trials are asked only until the
budget is reached. Seed runs whose result files exist are not rerun. A result is reused
only as :func:`cockpit.benchmark.runner.stored_result` allows: results made with other data
in the same output directory stop the sweep before it starts, and with ``cockpit`` a result
without a matching Cockpit run log (a tuning or seed run finished by an earlier sweep without
it) is trained again to write it; its score stays the one the study was told.

``space_overrides`` (``--space name=LU(low,high)``) replace or add a hyperparameter's
distribution for those optimizers that have that hyperparameter (in their search space or
their fixed defaults; for an optimizer without a protocol space, any hyperparameter its
class accepts); an override no listed optimizer has is an error before any run.
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cockpit._extras import missing_extra
from cockpit.benchmark.executors import make_executor
from cockpit.benchmark.optimizers import optimizer_kwargs
from cockpit.benchmark.results import iter_results, read_result
from cockpit.benchmark.runner import RunSpec, check_same_data, stored_result
from cockpit.benchmark.search_spaces import (
    SEARCH_SPACES,
    Dist,
    budget_trials,
    defaults,
    search_space,
)
from cockpit.benchmark.selection import best_setting, selection_value

HP_ATTR = "hyperparameters"
STORAGE_NAME = "sweep.sqlite3"


def score(result: dict[str, Any]) -> float:
    """What the study maximizes: :func:`cockpit.benchmark.selection.selection_value` (final
    validation accuracy, or −loss; −∞ if diverged)."""
    return selection_value(result)


def _sampler(name: str, seed: int):
    import optuna

    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "qmc":
        return optuna.samplers.QMCSampler(seed=seed, scramble=True)
    raise ValueError(f"unknown sampler {name!r}; choose random, tpe or qmc")


@dataclass
class StudyPlan:
    """One problem × optimizer of a sweep."""

    problem: str
    optimizer: str
    space: dict[str, Dist]
    n_trials: int
    template: RunSpec
    study: Any = None
    in_flight: int = 0
    best: dict[str, Any] | None = None
    seed_specs: list[RunSpec] = field(default_factory=list)


@dataclass
class SweepSummary:
    """What a sweep did: runs executed now, reused from files, failures, best settings."""

    executed: int = 0
    reused: int = 0
    failures: list[str] = field(default_factory=list)
    best: dict[str, dict[str, Any]] = field(default_factory=dict)
    results: list[str] = field(default_factory=list)


def sweep(problems: list[str], optimizers: list[str], *, output: str = "results",
          budget: str | int = "small", scale: float = 1.0, seeds: int = 10,
          sampler: str = "random", sampler_seed: int = 0, executor: str = "pool",
          workers: int = 1, ray_address: str | None = None,
          space_overrides: dict[str, Dist] | None = None, progress: bool = True,
          **run_options: Any) -> SweepSummary:
    """Tune every optimizer on every problem, then rerun each best setting with more seeds.

    ``run_options`` are :class:`RunSpec` fields shared by all runs (epochs, batch_size, data,
    data_dir, schedule, cockpit, cockpit_every, max_steps_per_epoch, device).
    """
    try:
        import optuna
    except ImportError as error:
        raise missing_extra(error, "optuna", "bench", "cockpit bench sweep") from None

    optuna.logging.set_verbosity(logging.WARNING)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{(out / STORAGE_NAME).resolve()}"
    n_trials = budget_trials(budget, scale)
    overrides = overrides_by_optimizer(optimizers, space_overrides or {})
    plans: list[StudyPlan] = []
    for problem in problems:
        for optimizer in optimizers:
            space = ({} if budget == "one-shot"
                     else search_space(optimizer, overrides[optimizer]))
            template = RunSpec(problem=problem, optimizer=optimizer, seed=0,
                               output=str(out), **run_options)
            RunSpec(**{**template.__dict__, "hyperparameters": defaults(optimizer)}).validate()
            _check_stored_data(template)
            plans.append(StudyPlan(problem, optimizer, space, n_trials, template))

    summary = SweepSummary()
    pool = make_executor(executor, workers, ray_address)
    bar = None
    try:
        for plan in plans:
            name = f"{plan.problem}/{plan.optimizer}/{plan.template.schedule}/{budget}"
            existing = _existing_trials(storage, name)
            plan.study = optuna.create_study(
                study_name=name, storage=storage, direction="maximize", load_if_exists=True,
                sampler=_sampler(sampler, sampler_seed + zlib.crc32(name.encode()) + existing),
            )
            plan.study.set_user_attr("space", {k: str(v) for k, v in plan.space.items()})
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(plans) * (n_trials + max(seeds - 1, 0)), unit="run",
                       desc="sweep")
        _tune(plans, pool, summary, bar, budget)
        _seed_runs(plans, pool, summary, bar, seeds)
    finally:
        if bar is not None:
            bar.close()
        pool.close()
    return summary


def _has_hyperparameter(optimizer: str, name: str) -> bool:
    """Whether ``optimizer`` has hyperparameter ``name``: in its protocol search space or
    fixed defaults, or — for an optimizer without a protocol space — among the keyword
    arguments its class accepts (so plain ``sgd`` has no momentum here)."""
    key = optimizer.lower()
    if key in SEARCH_SPACES:
        return name in SEARCH_SPACES[key] or name in defaults(optimizer)
    try:
        optimizer_kwargs(optimizer, {name: 0.0})
    except ValueError:
        return False
    return True


def overrides_by_optimizer(optimizers: list[str], space_overrides: dict[str, Dist],
                           ) -> dict[str, dict[str, Dist]]:
    """The ``--space`` overrides that apply to each optimizer (those of its
    hyperparameters); an override no optimizer has is a ``ValueError``."""
    out = {opt: {name: dist for name, dist in space_overrides.items()
                 if _has_hyperparameter(opt, name)} for opt in optimizers}
    unused = [name for name in space_overrides if not any(name in o for o in out.values())]
    if unused:
        raise ValueError(
            f"--space {', '.join(unused)}: no optimizer of this sweep "
            f"({', '.join(optimizers)}) has hyperparameter {', '.join(map(repr, unused))}"
        )
    return out


def _check_stored_data(template: RunSpec) -> None:
    """Stop before any run if results below the template's problem and optimizer were
    made with other data (the studies and results would mix them)."""
    folder = template.path.parent.parent
    if not folder.exists():
        return
    for result in iter_results(folder):
        check_same_data(template, result)


def _existing_trials(storage: str, name: str) -> int:
    import optuna

    try:
        return len(optuna.load_study(study_name=name, storage=storage).trials)
    except KeyError:
        return 0


def _spec_for(plan: StudyPlan, hyperparameters: dict[str, Any], seed: int = 0) -> RunSpec:
    return replace(plan.template, hyperparameters=dict(hyperparameters), seed=seed)


def _tune(plans: list[StudyPlan], pool, summary: SweepSummary, bar, budget) -> None:
    import optuna
    from optuna.trial import TrialState

    queue: list[tuple[StudyPlan, int, RunSpec]] = []
    for plan in plans:
        _tick(bar, _finished(plan))  # finished before this call
        for trial in plan.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if HP_ATTR not in trial.user_attrs:
                # stopped between ask() and recording its settings: it never ran; draw them
                # now (settings it had already suggested are kept) and run it
                queue.append(_suggest(plan, optuna.trial.Trial(plan.study, trial._trial_id),
                                      budget))
                continue
            spec = _spec_for(plan, json.loads(trial.user_attrs[HP_ATTR]))
            result, _ = stored_result(spec)
            if result is not None:  # the run finished, the sweep stopped before telling
                plan.study.tell(trial.number, score(result))
                summary.reused += 1
                summary.results.append(str(spec.path))
                _tick(bar)
            else:
                queue.append((plan, trial.number, spec))
    for plan in plans:
        plan.in_flight = sum(1 for p, _, _ in queue if p is plan)

    def next_run() -> tuple[StudyPlan, int, RunSpec] | None:
        if queue:
            return queue.pop(0)
        for plan in plans:
            if _finished(plan) + plan.in_flight < plan.n_trials:
                plan.in_flight += 1
                return _ask(plan, budget)
        return None

    in_flight = 0
    while True:
        while in_flight < pool.capacity:
            item = next_run()
            if item is None:
                break
            plan, number, spec = item
            pool.submit((plan, number, spec), spec)
            in_flight += 1
        if in_flight == 0:
            break
        for (plan, number, spec), outcome in pool.wait():
            in_flight -= 1
            plan.in_flight -= 1
            if isinstance(outcome, BaseException):
                plan.study.tell(number, state=TrialState.FAIL)
                summary.failures.append(f"{spec.path}: {type(outcome).__name__}: {outcome}")
            else:
                plan.study.tell(number, score(outcome))
                summary.results.append(str(spec.path))
                if outcome.get("reused"):
                    summary.reused += 1
                else:
                    summary.executed += 1
            _tick(bar)


def _finished(plan: StudyPlan) -> int:
    from optuna.trial import TrialState

    finished = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
    return len(plan.study.get_trials(deepcopy=False, states=finished))


def _ask(plan: StudyPlan, budget) -> tuple[StudyPlan, int, RunSpec]:
    return _suggest(plan, plan.study.ask(), budget)


def _suggest(plan: StudyPlan, trial, budget) -> tuple[StudyPlan, int, RunSpec]:
    """The trial's settings (drawn by the sampler, or the defaults for one-shot), recorded
    on the trial, and its run."""
    if budget == "one-shot":
        hyperparameters = defaults(plan.optimizer)
    else:
        hyperparameters = {
            name: trial.suggest_float(name, dist.low, dist.high, log=dist.log)
            for name, dist in plan.space.items()
        }
        for key, value in defaults(plan.optimizer).items():  # fixed, untuned entries
            hyperparameters.setdefault(key, value)
    trial.set_user_attr(HP_ATTR, json.dumps(hyperparameters))
    return plan, trial.number, _spec_for(plan, hyperparameters)


def _seed_runs(plans: list[StudyPlan], pool, summary: SweepSummary, bar, seeds: int) -> None:
    from optuna.trial import TrialState

    specs: list[RunSpec] = []
    for plan in plans:
        complete = plan.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not complete:
            summary.failures.append(f"{plan.problem}/{plan.optimizer}: no trial completed")
            continue
        # the analyzer's rule (cockpit.benchmark.selection) on the tuning runs' results
        trials: dict[str, tuple[Any, dict[str, Any]]] = {}
        for trial in complete:
            spec = _spec_for(plan, json.loads(trial.user_attrs[HP_ATTR]))
            if spec.path.exists():  # a result file deleted by hand: that trial is not judged
                trials.setdefault(spec.setting, (trial, read_result(spec.path)))
                if spec.cockpit is not None and stored_result(spec)[0] is None:
                    specs.append(spec)  # finished earlier without this Cockpit run log
        if not trials:
            summary.failures.append(f"{plan.problem}/{plan.optimizer}: no tuning result file")
            continue
        chosen = best_setting({setting: [r] for setting, (_, r) in trials.items()})
        best, result = trials[chosen]
        hyperparameters = json.loads(best.user_attrs[HP_ATTR])
        summary.best[f"{plan.problem}/{plan.optimizer}"] = {
            "hyperparameters": hyperparameters, "score": selection_value(result),
            "trial": best.number, "setting": chosen,
        }
        specs += [_spec_for(plan, hyperparameters, seed) for seed in range(1, seeds)]
    waiting = 0
    for spec in specs:
        if stored_result(spec)[0] is not None:
            summary.reused += 1
            summary.results.append(str(spec.path))
            _tick(bar)
            continue
        if waiting >= pool.capacity:
            waiting -= _collect(pool, summary, bar)
        pool.submit(spec, spec)
        waiting += 1
    while waiting:
        waiting -= _collect(pool, summary, bar)


def _collect(pool, summary: SweepSummary, bar) -> int:
    finished = pool.wait()
    for spec, outcome in finished:
        if isinstance(outcome, BaseException):
            summary.failures.append(f"{spec.path}: {type(outcome).__name__}: {outcome}")
        else:
            summary.executed += 1
            summary.results.append(str(spec.path))
        _tick(bar)
    return len(finished)


def _tick(bar, n: int = 1) -> None:
    if bar is not None and n:
        bar.update(n)
