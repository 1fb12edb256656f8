"""Run one optimizer on one test problem with one setting and seed: train for the problem's
epochs, evaluate train-eval / valid / test loss and accuracy before training and after every
epoch, and write one JSON result (layout and contents: :mod:`cockpit.benchmark.results`).

With ``cockpit=`` the run attaches :class:`cockpit.Cockpit` to its training loop — the
individual losses of every mini-batch go to ``with cockpit(step, losses=...)`` around the
backward pass — and writes the run log beside the result.
"""

from __future__ import annotations

import datetime
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cockpit.benchmark.lr_schedules import SCHEDULES, lr_scheduler
from cockpit.benchmark.optimizers import build_optimizer, optimizer_kwargs
from cockpit.benchmark.results import (
    RESULT_SCHEMA,
    cockpit_logdir,
    finite_or_none,
    result_path,
    setting_name,
    write_result,
)


@dataclass
class RunSpec:
    """Everything that defines a run (and so its result file)."""

    problem: str
    optimizer: str
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    epochs: int | None = None  # None: the problem's number of epochs
    batch_size: int | None = None  # None: the problem's batch size
    data: str = "synthetic"
    data_dir: str | None = None
    schedule: str = "constant"
    cockpit: str | None = None  # configuration name or comma-separated instrument names
    cockpit_every: int = 1
    # BatchNorm networks (ResNets, Wide ResNets, Inception-v3) train with batch statistics:
    # per-sample instruments as the labelled approximation (Cockpit's ``batchnorm``)
    batchnorm: str | None = "frozen_statistics"
    output: str = "results"
    device: str = "cpu"
    max_steps_per_epoch: int | None = None  # cap on steps per epoch (quick runs, tests)

    @property
    def setting(self) -> str:
        return setting_name(self.hyperparameters, self.schedule, self.batch_size,
                            self.epochs, self.max_steps_per_epoch)

    @property
    def path(self) -> Path:
        return result_path(self.output, self.problem, self.optimizer, self.setting, self.seed)

    def validate(self) -> None:
        """Check problem, optimizer, hyperparameters and schedule before any work."""
        from cockpit.benchmark.problems import list_problems

        problems = list_problems()
        if self.problem not in problems:
            raise ValueError(
                f"unknown problem {self.problem!r}; choose one of {', '.join(problems)}"
            )
        optimizer_kwargs(self.optimizer, self.hyperparameters)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {SCHEDULES}")
        if self.cockpit is not None:
            _cockpit_quantities(self.cockpit, self.cockpit_every)


def _cockpit_quantities(spec: str, every_k: int):
    from cockpit import quantities
    from cockpit.configurations import CONFIGURATIONS, configuration
    from cockpit.schedules import every

    if spec in CONFIGURATIONS:
        return configuration(spec, every(every_k))
    instruments = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        cls = getattr(quantities, name, None)
        if not (isinstance(cls, type) and issubclass(cls, quantities.Quantity)):
            raise ValueError(
                f"--cockpit {spec!r}: {name!r} is neither a configuration "
                f"({', '.join(CONFIGURATIONS)}) nor an instrument of cockpit.quantities"
            )
        instruments.append(cls(every(every_k)))
    return instruments


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _batch_counts(problem, output, target) -> tuple[float, float | None, int]:
    """(sum of individual losses, number correct or None, batch size) of one batch."""
    losses = problem.losses(output, target)
    n = int(losses.shape[0])
    accuracy = problem.accuracy(output, target)
    if accuracy is None:
        return float(losses.sum()), None, n
    accuracy = accuracy.detach().float()
    correct = float(accuracy.sum()) if accuracy.numel() > 1 else float(accuracy) * n
    return float(losses.sum()), correct, n


@torch.no_grad()
def evaluate(problem, loader, device: str = "cpu") -> tuple[float, float | None]:
    """Mean individual loss (no L2 term) and accuracy over all samples of ``loader``."""
    was_training = problem.model.training
    problem.model.eval()
    total, correct, count = 0.0, 0.0, 0
    has_accuracy = True
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss_sum, n_correct, n = _batch_counts(problem, problem.model(x), y)
        total, count = total + loss_sum, count + n
        if n_correct is None:
            has_accuracy = False
        else:
            correct += n_correct
    problem.model.train(was_training)
    if count == 0:
        raise ValueError(f"problem {problem.name!r}: an evaluation loader yielded no samples")
    return total / count, (correct / count if has_accuracy else None)


def run(spec: RunSpec, *, progress: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """Train and evaluate as ``spec`` says; write and return the result.

    An existing result file is returned as it is unless ``overwrite``.
    """
    from cockpit.benchmark.problems import get_problem
    from cockpit.benchmark.results import read_result

    path = spec.path
    if path.exists() and not overwrite:
        return read_result(path)
    spec.validate()
    start = time.perf_counter()
    _seed_everything(spec.seed)
    problem = get_problem(spec.problem, data=spec.data, data_dir=spec.data_dir,
                          batch_size=spec.batch_size, seed=spec.seed, device=spec.device)
    epochs = int(spec.epochs if spec.epochs is not None else problem.num_epochs)
    model = problem.model
    optimizer = build_optimizer(spec.optimizer, model.parameters(), spec.hyperparameters)
    steps_per_epoch = len(problem.train_loader)
    if spec.max_steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, spec.max_steps_per_epoch)
    scheduler = lr_scheduler(optimizer, spec.schedule, epochs * steps_per_epoch)

    cockpit = None
    logdir = cockpit_logdir(path)
    if spec.cockpit is not None:
        from cockpit import Cockpit

        if logdir.exists():  # left by an interrupted run: that run starts afresh
            shutil.rmtree(logdir)
        logdir.parent.mkdir(parents=True, exist_ok=True)
        cockpit = Cockpit(model, _cockpit_quantities(spec.cockpit, spec.cockpit_every),
                          optimizer=optimizer, logdir=str(logdir), batchnorm=spec.batchnorm)

    curves: dict[str, list[float | None]] = {
        f"{split}_{kind}": [] for split in ("train", "valid", "test")
        for kind in ("losses", "accuracies")
    }
    learning_rates: list[float | None] = []
    minibatch_losses: list[float | None] = []
    eval_time = 0.0

    def evaluate_all() -> None:
        nonlocal eval_time
        t0 = time.perf_counter()
        for split, loader in (("train", problem.train_eval_loader),
                              ("valid", problem.valid_loader), ("test", problem.test_loader)):
            loss, accuracy = evaluate(problem, loader, spec.device)
            curves[f"{split}_losses"].append(finite_or_none(loss))
            curves[f"{split}_accuracies"].append(finite_or_none(accuracy))
        learning_rates.append(float(optimizer.param_groups[0]["lr"]))
        eval_time += time.perf_counter() - t0

    evaluate_all()
    diverged = False
    step = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=epochs * steps_per_epoch, unit="step",
                   desc=f"{spec.problem} {spec.optimizer} seed {spec.seed}")
    try:
        for _epoch in range(epochs):
            model.train()
            for i, (x, y) in enumerate(problem.train_loader):
                if i >= steps_per_epoch:
                    break
                x, y = x.to(spec.device), y.to(spec.device)
                optimizer.zero_grad()
                losses = problem.losses(model(x), y)
                loss = losses.mean()
                regularizer = problem.regularizer()
                if regularizer is not None:
                    loss = loss + regularizer
                if cockpit is not None:
                    with cockpit(step, losses=losses):
                        loss.backward()
                else:
                    loss.backward()
                value = loss.item()
                minibatch_losses.append(finite_or_none(value))
                if not math.isfinite(value):
                    diverged = True
                    break
                optimizer.step()
                scheduler.step()
                step += 1
                if bar is not None:
                    bar.update()
                    if step % 20 == 0:
                        bar.set_postfix(loss=f"{value:.4g}")
            if diverged:
                break
            evaluate_all()
    finally:
        if bar is not None:
            bar.close()
        if cockpit is not None:
            cockpit.close()
    for values in curves.values():  # epochs not reached after a divergence
        values.extend([None] * (epochs + 1 - len(values)))
    learning_rates.extend([None] * (epochs + 1 - len(learning_rates)))
    wall = time.perf_counter() - start
    task = getattr(problem, "task", "classification")
    has_accuracy = any(a is not None for a in curves["test_accuracies"])
    result = {
        "schema": RESULT_SCHEMA,
        **{k: v for k, v in asdict(spec).items() if k not in ("output", "device")},
        "setting": spec.setting,
        "batch_size": int(problem.batch_size),
        "num_epochs": epochs,
        "steps_per_epoch": steps_per_epoch,
        "l2": getattr(problem, "l2", None),
        "task": task,
        "metric": "accuracy" if task == "classification" and has_accuracy else "loss",
        **curves,
        "learning_rates": learning_rates,
        "minibatch_train_losses": minibatch_losses,
        "diverged": diverged,
        "wall_time": wall,
        "eval_time": eval_time,
        "train_time": wall - eval_time,
        "cockpit_logdir": logdir.name if cockpit is not None else None,
        "torch": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    write_result(path, result)
    result["path"] = str(path)
    return result
