"""The small DeepOBS architectures (Schneider et al. 2019): logistic regression, MLP,
2C2D, 3C3D and the VAE, initialized as DeepOBS does (see each builder's docstring)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def xavier_init(model: nn.Module) -> nn.Module:
    """DeepOBS's initialization of the 3C3D and VGG networks: convolutions Xavier-normal,
    dense layers Xavier-uniform, biases zero."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.xavier_normal_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
    return model

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
    return xavier_init(model)


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


def logistic_regression(inputs: int, num_classes: int) -> nn.Sequential:
    """Flatten, then one zero-initialized linear layer (DeepOBS's logistic regressions)."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(inputs, num_classes))
    nn.init.zeros_(model[1].weight)
    nn.init.zeros_(model[1].bias)
    return model


def mnist_logreg(num_classes: int = 10) -> nn.Sequential:
    """Logistic regression 784 → 10 (7,850 parameters)."""
    return logistic_regression(784, num_classes)


def svhn_3c3d(num_classes: int = 10) -> nn.Sequential:
    """3C3D on SVHN: the same network as on CIFAR-10 (895,210 parameters)."""
    return cifar10_3c3d(num_classes)


def cifar100_3c3d(num_classes: int = 100) -> nn.Sequential:
    """3C3D with 100 outputs (918,340 parameters)."""
    return cifar10_3c3d(num_classes)


def mnist_2c2d(num_classes: int = 10) -> nn.Sequential:
    """2C2D on MNIST: the same network as on Fashion-MNIST (3,274,634 parameters)."""
    return fmnist_2c2d(num_classes)


class _SameConvTranspose(nn.Module):
    """TensorFlow's ``conv2d_transpose(padding="same")`` with stride 1 or 2: the full
    transposed convolution, cropped to ``stride × input`` positions. For a 4×4 kernel TF's
    forward "same" convolution pads 1 before and 2 after (stride 1) or 1 and 1 (stride 2),
    so its transpose drops 1 leading position."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose2d(in_channels, out_channels, kernel_size, stride)
        self.stride = stride
        self.kernel_size = kernel_size

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv(x)
        h, w = x.shape[2] * self.stride, x.shape[3] * self.stride
        total = max((x.shape[2] - 1) * self.stride + self.kernel_size - h, 0)
        start = total // 2
        return out[:, :, start:start + h, start:start + w]


class VAE(nn.Module):
    """DeepOBS's variational autoencoder for 28×28 images (MNIST / Fashion-MNIST).

    Encoder: three 4×4 convolutions with 64 filters (strides 2, 2, 1, "same" padding), each
    followed by leaky ReLU (slope 0.3) and dropout 0.2; then two dense heads giving the
    latent mean μ and log σ (= ½ · dense) of an 8-dimensional Gaussian.
    Decoder: z = μ + σ ⊙ ε, dense 24 and 49 with leaky ReLU, reshaped to 1×7×7, three 4×4
    transposed convolutions with 64 filters (strides 2, 1, 1) with ReLU, dropout 0.2 after
    the first two, then dense 784 with a sigmoid, reshaped to 1×28×28.
    Weights Glorot-uniform, biases zero (TensorFlow's defaults, which DeepOBS uses).
    ``forward`` returns (reconstruction, μ, log σ); 10,151,489 parameters.
    """

    def __init__(self, latent: int = 8, dropout: float = 0.2):
        super().__init__()
        act = nn.LeakyReLU(0.3)
        self.encoder = nn.Sequential(
            nn.Conv2d(1, 64, 4, stride=2, padding=1), act, nn.Dropout(dropout),
            nn.Conv2d(64, 64, 4, stride=2, padding=1), act, nn.Dropout(dropout),
            nn.ZeroPad2d((1, 2, 1, 2)), nn.Conv2d(64, 64, 4), act,  # TF "same", stride 1
            nn.Dropout(dropout),
            nn.Flatten(),
        )
        self.mean = nn.Linear(7 * 7 * 64, latent)
        self.log_sigma = nn.Linear(7 * 7 * 64, latent)
        self.decoder = nn.Sequential(
            nn.Linear(latent, 24), act, nn.Linear(24, 49), act,
            nn.Unflatten(1, (1, 7, 7)),
            _SameConvTranspose(1, 64, 4, 2), nn.ReLU(), nn.Dropout(dropout),
            _SameConvTranspose(64, 64, 4, 1), nn.ReLU(), nn.Dropout(dropout),
            _SameConvTranspose(64, 64, 4, 1), nn.ReLU(),
            nn.Flatten(),
            nn.Linear(14 * 14 * 64, 28 * 28), nn.Sigmoid(),
            nn.Unflatten(1, (1, 28, 28)),
        )
        for module in self.modules():
            if isinstance(module, nn.Conv2d | nn.ConvTranspose2d | nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = self.encoder(x)
        mu, log_sigma = self.mean(h), 0.5 * self.log_sigma(h)
        z = mu + torch.exp(log_sigma) * torch.randn_like(mu)
        return self.decoder(z), mu, log_sigma


def mnist_vae() -> VAE:
    """The VAE of ``mnist_vae`` / ``fmnist_vae``."""
    return VAE()
