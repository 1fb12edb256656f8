"""Hutchinson estimators of the Hessian diagonal and trace (paper B.8, B.9).

For v with i.i.d. Rademacher entries (±1 with probability ½), E[v vᵀ] = I, hence

    diag(H) = E[v ⊙ H v],        Tr(H) = E[vᵀ H v] = Σ_j E[v ⊙ H v]_j.

Both are estimated by the average over ``num_samples`` independent draws. They need only
Hessian-vector products, so they work for any model and loss (the fallback when no
Gauss-Newton factorization of the loss is available).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from cockpit.engine.histograms.device import device_path

__all__ = ["hutchinson_diagonal", "hutchinson_replicates", "hutchinson_trace", "rademacher_blocks",
           "rademacher_like"]

BlockHVP = Callable[[list[Tensor]], list[Tensor]]


def rademacher_like(tensor: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Tensor of i.i.d. ±1 entries with the shape, dtype and device of ``tensor``."""
    gen_device = tensor.device if generator is None else generator.device
    bits = torch.randint(0, 2, tensor.shape, generator=generator, device=gen_device)
    return (2 * bits - 1).to(dtype=tensor.dtype, device=tensor.device)


def rademacher_blocks(params: Sequence[Tensor], num_samples: int,
                      generator: torch.Generator | None = None) -> list[Tensor]:
    """``num_samples`` Rademacher vectors over all ``params`` as one [M, *p.shape] tensor
    per parameter (views of one draw: a few ops, not four per parameter and vector). The
    entries are drawn vector by vector, each in parameter order: from a CPU generator the
    same numbers as M × P calls of :func:`rademacher_like` in that order."""
    first = params[0]
    gen_device = first.device if generator is None else generator.device
    sizes = [p.numel() for p in params]
    bits = torch.randint(0, 2, (num_samples, sum(sizes)), generator=generator,
                         device=gen_device)
    signs = 2 * bits - 1
    if all(p.dtype == first.dtype and p.device == first.device for p in params):
        signs = signs.to(dtype=first.dtype, device=first.device)  # (one cast for all)
    parts = signs.split(sizes, dim=1) if len(params) > 1 else (signs,)
    return [part.to(dtype=p.dtype, device=p.device).view(num_samples, *p.shape)
            for part, p in zip(parts, params, strict=True)]


def hutchinson_diagonal(
    hvp: BlockHVP,
    params: Sequence[Tensor],
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    batched: bool | None = None,
) -> list[Tensor]:
    """Estimate diag(H) = E[v ⊙ H v] blockwise, averaging ``num_samples`` Rademacher draws.

    Args:
        hvp: Blockwise Hessian-vector product, e.g. a ``HessianVectorProduct``.
        params: Tensors giving shape, dtype and device of each block.
        num_samples: Number of Hessian-vector products spent.
        generator: Random generator for the Rademacher vectors.
        batched: Spend the products in one vmap'd backward pass (``hvp.batched``) instead
            of one pass each; None: on CUDA only (and on the CPU where it stands in for an
            accelerator, :func:`cockpit.engine.histograms.device.device_path`; on a CPU the
            loop is as fast). Where the graph has an operator without a batching rule, the
            loop runs. From a CPU generator the same draws, the same result either way.

    Returns:
        One tensor per parameter, shaped like it.
    """
    if num_samples < 1:
        raise ValueError("num_samples must be at least 1.")
    params = list(params)
    if _use_batched(params, batched) and num_samples > 1:
        draws = rademacher_blocks(params, num_samples, generator)
        products = _batched_products(hvp, draws)
        if products is not None:
            return [block.mean(0) for block in products]
        return _mean_of_loop(hvp, _by_draw(draws))
    return _mean_of_loop(hvp, ([block[0] for block in rademacher_blocks(params, 1, generator)]
                               for _ in range(num_samples)))


def _mean_of_loop(hvp: BlockHVP, draws) -> list[Tensor]:
    """(1/M) Σ_m v_m ⊙ H v_m, one product at a time."""
    estimate, count = None, 0
    for v in draws:
        products = [vi * hvi for vi, hvi in zip(v, hvp(v), strict=True)]
        estimate = products if estimate is None else torch._foreach_add(estimate, products)
        count += 1
    assert estimate is not None
    return torch._foreach_div(estimate, float(count))


def _use_batched(params: list[Tensor], batched: bool | None) -> bool:
    if batched is not None:
        return batched
    return params[0].device.type == "cuda" or device_path(params[0].device)


def _batched_products(hvp: BlockHVP, draws: list[Tensor]) -> list[Tensor] | None:
    """v_m ⊙ H v_m of every draw, [M, *shape] per block, by one batched product; None where
    the operator has none or the graph an operator without a batching rule."""
    if not hasattr(hvp, "batched"):
        return None
    try:
        products = hvp.batched(draws)
    except RuntimeError:  # an operator without a batching rule for double backward
        return None
    return list(torch._foreach_mul(draws, products))


def _by_draw(blocks: list[Tensor]) -> list[list[Tensor]]:
    """[M, *shape] per block as M lists of one tensor per block (views)."""
    return [list(draw) for draw in zip(*(block.unbind(0) for block in blocks), strict=True)]


def hutchinson_replicates(
    hvp: BlockHVP,
    params: Sequence[Tensor],
    num_samples: int,
    generator: torch.Generator | None = None,
    batched: bool | None = None,
) -> list[list[Tensor]]:
    """The ``num_samples`` independent unbiased estimates v_m ⊙ H v_m of diag(H) (blockwise),
    in the order of the draws; their mean is :func:`hutchinson_diagonal`'s estimate.
    ``batched`` as there."""
    if num_samples < 1:
        raise ValueError("num_samples must be at least 1.")
    params = list(params)
    draws = rademacher_blocks(params, num_samples, generator)
    if _use_batched(params, batched) and num_samples > 1:
        products = _batched_products(hvp, draws)
        if products is not None:
            return _by_draw(products)
    return [[vi * hvi for vi, hvi in zip(v, hvp(v), strict=True)] for v in _by_draw(draws)]


def hutchinson_trace(
    hvp: BlockHVP,
    params: Sequence[Tensor],
    num_samples: int = 1,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Estimate Tr(H) = E[vᵀ H v] (0-dim tensor), averaging ``num_samples`` draws."""
    diagonal = hutchinson_diagonal(hvp, params, num_samples, generator)
    return sum((d.sum() for d in diagonal[1:]), diagonal[0].sum())
