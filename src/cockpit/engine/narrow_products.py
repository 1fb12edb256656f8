r"""Batched products of half-precision factors, summed in float32 on tensor cores.

Under autocast a Linear layer computes in bfloat16 or float16, so its individual gradients

    g_n = c · Σ_t δ_{n,t} a_{n,t}ᵀ

come from half-precision factors δ, a (c: the loss weight's scale held apart). Each product
of two such numbers is exact in float32 (8 + 8 or 11 + 11 significant bits, float32 has 24),
so G in float32 needs only its sums in float32: a half-precision batched GEMM with a float32
result (``torch.bmm(x, y, out_dtype=torch.float32)``, ``baddbmm`` with c as its α) does
that on a GPU's tensor cores, at many times the float32 rate (an H200: ≈ 990 against
≈ 67 TFLOP/s dense) and without widened copies of the factors. Where the op is missing (a
CPU, torch before 2.8) the caller widens the factors and multiplies in float32, as before:
the same values up to the order of the float32 additions and where c is multiplied in.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

NARROW = (torch.bfloat16, torch.float16)
"""The dtypes whose products are exact in float32."""


def available(x: Tensor, y: Tensor, wide: torch.dtype | None) -> bool:
    """Whether :func:`wide_products` forms the products of ``x`` and ``y`` in ``wide``: both
    of one half-precision dtype, ``wide`` float32, and a device whose torch has the op."""
    return (wide is torch.float32 and x.dtype is y.dtype and x.dtype in NARROW
            and _runs(x.device.type)[0])


def wide_products(x: Tensor, y: Tensor, alpha: float = 1.0) -> Tensor:
    """α · x y, [B, M, K] × [B, K, N] → [B, M, N] in float32, from half-precision ``x`` and
    ``y`` of one dtype, summed in float32 (:func:`available` says where it runs); α in the
    product's epilogue where the device's op takes it, else one multiplication after it."""
    if alpha == 1.0:
        return _bmm(x, y)
    if _runs(x.device.type)[1]:
        return _baddbmm(x, y, alpha)
    return _bmm(x, y).mul_(alpha)


def _bmm(x: Tensor, y: Tensor) -> Tensor:
    return torch.bmm(x, y, out_dtype=torch.float32)  # type: ignore[call-arg]


def _baddbmm(x: Tensor, y: Tensor, alpha: float) -> Tensor:
    # β = 0: the added tensor is not read (a zero that broadcasts, made once per device)
    return torch.baddbmm(_zero(x.device), x, y, out_dtype=torch.float32,  # type: ignore[call-arg]
                         beta=0, alpha=alpha)


@functools.lru_cache(maxsize=8)
def _zero(device: torch.device) -> Tensor:
    return torch.zeros((), dtype=torch.float32, device=device)


@functools.cache
def _runs(device_type: str) -> tuple[bool, bool]:
    """(whether half-precision products with a float32 result run on this device type,
    whether α goes into their epilogue), probed once on numbers whose exact result is known
    (2^-9 is below bfloat16's and float16's resolution of 1: it survives only in float32)."""
    if device_type == "cpu":  # (no CPU kernel in any torch so far: skip the probe's error)
        return False, False
    try:
        x = torch.tensor([[[1.0, 2.0 ** -9]]], dtype=torch.bfloat16, device=device_type)
        y = torch.tensor([[[1.0], [1.0]]], dtype=torch.bfloat16, device=device_type)
        product = _bmm(x, y)
        if product.dtype != torch.float32 or float(product) != 1.0 + 2.0 ** -9:
            return False, False
    except (TypeError, RuntimeError, NotImplementedError):
        return False, False
    try:
        takes_alpha = float(_baddbmm(x, y, 3.0)) == 3.0 * (1.0 + 2.0 ** -9)
    except (TypeError, RuntimeError, NotImplementedError):
        takes_alpha = False
    return True, takes_alpha
