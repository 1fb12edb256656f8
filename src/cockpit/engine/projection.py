"""Projections of individual gradients onto a direction known only after the backward pass.

For one call y = m(x; θ) with individual output gradients δ_n, and a direction u in
parameter space,

    g_nᵀ u = δ_nᵀ (∂y_n/∂θ) u,

a Jacobian-vector product of the layer at its stored input: one forward-mode evaluation
(``torch.func.jvp`` of the module under ``functional_call``) for the whole batch, followed by
a per-sample inner product with δ_n. Summed over calls and layers this gives s_tᵀ g_n for
the update s_t of any optimizer, with memory of one forward pass's inputs and output
gradients, never |B|×D.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import functional_call, jvp

from cockpit.engine.rules.fallback import batch_dim_of


def project_call(call, directions: dict[str, Tensor], param_names: dict[str, str]) -> Tensor:
    """g_nᵀu restricted to one call's parameters; ``param_names`` maps the unit's attribute
    names to global parameter names (keys of ``directions``)."""
    unit = call.unit
    module = unit.module
    attrs = [a for a in unit.params if param_names[a] in directions]
    primals = {a: unit.params[a].detach() for a in attrs}
    tangents = {a: directions[param_names[a]].to(primals[a].dtype) for a in attrs}
    args = tuple(v.detach() if isinstance(v, Tensor) else v for v in call.args)
    kwargs = {k: v.detach() if isinstance(v, Tensor) else v for k, v in call.kwargs.items()}
    num_outputs = len(call.grads)

    def forward(params):
        result = functional_call(module, params, args, kwargs)
        flat = result if isinstance(result, tuple | list) else (result,)
        tensors = [t for t in flat if isinstance(t, Tensor) and t.is_floating_point()]
        return tuple(tensors[:num_outputs])

    _, out_tangents = jvp(forward, (primals,), (tangents,))
    bd = batch_dim_of(module)
    total = None
    for delta, t in zip(call.grads, out_tangents, strict=True):
        prod = (delta * t).movedim(bd, 0)
        dots = prod.reshape(prod.shape[0], -1).sum(1)
        total = dots if total is None else total + dots
    assert total is not None
    return total


def project_calls(tracker, calls, directions: dict[str, Tensor]) -> Tensor:
    """Σ over calls of :func:`project_call` (the full g_nᵀu over all parameters)."""
    total = None
    tracker._suspended = True
    try:
        with torch.enable_grad():
            for call in calls:
                names = {a: tracker.unit_param_name(call.unit, a) for a in call.unit.params}
                if not any(n in directions for n in names.values()):
                    continue
                dots = project_call(call, directions, names)
                total = dots if total is None else total + dots
    finally:
        tracker._suspended = False
    if total is None:
        raise ValueError("no layer with parameters was recorded at this step")
    return total
