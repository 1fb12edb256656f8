"""Run one optimizer on one test problem with one setting and seed: train for the problem's
epochs, evaluate train-eval / valid / test loss and accuracy before training and after every
epoch, and write one JSON result (layout and contents: :mod:`cockpit.benchmark.results`).

With ``cockpit=`` the run attaches :class:`cockpit.Cockpit` to its training loop — the
individual losses of every mini-batch go to ``with cockpit(step, losses=...)`` around the
backward pass — and writes the run log beside the result.

A stored result of the same run (same file, see :mod:`cockpit.benchmark.results`) is reused
— returned with ``"reused": True`` — only if it was made with the same data (``data``, and
for real data the folder read); one made with other data is an error, never returned. When
Cockpit is asked for and the stored result has no run log made with the same ``cockpit``,
``cockpit_every`` and ``batchnorm``, the run is trained again to write it (the returned
result says why in ``"rerun_reason"``).
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
        default_batch_size, default_epochs = _problem_defaults(self.problem)
        return setting_name(self.hyperparameters, self.schedule, self.batch_size,
                            self.epochs, self.max_steps_per_epoch,
                            default_batch_size=default_batch_size,
                            default_epochs=default_epochs)

    @property
    def data_root(self) -> str | None:
        """The folder real data are read from (absolute); None for synthetic data."""
        return _data_root(self.data, self.data_dir)

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


def _problem_defaults(problem: str) -> tuple[int | None, int | None]:
    """(batch size, epochs) of ``problem`` by default; (None, None) for an unknown name."""
    from cockpit.benchmark.problems.registry import REGISTRY

    spec = REGISTRY.get(problem)
    return (None, None) if spec is None else (spec.batch_size, spec.num_epochs)


def _data_root(data: str, data_dir: str | None) -> str | None:
    if data != "real":
        return None
    from cockpit.benchmark.problems.readers import data_root

    return str(data_root(data_dir).resolve())


def _describe_data(data: str, root: str | None) -> str:
    return f"--data {data}" + (f" from {root}" if root is not None else "")


def check_same_data(spec: RunSpec, result: dict[str, Any]) -> None:
    """``ValueError`` if stored ``result`` was made with other data than ``spec`` asks for
    (``data``, or for real data the folder read)."""
    stored_data = result.get("data", "synthetic")
    stored_root = result.get("data_root", _data_root(stored_data, result.get("data_dir")))
    if (stored_data, stored_root) != (spec.data, spec.data_root):
        raise ValueError(
            f"{result['path']} holds a result made with "
            f"{_describe_data(stored_data, stored_root)}, not "
            f"{_describe_data(spec.data, spec.data_root)} as asked; it is not reused. "
            "Use another --output directory for these data (or --overwrite to replace it)"
        )


def stored_result(spec: RunSpec) -> tuple[dict[str, Any] | None, str | None]:
    """The stored result of ``spec`` if it can be reused, else ``(None, why)``: why it has
    to be trained (again), None when there is no stored result.

    A stored result made with other data (``data``, or the folder of real data) is a
    ``ValueError``: it is neither returned nor replaced without ``overwrite``.
    """
    from cockpit.benchmark.results import read_result

    path = spec.path
    if not path.exists():
        return None, None
    result = read_result(path)
    check_same_data(spec, result)
    if spec.cockpit is None:
        return result, None
    wanted = (spec.cockpit, spec.cockpit_every, spec.batchnorm or "none")
    made = (result.get("cockpit"), result.get("cockpit_every"),
            result.get("batchnorm") or "none")
    logdir = result.get("cockpit_logdir")
    if not logdir or not (path.parent / logdir).exists():
        return None, (f"{path} has no Cockpit run log; training again to write one "
                      f"(--cockpit {spec.cockpit} --cockpit-every {spec.cockpit_every})")
    if made != wanted:
        return None, (f"the Cockpit run log of {path} was made with --cockpit {made[0]} "
                      f"--cockpit-every {made[1]} --batchnorm {made[2]}; training again "
                      f"for --cockpit {wanted[0]} --cockpit-every {wanted[1]} "
                      f"--batchnorm {wanted[2]}")
    return result, None


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

    A stored result is returned as it is (with ``"reused": True``) unless ``overwrite``, if
    :func:`stored_result` allows it; one made with other data is an error.
    """
    from cockpit.benchmark.problems import get_problem

    path = spec.path
    rerun_reason = None
    if not overwrite:
        stored, rerun_reason = stored_result(spec)
        if stored is not None:
            stored["reused"] = True
            return stored
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

    def evaluate_all() -> bool:
        """Evaluate every split; False if a loss is not finite (the model blew up: the
        accuracies of this evaluation are then not recorded)."""
        nonlocal eval_time
        t0 = time.perf_counter()
        measured = [(split, *evaluate(problem, loader, spec.device)) for split, loader in (
            ("train", problem.train_eval_loader), ("valid", problem.valid_loader),
            ("test", problem.test_loader))]
        finite = all(math.isfinite(loss) for _, loss, _ in measured)
        for split, loss, accuracy in measured:
            curves[f"{split}_losses"].append(finite_or_none(loss))
            curves[f"{split}_accuracies"].append(finite_or_none(accuracy) if finite else None)
        learning_rates.append(float(optimizer.param_groups[0]["lr"]))
        eval_time += time.perf_counter() - t0
        return finite

    diverged = not evaluate_all()
    step = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=epochs * steps_per_epoch, unit="step",
                   desc=f"{spec.problem} {spec.optimizer} seed {spec.seed}")
    try:
        for _epoch in range(0 if diverged else epochs):
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
            if diverged or not evaluate_all():
                diverged = True
                break
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
        "data_root": spec.data_root,
        "wall_time": wall,
        "eval_time": eval_time,
        "train_time": wall - eval_time,
        "cockpit_logdir": logdir.name if cockpit is not None else None,
        "torch": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    write_result(path, result)
    result["path"] = str(path)
    result["reused"] = False
    if rerun_reason is not None:
        result["rerun_reason"] = rerun_reason
    return result
