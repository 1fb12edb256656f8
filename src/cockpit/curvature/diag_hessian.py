"""The exact diagonal of the mini-batch loss's Hessian, including the terms of activations
that are not piecewise linear.

For a network whose only nonlinearities are elementwise activation modules a = σ(z) (and
piecewise-linear operations such as ReLU and max-pooling, whose second derivative vanishes
almost everywhere), the Hessian of L_B = (1/|B|) Σ_n ℓ_n decomposes into the generalized
Gauss-Newton matrix and one residual term per activation:

    ∇²L_B = G + (1/|B|) Σ_n Σ_k Σ_u r_{n,k,u} ∇_θ z_{n,k,u} ∇_θ z_{n,k,u}ᵀ,
    r_{n,k,u} = (∂ℓ_n/∂a_{n,k,u}) · σ_k''(z_{n,k,u}).

(Products W·a of a layer's weight and its input only create off-diagonal entries.) On the
diagonal, the residual of activation k is (1/|B|) Σ_u Σ_n r_{n,u} (∂z_{n,u}/∂θ_j)²: for each
unit u, backpropagate √(r⁺) e_u and √(r⁻) e_u from z (r = r⁺ − r⁻) and reduce the resulting
individual "gradients" to sums of squares with the engine's layer rules. That is two vector
backpropagations per activation unit, affordable for small networks; the ``"auto"`` setting
of the curvature instruments uses it only within a budget.

Applicability is checked on the autograd graph of the model output: every node must be a
linear or piecewise-linear operation, or the output of a recorded activation module listed
in :data:`SECOND_DERIVATIVES`; anything else (normalization layers, attention, a sigmoid
called as a function) raises :class:`~cockpit.curvature.diagonal.CurvatureError`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def _sigmoid_2(z: Tensor, module) -> Tensor:
    s = torch.sigmoid(z)
    return s * (1 - s) * (1 - 2 * s)


def _tanh_2(z: Tensor, module) -> Tensor:
    t = torch.tanh(z)
    return -2 * t * (1 - t * t)


def _gelu_2(z: Tensor, module) -> Tensor:
    if getattr(module, "approximate", "none") != "none":
        raise NotImplementedError("GELU(approximate='tanh')")
    pdf = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return pdf * (2 - z * z)


def _silu_2(z: Tensor, module) -> Tensor:
    s = torch.sigmoid(z)
    return s * (1 - s) * (2 + z * (1 - 2 * s))


def _softplus_2(z: Tensor, module) -> Tensor:
    beta, threshold = module.beta, module.threshold
    s = torch.sigmoid(beta * z)
    return torch.where(beta * z > threshold, torch.zeros_like(z), beta * s * (1 - s))


def _elu_2(z: Tensor, module) -> Tensor:
    return torch.where(z > 0, torch.zeros_like(z), module.alpha * torch.exp(z))


SECOND_DERIVATIVES = {
    nn.Sigmoid: _sigmoid_2,
    nn.Tanh: _tanh_2,
    nn.GELU: _gelu_2,
    nn.SiLU: _silu_2,
    nn.Softplus: _softplus_2,
    nn.ELU: _elu_2,
}
ACTIVATION_NODES = {
    "SigmoidBackward0", "TanhBackward0", "GeluBackward0", "SiluBackward0",
    "SoftplusBackward0", "EluBackward0",
}
# Autograd nodes that are linear or piecewise linear in their differentiable inputs.
LINEAR_NODES = {
    "AccumulateGrad", "AddmmBackward0", "MmBackward0", "AddBackward0", "SubBackward0",
    "TBackward0", "ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0",
    "PermuteBackward0", "TransposeBackward0", "ExpandBackward0", "SqueezeBackward0",
    "SqueezeBackward1", "SqueezeBackward4", "UnsqueezeBackward0", "CloneBackward0",
    "ConvolutionBackward0", "MaxPool2DWithIndicesBackward0", "MaxPool3DWithIndicesBackward0",
    "AvgPool2DBackward0", "AvgPool3DBackward0", "AdaptiveAvgPool2DBackward0",
    "ReluBackward0", "ThresholdBackward0", "LeakyReluBackward0", "HardtanhBackward0",
    "CatBackward0", "SliceBackward0", "SelectBackward0", "SumBackward0", "SumBackward1",
    "MeanBackward0", "MeanBackward1", "ConstantPadNdBackward0", "NativeDropoutBackward0",
    "EmbeddingBackward0", "SplitBackward0", "SplitWithSizesBackward0", "NegBackward0",
    "MulBackward0", "DivBackward0", "SqueezeBackward2", "UnbindBackward0",
    "IndexBackward0", "StackBackward0", "AliasBackward0",
}
_ONE_SIDED = {"MulBackward0", "DivBackward0"}  # linear only if one factor is constant


def check_graph(output: Tensor, activation_nodes: set) -> None:
    """Raise ValueError unless the graph has only the structure the decomposition covers."""
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if name in ACTIVATION_NODES:
            if node not in activation_nodes:
                raise ValueError(
                    f"the graph contains {name.removesuffix('Backward0')} that is not an "
                    "activation module Cockpit recorded (e.g. called as a function)"
                )
        elif name not in LINEAR_NODES:
            raise ValueError(f"the graph contains {name}, which is not covered")
        elif name in _ONE_SIDED:
            live = [n for n, _ in node.next_functions if n is not None]
            if len(live) > 1:
                raise ValueError(f"the graph multiplies two parameter-dependent tensors ({name})")
        stack.extend(n for n, _ in node.next_functions)


def residual_diagonal(tracker, losses: Tensor, max_backprops: int) -> dict[str, Tensor]:
    """Σ_k (1/|B|) Σ_u Σ_n r_{n,u} (∂z_{n,u}/∂θ)² per parameter (module docstring)."""
    calls = [c for c in tracker.activation_calls if c[1].requires_grad]
    if not calls:
        return {}
    units = sum(2 * z[0].numel() for _, z, _ in calls)
    if units > max_backprops:
        raise ValueError(
            f"the residual terms need {units} vector backpropagations (two per activation "
            f"unit), more than the budget of {max_backprops}"
        )
    n = losses.shape[0]
    with tracker.suspended():
        grads_a = torch.autograd.grad(losses.sum(), [a for _, _, a in calls], retain_graph=True)
    totals: dict[str, Tensor] = {}
    for (module, z, _), grad_a in zip(calls, grads_a, strict=True):
        r = (grad_a * SECOND_DERIVATIVES[type(module)](z.detach(), module)).reshape(n, -1)
        for sign, part in ((1.0, r.clamp(min=0)), (-1.0, (-r).clamp(min=0))):
            active = [u for u in range(part.shape[1]) if bool(part[:, u].any())]
            if not active:
                continue
            probes = z.new_zeros(len(active), n, part.shape[1])
            for i, u in enumerate(active):
                probes[i, :, u] = part[:, u].sqrt()
            sums = tracker.sum_sq_of_backprops(z, probes.reshape(len(active), *z.shape))
            for name, value in sums.items():
                totals[name] = totals.get(name, 0) + sign * value / n
    return totals


def is_activation(module: nn.Module) -> bool:
    return type(module) in SECOND_DERIVATIVES
