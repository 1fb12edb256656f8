"""The four DeepOBS architectures of the paper's overhead measurements (Figures 6 and 7), by
name, with endless synthetic batches of their input shapes: what the overhead benchmarks
time. Complete test problems (real data, loss, L2, splits) are
:func:`cockpit.benchmark.problems.get_problem`.
"""

from __future__ import annotations

import torch

from cockpit.benchmark.problems.small_nets import (
    TFSamePool,
    cifar10_3c3d,
    fmnist_2c2d,
    mnist_logreg,
    mnist_mlp,
)

__all__ = ["BUILDERS", "INPUT_SHAPES", "TFSamePool", "cifar10_3c3d", "fmnist_2c2d",
           "mnist_logreg", "mnist_mlp", "synthetic_batches"]

INPUT_SHAPES = {
    "cifar10_3c3d": (3, 32, 32),
    "fmnist_2c2d": (1, 28, 28),
    "mnist_mlp": (1, 28, 28),
    "mnist_logreg": (1, 28, 28),
}
BUILDERS = {
    "cifar10_3c3d": cifar10_3c3d,
    "fmnist_2c2d": fmnist_2c2d,
    "mnist_mlp": mnist_mlp,
    "mnist_logreg": mnist_logreg,
}


def synthetic_batches(
    problem: str, batch_size: int = 128, num_classes: int = 10, seed: int = 0, device=None
):
    """Endless iterator of (inputs, labels): standard-normal inputs, uniform labels."""
    shape = INPUT_SHAPES[problem]
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(batch_size, *shape, generator=generator)
        y = torch.randint(0, num_classes, (batch_size,), generator=generator)
        yield x.to(device), y.to(device)
