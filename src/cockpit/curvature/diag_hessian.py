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

Normalization layers (``nn.LayerNorm``, ``nn.RMSNorm``) are vector nonlinearities a = φ(z)
over each normalized slice z_{n,p} ∈ R^d (position p). Their residual is
(1/|B|) Σ_{n,p} u_{n,p}ᵀ M_{n,p} u_{n,p} with u = ∂z_{n,p}/∂θ_j and
M_{n,p} = ∇²_z (g_{n,p}ᵀ φ(z_{n,p})), g = ∂ℓ_n/∂a (the layer's weight and bias enter a
linearly and create no diagonal term). M is formed by ``torch.func.hessian`` per slice and
diagonalized, M = Σ_e λ_e v_e v_eᵀ; each eigenpair is backpropagated as √(λ_e⁺) v_e and
√(λ_e⁻) v_e (one slice position at a time, every sample with its own vectors): two vector
backpropagations per element of the slice and position, as for elementwise activations.

Applicability is checked on the autograd graph of the model output: every node must be a
linear or piecewise-linear operation, or the output of a recorded activation or
normalization module listed in :data:`SECOND_DERIVATIVES` / :data:`NORMALIZATIONS` (the
engine records the calls of exactly these, :mod:`cockpit.engine.capture.activations`);
anything else (attention, GroupNorm, a sigmoid called as a function) raises
:class:`~cockpit.curvature.diagonal.CurvatureError`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import hessian, vmap

from cockpit._listing import listed
from cockpit.engine.engine_view import EngineView


def _sigmoid_2(z: Tensor, module) -> Tensor:
    s = torch.sigmoid(z)
    return s * (1 - s) * (1 - 2 * s)


def _tanh_2(z: Tensor, module) -> Tensor:
    t = torch.tanh(z)
    return -2 * t * (1 - t * t)


def _gelu_2(z: Tensor, module) -> Tensor:
    if getattr(module, "approximate", "none") != "none":
        return _gelu_tanh_2(z)
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


def _gelu_tanh_2(z: Tensor) -> Tensor:
    """σ'' of GELU(approximate='tanh'), by automatic differentiation of the formula."""
    def gelu(x):
        return F.gelu(x, approximate="tanh")

    return vmap(torch.func.grad(torch.func.grad(gelu)))(z.reshape(-1)).reshape(z.shape)


SECOND_DERIVATIVES = {
    nn.Sigmoid: _sigmoid_2,
    nn.Tanh: _tanh_2,
    nn.GELU: _gelu_2,
    nn.SiLU: _silu_2,
    nn.Softplus: _softplus_2,
    nn.ELU: _elu_2,
}



def _layer_norm(module: nn.LayerNorm):
    shape = tuple(module.normalized_shape)
    weight = None if module.weight is None else module.weight.detach()
    bias = None if module.bias is None else module.bias.detach()
    return lambda x: F.layer_norm(x, shape, weight, bias, module.eps)


def _rms_norm(module: nn.RMSNorm):
    shape = tuple(module.normalized_shape)
    weight = None if module.weight is None else module.weight.detach()
    return lambda x: F.rms_norm(x, shape, weight, module.eps)


# vector nonlinearities over the trailing ``normalized_shape`` dims: module -> φ at fixed θ
NORMALIZATIONS = {nn.LayerNorm: _layer_norm, nn.RMSNorm: _rms_norm}
ACTIVATION_NODES = {
    "SigmoidBackward0", "TanhBackward0", "GeluBackward0", "SiluBackward0",
    "SoftplusBackward0", "EluBackward0", "NativeLayerNormBackward0",
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
    "IndexBackward0", "StackBackward0", "AliasBackward0", "ToCopyBackward0",
    # fully_shard's identities on a sharded module's inputs (its post-backward hook) and,
    # under torch.func transforms, on its outputs; DistributedDataParallel's identity on
    # its outputs (find_unused_parameters, static_graph)
    "RegisterPostBackwardFunctionBackward", "RegisterPreBackwardFunctionBackward",
    "_DDPSinkBackward",
}
_ONE_SIDED = {"MulBackward0", "DivBackward0"}  # linear only if one factor is constant


def check_single_use(engine: EngineView) -> None:
    """Raise ValueError where a parameter enters the network in several calls (a layer
    called twice): its weight then multiplies an input that depends on it, W·a(W), whose
    diagonal term 2·δ·∂a/∂W the decomposition leaves out (an 18 % error measured)."""
    repeated = [name for name in engine.params if engine.used_repeatedly(name)]
    if repeated:
        raise ValueError(
            f"{listed(repeated, 3)} enter the network in several calls (a layer called "
            "more than once), whose product with an input that depends on the same weights "
            "the exact diagonal's decomposition does not cover")


def check_graph(output: Tensor, calls) -> None:
    """Raise ValueError unless the graph has only the structure the decomposition covers.

    ``calls``: the recorded (module, input z, output a) of activation and normalization
    modules; the traversal passes from a recorded output a to its input z (a normalization's
    own weight and bias are leaves)."""
    inputs = {a.grad_fn: z for _, z, a in calls if a.grad_fn is not None}
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in inputs:
            stack.append(inputs[node].grad_fn)
            continue
        name = type(node).__name__
        if name in ACTIVATION_NODES:
            raise ValueError(
                f"the graph contains {name.removesuffix('Backward0')} that is not an "
                "activation or normalization module Cockpit recorded (e.g. called as a "
                "function)"
            )
        if name not in LINEAR_NODES:
            raise ValueError(f"the graph contains {name}, which is not covered")
        if name in _ONE_SIDED:
            live = [n for n, _ in node.next_functions if n is not None]
            if len(live) > 1:
                raise ValueError(f"the graph multiplies two parameter-dependent tensors ({name})")
        stack.extend(n for n, _ in node.next_functions)


def num_backprops(calls) -> int:
    """Vector backpropagations the residual terms need: two per unit of z_n."""
    return sum(2 * math.prod(z.shape[1:]) for _, z, _ in calls if z.requires_grad)


def residual_diagonal(engine: EngineView, losses: Tensor, max_backprops: int,
                      sum_sq_of_backprops=None) -> dict[str, Tensor]:
    """Σ_k (1/|B|) Σ_u Σ_n r_{n,u} (∂z_{n,u}/∂θ)² per parameter (module docstring).

    ``sum_sq_of_backprops(z, probes)``: Σ_k Σ_n g_{n,k} ⊙ g_{n,k} of the probes'
    backpropagations from z (default: the engine's, one backward pass per probe)."""
    if sum_sq_of_backprops is None:
        sum_sq_of_backprops = engine.sum_sq_of_backprops
    calls = [c for c in engine.activation_calls if c[1].requires_grad]
    if not calls:
        return {}
    units = num_backprops(calls)
    if units > max_backprops:
        raise ValueError(
            f"the residual terms need {units} vector backpropagations (two per activation "
            f"unit), more than the budget of {max_backprops}"
        )
    n = losses.shape[0]
    with engine.suspended():
        grads_a = torch.autograd.grad(losses.sum(), [a for _, _, a in calls], retain_graph=True)
    totals: dict[str, Tensor] = {}
    for (module, z, _), grad_a in zip(calls, grads_a, strict=True):
        if type(module) in NORMALIZATIONS:
            probe_sets = _normalization_probes(module, z.detach(), grad_a.detach())
        else:
            probe_sets = _elementwise_probes(module, z.detach(), grad_a)
        for sign, probes in probe_sets:
            sums = sum_sq_of_backprops(z, probes)
            for name, value in sums.items():
                totals[name] = totals.get(name, 0) + sign * value / n
    return totals


def _elementwise_probes(module, z: Tensor, grad_a: Tensor) -> list[tuple[float, Tensor]]:
    """(sign, probes [K, *z.shape]): √(r±) e_u for every unit u with r ≠ 0."""
    n = z.shape[0]
    r = (grad_a * SECOND_DERIVATIVES[type(module)](z, module)).reshape(n, -1)
    out = []
    for sign, part in ((1.0, r.clamp(min=0)), (-1.0, (-r).clamp(min=0))):
        active = [u for u in range(part.shape[1]) if bool(part[:, u].any())]
        if not active:
            continue
        probes = z.new_zeros(len(active), n, part.shape[1])
        for i, u in enumerate(active):
            probes[i, :, u] = part[:, u].sqrt()
        out.append((sign, probes.reshape(len(active), *z.shape)))
    return out


def _normalization_probes(module, z: Tensor, grad_a: Tensor) -> list[tuple[float, Tensor]]:
    """(sign, probes [K, *z.shape]): √(λ±) v for every eigenpair of M_{n,p} (module
    docstring), one slice position p per probe."""
    phi = NORMALIZATIONS[type(module)](module)
    shape = tuple(module.normalized_shape)
    d = math.prod(shape)
    n = z.shape[0]
    slices = z.reshape(n, -1, d)  # [N, P, d]
    weights = grad_a.reshape(n, -1, d)
    positions = slices.shape[1]

    def weighted(x: Tensor, g: Tensor) -> Tensor:
        return (g * phi(x.reshape(shape)).reshape(-1)).sum()

    M = vmap(hessian(weighted))(slices.reshape(-1, d), weights.reshape(-1, d))
    M = 0.5 * (M + M.transpose(1, 2))
    evals, evecs = torch.linalg.eigh(M)  # [N·P, d], [N·P, d, d]
    evals = evals.reshape(n, positions, d)
    evecs = evecs.reshape(n, positions, d, d)
    out = []
    for sign in (1.0, -1.0):
        scale = (sign * evals).clamp(min=0).sqrt()  # [N, P, e]
        probes = []
        for p in range(positions):
            for e in range(d):
                if not bool(scale[:, p, e].any()):
                    continue
                probe = z.new_zeros(n, positions, d)
                probe[:, p, :] = scale[:, p, e, None] * evecs[:, p, :, e]
                probes.append(probe.reshape(z.shape))
        if probes:
            out.append((sign, torch.stack(probes)))
    return out
