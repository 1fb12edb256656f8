"""Digits problems: scikit-learn's 1,797 real 8×8 handwritten digits (shipped with
scikit-learn, nothing downloaded) — a small real problem that trains in seconds on a CPU.

Split (fixed, independent of the seed): a permutation with seed 0 puts 20 % (360 images)
into ``test``, the next 360 into ``valid`` and the remaining 1,077 into ``train``;
``train_eval`` is DeepOBS's: the first 360 // B batches of the reshuffled training stream.
Inputs are standardized with the training part's mean and standard deviation (pixel values
0–16).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from cockpit.benchmark.problems.base import BatchLoader, Splits, train_eval_stream
from cockpit.benchmark.problems.data import synthetic_counts, synthetic_images
from cockpit.benchmark.problems.small_nets import logistic_regression

N_TEST = 360


def load_digits_arrays() -> tuple[Tensor, Tensor]:
    """All 1,797 images ``float32 [N, 1, 8, 8]`` (values 0–16) and labels ``int64``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        from cockpit._extras import missing_extra

        raise missing_extra(error, "sklearn", "demo", "the digits data (scikit-learn's)") \
            from None
    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1)
    return x, torch.tensor(bunch.target, dtype=torch.long)


def load_digits_tensors(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The demo's data: (x_train, y_train, x_test, y_test), images [N, 1, 8, 8] standardized
    with the mean and standard deviation of all 1,797 images, an 80/20 split shuffled with
    ``seed`` (the test problems above split and standardize the DeepOBS way instead)."""
    x, y = load_digits_arrays()
    x = (x - x.mean()) / x.std()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(y))
    train, test = order[:split], order[split:]
    return x[train], y[train], x[test], y[test]


def minibatches(x: Tensor, y: Tensor, batch_size: int, seed: int = 0):
    """Endless shuffled mini-batches of (x, y), reshuffled every epoch."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y) - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            yield x[idx], y[idx]


def digits_splits(data: str, data_dir, batch_size: int, seed: int, device) -> Splits:
    if data == "real":
        x, y = load_digits_arrays()
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        test_idx, valid_idx, train_idx = order[:N_TEST], order[N_TEST:2 * N_TEST], \
            order[2 * N_TEST:]
    else:
        n_train, n_test = synthetic_counts(batch_size)
        x, y = synthetic_images(n_train + n_test, (1, 8, 8), 10, seed)
        x = x.float() * (16.0 / 255.0)
        test_idx = torch.arange(n_test)
        valid_idx = torch.arange(n_test, 2 * n_test)
        train_idx = torch.arange(2 * n_test, n_train + n_test)
    mean, std = x[train_idx].mean(), x[train_idx].std()

    def prepare(batch: Tensor) -> Tensor:
        return (batch - mean) / std

    def loader(idx: Tensor, train: bool = False) -> BatchLoader:
        return BatchLoader(x, y, batch_size, shuffle=train, drop_last=True, seed=seed,
                           indices=idx, prepare=prepare, device=device)

    train = loader(train_idx, train=True)
    return Splits(train=train, train_eval=train_eval_stream(train, len(test_idx), seed),
                  valid=loader(valid_idx), test=loader(test_idx))


def digits_logreg(num_classes: int = 10) -> nn.Sequential:
    """Logistic regression 64 → 10, zero-initialized (650 parameters)."""
    return logistic_regression(64, num_classes)


def digits_mlp(num_classes: int = 10) -> nn.Sequential:
    """MLP 64–256–128–10 with ReLU, PyTorch's default initialization (50,826 parameters)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128),
                         nn.ReLU(), nn.Linear(128, num_classes))


def digits_cnn(num_classes: int = 10) -> nn.Sequential:
    """Conv(1→16, 3×3) – ReLU – Conv(16→32, 3×3) – ReLU – MaxPool 2 – Linear(512→64) – ReLU –
    Linear(64→10), PyTorch's default initialization (38,282 parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
        nn.Linear(64, num_classes),
    )
