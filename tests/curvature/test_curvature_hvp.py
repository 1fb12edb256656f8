"""HessianVectorProduct against dense float64 Hessians; no side effects on the user's backward."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from curvature_reference import (
    dense_hessian,
    flatten,
    functional_loss,
    single_thread,  # noqa: F401  (autouse fixture)
)
from torch import nn

from cockpit.curvature import HessianVectorProduct, flatten_tensors, unflatten_like


def make_problem(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(4, 5), nn.Sigmoid(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)
    )
    model = model.to(dtype)
    x = torch.randn(6, 4, dtype=dtype)
    y = torch.randint(0, 3, (6,))
    return model, x, y


def test_hvp_matches_dense_hessian():
    model, x, y = make_problem()
    params = list(model.parameters())
    H = dense_hessian(functional_loss(model, x, y, "cross_entropy"), params)
    losses = F.cross_entropy(model(x), y, reduction="none")
    hvp = HessianVectorProduct(losses.mean(), params)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        v = torch.randn(hvp.dim, generator=gen, dtype=torch.float64)
        expected = H @ v
        assert (hvp.matvec(v) - expected).abs().max() < 1e-10
        blocks = hvp(unflatten_like(v, params))
        assert [b.shape for b in blocks] == [p.shape for p in params]
        assert (flatten(blocks) - expected).abs().max() < 1e-10
    assert hvp.num_calls == 6
    hvp.release()


def _grads_after_backward(use_hvp: bool) -> list[torch.Tensor]:
    model, x, y = make_problem(dtype=torch.float32, seed=3)
    params = list(model.parameters())
    losses = F.cross_entropy(model(x), y, reduction="none")
    if use_hvp:
        with HessianVectorProduct(losses.mean(), params) as hvp:
            for _ in range(4):
                hvp.matvec(torch.randn(hvp.dim))
            assert all(p.grad is None for p in params)  # .grad untouched
    losses.mean().backward()
    return [p.grad.clone() for p in params]


def test_user_backward_bit_identical_and_no_warning():
    reference = _grads_after_backward(use_hvp=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = _grads_after_backward(use_hvp=True)
    assert not [w for w in caught if "create_graph" in str(w.message)]
    assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))


def test_release_frees_double_backward_graph():
    model, x, y = make_problem()
    losses = F.cross_entropy(model(x), y, reduction="none")
    hvp = HessianVectorProduct(losses.mean(), list(model.parameters()))
    grad_refs = [weakref.ref(g) for g in hvp._grads if g is not None]
    hvp.matvec(torch.ones(hvp.dim, dtype=torch.float64))
    hvp.release()
    gc.collect()
    assert all(ref() is None for ref in grad_refs)
    with pytest.raises(RuntimeError, match="released"):
        hvp.matvec(torch.ones(hvp.dim, dtype=torch.float64))
    losses.mean().backward()  # the forward graph is still usable


def test_unused_linear_and_frozen_parameters():
    torch.manual_seed(0)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    linear_only = torch.randn(3, dtype=torch.float64, requires_grad=True)
    unused = torch.randn(2, dtype=torch.float64, requires_grad=True)
    frozen = torch.randn(3, dtype=torch.float64)  # requires_grad=False
    x = torch.randn(3, dtype=torch.float64)

    def loss_fn(ps):
        w_, lin_, _ = ps
        return (torch.sin(w_ * x) ** 2).sum() + (lin_ * x).sum() + (frozen * w_).sum()

    params = [w, linear_only, unused]
    H = dense_hessian(loss_fn, params)
    hvp = HessianVectorProduct(loss_fn(params), params)
    v = torch.randn(hvp.dim, dtype=torch.float64)
    hv = hvp(unflatten_like(v, params))
    assert torch.equal(hv[1], torch.zeros(3, dtype=torch.float64))
    assert torch.equal(hv[2], torch.zeros(2, dtype=torch.float64))
    assert (flatten_tensors(hv) - H @ v).abs().max() < 1e-12

    with pytest.raises(ValueError, match="requires_grad=False"):
        HessianVectorProduct(loss_fn(params), [w, frozen])
    # A loss linear in all parameters has a zero Hessian, not an error.
    linear = HessianVectorProduct((linear_only * x).sum(), [linear_only, unused])
    assert all(torch.equal(b, torch.zeros_like(b)) for b in linear([x, torch.ones(2)]))


def test_rejects_non_scalar_loss():
    model, x, y = make_problem()
    losses = F.cross_entropy(model(x), y, reduction="none")
    with pytest.raises(ValueError, match="scalar"):
        HessianVectorProduct(losses, list(model.parameters()))


@pytest.mark.parametrize("case", ["plain", "scalar", "empty", "mixed_dtype", "in_graph"])
def test_flatten_tensors_is_cat_of_the_flattened_tensors(case):
    """The one-op path (transposed, 3-d and 1-d tensors) and every case it leaves to cat
    give the row-major concatenation; unflatten_like inverts it."""
    torch.manual_seed(0)
    tensors = [torch.randn(3, 4).T, torch.randn(2, 2, 2), torch.randn(5)]
    if case == "scalar":
        tensors.append(torch.tensor(2.0))
    elif case == "empty":
        tensors.append(torch.zeros(0, 3))
    elif case == "mixed_dtype":
        tensors.append(torch.randn(2, dtype=torch.float64))
    elif case == "in_graph":
        tensors[0] = tensors[0].clone().requires_grad_()
    flat = flatten_tensors(tensors)
    expected = torch.cat([torch.tensor(t.tolist(), dtype=flat.dtype).reshape(-1)
                          for t in tensors])
    assert flat.shape == (sum(t.numel() for t in tensors),)
    assert torch.equal(flat.detach(), expected)
    assert flat.requires_grad == (case == "in_graph")
    for block, t in zip(unflatten_like(flat, tensors), tensors, strict=True):
        assert torch.equal(block.detach(), t.detach().to(flat.dtype))


@pytest.mark.skipif(not hasattr(torch, "_chunk_cat"), reason="this torch has no _chunk_cat")
def test_flatten_tensors_is_one_copy():
    """Parameter-shaped blocks (a transposed one among them, where this torch's
    ``_chunk_cat`` takes strided inputs) are flattened by one copy and one view, not a view
    or copy per block (on an accelerator each op is a launch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cockpit.engine.chunk_cat import _takes_strided_inputs

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    tensors = [torch.randn(3, 4).T if _takes_strided_inputs() else torch.randn(4, 3),
               torch.randn(4), torch.randn(2, 3, 3, 3), torch.randn(2)]
    with Count() as count:
        flatten_tensors(tensors)
    assert count.ops == ["_chunk_cat", "view"]
