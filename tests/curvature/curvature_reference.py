"""Brute-force curvature references for tests (float64, torch.func). Not for production use.

* :func:`dense_hessian` — the full D×D Hessian of a loss given as a function of the
  parameter list, by ``torch.func.hessian`` on the flattened parameter vector.
* :func:`diag_ggn_reference` — diag of the GGN of the mean loss,
  G = (1/N) Σ_n J_nᵀ (∂²ℓ_n/∂f_n²) J_n, from per-sample Jacobians (``vmap(jacrev)``) and
  the output Hessian of the per-sample loss computed by ``torch.func.hessian``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev, vmap


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(vector: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    sizes = [t.numel() for t in like]
    return [c.reshape(t.shape) for c, t in zip(vector.split(sizes), like, strict=True)]


def dense_hessian(model_fn: Callable[[list[Tensor]], Tensor], params: Sequence[Tensor]) -> Tensor:
    """Dense Hessian [D, D] (float64) of the scalar ``model_fn(params)``."""
    params = [p.detach().to(torch.float64) for p in params]

    def loss_of_flat(flat: Tensor) -> Tensor:
        return model_fn(unflatten(flat, params))

    return hessian(loss_of_flat)(flatten(params))


def per_sample_loss(output: Tensor, target: Tensor, kind: str, mse_reduction: str = "mean"):
    """ℓ_n per sample, written independently of cockpit.curvature."""
    if kind == "cross_entropy":
        return F.cross_entropy(output, target, reduction="none")
    squared = ((output - target) ** 2).reshape(output.shape[0], -1)
    return squared.mean(1) if mse_reduction == "mean" else squared.sum(1)


def functional_loss(
    model: nn.Module, x: Tensor, y: Tensor, kind: str, mse_reduction: str = "mean"
) -> Callable[[list[Tensor]], Tensor]:
    """params ↦ mean_n ℓ_n(f(params, x_n), y_n) for the trainable parameters of ``model``."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def loss_fn(params: list[Tensor]) -> Tensor:
        out = functional_call(model, dict(zip(names, params, strict=True)), (x,))
        return per_sample_loss(out, y, kind, mse_reduction).mean()

    return loss_fn


def diag_ggn_reference(
    model: nn.Module, x: Tensor, kind: str, mse_reduction: str = "mean"
) -> list[Tensor]:
    """diag(G) of the mean loss, one float64 tensor per trainable parameter.

    The output Hessians of cross-entropy and MSE do not depend on the labels, so no
    labels are needed (dummy labels are used internally).
    """
    model = copy.deepcopy(model).to(torch.float64)
    x = x.to(torch.float64)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def f_single(prm: dict[str, Tensor], x_n: Tensor) -> Tensor:
        return functional_call(model, prm, (x_n.unsqueeze(0),)).squeeze(0)

    outputs = functional_call(model, params, (x,)).detach()
    jacobians = vmap(jacrev(f_single), in_dims=(None, 0))(params, x)  # [N, C, *p.shape]

    def loss_of_output(f_n: Tensor) -> Tensor:
        if kind == "cross_entropy":
            target = torch.zeros(1, dtype=torch.long, device=f_n.device)
        else:
            target = torch.zeros_like(f_n).unsqueeze(0)
        return per_sample_loss(f_n.unsqueeze(0), target, kind, mse_reduction)[0]

    out_hessians = vmap(hessian(loss_of_output))(outputs)  # [N, C, C]
    N, C = outputs.shape[0], outputs[0].numel()
    result = []
    for name in names:
        J = jacobians[name].reshape(N, C, -1)  # [N, C, D_p]
        HJ = torch.einsum("ncd,ndj->ncj", out_hessians.reshape(N, C, C), J)
        diag = torch.einsum("ncj,ncj->j", J, HJ) / N
        result.append(diag.reshape(params[name].shape))
    return result


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny float64 problems run much faster on one thread on a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
