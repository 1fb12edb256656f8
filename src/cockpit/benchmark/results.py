"""The result files of benchmark runs: one JSON file per run in a stable layout.

Layout (relative to the output directory)::

    <problem>/<optimizer>/<setting>/seed_<N>.json        the run's result
    <problem>/<optimizer>/<setting>/seed_<N>.cockpit/     its Cockpit run log (with --cockpit)

``<setting>`` names the hyperparameters and the training setup, ``key=value`` pairs joined
by ``__`` in a fixed order: the optimizer's hyperparameters sorted by name (floats with 8
significant digits), then ``schedule=…``, then ``bs=…`` / ``epochs=…`` when they differ
from the problem's defaults (giving a default explicitly names the same setting), then
``steps=…`` when the steps per epoch are capped, e.g.
``lr=0.001__momentum=0.9__schedule=constant``. The same run always lands in the same file,
so a finished run is recognised by its file (that is how interrupted sweeps resume). The
data (``synthetic`` or ``real``, and for real data the folder read) are not in the name: a
stored result made with other data is never reused — the runner stops with an error that
asks for another output directory (or ``--overwrite``).

A result file holds (``RESULT_SCHEMA``): the run's identity (problem, optimizer,
hyperparameters, setting, seed, schedule, data, batch size, epochs, task and the metric
that ranks runs: ``"accuracy"`` for classification, ``"loss"`` otherwise), per-epoch
curves for epochs 0 … E (epoch 0 = before training) ``train_losses``, ``valid_losses``,
``test_losses`` and the matching ``*_accuracies`` (null without accuracy), the learning
rate per epoch, every mini-batch training loss, ``diverged`` (a non-finite training loss, or
a non-finite evaluation loss after an update, stopped the run; the accuracies of that
evaluation and all later epochs are null), ``data_root`` (the folder real data were read
from, null for synthetic data), and the wall, training and evaluation times.
Evaluation losses are the mean individual loss without the L2 term; training mini-batch
losses include it (as DeepOBS reports them). Non-finite numbers are written as null.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULT_SCHEMA = "cockpit.benchmark.result/1"


def format_value(value: Any) -> str:
    """A hyperparameter value as it appears in a setting name."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return format(value, ".8g")
    if isinstance(value, (tuple, list)):
        return ",".join(format_value(v) for v in value)
    return str(value).replace("/", "_").replace(os.sep, "_")


def setting_name(hyperparameters: dict[str, Any], schedule: str = "constant",
                 batch_size: int | None = None, epochs: int | None = None,
                 max_steps_per_epoch: int | None = None, *,
                 default_batch_size: int | None = None,
                 default_epochs: int | None = None) -> str:
    """The directory name of a setting (see the module docstring).

    ``batch_size`` / ``epochs`` equal to ``default_batch_size`` / ``default_epochs`` (the
    problem's) are left out, as if they had not been given.
    """
    parts = [f"{k}={format_value(hyperparameters[k])}" for k in sorted(hyperparameters)]
    parts.append(f"schedule={schedule}")
    if batch_size is not None and batch_size != default_batch_size:
        parts.append(f"bs={batch_size}")
    if epochs is not None and epochs != default_epochs:
        parts.append(f"epochs={epochs}")
    if max_steps_per_epoch is not None:
        parts.append(f"steps={max_steps_per_epoch}")
    return "__".join(parts)


def result_path(output: str | Path, problem: str, optimizer: str, setting: str,
                seed: int) -> Path:
    """Where the result of one run is written."""
    optimizer_dir = optimizer.replace(":", "_").replace("/", "_")
    return Path(output) / problem / optimizer_dir / setting / f"seed_{seed}.json"


def cockpit_logdir(path: Path) -> Path:
    """The Cockpit run log beside result file ``path``."""
    return path.with_suffix(".cockpit")


def finite_or_none(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write ``result`` atomically (a crash never leaves a half-written result)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, allow_nan=False))
    os.replace(tmp, path)


def read_result(path: str | Path) -> dict[str, Any]:
    result = json.loads(Path(path).read_text())
    if result.get("schema") != RESULT_SCHEMA:
        raise ValueError(f"{path} is not a benchmark result ({RESULT_SCHEMA})")
    result["path"] = str(path)
    return result


def iter_results(root: str | Path) -> Iterator[dict[str, Any]]:
    """Every result file below ``root`` (sorted by path)."""
    for path in sorted(Path(root).rglob("seed_*.json")):
        yield read_result(path)
