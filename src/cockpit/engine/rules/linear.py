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
    if scale != 1.0:
        grad_output = grad_output * scale
    n = a.shape[0]
    grads: dict[str, SampleGrads] = {}
    if a.dim() == 1:
        raise ValueError(
            f"{type(module).__name__} received an input without batch dimension "
            f"(shape {tuple(a.shape)}); Cockpit needs inputs of shape [batch, ..., features]."
        )
    if a.dim() == 2:
        delta = grad_output
        if module.weight.requires_grad:
            grads["weight"] = OuterSampleGrads(delta, _detached(a))
        if module.bias is not None and module.bias.requires_grad:
            grads["bias"] = DenseSampleGrads(delta)
        return grads
    a_seq = _detached(a).reshape(n, -1, a.shape[-1])
    delta_seq = grad_output.reshape(n, -1, grad_output.shape[-1])
    if module.weight.requires_grad:
        grads["weight"] = SequenceOuterSampleGrads(delta_seq, a_seq)
    if module.bias is not None and module.bias.requires_grad:
        grads["bias"] = DenseSampleGrads(delta_seq.sum(1))
    return grads


def _detached(a: Tensor) -> Tensor:
    """``a`` outside autograd (an input outside it already, e.g. a copy, needs no op)."""
    return a.detach() if a.requires_grad else a


linear_rule.takes_scale = True  # type: ignore[attr-defined]
