"""Shared by the case studies: train on scikit-learn's digits with Cockpit, and read the
spread of the individual gradients from the recorded values."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cockpit import Cockpit, configuration, quantities


def digits(raw: bool, seed: int = 0) -> tuple[Tensor, Tensor]:
    """All 1,797 digits images [N, 1, 8, 8]: raw pixel values 0…16 as shipped (raw=True) or
    standardized to zero mean and unit variance (raw=False) — the same images."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1)
    if not raw:
        x = (x - x.mean()) / x.std()
    return x, torch.tensor(data.target, dtype=torch.long)


def train(model: nn.Module, x: Tensor, y: Tensor, optimizer: torch.optim.Optimizer,
          steps: int, logdir: Path, batch_size: int = 64, seed: int = 0) -> dict:
    """Train ``steps`` steps with the economy instruments + DeadUnits tracked every step;
    returns ``get_output()`` (the run log goes to ``logdir``)."""
    instruments = [*configuration("economy"), quantities.DeadUnits()]
    cockpit = Cockpit(model, instruments, optimizer=optimizer, logdir=str(logdir))
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=generator)
    for step in range(steps):
        start = (step * batch_size) % (len(y) - batch_size)
        idx = order[start:start + batch_size]
        optimizer.zero_grad()
        losses = F.cross_entropy(model(x[idx]), y[idx], reduction="none")
        with cockpit(step, losses=losses):
            losses.mean().backward()
        optimizer.step()
    cockpit.close()
    return cockpit.get_output()


def element_rms(values: dict, param: str | None = None) -> float:
    """RMS of the individual-gradient elements g_n,j at one step (all parameters, or one):
    √(Σ_n‖g_n‖² / (|B|·D)), with Σ_n‖g_n‖² = ‖g_B‖²(|B| + |B|(|B|−1)·NormTest²) (eq. 19c)
    and |B|·D the histogram's total count. Unlike the histogram it is not clamped to a range."""
    key = "" if param is None else f"/{param}"
    g, theta, b = values[f"GradNorm{key}"], values[f"NormTest{key}"], values["BatchSize"]
    total = float(np.sum(values[f"GradHist1d{key}"]["counts"]))
    return math.sqrt(g**2 * (b + b * (b - 1) * theta**2) / total)


def median_over_steps(output: dict, fn) -> float:
    return float(np.median([fn(v) for v in output.values()]))


def outside_share(values: dict, key: str = "GradHist1d") -> float:
    """Share of the histogram's elements in its two edge bins: those beyond its range
    ±``range`` (exactly, for the range Cockpit sets from the data; at most, for a fixed
    ``hist_bins=``, whose edge bins also hold values inside)."""
    counts = np.asarray(values[key]["counts"], dtype=np.float64)
    return float((counts[0] + counts[-1]) / counts.sum())


def save_figures(fig, out: Path, stem: str, runs: tuple[str, ...]) -> list[Path]:
    """Save the case study's figure as ``out/stem.png`` and the layer-wise view
    (:func:`cockpit.view.plot_layers`) of each run's log ``out/<run>`` beside it."""
    import matplotlib.pyplot as plt

    from cockpit.view import plot_layers

    paths = [out / f"{stem}.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    for name in runs:
        path = out / f"layers_{name}.png"
        plt.close(plot_layers(out / name, path))
        paths.append(path)
    return paths
