"""Synthetic Cockpit outputs in the data contract's format, for examples, docs and tests.

The numbers imitate a small CNN (DeepOBS 3C3D-like parameter names) trained with SGD: a
decaying noisy loss, slowly growing distance from the initialization, α scattered around
a positive mean (overshooting the local minimum), gradient tests of order one and
heavy-tailed individual-gradient histograms. They are *not* the output of a real run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PARAMS_3C3D: dict[str, tuple[int, ...]] = {
    "conv1.weight": (64, 3, 5, 5),
    "conv1.bias": (64,),
    "conv2.weight": (96, 64, 3, 3),
    "conv2.bias": (96,),
    "conv3.weight": (128, 96, 3, 3),
    "conv3.bias": (128,),
    "fc1.weight": (512, 1152),
    "fc1.bias": (512,),
    "fc2.weight": (256, 512),
    "fc2.bias": (256,),
    "fc3.weight": (10, 256),
    "fc3.bias": (10,),
}

CONFIG_INSTRUMENTS: dict[str, tuple[str, ...]] = {
    "economy": (
        "Loss", "GradNorm", "Distance", "UpdateSize", "Alpha", "NormTest", "InnerTest",
        "OrthoTest", "GradHist1d", "LearningRate", "BatchSize",
    ),
    "business": ("HessTrace", "TICDiag"),
    "full": ("HessMaxEV", "GradHist2d", "TICTrace"),
}


def instruments_of(config: str) -> tuple[str, ...]:
    """Instrument names of ``"economy"``, ``"business"`` or ``"full"`` (cumulative)."""
    order = ["economy", "business", "full"]
    names: list[str] = []
    for level in order[: order.index(config) + 1]:
        names.extend(CONFIG_INSTRUMENTS[level])
    return tuple(names)


def _hist1d(rng: np.random.Generator, scale: float, n: int, bins: int = 100) -> dict:
    edges = np.linspace(-2.0, 2.0, bins + 1)
    samples = rng.laplace(0.0, scale, size=n)
    counts, _ = np.histogram(np.clip(samples, -2.0, 2.0), bins=edges)
    return {"counts": counts.astype(np.int64), "edges": edges}


def _hist2d(rng: np.random.Generator, scale: float, n: int) -> dict:
    edges_grad = np.linspace(-2.0, 2.0, 41)
    edges_param = np.linspace(-0.5, 0.5, 51)
    theta = rng.normal(0.0, 0.08, size=n)
    grad = rng.laplace(0.0, scale, size=n) * (1.0 + 4.0 * np.abs(theta))
    counts, _, _ = np.histogram2d(
        np.clip(grad, -2, 2), np.clip(theta, -0.5, 0.5), bins=[edges_grad, edges_param]
    )
    return {
        "counts": counts.astype(np.int64),
        "edges_grad": edges_grad,
        "edges_param": edges_param,
    }


def synthetic_output(
    config: str = "economy",
    num_steps: int = 400,
    every: int = 5,
    seed: int = 0,
    *,
    per_param: bool = True,
    instruments: tuple[str, ...] | None = None,
) -> dict[int, dict[str, Any]]:
    """A Cockpit output ``{step: {name: value}}`` tracked every ``every`` steps.

    Alpha of the last tracked step is ``None`` (it needs the following step).
    ``instruments`` overrides the configuration's instrument list.
    """
    rng = np.random.default_rng(seed)
    names = set(instruments if instruments is not None else instruments_of(config))
    steps = list(range(0, num_steps + 1, every))
    output: dict[int, dict[str, Any]] = {}
    lr, batch = 0.05, 128
    for i, t in enumerate(steps):
        progress = t / max(num_steps, 1)
        v: dict[str, Any] = {}
        grad_norm = 0.6 + 0.9 * progress + 0.08 * rng.standard_normal()
        if "Loss" in names:
            v["Loss"] = float(2.3 * np.exp(-3.0 * progress) + 0.4 + 0.08 * rng.standard_normal())
        if "GradNorm" in names:
            v["GradNorm"] = float(abs(grad_norm))
        if "Distance" in names:
            v["Distance"] = float(6.0 * np.sqrt(progress) + 0.05 * rng.random())
        if "UpdateSize" in names:
            v["UpdateSize"] = float(lr * abs(grad_norm) * (1 + 0.1 * rng.standard_normal()))
        if "Alpha" in names:
            v["Alpha"] = None if i == len(steps) - 1 else float(rng.normal(0.35, 0.45))
        if "NormTest" in names:
            v["NormTest"] = float(abs(1.8 - 0.8 * progress + 0.2 * rng.standard_normal()))
        if "InnerTest" in names:
            v["InnerTest"] = float(abs(0.9 - 0.4 * progress + 0.1 * rng.standard_normal()))
        if "OrthoTest" in names:
            v["OrthoTest"] = float(abs(2.5 - 1.0 * progress + 0.3 * rng.standard_normal()))
        scale = 0.08 + 0.15 * (1 - progress)
        if "GradHist1d" in names:
            v["GradHist1d"] = _hist1d(rng, scale, 20_000)
            if per_param:
                for j, pname in enumerate(PARAMS_3C3D):
                    v[f"GradHist1d/{pname}"] = _hist1d(rng, scale * (0.3 + 0.25 * j), 2_000)
        if "HessTrace" in names:
            v["HessTrace"] = float(800.0 * np.exp(-4 * progress) + 40 + 5 * rng.random())
        if "TICDiag" in names:
            v["TICDiag"] = float(3.0 + 2.0 * progress + 0.3 * rng.standard_normal())
        if "TICTrace" in names:
            v["TICTrace"] = float(1.5 + 1.0 * progress + 0.2 * rng.standard_normal())
        if "HessMaxEV" in names:
            v["HessMaxEV"] = float(300.0 * np.exp(-5 * progress) + 8 + rng.random())
        if "GradHist2d" in names:
            v["GradHist2d"] = _hist2d(rng, scale, 20_000)
        if "LearningRate" in names:
            v["LearningRate"] = lr * (0.1 if progress > 0.75 else 1.0)
        if "BatchSize" in names:
            v["BatchSize"] = float(batch)
        output[t] = v
    return output


def synthetic_meta(config: str = "economy") -> dict[str, Any]:
    """Run metadata in the contract's layout for :func:`synthetic_output`."""
    return {
        "model": "cifar10_3c3d (synthetic)",
        "model_summary": "Net3c3d(conv1, conv2, conv3, fc1, fc2, fc3)",
        "num_parameters": 895_210,
        "parameters": {k: list(s) for k, s in PARAMS_3C3D.items()},
        "optimizer": {"class": "SGD", "lr": 0.05, "momentum": 0.9},
        "configuration": list(instruments_of(config)),
        "schedule": "linear(every=5)",
        "device": "cpu",
    }
