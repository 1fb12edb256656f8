"""Linear layers: g_n(W) = Σ_t δ_{n,t} a_{n,t}ᵀ and g_n(b) = Σ_t δ_{n,t}.

Inputs may carry any number of dimensions between the batch and the feature dimension
(sequences, image rows, …); they are summed over, as the weight is shared across them.
The transposed layout y = x W + b with W ∈ R^{in×out} (``transformers``' ``Conv1D`` of GPT-2)
has g_n(W) = Σ_t a_{n,t} δ_{n,t}ᵀ: the same factors in swapped roles.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from cockpit.engine.dtypes import in_dtype, promote
from cockpit.engine.rules.registry import register_rule, register_rule_for_class_named
from cockpit.engine.rules.sample_grads import (
    DenseSampleGrads,
    OuterSampleGrads,
    RowNorms,
    SampleGrads,
    SequenceOuterSampleGrads,
    outside_autograd,
)


@register_rule(nn.Linear)
def linear_rule(
    module: nn.Linear, args: tuple, kwargs: dict, output: Tensor, grad_output: Tensor,
    scale: float = 1.0,
) -> dict[str, SampleGrads]:
    """``scale``: the factor δ = scale · ``grad_output`` (1/w of a uniform loss weight w:
    one multiplication instead of the division of the output gradient by w_n per sample)."""
    return _linear_grads(module, args, kwargs, grad_output, scale, transposed=False)


@register_rule_for_class_named("transformers.pytorch_utils.Conv1D")
def transposed_linear_rule(
    module: nn.Module, args: tuple, kwargs: dict, output: Tensor, grad_output: Tensor,
    scale: float = 1.0,
) -> dict[str, SampleGrads]:
    """y = x W + b with W [in, out] (GPT-2's ``Conv1D``); ``scale`` as for Linear."""
    return _linear_grads(module, args, kwargs, grad_output, scale, transposed=True)


def _linear_grads(module: nn.Module, args: tuple, kwargs: dict, grad_output: Tensor,
                  scale: float, transposed: bool) -> dict[str, SampleGrads]:
    """The weight's factors δ, a (a, δ where ``transposed``: W [in, out]) and the bias's δ,
    each summed over the dimensions between batch and features."""
    a = args[0] if args else kwargs["x" if transposed else "input"]
    n = a.shape[0]
    # the input and output gradient arrive as the layer computed them (bfloat16 or float16
    # under autocast; see widens_when_read): the gradients are formed in at least float32,
    # from factors widened here, or when read (sequences)
    wide = (promote(promote(grad_output.dtype, a.dtype), torch.float32)
            if grad_output.is_floating_point() else None)
    grads: dict[str, SampleGrads] = {}
    weight, bias = module.weight, getattr(module, "bias", None)
    if a.dim() == 1:
        raise ValueError(
            f"{type(module).__name__} received an input without batch dimension "
            f"(shape {tuple(a.shape)}); Cockpit needs inputs of shape [batch, ..., features]."
        )
    if a.dim() == 2:
        delta = grad_output if wide is None else in_dtype(grad_output, wide)
        a = a if wide is None else in_dtype(a, wide)
        delta = delta * scale if scale != 1.0 else delta
        delta_norms = RowNorms(delta)  # ‖δ_n‖: weight and bias
        if weight.requires_grad:
            grads["weight"] = (OuterSampleGrads(outside_autograd(a), delta) if transposed
                               else OuterSampleGrads(delta, outside_autograd(a), delta_norms))
        if bias is not None and bias.requires_grad:
            grads["bias"] = DenseSampleGrads(delta, None if transposed else delta_norms)
        return grads
    a_seq = outside_autograd(a)  # [N, T, ·] (other dims between batch and features: one T)
    a_seq = a_seq if a_seq.dim() == 3 else a_seq.reshape(n, -1, a.shape[-1])
    delta_seq = (grad_output if grad_output.dim() == 3
                 else grad_output.reshape(n, -1, grad_output.shape[-1]))
    # g_n = Σ_t (c·δ_{n,t}) a_{n,t}ᵀ = Σ_t δ_{n,t} (c·a_{n,t})ᵀ: the factor c goes into the
    # smaller of the two (GPT-2's output layer: the input, 768 wide, not δ, 50257 wide: no
    # 412 MB copy of δ at the start of the backward pass, where the activations peak), when
    # it is read (a stack of layers multiplies once for all of them)
    into_input = a_seq.numel() < delta_seq.numel()
    if weight.requires_grad:  # (δ widened when read: a tied layer's waits at its width)
        grads["weight"] = (
            SequenceOuterSampleGrads(a_seq, delta_seq, wide, scale, 0 if into_input else 1)
            if transposed else
            SequenceOuterSampleGrads(delta_seq, a_seq, wide, scale, 1 if into_input else 0))
    if bias is not None and bias.requires_grad:
        grads["bias"] = DenseSampleGrads(delta_seq.sum(1, dtype=wide), scale=scale)
    return grads



linear_rule.takes_scale = True  # type: ignore[attr-defined]
transposed_linear_rule.takes_scale = True  # type: ignore[attr-defined]
# the input and output gradient as the layer computed them (the rule widens them)
linear_rule.widens_when_read = True  # type: ignore[attr-defined]
transposed_linear_rule.widens_when_read = True  # type: ignore[attr-defined]
