"""Image preprocessing and data augmentation of the DeepOBS data sets, in torch, per batch.

All functions take a float batch ``[B, C, H, W]`` and a ``torch.Generator`` (one random draw
per image). They follow the TensorFlow ops DeepOBS uses:

* CIFAR-10/100 training: zero-pad to 36×36, random 32×32 crop, random horizontal flip,
  random brightness (δ ~ U(−63/255, 63/255) added), random saturation (factor U(0.5, 1.5)),
  random contrast (factor U(0.2, 1.8)), then per-image standardization. SVHN: the same
  without the flip. Evaluation: per-image standardization only.
* ImageNet training: random 224×224 crop of the 256×256 image and a random flip; evaluation:
  the central crop; then per-image standardization.

Images enter as values in [0, 255] (DeepOBS casts the stored bytes to float without scaling,
so the brightness shift is tiny in comparison — as in DeepOBS).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _uniform(n: int, low: float, high: float, generator: torch.Generator) -> Tensor:
    return low + (high - low) * torch.rand(n, generator=generator)


def per_image_standardization(x: Tensor) -> Tensor:
    """(x − mean) / max(std, 1/√N) per image over all N = C·H·W values (TensorFlow's
    ``per_image_standardization``; std with 1/N)."""
    flat = x.flatten(1)
    std, mean = torch.std_mean(flat, dim=1, correction=0, keepdim=True)
    return ((flat - mean) / std.clamp_min(flat.shape[1] ** -0.5)).view_as(x)


def random_crop(x: Tensor, size: int, generator: torch.Generator, pad: int = 0) -> Tensor:
    """Zero-pad by ``pad`` on every side, then crop a random ``size``×``size`` window per image."""
    if pad:
        x = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    b, _, h, w = x.shape
    tops = torch.randint(0, h - size + 1, (b,), generator=generator).tolist()
    lefts = torch.randint(0, w - size + 1, (b,), generator=generator).tolist()
    # slicing per image is faster on a CPU than gathering index grids
    return torch.stack([x[i, :, t:t + size, l:l + size]
                        for i, (t, l) in enumerate(zip(tops, lefts, strict=True))])


def center_crop(x: Tensor, size: int) -> Tensor:
    h, w = x.shape[-2:]
    top, left = (h - size) // 2, (w - size) // 2
    return x[..., top:top + size, left:left + size]


def random_flip(x: Tensor, generator: torch.Generator) -> Tensor:
    """Mirror each image left–right with probability ½."""
    flip = torch.rand(x.shape[0], generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def random_brightness(x: Tensor, max_delta: float, generator: torch.Generator) -> Tensor:
    """x + δ, δ ~ U(−max_delta, max_delta) per image."""
    delta = _uniform(x.shape[0], -max_delta, max_delta, generator)
    return x + delta[:, None, None, None]


def adjust_saturation(x: Tensor, factor: Tensor) -> Tensor:
    """Scale the HSV saturation S = (max − min)/max of each pixel by ``factor`` (per image),
    clipped to [0, 1], keeping hue and value: channel c ↦ V − k (V − c) with
    k = min(factor, 1/S) (pixels with V ≤ 0 become grey)."""
    value = x.amax(dim=1, keepdim=True)
    spread = value - x.amin(dim=1, keepdim=True)
    k = factor.to(x.dtype).view(-1, 1, 1, 1)
    positive = value.clamp_min(0)
    # k·S > 1  ⇔  k·spread > V: clip k to V / spread
    k = torch.where(k * spread > positive, positive / spread.clamp_min(1e-30), k)
    return value - k * (value - x)


def random_saturation(x: Tensor, low: float, high: float, generator: torch.Generator) -> Tensor:
    return adjust_saturation(x, _uniform(x.shape[0], low, high, generator))


def random_contrast(x: Tensor, low: float, high: float, generator: torch.Generator) -> Tensor:
    """(x − m) · f + m with m the per-channel spatial mean, f ~ U(low, high) per image."""
    factor = _uniform(x.shape[0], low, high, generator)[:, None, None, None]
    mean = x.mean(dim=(2, 3), keepdim=True)
    return (x - mean) * factor + mean


def cifar_train_augmentation(flip: bool = True):
    """DeepOBS's CIFAR (``flip=True``) / SVHN (``flip=False``) training augmentation."""

    def augment(x: Tensor, generator: torch.Generator) -> Tensor:
        x = random_crop(x, 32, generator, pad=2)
        if flip:
            x = random_flip(x, generator)
        x = random_brightness(x, 63.0 / 255.0, generator)
        x = random_saturation(x, 0.5, 1.5, generator)
        x = random_contrast(x, 0.2, 1.8, generator)
        return per_image_standardization(x)

    return augment


def imagenet_train_augmentation(x: Tensor, generator: torch.Generator) -> Tensor:
    return per_image_standardization(random_flip(random_crop(x, 224, generator), generator))


def imagenet_eval_preparation(x: Tensor) -> Tensor:
    return per_image_standardization(center_crop(x, 224))
