"""Linear layers: g_n(W) = Σ_t δ_{n,t} a_{n,t}ᵀ and g_n(b) = Σ_t δ_{n,t}.

Inputs may carry any number of dimensions between the batch and the feature dimension
(sequences, image rows, …); they are summed over, as the weight is shared across them.
"""

from __future__ import annotations

from torch import Tensor, nn

from cockpit.engine.rules.registry import register_rule
from cockpit.engine.rules.sample_grads import (
    DenseSampleGrads,
    OuterSampleGrads,
    SampleGrads,
    SequenceOuterSampleGrads,
)


@register_rule(nn.Linear)
def linear_rule(
    module: nn.Linear, args: tuple, kwargs: dict, output: Tensor, grad_output: Tensor,
    scale: float = 1.0,
) -> dict[str, SampleGrads]:
    """``scale``: the factor δ = scale · ``grad_output`` (1/w of a uniform loss weight w:
    one multiplication instead of the division of the output gradient by w_n per sample)."""
    a = args[0] if args else kwargs["input"]
    n = a.shape[0]
    grads: dict[str, SampleGrads] = {}
    if a.dim() == 1:
        raise ValueError(
            f"{type(module).__name__} received an input without batch dimension "
            f"(shape {tuple(a.shape)}); Cockpit needs inputs of shape [batch, ..., features]."
        )
    if a.dim() == 2:
        delta = grad_output * scale if scale != 1.0 else grad_output
        if module.weight.requires_grad:
            grads["weight"] = OuterSampleGrads(delta, a.detach())
        if module.bias is not None and module.bias.requires_grad:
            grads["bias"] = DenseSampleGrads(delta)
        return grads
    a_seq = a.detach().reshape(n, -1, a.shape[-1])
    delta_seq = grad_output.reshape(n, -1, grad_output.shape[-1])
    # g_n = Σ_t (c·δ_{n,t}) a_{n,t}ᵀ = Σ_t δ_{n,t} (c·a_{n,t})ᵀ: the factor c goes into the
    # smaller of the two (GPT-2's output layer: the input, 768 wide, not δ, 50257 wide: no
    # 412 MB copy of δ at the start of the backward pass, where the activations peak)
    scale_input = scale != 1.0 and a_seq.numel() < delta_seq.numel()
    if scale != 1.0 and not scale_input:
        delta_seq = delta_seq * scale
    if module.weight.requires_grad:
        grads["weight"] = SequenceOuterSampleGrads(
            delta_seq, a_seq * scale if scale_input else a_seq)
    if module.bias is not None and module.bias.requires_grad:
        bias = delta_seq.sum(1)
        grads["bias"] = DenseSampleGrads(bias * scale if scale_input else bias)
    return grads


linear_rule.takes_scale = True  # type: ignore[attr-defined]
