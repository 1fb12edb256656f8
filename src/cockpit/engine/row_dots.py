r"""Dot products of a stack's individual gradients with a few directions, in one pass on CUDA.

For L layers of one shape the stack holds G ∈ R^{L × N × D} (:mod:`cockpit.engine.stacked`)
and asks for g_{l,n}ᵀu_{l,k} with K directions per layer (ḡ for InnerTest and OrthoTest, the
predicted step s_t for Alpha): [L, N, K]. PyTorch offers two ways, both poor for D in the
millions: a batched product [K, D] × [D, N], for which cuBLAS reduced D with a kernel that
took 18–23 ms a stack of GPT-2 124M on an H200, or per direction one product G ⊙ u_k and
one sum, which reads G K times and writes and reads a G-sized temporary each time (3K
passes over G: 25 GB of memory traffic a tracked step of GPT-2 124M at B = 8).

One Triton kernel reads G once: a program takes one sample n of one layer l and a range of
D and adds u_{l,k,j} g_{l,n,j} over the range in float32 (K accumulators of BLOCK lanes,
summed once); the programs of one range run side by side, so the directions' values come
from the cache for all but the first sample; the ranges' partial sums are added by one
reduction. The products and sums are those of the second way in another order
(float32 rounding).

Used on CUDA for float32 stacks of at least :data:`MIN_VALUES` numbers, where Triton imports;
the kernel also runs in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which
is how the tests check it without a GPU. Elsewhere, with ``COCKPIT_ROW_DOTS=0`` and after a
failure, the products and sums run as before.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.engine.triton_device import KernelSwitch, triton_kernel

BLOCK = 1024  # values of a row a program reads at once
ITERS = 4  # reads per program and sample: a program covers BLOCK · ITERS values of D
NUM_WARPS = 4
MAX_DIRECTIONS = 8  # K at most (the accumulators: K_PAD · BLOCK float32 per program)
# Fewer numbers go by the products and sums: below 2^22 a tracked step is the host's and
# the kernel's launch costs it more than the few aten ops it replaces
MIN_VALUES = 2**22


@triton_kernel
def _kernel(triton, tl):
    """The Triton kernel, or None where Triton does not import."""

    @triton.jit
    def dots(g_ptr, u_ptr, out_ptr, width, K: tl.constexpr, K_PAD: tl.constexpr,
             BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # program (n, part, l): sample n's range ``part`` of D in layer l; the programs of
        # one range and layer run side by side and read its directions from the cache
        n = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        layer = tl.program_id(2).to(tl.int64)
        samples, parts = tl.num_programs(0), tl.num_programs(1)
        ks = tl.arange(0, K_PAD).to(tl.int64)  # (K · D may pass 2^31)
        g_ptr += (layer * samples + n) * width
        u_ptr += layer * K * width
        acc = tl.zeros((K_PAD, BLOCK), dtype=tl.float32)
        for step in range(ITERS):
            offsets = (part * ITERS + step) * BLOCK + tl.arange(0, BLOCK)
            inside = offsets < width
            g = tl.load(g_ptr + offsets, mask=inside, other=0.0)
            u = tl.load(u_ptr + ks[:, None] * width + offsets[None, :],
                        mask=(ks[:, None] < K) & inside[None, :], other=0.0)
            acc += u * g[None, :]
        # partial sums [L, parts, N, K_PAD]
        tl.store(out_ptr + ((layer * parts + part) * samples + n) * K_PAD + ks,
                 tl.sum(acc, axis=1))

    return dots


def available(rows: Tensor, num_directions: int, threshold: bool = True) -> bool:
    """Whether :func:`row_dots` forms the dot products of ``rows`` (G, [L, N, D]) with
    ``num_directions`` directions per layer: float32, at least :data:`MIN_VALUES` numbers
    (unless not ``threshold``), at most :data:`MAX_DIRECTIONS` directions, on CUDA (or on
    the CPU under Triton's interpreter), Triton importable, not ``COCKPIT_ROW_DOTS=0``."""
    return (rows.dtype == torch.float32 and not (threshold and rows.numel() < MIN_VALUES)
            and 0 < num_directions <= MAX_DIRECTIONS and SWITCH.runs(rows)
            and _kernel() is not None)


# used until it fails to compile or run: then the products and sums (the same values to
# rounding)
SWITCH = KernelSwitch("dot-product kernel", "the stacks' dot products are formed by "
                      "PyTorch's products and sums instead (slower)", "COCKPIT_ROW_DOTS")
disable = SWITCH.disable


def row_dots(rows: Tensor, directions: Tensor) -> Tensor:
    """[g_{l,n}ᵀu_{l,k}]_{l,n,k}, [L, N, K] float32, from G = ``rows`` [L, N, D] and
    ``directions`` [L, K, D] (contiguous float32; :func:`available` says where it runs)."""
    layers, samples, width = rows.shape
    k = directions.shape[1]
    k_pad = max(2, 1 << (k - 1).bit_length())  # (a power of two; two rows at least)
    parts = -(-width // (BLOCK * ITERS))
    partial = torch.empty(layers, parts, samples, k_pad, dtype=torch.float32,
                          device=rows.device)
    _kernel()[(samples, parts, layers)](rows.contiguous(), directions.contiguous(), partial,
                                        width, K=k, K_PAD=k_pad, BLOCK=BLOCK, ITERS=ITERS,
                                        num_warps=NUM_WARPS)
    return partial.sum(1)[:, :, :k]


def sample_dots(rows: Tensor, directions: Tensor) -> Tensor:
    """[g_nᵀu_k]_{k,n}, [K, N], of one parameter's individual gradients ``rows`` [N, D] (a
    chunk of samples, materialized; a stack's layer) and ``directions`` [K, D] (one
    direction [D]: [N]): by the kernel, as a stack of one layer, where it runs
    (:func:`available`, asked before any view is made), else by a product. cuBLAS's
    product [K, D] × [D, N] reduces D (the millions of a large embedding) for a tiny output
    with a kernel of the kind the stacks measured at 18–23 ms."""
    one = directions.dim() == 1
    if available(rows, 1 if one else directions.shape[0]):  # (G's numbers, as a stack)
        try:
            dots = row_dots(rows.unsqueeze(0), directions.reshape(1, -1, rows.shape[1]))[0]
        except Exception as error:  # e.g. no compiler for Triton: the product instead
            disable(error)
        else:
            return dots[:, 0] if one else dots.T
    return rows @ directions if one else directions @ rows.T
