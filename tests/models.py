"""Small test problems: (model, inputs, targets, per-sample loss function)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def cross_entropy(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def mse(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y, reduction="none").flatten(1).mean(1)


@dataclass
class Problem:
    name: str
    model: nn.Module
    x: Tensor
    y: Tensor
    loss_fn: object

    def losses(self) -> Tensor:
        return self.loss_fn(self.model(self.x), self.y)


class ScaledTanh(nn.Module):
    """A custom layer with its own parameters (handled by the torch.func fallback)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))
        self.shift = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x * self.scale) + self.shift


class ResidualNet(nn.Module):
    def __init__(self, d_in=6, width=8, classes=3):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.norm = nn.GroupNorm(2, width)
        self.out = nn.Linear(width, classes)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        return self.out(self.norm(h))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=11, dim=8, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.TransformerEncoderLayer(
            dim, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens):
        h = self.encoder(self.embed(tokens))
        return self.head(self.norm(h).mean(1))


class RoutedNet(nn.Module):
    """Two heads, each sample routed by the sign of its first input: a batch whose samples
    all take one head never calls the other (that head gets no gradient), a mixed batch
    calls both on every sample and picks per sample (the other head's individual gradients
    are exactly 0)."""

    def __init__(self, d_in=5, width=6, classes=3):
        super().__init__()
        self.body = nn.Linear(d_in, width)
        self.a = nn.Linear(width, classes)
        self.b = nn.Linear(width, classes)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        route = x[:, 0] > 0
        if bool(route.all()):
            return self.a(h)
        if not bool(route.any()):
            return self.b(h)
        return torch.where(route[:, None], self.a(h), self.b(h))


class CustomNet(nn.Module):
    """Custom layer, Conv1d, RMSNorm, a module used twice and tied weights."""

    def __init__(self, vocab=9, dim=6, classes=9):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1d(dim, dim, 3, padding=1)
        self.custom = ScaledTanh(dim)
        self.shared = nn.Linear(dim, dim)
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, classes, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, tokens):
        h = self.conv(self.embed(tokens).transpose(1, 2)).transpose(1, 2).mean(1)
        h = self.shared(torch.relu(self.shared(self.custom(h))))  # used twice
        return self.out(self.norm(h))


def make_problem(name: str, batch_size: int, dtype=torch.float64, seed: int = 0) -> Problem:
    torch.manual_seed(seed)
    n = batch_size
    if name == "mlp_relu":
        model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(),
                              nn.Linear(6, 3))
        x, y, loss = torch.randn(n, 5), torch.randint(0, 3, (n,)), cross_entropy
    elif name == "mlp_deep":  # three hidden Linear layers and LayerNorms of one shape
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(),
                              *[m for _ in range(3)
                                for m in (nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh())],
                              nn.Linear(6, 3))
        x, y, loss = torch.randn(n, 5), torch.randint(0, 3, (n,)), cross_entropy
    elif name == "mlp_sigmoid":
        model = nn.Sequential(nn.Linear(5, 7), nn.Sigmoid(), nn.Linear(7, 4))
        x, y, loss = torch.randn(n, 5), torch.randn(n, 4), mse
    elif name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(4, 4, 3, stride=2, groups=2, padding="valid"), nn.ReLU(),
            nn.Flatten(), nn.Linear(4, 3),
        )
        x, y, loss = torch.randn(n, 2, 8, 8), torch.randint(0, 3, (n,)), cross_entropy
    elif name == "residual":
        model = ResidualNet()
        x, y, loss = torch.randn(n, 6), torch.randint(0, 3, (n,)), cross_entropy
    elif name == "transformer":
        model = TinyTransformer()
        x, y, loss = torch.randint(0, 11, (n, 5)), torch.randint(0, 3, (n,)), cross_entropy
    elif name == "routed":  # the first half of the samples takes head a, the second b
        model = RoutedNet()
        x, y, loss = torch.randn(n, 5), torch.randint(0, 3, (n,)), cross_entropy
        x[:, 0] = torch.where(torch.arange(n) < n // 2, 1.0, -1.0) * x[:, 0].abs()
    elif name == "custom":
        model = CustomNet()
        x, y, loss = torch.randint(0, 9, (n, 4)), torch.randint(0, 9, (n,)), cross_entropy
    else:
        raise KeyError(name)
    model = model.to(dtype)
    if x.is_floating_point():
        x = x.to(dtype)
    if y.is_floating_point():
        y = y.to(dtype)
    return Problem(name, model, x, y, loss)


PROBLEMS = ["mlp_relu", "mlp_sigmoid", "cnn", "residual", "transformer", "custom"]


def train(problem: Problem, cockpit, steps: int, opt, reduction: str = "mean") -> None:
    """The ordinary loop with Cockpit attached (``cockpit=None``: without it)."""
    for step in range(steps):
        opt.zero_grad()
        losses = problem.losses()
        loss = losses.mean() if reduction == "mean" else losses.sum()
        if cockpit is None:
            loss.backward()
        else:
            with cockpit(step, losses=losses):
                loss.backward()
        opt.step()


def recorded_run(logdir, steps: int):
    """A real Cockpit run (economy instruments) of a tiny MLP on one batch, ``steps``
    steps written to the run log in ``logdir`` (0: it stops before its first step);
    returns the closed Cockpit."""
    from cockpit import Cockpit, configuration

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    with Cockpit(model, configuration("economy"), optimizer=opt, logdir=str(logdir)) as cockpit:
        for step in range(steps):
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
    return cockpit
