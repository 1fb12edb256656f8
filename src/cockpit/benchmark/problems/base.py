"""The test-problem interface shared by all DeepOBS problems, and the mini-batch loader.

A :class:`TestProblem` bundles what DeepOBS defines for a problem (Schneider, Balles & Hennig,
"DeepOBS: A Deep Learning Optimizer Benchmark Suite", ICLR 2019): the model, the loss as
*individual* losses ℓ_n (one per sample, shape ``[batch]``), the L2 regularizer R(θ), the
default batch size and number of epochs, and the four data splits. The training objective
of one mini-batch B is

    L_B(θ) = (1/|B|) Σ_{n∈B} ℓ_n(θ) + R(θ),      R(θ) = (λ/2) Σ_{W} ‖W‖²,

where λ is the problem's ``l2`` and W runs over the weight tensors of convolution and
fully-connected layers (biases and normalization parameters are not regularized), exactly
as TensorFlow's ``l2_regularizer(λ)`` that DeepOBS uses. Cockpit's individual gradients are
g_n = ∇ℓ_n: pass ``losses`` to the cockpit and back-propagate ``losses.mean() +
regularizer()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TASKS = ("classification", "regression", "function", "vae", "lm")

Transform = Callable[[Tensor, torch.Generator], Tensor]


class BatchLoader:
    """Iterable of ``(x, y)`` mini-batches over in-memory tensors (or a lazy source).

    * ``shuffle``: a new permutation each epoch, drawn from a generator seeded with
      ``seed`` — epoch ``e`` of two loaders with the same seed is identical.
    * ``drop_last``: drop the final incomplete batch (DeepOBS does so in every split).
    * ``max_batches``: yield at most this many batches per pass (DeepOBS's ``take``).
    * ``prepare(x)``: turns stored samples (e.g. ``uint8`` images) into model inputs.
    * ``augment(x, generator)``: random data augmentation of a prepared batch (training only).
    * ``indices``: restrict to a subset of the stored samples (train / valid / train-eval).
    * ``target_is_input``: yield ``(x, x)`` (autoencoders: the target is the image).
    * ``on_start()``: called when an iteration (epoch) begins, e.g. to reset an RNN's state.
    """

    def __init__(
        self,
        x: Tensor | Callable[[Tensor], Tensor],
        y: Tensor,
        batch_size: int,
        *,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int = 0,
        max_batches: int | None = None,
        indices: Tensor | None = None,
        prepare: Callable[[Tensor], Tensor] | None = None,
        augment: Transform | None = None,
        device: torch.device | str = "cpu",
        target_is_input: bool = False,
        on_start: Callable[[], None] | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self._x, self._y = x, y
        self.indices = torch.arange(len(y)) if indices is None else indices.long()
        self.batch_size = batch_size
        self.shuffle, self.drop_last = shuffle, drop_last
        self.max_batches = max_batches
        self.prepare, self.augment = prepare, augment
        self.device = torch.device(device)
        self.target_is_input, self.on_start = target_is_input, on_start
        self._generator = torch.Generator().manual_seed(seed)

    @property
    def num_samples(self) -> int:
        return len(self.indices)

    def __len__(self) -> int:
        if self.drop_last:
            n = self.num_samples // self.batch_size
        else:
            n = -(-self.num_samples // self.batch_size)
        return n if self.max_batches is None else min(n, self.max_batches)

    def take(self, num_batches: int, seed: int) -> BatchLoader:
        """The first ``num_batches`` batches of each pass over this loader's stream — same
        samples, preparation, augmentation and shuffling, but drawn from its own generator
        (seeded ``seed``), so a pass over it leaves this loader's order untouched."""
        return BatchLoader(self._x, self._y, self.batch_size, shuffle=self.shuffle,
                           drop_last=self.drop_last, seed=seed, indices=self.indices,
                           prepare=self.prepare, augment=self.augment, device=self.device,
                           target_is_input=self.target_is_input, on_start=self.on_start,
                           max_batches=num_batches)

    def _take(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        x = self._x(idx) if callable(self._x) else self._x[idx]
        return x, self._y[idx]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        if self.on_start is not None:
            self.on_start()
        order = self.indices
        if self.shuffle:
            order = order[torch.randperm(len(order), generator=self._generator)]
        for i in range(len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            x, y = self._take(idx)
            if self.prepare is not None:
                x = self.prepare(x)
            if self.augment is not None:
                x = self.augment(x, self._generator)
            x = x.to(self.device)
            yield x, (x if self.target_is_input else y.to(self.device))


@dataclass
class Splits:
    """The four DeepOBS data splits as loaders.

    ``train_eval`` is DeepOBS's: the first N_test // B batches of the training stream, drawn
    afresh at each evaluation (reshuffled, and augmented where training is; see
    :func:`train_eval_stream`); ``valid`` is held out of the training file, disjoint from
    ``train``. Every split drops its last incomplete batch (as DeepOBS)."""

    train: BatchLoader
    train_eval: BatchLoader
    valid: BatchLoader
    test: BatchLoader


TRAIN_EVAL_SEED_OFFSET = 1 << 32


def train_eval_stream(train: BatchLoader, eval_size: int, seed: int) -> BatchLoader:
    """DeepOBS's train-eval split: ``eval_size // B`` batches taken from the training stream
    (``train_dataset.take(train_eval_size // batch_size)``), so each evaluation sees a new
    random subset of the training data, augmented as training is. Its shuffling has its own
    generator: evaluating does not change the order of the training batches."""
    num_batches = eval_size // train.batch_size
    return train.take(num_batches, seed + TRAIN_EVAL_SEED_OFFSET)


@dataclass
class TestProblem:
    """One DeepOBS test problem, ready to train.

    Attributes:
        name: e.g. ``"cifar10_3c3d"``.
        batch_size, num_epochs: DeepOBS's defaults (or the caller's ``batch_size``).
        l2: the L2 factor λ of R(θ) (see the module docstring); ``None`` if unregularized.
        task: ``"classification"``, ``"regression"``, ``"function"`` (the model's output
            *is* the individual losses: 2-D functions and the quadratic), ``"vae"``, ``"lm"``.
        model: the network (``torch.nn.Module``), initialized as DeepOBS does.
        train_loader, train_eval_loader, valid_loader, test_loader: iterables of ``(x, y)``.
        source: where the definition comes from (and which settings are ours).
    """

    __test__ = False  # not a pytest test class

    name: str
    batch_size: int
    num_epochs: int
    l2: float | None
    task: str
    model: nn.Module = field(repr=False)
    splits: Splits = field(repr=False)
    num_classes: int | None = None
    data: str = "synthetic"
    label_smoothing: float = 0.0
    aux_weight: float = 0.0
    source: str = "DeepOBS"

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")

    @property
    def train_loader(self) -> BatchLoader:
        return self.splits.train

    @property
    def train_eval_loader(self) -> BatchLoader:
        return self.splits.train_eval

    @property
    def valid_loader(self) -> BatchLoader:
        return self.splits.valid

    @property
    def test_loader(self) -> BatchLoader:
        return self.splits.test

    # --- loss ---------------------------------------------------------------------------
    def losses(self, output, target: Tensor) -> Tensor:
        """Individual losses ℓ_n, shape ``[batch]`` (without the regularizer).

        classification: cross-entropy −log softmax(z_n)[y_n] (with ``label_smoothing`` ε the
        target is (1 − ε)·onehot + ε/K); a model with an auxiliary head (Inception-v3 in
        training mode) outputs ``(logits, aux_logits)`` and ℓ_n adds ``aux_weight`` times the
        auxiliary cross-entropy; lm: the cross-entropy averaged over the sequence's
        positions; vae: ‖x̂_n − x_n‖² + KL(q(z|x_n) ‖ N(0, I)) (the negative ELBO up to
        constants, as DeepOBS); function: the model output itself.
        """
        if self.task == "classification":
            if isinstance(output, tuple):
                main, aux = output
                return (self._cross_entropy(main, target)
                        + self.aux_weight * self._cross_entropy(aux, target))
            return self._cross_entropy(output, target)
        if self.task == "lm":
            per_token = F.cross_entropy(output.transpose(1, 2), target, reduction="none")
            return per_token.mean(dim=1)
        if self.task == "regression":
            return (output - target).pow(2).flatten(1).sum(1)
        if self.task == "vae":
            return vae_losses(output, target)
        return output  # function: the model returns the individual losses

    def _cross_entropy(self, logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits, target, reduction="none",
                               label_smoothing=self.label_smoothing)

    def regularizer(self) -> Tensor:
        """R(θ) = (λ/2) Σ_W ‖W‖² over conv / linear weights; a 0-dim zero without L2."""
        params = regularized_parameters(self.model)
        if not self.l2 or not params:
            first = next(self.model.parameters())
            return torch.zeros((), dtype=first.dtype, device=first.device)
        return 0.5 * self.l2 * sum(p.pow(2).sum() for p in params)

    def accuracy(self, output, target: Tensor) -> Tensor | None:
        """Fraction of correct predictions in the batch (per character for ``lm``);
        ``None`` for problems without accuracy."""
        if self.task == "classification":
            logits = output[0] if isinstance(output, tuple) else output
            return (logits.argmax(dim=1) == target).float().mean()
        if self.task == "lm":
            return (output.argmax(dim=2) == target).float().mean()
        return None

    def num_parameters(self) -> int:
        """Number of trainable parameters (``requires_grad``)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def regularized_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Weights of the convolution and fully-connected layers (what DeepOBS regularizes), or
    ``model.l2_parameters()`` where the model says otherwise (VGG, Inception-v3)."""
    if hasattr(model, "l2_parameters"):
        return list(model.l2_parameters())
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d)
    return [m.weight for m in model.modules() if isinstance(m, kinds)]


def vae_losses(output: tuple[Tensor, Tensor, Tensor], target: Tensor) -> Tensor:
    """Negative ELBO per sample as DeepOBS's VAE: squared reconstruction error summed over
    pixels plus KL(N(μ, σ²) ‖ N(0, I)) = −½ Σ_k (1 + 2 log σ_k − μ_k² − σ_k²).

    ``output`` is ``(reconstruction, mu, log_sigma)``."""
    reconstruction, mu, log_sigma = output
    image = reconstruction.flatten(1) - target.flatten(1)
    kl = -0.5 * (1 + 2 * log_sigma - mu.pow(2) - torch.exp(2 * log_sigma)).sum(dim=1)
    return image.pow(2).sum(dim=1) + kl


class SequenceLoader:
    """Character sequences as DeepOBS's Tolstoi loader: the id array is cut into
    ``batch_size`` contiguous rows, and batch i holds columns [i·T, (i+1)·T) of every row
    (x) and the same positions shifted by one character (y), so row b of batch i + 1
    continues row b of batch i (the RNN state may be carried over). Batches come in order,
    never shuffled; the incomplete remainder is dropped. ``max_batches``: only the first
    batches of each pass (DeepOBS's train-eval split is the first N_test // (B·T))."""

    def __init__(self, ids: Tensor, batch_size: int, seq_length: int, *,
                 device: torch.device | str = "cpu",
                 on_start: Callable[[], None] | None = None,
                 max_batches: int | None = None):
        num_batches = (len(ids) - 1) // (batch_size * seq_length)
        if num_batches == 0:
            raise ValueError(f"{len(ids)} characters are too few for batch_size={batch_size} "
                             f"and sequences of {seq_length}")
        n = num_batches * batch_size * seq_length
        self.x = ids[:n].reshape(batch_size, -1)
        self.y = ids[1:n + 1].reshape(batch_size, -1)
        self.batch_size, self.seq_length = batch_size, seq_length
        self.num_batches = num_batches if max_batches is None else min(num_batches,
                                                                        max_batches)
        self.device, self.on_start = torch.device(device), on_start

    @property
    def num_samples(self) -> int:
        return self.num_batches * self.batch_size

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        if self.on_start is not None:
            self.on_start()
        t = self.seq_length
        for i in range(self.num_batches):
            yield (self.x[:, i * t:(i + 1) * t].to(self.device),
                   self.y[:, i * t:(i + 1) * t].to(self.device))
