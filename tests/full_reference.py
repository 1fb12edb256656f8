"""Every instrument of ``configuration("full")`` against float64 brute force, for models
given as ``loss_of(model, x, y) -> losses [N]``: individual gradients by one backward pass
per sample, histograms by materializing, Alpha by the independent fit of test_alpha, and
curvature from the dense Hessian (HVP columns)."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from cockpit import Cockpit, configuration
from tests.quantities.test_alpha import reference_alpha
from tests.reference import bin_indices, gradient_tests, per_sample_backward, rel_close

LR = 0.05


def dense_hessian(model: nn.Module, loss) -> torch.Tensor:
    """∇²L of the mean loss ``loss()`` w.r.t. all trainable parameters, column by column."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss(), params, create_graph=True)
    g = torch.cat([t.reshape(-1) for t in grads])
    eye = torch.eye(g.numel(), dtype=g.dtype)
    try:  # all HVP columns in one vectorized backward pass
        columns = torch.autograd.grad(g, params, eye, is_grads_batched=True, allow_unused=True)
    except RuntimeError:  # an operator without a batching rule: column by column
        columns = [torch.stack(c) for c in zip(*(
            torch.autograd.grad(g, params, e, retain_graph=True, allow_unused=True)
            for e in eye), strict=True)]
    return torch.cat([(c if c is not None else torch.zeros(g.numel(), *p.shape, dtype=g.dtype))
                      .reshape(g.numel(), -1) for c, p in zip(columns, params, strict=True)],
                     dim=1).detach()


def bin_index(values: torch.Tensor, edges) -> torch.Tensor:
    edges = torch.as_tensor(edges, dtype=torch.float64)
    return bin_indices(values, edges[0].item(), edges[-1].item(), edges.numel() - 1)


def run_full(model: nn.Module, loss_of, batches: list, context=None) -> tuple[dict, list, list]:
    """Two SGD steps with ``configuration("full")``; returns step 0's values, the parameter
    snapshots θ_0, θ_1 and the instruments."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    instruments = configuration("full")
    cockpit = Cockpit(model, instruments, optimizer=opt)
    thetas = []
    for step, (x, y) in enumerate(batches):
        thetas.append(copy.deepcopy(model.state_dict()))
        opt.zero_grad()
        losses = loss_of(model, x, y)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    thetas.append(copy.deepcopy(model.state_dict()))
    cockpit.close()
    return cockpit.get_output()[0], thetas, instruments, cockpit.get_notes().get(0, {})


def ggn_diagonal(model: nn.Module, logits_of, x) -> torch.Tensor:
    """diag of (1/N) Σ_n J_nᵀ (diag(p_n) − p_n p_nᵀ) J_n for cross-entropy on logits [N, C],
    with the Jacobians J_n row by row."""
    params = [p for p in model.parameters() if p.requires_grad]
    logits = logits_of(model, x)
    n, c = logits.shape
    total = 0
    for i in range(n):
        rows = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            logits[i, k], params, retain_graph=True)]) for k in range(c)])  # [C, P]
        p = torch.softmax(logits[i].detach(), 0)
        hess = torch.diag(p) - torch.outer(p, p)
        total = total + torch.einsum("cp,cd,dp->p", rows, hess, rows)
    return total / n


def check_full(model: nn.Module, loss_of, batches: list, rtol: float = 1e-7,
               logits_of=None, ggn_loss: bool = True) -> dict:
    """Run :func:`run_full` and compare every value of step 0 with the references.
    ``logits_of(model, x)``: the logits of a cross-entropy loss, for the GGN reference;
    ``ggn_loss=False``: the losses are not cross-entropy (or squared error) of the model's
    whole output (e.g. a language model's shifted token losses): the GGN does not apply."""
    reference_model = copy.deepcopy(model)
    out, thetas, instruments, notes = run_full(model, loss_of, batches)
    names = [k for k, p in reference_model.named_parameters() if p.requires_grad]
    params = dict(reference_model.named_parameters())

    def ends(k: int):
        reference_model.load_state_dict(thetas[k])
        x, y = batches[k]
        G = per_sample_backward(reference_model, x, y,
                                loss_of=lambda xn, yn: loss_of(reference_model, xn, yn))
        losses = loss_of(reference_model, x, y).detach().double()
        return losses, G

    losses0, G = ends(0)
    losses1, G1 = ends(1)
    reference_model.load_state_dict(thetas[0])
    g = G.mean(0)
    assert rel_close(out["Loss"], losses0.mean().item(), rtol)
    assert rel_close(out["GradNorm"], g.norm().item(), rtol)
    for test, value in gradient_tests(G).items():
        assert rel_close(out[test], value, rtol), (test, out[test], value, notes)
    assert out["Distance"] == 0.0
    assert rel_close(out["UpdateSize"], LR * g.norm().item(), rtol)
    s = torch.cat([(thetas[1][k] - thetas[0][k]).flatten().double() for k in names])
    alpha = reference_alpha(losses0, G, losses1, G1, s)
    assert math.isclose(out["Alpha"], alpha, rel_tol=1e-6, abs_tol=1e-6), (out["Alpha"], alpha)

    hist = out["GradHist1d"]
    counts = torch.bincount(bin_index(G, hist["edges"]).reshape(-1),
                            minlength=len(hist["edges"]) - 1)
    assert (torch.as_tensor(hist["counts"]) == counts).all()
    hist2 = out["GradHist2d"]
    theta = torch.cat([params[k].detach().reshape(-1) for k in names])
    gi = bin_index(G, hist2["edges_grad"])
    ti = bin_index(theta, hist2["edges_param"]).expand_as(gi)
    kt = len(hist2["edges_param"]) - 1
    counts2 = torch.bincount((gi * kt + ti).reshape(-1),
                             minlength=(len(hist2["edges_grad"]) - 1) * kt).reshape(-1, kt)
    assert (torch.as_tensor(hist2["counts"]) == counts2).all()

    x, y = batches[0]
    H = dense_hessian(reference_model, lambda: loss_of(reference_model, x, y).mean())
    H = (H + H.T) / 2
    assert rel_close(out["HessMaxEV"], torch.linalg.eigvalsh(H)[-1].item(), 3e-2)
    trace = torch.diagonal(H).sum().item()
    by_name = {q.name: q for q in instruments}
    n = G.shape[0]

    def exact_diagonal(method: str) -> torch.Tensor:
        return (torch.diagonal(H) if method == "diag_hessian"
                else ggn_diagonal(reference_model, logits_of, x))

    method = getattr(by_name["HessTrace"], "method_used", None)
    if method in ("diag_hessian", "diag_ggn_exact"):
        assert rel_close(out["HessTrace"], exact_diagonal(method).sum().item(), 1e-6)
    else:  # Hutchinson with Rademacher probes: Var(vᵀHv) = 2(‖H‖_F² − Σ_i H_ii²)
        assert method == "hutchinson", method
        samples = getattr(by_name["HessTrace"], "mc_samples", 1)
        sigma = math.sqrt(2 * (H.pow(2).sum() - torch.diagonal(H).pow(2).sum()).item() / samples)
        assert abs(out["HessTrace"] - trace) <= 6 * sigma, (out["HessTrace"], trace, sigma)
    # TICDiag falls back to the GGN diagonal, not to Hutchinson (curvature_base)
    method = getattr(by_name["TICDiag"], "method_used", None)
    if method in ("diag_hessian", "diag_ggn_exact"):
        diag = exact_diagonal(method)
        tic = (G.pow(2).sum(0) / (diag.clamp(min=0) + 1e-7)).sum().item() / n
        assert rel_close(out["TICDiag"], tic, 1e-6)
    elif ggn_loss:
        assert method == "hutchinson", method
        assert out["TICDiag"] is not None and math.isfinite(out["TICDiag"])
    else:  # the GGN needs cross-entropy or squared error on the model's whole output
        assert out["TICDiag"] is None, out["TICDiag"]
        assert "not recognized" in notes["TICDiag"], notes.get("TICDiag")
        assert "curvature='hutchinson'" in notes["TICDiag"], notes["TICDiag"]
    return out
