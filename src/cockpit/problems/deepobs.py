"""DeepOBS test-problem architectures (Schneider et al. 2019), as used by the paper's
benchmarks, with synthetic data of the right shape.

Architectures follow DeepOBS: see each builder's docstring. Data here is synthetic
(standard-normal inputs, uniform labels from a seeded generator); nothing is downloaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TFSamePool(nn.Module):
    """Max-pooling with TensorFlow's "same" padding: pad right/bottom so that the output has
    ⌈input / stride⌉ positions (for 3×3 windows with stride 2 on even sizes: pad by 1)."""

    def __init__(self, kernel_size: int, stride: int):
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride

    def forward(self, x: Tensor) -> Tensor:
        pads = []
        for size in reversed(x.shape[2:]):
            out = -(-size // self.stride)
            total = max((out - 1) * self.stride + self.kernel_size - size, 0)
            pads += [total // 2, total - total // 2]
        x = F.pad(x, pads, value=float("-inf"))
        return F.max_pool2d(x, self.kernel_size, self.stride)


def cifar10_3c3d(num_classes: int = 10) -> nn.Sequential:
    """3C3D (895,210 parameters for 10 classes; input 3×32×32)."""
    model = nn.Sequential(
        nn.Conv2d(3, 64, 5), nn.ReLU(), TFSamePool(3, 2),
        nn.Conv2d(64, 96, 3), nn.ReLU(), TFSamePool(3, 2),
        nn.Conv2d(96, 128, 3, padding=1), nn.ReLU(), TFSamePool(3, 2),
        nn.Flatten(),
        nn.Linear(128 * 3 * 3, 512), nn.ReLU(),
        nn.Linear(512, 256), nn.ReLU(),
        nn.Linear(256, num_classes),
    )
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.xavier_normal_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
    return model


def fmnist_2c2d(num_classes: int = 10) -> nn.Sequential:
    """2C2D (3,274,634 parameters for 10 classes; input 1×28×28)."""
    model = nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 1024), nn.ReLU(),
        nn.Linear(1024, num_classes),
    )
    for module in model.modules():
        if isinstance(module, nn.Conv2d | nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.05, a=-0.1, b=0.1)
            nn.init.constant_(module.bias, 0.05)
    return model


def mnist_mlp(num_classes: int = 10) -> nn.Sequential:
    """MLP 784–1000–500–100–10 with ReLU (1,336,610 parameters)."""
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 500), nn.ReLU(),
        nn.Linear(500, 100), nn.ReLU(), nn.Linear(100, num_classes),
    )
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.03, a=-0.06, b=0.06)
            nn.init.zeros_(module.bias)
    return model


def mnist_logreg(num_classes: int = 10) -> nn.Sequential:
    """Logistic regression 784 → 10 (7,850 parameters)."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, num_classes))
    nn.init.zeros_(model[1].weight)
    nn.init.zeros_(model[1].bias)
    return model


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
