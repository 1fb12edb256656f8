"""The four DeepOBS splits of each data set, from real files or a synthetic stand-in.

Splits (DeepOBS 1.2): ``valid`` is the first N_test samples of the training file (in file
order), ``train`` the remaining ones; ``train_eval`` is the first N_test // B batches of the
training stream (reshuffled and, where training is, augmented at each evaluation: DeepOBS's
``train_dataset.take(train_eval_size // batch_size)``); ``test`` is the test file. Training
batches are reshuffled every epoch; every split drops its incomplete last batch (as
DeepOBS).

Synthetic data (``data="synthetic"``) has the real data's shapes, dtypes, classes and
preprocessing, but few samples (8 training and 2 evaluation batches by default) and
learnable labels: image x of class y is noise plus a fixed random pattern of class y.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from cockpit.benchmark.problems import augment as aug
from cockpit.benchmark.problems import readers
from cockpit.benchmark.problems.base import BatchLoader, Splits, train_eval_stream

SYNTHETIC_TRAIN_BATCHES = 8
SYNTHETIC_EVAL_BATCHES = 2


def split_train_valid(n_train: int, n_valid: int) -> tuple[Tensor, Tensor]:
    """(train indices, valid indices): the first ``n_valid`` samples are held out."""
    if n_valid >= n_train:
        raise ValueError(f"cannot hold out {n_valid} validation samples of {n_train}")
    return torch.arange(n_valid, n_train), torch.arange(n_valid)


def image_splits(
    train_x, train_y: Tensor, test_x, test_y: Tensor, batch_size: int, *, seed: int,
    device, prepare_train: Callable | None, prepare_eval: Callable | None,
    augment: Callable | None = None,
) -> Splits:
    """Splits of an image classification set (``train_x`` may be a lazy loader callable)."""
    n_test = len(test_y)
    train_idx, valid_idx = split_train_valid(len(train_y), n_test)

    def loader(x, y, idx=None, *, train=False):
        return BatchLoader(x, y, batch_size, shuffle=train, drop_last=True, seed=seed,
                           indices=idx, prepare=prepare_train if train else prepare_eval,
                           augment=augment if train else None, device=device)

    train = loader(train_x, train_y, train_idx, train=True)
    return Splits(
        train=train,
        train_eval=train_eval_stream(train, n_test, seed),
        valid=loader(train_x, train_y, valid_idx),
        test=loader(test_x, test_y),
    )


def synthetic_images(n: int, shape: tuple[int, ...], num_classes: int, seed: int,
                     *, label_offset: int = 0) -> tuple[Tensor, Tensor]:
    """``uint8`` images: 128 + 40·(noise + pattern_y), clipped; labels uniform (+offset)."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(num_classes, *shape, generator=g)
    y = torch.randint(0, num_classes, (n,), generator=g)
    x = 128 + 40 * (torch.randn(n, *shape, generator=g) + patterns[y])
    return x.clamp(0, 255).to(torch.uint8), y + label_offset


def synthetic_counts(batch_size: int) -> tuple[int, int]:
    """(training samples incl. the held-out valid part, test samples)."""
    n_eval = SYNTHETIC_EVAL_BATCHES * batch_size
    return SYNTHETIC_TRAIN_BATCHES * batch_size + n_eval, n_eval


def _scaled(x: Tensor) -> Tensor:
    return x.float() / 255.0


def _standardized(x: Tensor) -> Tensor:
    return aug.per_image_standardization(x.float())


def _float(x: Tensor) -> Tensor:
    return x.float()


# --- data sets ---------------------------------------------------------------------------
def mnist_like(name: str, data: str, data_dir, batch_size: int, seed: int, device,
               *, autoencoder: bool = False) -> Splits:
    """MNIST / Fashion-MNIST (``name`` ``"mnist"`` / ``"fmnist"``): images scaled to [0, 1],
    ``[N, 1, 28, 28]``. ``autoencoder``: targets are the images themselves (VAE)."""
    if data == "real":
        d = readers.read_mnist(readers.data_root(data_dir), name)
        train_x, train_y, test_x, test_y = d["train_x"], d["train_y"], d["test_x"], d["test_y"]
    else:
        n_train, n_test = synthetic_counts(batch_size)
        train_x, train_y = synthetic_images(n_train, (1, 28, 28), 10, seed)
        test_x, test_y = synthetic_images(n_test, (1, 28, 28), 10, seed + 7)
    splits = image_splits(train_x, train_y, test_x, test_y, batch_size, seed=seed,
                          device=device, prepare_train=_scaled, prepare_eval=_scaled)
    if autoencoder:
        for loader in (splits.train, splits.train_eval, splits.valid, splits.test):
            loader.target_is_input = True
    return splits


def cifar(num_classes: int, data: str, data_dir, batch_size: int, seed: int, device,
          *, augment: bool = True) -> Splits:
    """CIFAR-10/100 with DeepOBS's training augmentation (crop, flip, colour)."""
    if data == "real":
        d = readers.read_cifar(readers.data_root(data_dir), num_classes)
        train_x, train_y, test_x, test_y = d["train_x"], d["train_y"], d["test_x"], d["test_y"]
    else:
        n_train, n_test = synthetic_counts(batch_size)
        train_x, train_y = synthetic_images(n_train, (3, 32, 32), num_classes, seed)
        test_x, test_y = synthetic_images(n_test, (3, 32, 32), num_classes, seed + 7)
    return image_splits(train_x, train_y, test_x, test_y, batch_size, seed=seed,
                        device=device, prepare_train=_float if augment else _standardized,
                        prepare_eval=_standardized,
                        augment=aug.cifar_train_augmentation(flip=True) if augment else None)


def svhn(data: str, data_dir, batch_size: int, seed: int, device,
         *, augment: bool = True) -> Splits:
    """SVHN (train_32x32 only, as DeepOBS) with crop and colour augmentation, no flip."""
    if data == "real":
        d = readers.read_svhn(readers.data_root(data_dir))
        train_x, train_y, test_x, test_y = d["train_x"], d["train_y"], d["test_x"], d["test_y"]
    else:
        n_train, n_test = synthetic_counts(batch_size)
        train_x, train_y = synthetic_images(n_train, (3, 32, 32), 10, seed)
        test_x, test_y = synthetic_images(n_test, (3, 32, 32), 10, seed + 7)
    return image_splits(train_x, train_y, test_x, test_y, batch_size, seed=seed,
                        device=device, prepare_train=_float if augment else _standardized,
                        prepare_eval=_standardized,
                        augment=aug.cifar_train_augmentation(flip=False) if augment else None)


class _LazyImages:
    """``idx -> uint8 [len(idx), 3, 256, 256]``, reading image files on demand; decoding and
    resizing run in a few threads (PIL releases the GIL while it works)."""

    def __init__(self, files: list[Path], threads: int | None = None):
        self.files = files
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0  # a forked DataLoader worker starts its own threads

    def __call__(self, idx: Tensor) -> Tensor:
        paths = [self.files[i] for i in idx.tolist()]
        if self.threads <= 1 or len(paths) <= 1:
            return torch.stack([readers.load_image(p) for p in paths])
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="cockpit-images")
            self._pool_pid = os.getpid()
        return torch.stack(list(self._pool.map(readers.load_image, paths)))


class _SyntheticLazyImages:
    """Synthetic 256×256 images generated per index (nothing held in memory)."""

    def __init__(self, labels: Tensor, seed: int, num_classes: int = 1001, size: int = 256):
        self.labels, self.seed, self.size = labels, seed, size
        g = torch.Generator().manual_seed(seed)
        # one low-resolution pattern per class, upsampled (cheap to hold for 1,001 classes)
        self.patterns = torch.randn(num_classes, 3, 8, 8, generator=g)

    def __call__(self, idx: Tensor) -> Tensor:
        images = []
        for i in idx.tolist():
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            pattern = self.patterns[self.labels[i]].repeat_interleave(self.size // 8, 1)
            pattern = pattern.repeat_interleave(self.size // 8, 2)
            noise = torch.randn(3, self.size, self.size, generator=g)
            images.append((128 + 40 * (noise + pattern)).clamp(0, 255).to(torch.uint8))
        return torch.stack(images)


def imagenet(data: str, data_dir, batch_size: int, seed: int, device,
             *, augment: bool = True) -> Splits:
    """ImageNet from a folder of class folders: 1,001 outputs (label 0 = background, unused),
    valid = the first N_test training images in sorted order (DeepOBS: 50,000)."""
    if data == "real":
        d = readers.read_imagenet(readers.data_root(data_dir))
        train_x, train_y = _LazyImages(d["train_files"]), d["train_y"]
        test_x, test_y = _LazyImages(d["test_files"]), d["test_y"]
    else:
        n_train, n_test = synthetic_counts(batch_size)
        g = torch.Generator().manual_seed(seed)
        train_y = torch.randint(1, 1001, (n_train,), generator=g)
        test_y = torch.randint(1, 1001, (n_test,), generator=g)
        train_x = _SyntheticLazyImages(train_y, seed)
        test_x = _SyntheticLazyImages(test_y, seed + 7)

    def prepare_train(x: Tensor) -> Tensor:
        return x.float()

    def prepare_eval(x: Tensor) -> Tensor:
        return aug.imagenet_eval_preparation(x.float())

    return image_splits(train_x, train_y, test_x, test_y, batch_size, seed=seed,
                        device=device, prepare_train=prepare_train if augment else prepare_eval,
                        prepare_eval=prepare_eval,
                        augment=aug.imagenet_train_augmentation if augment else None)


# --- Tolstoi ---------------------------------------------------------------------------------
TOLSTOI_VOCAB = 83
TOLSTOI_SEQ_LENGTH = 50


def synthetic_text(n: int, seed: int, vocab: int = TOLSTOI_VOCAB) -> Tensor:
    """Character ids from a fixed random first-order Markov chain (learnable, unlike noise)."""
    rng = np.random.RandomState(seed)
    logits = 3 * rng.normal(size=(vocab, vocab))
    transitions = np.exp(logits - logits.max(axis=1, keepdims=True))
    cumulative = np.cumsum(transitions / transitions.sum(axis=1, keepdims=True), axis=1)
    uniforms = rng.uniform(size=n)
    ids = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        ids[i] = min(int(np.searchsorted(cumulative[ids[i - 1]], uniforms[i])), vocab - 1)
    return torch.from_numpy(ids)


def tolstoi(data: str, data_dir, batch_size: int, seed: int, device,
            on_start: Callable[[], None] | None = None) -> Splits:
    """War and Peace as character ids (80 % train / 20 % test, as DeepOBS's preprocessing);
    valid = the first N_test characters of the training part, train the rest; train_eval =
    the first N_test // (B·50) batches of the training stream (DeepOBS). Sequences of 50
    characters."""
    from cockpit.benchmark.problems.base import SequenceLoader

    t = TOLSTOI_SEQ_LENGTH
    if data == "real":
        d = readers.read_tolstoi(readers.data_root(data_dir))
        if len(d["vocab"]) > TOLSTOI_VOCAB:
            raise ValueError(
                f"the text has {len(d['vocab'])} distinct characters; DeepOBS's War and Peace "
                f"(and the char-RNN's embedding) has {TOLSTOI_VOCAB}. Use the plain War and "
                f"Peace text DeepOBS uses.")
        train_all, test = d["train"], d["test"]
    else:
        n_eval = SYNTHETIC_EVAL_BATCHES * batch_size * t + 1
        text = synthetic_text(SYNTHETIC_TRAIN_BATCHES * batch_size * t + 3 * n_eval, seed)
        test, train_all = text[:n_eval], text[n_eval:]
    n_test = len(test)
    if len(train_all) <= n_test:
        raise ValueError(f"the training text ({len(train_all)} characters) must be longer "
                         f"than the test text ({n_test})")
    valid, train = train_all[:n_test], train_all[n_test:]

    def loader(ids: Tensor, max_batches: int | None = None) -> SequenceLoader:
        return SequenceLoader(ids, batch_size, t, device=device, on_start=on_start,
                              max_batches=max_batches)

    n_eval_batches = n_test // (batch_size * t)
    return Splits(train=loader(train), train_eval=loader(train, n_eval_batches),
                  valid=loader(valid), test=loader(test))
