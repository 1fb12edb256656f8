"""Convolutions (1d, 2d, 3d; stride, padding incl. "same" and non-zero padding modes,
dilation, groups).

With the input unfolded into patches U_n ∈ R^{(C_in/G)·K × L} per group (K kernel elements,
L output positions), the individual gradient of the weight is the per-sample matrix product
g_n(W) = δ_n U_nᵀ ∈ R^{C_out/G × (C_in/G)·K} per group, and g_n(b) = Σ_l δ_{n,:,l}. The
patches are a strided view of the padded input, which works alike in 1, 2 and 3 dimensions
and is several times faster on a CPU than ``F.unfold`` (im2col).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cockpit.engine.rules.registry import register_rule
from cockpit.engine.sample_grads import DenseSampleGrads, SampleGrads


def _explicit_padding(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """Apply the module's padding to ``x`` explicitly, so the convolution itself uses none."""
    dims = len(module.kernel_size)
    if module.padding == "valid":
        return x
    if module.padding == "same":
        pads: list[int] = []
        for k, d in zip(reversed(module.kernel_size), reversed(module.dilation), strict=True):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
    else:
        pads = [p for p in reversed(module.padding) for _ in range(2)]
    if not any(pads):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    assert len(pads) == 2 * dims
    return F.pad(x, pads, mode=mode)


def _conv_weight_grads(module: nn.modules.conv._ConvNd, x: Tensor, delta: Tensor) -> Tensor:
    """g_n(W) for every sample: patches as a strided view of the padded input (no im2col),
    copied once into [N, G, L, (C_in/G)·K] and contracted with δ by a batched matmul."""
    n, c_in = x.shape[:2]
    groups, kernel = module.groups, module.kernel_size
    out_sizes = delta.shape[2:]
    spatial_strides = x.stride()[2:]
    view = x.as_strided(
        (n, *out_sizes, c_in, *kernel),
        (
            x.stride(0),
            *(st * s for st, s in zip(spatial_strides, module.stride, strict=True)),
            x.stride(1),
            *(st * d for st, d in zip(spatial_strides, module.dilation, strict=True)),
        ),
    )
    positions = math.prod(out_sizes)
    patches = view.reshape(n, positions, groups, -1).transpose(1, 2)  # [N, G, L, Cg·K]
    c_out = delta.shape[1]
    delta = delta.reshape(n, groups, c_out // groups, positions)  # [N, G, Og, L]
    grads = torch.matmul(delta, patches)  # [N, G, Og, Cg·K]
    return grads.reshape(n, *module.weight.shape)


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_rule(
    module: nn.modules.conv._ConvNd, args: tuple, kwargs: dict, output: Tensor, grad_output: Tensor
) -> dict[str, SampleGrads]:
    x = args[0] if args else kwargs["input"]
    if x.dim() != len(module.kernel_size) + 2:
        raise ValueError(
            f"{type(module).__name__} received an input of shape {tuple(x.shape)} without "
            "batch dimension; Cockpit needs batched inputs [batch, channels, ...]."
        )
    grads: dict[str, SampleGrads] = {}
    delta = grad_output
    if module.weight.requires_grad:
        x_padded = _explicit_padding(module, x.detach())
        grads["weight"] = DenseSampleGrads(_conv_weight_grads(module, x_padded, delta))
    if module.bias is not None and module.bias.requires_grad:
        grads["bias"] = DenseSampleGrads(delta.flatten(2).sum(2))
    return grads
