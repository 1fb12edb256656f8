"""Normalization layers with an elementwise affine transform y = x̂ ⊙ γ + β.

x̂ is recomputed from the stored input: LayerNorm normalizes over the trailing
``normalized_shape`` dims, GroupNorm over each group of channels and the spatial dims,
RMSNorm divides by the root mean square over the trailing dims, and BatchNorm in eval mode
uses its running statistics. Then g_n(γ) = Σ_{other dims} δ_n ⊙ x̂_n and g_n(β) = Σ δ_n.

BatchNorm in training mode normalizes with statistics of the whole batch, so every sample's
loss depends on every other sample: individual gradients are not defined and the rule
raises :class:`SampleMixingError`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cockpit.engine.rules.registry import register_rule
from cockpit.engine.rules.sample_grads import (
    DenseSampleGrads,
    SampleGrads,
    outside_autograd,
)


class SampleMixingError(ValueError):
    """A layer mixes the samples of a batch, so individual gradients do not exist."""


def _affine_grads(
    module: nn.Module, x_hat: Tensor, delta: Tensor, param_dims: int, channel_dim: int | None,
    scale: float = 1.0,
) -> dict[str, SampleGrads]:
    """Sum δ⊙x̂ (weight) and δ (bias) over all dims except batch and the parameter's dims,
    δ = ``scale`` · ``delta`` (the uniform loss weight's 1/w: multiplied into the sums, not
    into the layer-sized δ)."""
    n = delta.shape[0]
    if channel_dim is None:  # parameter covers the trailing ``param_dims`` dims
        reduce_dims = tuple(range(1, delta.dim() - param_dims))
    else:  # parameter indexed by the channel dim only
        reduce_dims = tuple(d for d in range(1, delta.dim()) if d != channel_dim)
    grads: dict[str, SampleGrads] = {}
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if weight is not None and weight.requires_grad:
        g = (delta * x_hat).sum(reduce_dims) if reduce_dims else delta * x_hat
        grads["weight"] = DenseSampleGrads(g if g.shape[1:] == weight.shape
                                           else g.reshape(n, *weight.shape), scale=scale)
    if bias is not None and bias.requires_grad:
        g = delta.sum(reduce_dims) if reduce_dims else delta
        grads["bias"] = DenseSampleGrads(g if g.shape[1:] == bias.shape
                                         else g.reshape(n, *bias.shape), scale=scale)
    return grads


def _input(args: tuple, kwargs: dict) -> Tensor:
    return outside_autograd(args[0] if args else kwargs["input"])


# x̂ by the functional form of the layer without its affine transform: the kernel the
# forward pass ran (one op, its rounding), not a chain of reductions and divisions


@register_rule(nn.LayerNorm)
def layer_norm_rule(module, args, kwargs, output, grad_output, scale: float = 1.0):
    x_hat = F.layer_norm(_input(args, kwargs), module.normalized_shape, eps=module.eps)
    return _affine_grads(module, x_hat, grad_output, len(module.normalized_shape), None, scale)


@register_rule(nn.RMSNorm)
def rms_norm_rule(module, args, kwargs, output, grad_output, scale: float = 1.0):
    x = _input(args, kwargs)
    dims = tuple(range(-len(module.normalized_shape), 0))
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    x_hat = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return _affine_grads(module, x_hat, grad_output, len(module.normalized_shape), None, scale)


@register_rule(nn.GroupNorm)
def group_norm_rule(module, args, kwargs, output, grad_output, scale: float = 1.0):
    x_hat = F.group_norm(_input(args, kwargs), module.num_groups, eps=module.eps)
    return _affine_grads(module, x_hat, grad_output, 1, 1, scale)


@register_rule(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
def batch_norm_rule(module, args, kwargs, output, grad_output, scale: float = 1.0):
    if uses_batch_statistics(module):
        raise SampleMixingError(batch_norm_message(module))
    x_hat = F.batch_norm(_input(args, kwargs), module.running_mean, module.running_var,
                         training=False, eps=module.eps)
    return _affine_grads(module, x_hat, grad_output, 1, 1, scale)


for _rule in (layer_norm_rule, rms_norm_rule, group_norm_rule, batch_norm_rule):
    _rule.takes_scale = True  # type: ignore[attr-defined]


def uses_batch_statistics(module: nn.modules.batchnorm._BatchNorm) -> bool:
    return module.training or module.running_mean is None


def batch_norm_message(module: nn.Module, name: str = "") -> str:
    where = f" '{name}'" if name else ""
    return (
        f"{type(module).__name__}{where} normalizes with statistics of the whole batch "
        "(training mode), so each sample's loss depends on all others and individual "
        "gradients are undefined. Per-sample instruments (GradHist1d, the gradient tests, "
        "Alpha, TIC, ...) cannot be computed. Ways out: replace BatchNorm by GroupNorm or "
        "LayerNorm, put the BatchNorm layers in eval mode (module.eval()), pass "
        "Cockpit(..., batchnorm='frozen_statistics') for an approximation that holds the "
        "batch statistics constant, or use only instruments that need no individual "
        "gradients (Loss, GradNorm, Distance, UpdateSize, curvature)."
    )
