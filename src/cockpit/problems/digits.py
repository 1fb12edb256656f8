"""The demo problem: scikit-learn's digits (1,797 real 8×8 images of handwritten digits,
shipped with scikit-learn, nothing downloaded) and a small CNN."""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.benchmark.problems.digits import digits_cnn

__all__ = ["digits_cnn", "load_digits_tensors", "minibatches"]


def load_digits_tensors(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_test, y_test); images [N, 1, 8, 8] standardized to zero mean and
    unit variance, an 80/20 split shuffled with ``seed``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        from cockpit._extras import missing_extra

        raise missing_extra(error, "sklearn", "demo", "the demo (scikit-learn's digits data)") \
            from None
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(y))
    train, test = order[:split], order[split:]
    return x[train], y[train], x[test], y[test]


def minibatches(x: Tensor, y: Tensor, batch_size: int, seed: int = 0):
    """Endless shuffled mini-batches (reshuffled every epoch)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y) - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            yield x[idx], y[idx]
