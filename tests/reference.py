"""Brute-force references for the tests: individual gradients by torch.func, instruments
computed from them by the paper's formulas in float64, histograms by materializing."""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from cockpit.engine.histograms.exact import BinSpec


def individual_gradients(model: nn.Module, loss_fn, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """g_n = ∇ℓ_n for every trainable parameter, shape [N, *shape] (vmap over samples).

    torch.func.functional_call leaves a module that appears twice in an nn.Sequential with
    its detached stand-ins instead of its parameters (torch 2.13), so they are restored."""
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}

    def sample_loss(theta, x_n, y_n):
        out = functional_call(model, {**theta, **frozen, **buffers}, (x_n.unsqueeze(0),))
        return loss_fn(out, y_n.unsqueeze(0)).sum()

    originals = [(m, k, p) for m in model.modules() for k, p in m._parameters.items()]
    try:
        return vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
    finally:
        for module, key, param in originals:
            module._parameters[key] = param


def per_sample_backward(model: nn.Module, x: Tensor, y: Tensor, loss_of=None,
                        scale: float = 1.0) -> Tensor:
    """Individual gradients [N, D] in float64 by one ordinary backward pass per sample, for
    models torch.func cannot follow (autocast, sparse gradients, attention weights).
    ``loss_of(x_n, y_n)``: the sample's loss (default: cross-entropy of ``model``);
    backpropagated times ``scale`` (a GradScaler's factor), which is divided out again.
    Leaves the parameters' gradients zeroed."""
    if loss_of is None:
        def loss_of(x_n, y_n):
            return nn.functional.cross_entropy(model(x_n), y_n)

    rows = []
    for n in range(len(x)):
        model.zero_grad()
        (scale * loss_of(x[n : n + 1], y[n : n + 1]).sum()).backward()
        rows.append(torch.cat([p.grad.to_dense().flatten() / scale
                               for p in model.parameters()]))
    model.zero_grad()
    return torch.stack(rows).double()


def flat(grads: dict[str, Tensor], names=None) -> Tensor:
    names = list(grads) if names is None else names
    n = next(iter(grads.values())).shape[0]
    return torch.cat([grads[k].reshape(n, -1).double() for k in names], dim=1)


def gradient_tests(G: Tensor) -> dict[str, float]:
    """NormTest (19a), InnerTest (22a), OrthoTest (25a) from individual gradients [N, D],
    written as the sample variances they are (not via the engine's expansions)."""
    n = G.shape[0]
    g = G.mean(0)
    gg = g.dot(g)
    norm = ((G - g).pow(2).sum() / gg / (n * (n - 1))).sqrt()
    proj = G @ g / gg  # g_nᵀg_B / ‖g_B‖²
    inner = ((proj - 1).pow(2).sum() / (n * (n - 1))).sqrt()
    ortho_vecs = G / gg.sqrt() - proj[:, None] * (g / gg.sqrt())[None, :]
    ortho = (ortho_vecs.pow(2).sum() / (n * (n - 1))).sqrt()
    return {"NormTest": norm.item(), "InnerTest": inner.item(), "OrthoTest": ortho.item()}


def elementwise(G: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, biased variance) per element, excluding elements without noise."""
    n = G.shape[0]
    mean = G.mean(0)
    var = G.var(0, unbiased=False)
    second = G.pow(2).sum(0)
    floor = 64 * torch.finfo(G.dtype).eps
    keep = (n * var > floor * second) & (second > floor**2 * second.max())
    return mean[keep], var[keep]


def mean_gsnr(blocks: list[Tensor]) -> float:
    """Per-parameter-tensor blocks [N, D_p]: exclusions are decided per tensor."""
    ratios = [(m.pow(2) / v) for m, v in map(elementwise, blocks)]
    return torch.cat(ratios).mean().item()


def early_stopping(blocks: list[Tensor]) -> float:
    n = blocks[0].shape[0]
    pairs = [elementwise(b) for b in blocks]
    mean = torch.cat([m for m, _ in pairs])
    unbiased = torch.cat([v for _, v in pairs]) * n / (n - 1)
    return 1 - n / mean.numel() * (mean.pow(2) / unbiased).sum().item()


def cabs(G: Tensor, lr: float, loss: float) -> float:
    g = G.mean(0)
    return lr * (G - g).pow(2).sum(1).mean().item() / loss


@functools.lru_cache(maxsize=64)
def edges_rounded_up(lo: float, hi: float, bins: int) -> tuple[float, ...]:
    """The inner edges e_k = lo + k·(hi − lo)/bins (rational), each rounded *up* to float64."""
    width = (Fraction(hi) - Fraction(lo)) / bins
    edges = []
    for k in range(1, bins):
        e = Fraction(lo) + k * width
        up = float(e)  # correctly rounded (nearest)
        edges.append(up if Fraction(up) >= e else math.nextafter(up, math.inf))
    return tuple(edges)


def bin_indices(values: Tensor, lo: float, hi: float, bins: int) -> Tensor:
    """Exact bin of each value: #{k ≥ 1 : v ≥ e_k} with e_k = lo + k·(hi − lo)/bins in
    rational arithmetic, by comparison in float64 with every inner edge rounded up to
    float64 (for a float64 v, v ≥ e_k ⟺ v ≥ ⌈e_k⌉; float16/32 values are float64 values).
    Bin k holds [e_k, e_{k+1}); values outside [lo, hi) fall into the edge bins."""
    edges = torch.tensor(edges_rounded_up(lo, hi, bins), dtype=torch.float64)
    return torch.bucketize(values.double().contiguous(), edges, right=True)


def bin_indices_np(x: np.ndarray, spec: BinSpec) -> np.ndarray:
    """:func:`bin_indices` of a NumPy array of any float dtype and shape, for a ``BinSpec``;
    −1 for non-finite values."""
    x = np.asarray(x)
    finite = np.isfinite(x)
    idx = bin_indices(torch.from_numpy(np.where(finite, x, 0).astype(np.float64)),
                      spec.lo, spec.hi, spec.bins).numpy()
    return np.where(finite, idx, -1)


def histogram(values: Tensor, lo=-2.0, hi=2.0, bins=100) -> Tensor:
    return torch.bincount(bin_indices(values.reshape(-1), lo, hi, bins), minlength=bins)


def same_histogram(counts, values: Tensor, lo=-2.0, hi=2.0, bins=100,
                   noise: float = 1e-14) -> bool:
    """Whether ``counts`` (Cockpit's) equal the histogram of the reference ``values`` [N, D],
    allowing for the sign of rounding noise: elements with |v| ≤ noise·max|v| (zero up to
    rounding in both computations) may sit on either side of the edge 0."""
    counts = torch.as_tensor(counts)
    expected = histogram(values, lo, hi, bins)
    if torch.equal(counts, expected):
        return True
    v = values.double().reshape(-1)
    ambiguous = int(((v != 0) & (v.abs() <= noise * v.abs().max())).sum())
    zero = bin_indices(torch.zeros(1), lo, hi, bins).item()
    diff = counts - expected
    others = torch.ones(bins, dtype=torch.bool)
    others[[zero - 1, zero]] = False
    return (bool((diff[others] == 0).all()) and int(diff[zero - 1] + diff[zero]) == 0
            and abs(int(diff[zero])) <= ambiguous)


def rel_close(actual: float, expected: float, rtol: float, atol: float = 0.0) -> bool:
    if math.isnan(expected):
        return math.isnan(actual)
    return abs(actual - expected) <= atol + rtol * abs(expected)


def edge_neighbours(spec: BinSpec, dtype: torch.dtype, steps: int = 2) -> torch.Tensor:
    """Nominal edges and their nearest floats in ``dtype``: the hardest values to bin."""
    out = [spec.edges(torch.float64).to(dtype)]
    for direction in (math.inf, -math.inf):
        e = out[0]
        for _ in range(steps):
            e = torch.nextafter(e, torch.full_like(e, direction))
            out.append(e)
    return torch.cat(out)


class OpNames(TorchDispatchMode):
    """The names of the aten ops run inside it (which ops a computation issues: e.g. none
    whose output size depends on the data, a wait on a GPU)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def host_count(n):
    """A histogram's number of non-finite values as the CPU path returns it (an int); the
    accelerator path (``pytest --accelerator-path``) keeps it a 0-dim integer tensor on the
    device, read with the step's other numbers."""
    from cockpit.engine.histograms import device

    if (device._forced and isinstance(n, Tensor) and n.dim() == 0
            and not n.is_floating_point()):
        return int(n)
    return n
