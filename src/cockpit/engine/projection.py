"""Projections of individual gradients onto a direction known only after the backward pass.

For one recorded call y = m(x; θ) with individual output gradients δ_n and a direction u in
parameter space, g_nᵀu = δ_nᵀ (∂y_n/∂θ) u. The layer's rule evaluates it from the kept
input and output gradient (closed forms where the layer allows, e.g. δ_nᵀ U a_n for a Linear
layer; otherwise the layer's own individual gradients, one layer at a time). Summed over
calls and layers this gives s_tᵀ g_n for the update s_t of any optimizer, holding about one
forward pass's inputs and output gradients, never all |B|×D individual gradients at once.
"""

from __future__ import annotations

from torch import Tensor


def project_calls(tracker, calls, directions: dict[str, Tensor]) -> Tensor:
    """Σ over kept calls and their parameters of g_nᵀu (shape [N])."""
    total = None
    with tracker.suspended():
        for call in calls:
            for name, sg in tracker._rule(call, call.grads).items():
                if name not in directions:
                    continue
                dots = sg.dots(directions[name])
                total = dots if total is None else total + dots
    if total is None:
        raise ValueError("no layer with parameters was recorded at this step")
    return total

