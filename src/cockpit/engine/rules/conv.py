"""Convolutions (1d, 2d, 3d; stride, padding incl. "same" and non-zero padding modes,
dilation, groups).

With the input unfolded into patches U_n ∈ R^{(C_in/G)·K × L} per group (K kernel elements,
L output positions), the individual gradient of the weight is the per-sample matrix product
g_n(W) = δ_n U_nᵀ ∈ R^{C_out/G × (C_in/G)·K} per group, and g_n(b) = Σ_l δ_{n,:,l}. Conv1d
and Conv2d use ``F.unfold`` (Conv1d as a 2d convolution of height one); Conv3d, for which
torch has no unfold, vmaps the convolution's own vector-Jacobian product over the batch.
"""

from __future__ import annotations

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


def _conv_weight_grads_unfold(module: nn.modules.conv._ConvNd, x: Tensor, delta: Tensor) -> Tensor:
    n, groups = x.shape[0], module.groups
    kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
    if len(kernel) == 1:
        x, delta = x.unsqueeze(2), delta.unsqueeze(2)
        kernel, stride, dilation = (1, *kernel), (1, *stride), (1, *dilation)
    patches = F.unfold(x, kernel, dilation=dilation, stride=stride)  # [N, C_in·K, L]
    c_out = delta.shape[1]
    patches = patches.reshape(n, groups, -1, patches.shape[-1])
    delta = delta.reshape(n, groups, c_out // groups, -1)
    grads = torch.einsum("ngol,ngkl->ngok", delta, patches)
    return grads.reshape(n, *module.weight.shape)


def _conv_weight_grads_vmap(module: nn.modules.conv._ConvNd, x: Tensor, delta: Tensor) -> Tensor:
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(module.kernel_size)]
    weight = module.weight.detach()

    def one_sample(x_n: Tensor, delta_n: Tensor) -> Tensor:
        def forward(w: Tensor) -> Tensor:
            return conv(x_n[None], w, None, module.stride, 0, module.dilation, module.groups)

        _, vjp_fn = torch.func.vjp(forward, weight)
        return vjp_fn(delta_n[None])[0]

    return torch.func.vmap(one_sample)(x, delta)


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
        if len(module.kernel_size) <= 2:
            weight_grads = _conv_weight_grads_unfold(module, x_padded, delta)
        else:
            weight_grads = _conv_weight_grads_vmap(module, x_padded, delta)
        grads["weight"] = DenseSampleGrads(weight_grads)
    if module.bias is not None and module.bias.requires_grad:
        grads["bias"] = DenseSampleGrads(delta.flatten(2).sum(2))
    return grads
