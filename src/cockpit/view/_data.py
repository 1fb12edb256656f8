"""Read instrument series out of a Cockpit output ``{step: {name: value}}``.

The output follows the data contract: a value is a float (NaN = the instrument saw a
non-finite number), ``None`` (not computed at this step) or a dict of float / array fields.
Outputs loaded from JSON have string step keys and lists instead of arrays;
:func:`normalize_output` turns both into ``{int step: {name: value}}`` with numpy arrays.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

Output = dict[int, dict[str, Any]]


def _as_field(x: Any) -> Any:
    if isinstance(x, list | tuple):
        return np.asarray(x)
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor slipped through
        return x.detach().cpu().numpy()
    return x


def _as_value(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _as_field(v) for k, v in x.items()}
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray) and x.ndim == 0:
        return float(x)
    return x


def normalize_output(output: Mapping[Any, Mapping[str, Any]] | None) -> Output:
    """Return the output with integer step keys (sorted) and numpy array fields."""
    if not output:
        return {}
    result: Output = {}
    for step, values in output.items():
        if not isinstance(values, Mapping):
            continue
        result[int(step)] = {str(k): _as_value(v) for k, v in values.items()}
    return dict(sorted(result.items()))


def as_float(value: Any) -> float | None:
    """The value as a float if it is a real number (NaN/inf kept), else ``None``."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "biuf":
        return float(value.reshape(()))
    return None


def is_tracked(output: Output, name: str) -> bool:
    """Whether ``name`` appears at any step (also as ``None``): the instrument was tracked."""
    return any(name in values for values in output.values())


def scalar_series(output: Output, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and float values of a scalar instrument; ``None`` (not computed) is left out.

    Non-finite values are kept as NaN/inf so callers can mark them.
    """
    steps, vals = [], []
    for step, values in output.items():
        x = as_float(values.get(name))
        if x is not None:
            steps.append(step)
            vals.append(x)
    return np.asarray(steps, dtype=np.int64), np.asarray(vals, dtype=np.float64)


def finite_part(steps: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The entries of a series with finite values."""
    mask = np.isfinite(vals)
    return steps[mask], vals[mask]


def structured_steps(output: Output, name: str, fields: tuple[str, ...]) -> list[int]:
    """Steps at which ``name`` is a dict holding all ``fields``."""
    return [
        step
        for step, values in output.items()
        if isinstance(values.get(name), Mapping)
        and all(f in values[name] for f in fields)
    ]


def structured_at(
    output: Output, name: str, fields: tuple[str, ...], step: int | None = None
) -> tuple[int, dict[str, Any]] | None:
    """The dict value of ``name`` at ``step`` (default: last step that has one)."""
    steps = structured_steps(output, name, fields)
    if not steps:
        return None
    if step is None:
        step = steps[-1]
    elif step not in steps:
        return None
    return step, output[step][name]


def per_param_names(output: Output, prefix: str) -> list[str]:
    """Parameter names ``p`` with an entry ``"<prefix>/p"``, in first-seen order."""
    seen: dict[str, None] = {}
    for values in output.values():
        for name in values:
            if name.startswith(prefix + "/"):
                seen.setdefault(name[len(prefix) + 1 :], None)
    return list(seen)


def spans_decades(vals: np.ndarray, decades: float = 1.5) -> bool:
    """Whether positive finite values span more than ``decades`` orders of magnitude."""
    vals = vals[np.isfinite(vals)]
    if vals.size < 2 or np.any(vals <= 0):
        return False
    return math.log10(vals.max() / vals.min()) > decades
