r"""Sums of squares and products of many tensors, each tensor read once, on CUDA.

Several instruments need a sum over every parameter tensor x_k (P of them, P = 148 for
GPT-2) at a tracked step: ‖x_k‖² (ParamNorm, GradNorm), ‖x_k − c·y_k‖² (Distance against
θ_0, the gradient check's ½‖p.grad/‖p.grad‖ − ḡ/‖ḡ‖‖², the update check's ‖a − κp‖),
⟨x_k, y_k⟩ (the update check's κ = ⟨p, a⟩/⟨p, p⟩). Without a kernel of their own they
take :class:`~cockpit.engine.tensor_block.TensorBlock`: both lists copied into one block
each, then a difference and the norms of the blocks' columns — three passes over the
tensors and a block's worth of memory written (GPT-2 124M: 8.9 GB of copies and 5 GB of
norms a tracked step, ≈ 4 ms of an H200's memory time).

One Triton kernel reads each tensor once instead. A program takes CHUNK = BLOCK · ITERS
consecutive elements of one tensor (the programs of tensor k, from a table built once per
list of sizes, start at 0, CHUNK, 2·CHUNK, …), finds the tensor's address in a table of
the P addresses, and sums, in float32, one of

    Σ x²                      (``sq_norms``)
    Σ (x − c·y)²              (``sq_norms_of_differences``; c a number on the device)
    Σ x², Σ y², Σ x·y         (``pair_sums``)

over its elements (BLOCK lanes of ITERS values each, then a tree sum of the lanes); the
programs' partial sums are added per tensor in float64 by one segmented sum. A whole chunk
(all of a tensor's but its last) is read without a mask, and where every address of the
lists is a multiple of 16 bytes (the caching allocator's are) the compiler is told so: each
lane then loads 16 bytes at once (``ld.global.v4`` in the PTX; with a mask, or addresses it
cannot prove aligned, it loads one number at a time, 2 bytes in bfloat16). Float32 sums
of at most CHUNK non-negative squares: a relative rounding of about (ITERS + log2 BLOCK)
float32 units; the blocks sum 32 numbers in float32 before their float64 sums.

Used on CUDA for lists of at least :data:`MIN_TENSORS` dense tensors of one dtype
(float32, bfloat16, float16) and device, where Triton imports; also in Triton's interpreter
on CPU tensors, which is how the tests check it without a GPU. Elsewhere, with
``COCKPIT_TENSOR_SUMS=0`` and after a failure (one warning) the callers take the blocks or
the multi-tensor ops as before; the functions then return None.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence

import torch
from torch import Tensor

from cockpit.engine.triton_device import KernelSwitch, triton_kernel

BLOCK = 1024  # lanes of a program
ITERS = 4  # values per lane: a program sums CHUNK = BLOCK · ITERS elements of one tensor
CHUNK = BLOCK * ITERS
NUM_WARPS = 4
MIN_TENSORS = 32  # fewer go by the multi-tensor ops (as for the blocks)

SQUARES, DIFFERENCES, PAIRS = 0, 1, 2  # the kernel's modes (the sums above, in order)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN = frozenset({Tensor, torch.nn.Parameter})


@triton_kernel
def _kernel(triton, tl):
    """The Triton kernel and Triton's dtypes by torch dtype, or None where Triton does not
    import."""

    @triton.jit
    def sums(x_table, y_table, scale_ptr, owner, start, sizes, out_ptr,
             DTYPE: tl.constexpr, MODE: tl.constexpr, HAS_SCALE: tl.constexpr,
             WIDTH: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
             ALIGNED: tl.constexpr):
        program = tl.program_id(0)
        k = tl.load(owner + program)  # the tensor this program reads
        first = tl.load(start + program)  # (int64: a tensor may pass 2^31 elements)
        first = tl.multiple_of(first, BLOCK * ITERS)
        size = tl.load(sizes + k)
        x_ptr = tl.load(x_table + k).to(tl.pointer_type(DTYPE))
        y_ptr = x_ptr
        if MODE != 0:
            y_ptr = tl.load(y_table + k).to(tl.pointer_type(DTYPE))
        if ALIGNED:  # every tensor at a 16-byte address: each lane loads 16 bytes at once
            x_ptr = tl.multiple_of(x_ptr, 16)
            y_ptr = tl.multiple_of(y_ptr, 16)
        whole = first + BLOCK * ITERS <= size  # (all chunks of a tensor but its last)
        c = 1.0
        if HAS_SCALE:
            c = tl.load(scale_ptr).to(tl.float32)
        a = tl.zeros((BLOCK,), dtype=tl.float32)
        b = tl.zeros((BLOCK,), dtype=tl.float32)
        ab = tl.zeros((BLOCK,), dtype=tl.float32)
        for step in range(ITERS):
            offsets = first + step * BLOCK + tl.arange(0, BLOCK)
            if whole:  # no mask: loads the compiler can widen
                x = tl.load(x_ptr + offsets).to(tl.float32)
                y = x
                if MODE != 0:
                    y = tl.load(y_ptr + offsets).to(tl.float32)
            else:
                inside = offsets < size
                x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
                y = x
                if MODE != 0:
                    y = tl.load(y_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            if MODE == 0:
                a += x * x
            elif MODE == 1:
                if HAS_SCALE:
                    y = y * c
                d = x - y
                a += d * d
            else:
                a += x * x
                b += y * y
                ab += x * y
        tl.store(out_ptr + program * WIDTH, tl.sum(a, axis=0))
        if MODE == 2:
            tl.store(out_ptr + program * WIDTH + 1, tl.sum(b, axis=0))
            tl.store(out_ptr + program * WIDTH + 2, tl.sum(ab, axis=0))

    dtypes = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
              torch.float16: tl.float16}
    return sums, dtypes


# used until it fails to compile or run: then the callers' blocks and multi-tensor ops (the
# same values to rounding)
SWITCH = KernelSwitch("kernel for the norms of many tensors", "they are formed by "
                      "PyTorch's ops instead (slower)", "COCKPIT_TENSOR_SUMS")


def available(xs: Sequence[Tensor], ys: Sequence[Tensor] | None = None) -> bool:
    """Whether the kernel takes ``xs`` (and ``ys``, of the same sizes): at least
    :data:`MIN_TENSORS` dense plain tensors (no DTensors), of one dtype in float32,
    bfloat16, float16 and one device where Triton kernels run, not ``COCKPIT_TENSOR_SUMS=0``,
    the kernel not broken."""
    return checked(xs, ys) is not None


_dtype_of, _type_of = operator.attrgetter("dtype"), type


def checked(xs: Sequence[Tensor], ys: Sequence[Tensor] | None = None
            ) -> tuple[int, ...] | None:
    """The tensors' sizes where the kernel takes the lists (:func:`available`), else None;
    a caller that asks twice about the same lists passes them on as ``sizes``. Each check
    one pass of a builtin over the list (≈ 60 µs a list of 148 tensors: no Python frame per
    tensor)."""
    if len(xs) < MIN_TENSORS or (ys is not None and len(ys) != len(xs)):
        return None
    first = xs[0]
    if first.dtype not in _DTYPES or not SWITCH.runs(first) or _kernel() is None:
        return None
    sizes = tuple(map(Tensor.numel, xs))
    for tensors in (xs,) if ys is None else (xs, ys):
        if (not set(map(_type_of, tensors)) <= _PLAIN
                or set(map(_dtype_of, tensors)) != {first.dtype}
                or set(map(Tensor.get_device, tensors)) != {first.get_device()}):
            return None
    if ys is not None and tuple(map(Tensor.numel, ys)) != sizes:
        return None
    if all(map(Tensor.is_contiguous, xs)) and (ys is None or all(map(Tensor.is_contiguous, ys))):
        return sizes
    # channels-last tensors: read place by place, a pair then with equal strides
    if not all(map(_dense, xs)):
        return None
    if ys is not None and not all(y.is_contiguous() if x.is_contiguous()
                                  else y.stride() == x.stride()
                                  for x, y in zip(xs, ys, strict=True)):
        return None
    return sizes


def _dense(x: Tensor) -> bool:
    """Whether ``x``'s elements fill ``numel`` consecutive places from its first: contiguous,
    or channels-last (a convolution's weight and gradient in a channels-last model)."""
    return x.is_contiguous() or (
        x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)) or (
        x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d))


def sq_norms(xs: Sequence[Tensor]) -> Tensor | None:
    """[‖x_k‖²]_k, [P] float64, or None where the kernel does not take ``xs``."""
    sums = _guarded(xs, None, None, SQUARES)
    return None if sums is None else sums[:, 0]


def sq_norms_of_differences(xs: Sequence[Tensor], ys: Sequence[Tensor],
                            scale: Tensor | None = None,
                            sizes: tuple[int, ...] | None = None) -> Tensor | None:
    """[‖x_k − c·y_k‖²]_k, [P] float64 (c = ``scale``, a number on the device, or 1; the
    difference in float32), or None where the kernel does not take the lists (``sizes``:
    :func:`checked`'s answer for them, if asked already)."""
    sums = _guarded(xs, ys, scale, DIFFERENCES, sizes)
    return None if sums is None else sums[:, 0]


def pair_sums(xs: Sequence[Tensor], ys: Sequence[Tensor],
              sizes: tuple[int, ...] | None = None) -> Tensor | None:
    """[Σ x_k², Σ y_k², Σ x_k·y_k]_k, [3, P] float64, or None where the kernel does not
    take the lists (``sizes``: as for :func:`sq_norms_of_differences`)."""
    sums = _guarded(xs, ys, None, PAIRS, sizes)
    return None if sums is None else sums.T


def _guarded(xs: Sequence[Tensor], ys: Sequence[Tensor] | None, scale: Tensor | None,
             mode: int, sizes: tuple[int, ...] | None = None) -> Tensor | None:
    if sizes is None:
        sizes = checked(xs, ys)
    if sizes is None or SWITCH.broken is not None:
        return None
    try:
        return _sums(xs, ys, scale, mode, sizes)
    except Exception as error:  # e.g. no compiler for Triton: the callers' ops instead
        SWITCH.disable(error)
        return None


@functools.lru_cache(maxsize=16)
def _programs(sizes: tuple[int, ...], device: torch.device
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """For tensors of ``sizes`` elements: each program's tensor and first element, the
    sizes, and the programs per tensor (on ``device``; built once per list of sizes)."""
    counts = [max(1, math.ceil(size / CHUNK)) for size in sizes]
    owner = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32),
                                    torch.tensor(counts))
    firsts = torch.tensor(counts).cumsum(0) - torch.tensor(counts)
    start = (torch.arange(len(owner)) - firsts[owner.long()]) * CHUNK
    tables = (owner, start, torch.tensor(sizes, dtype=torch.int64), torch.tensor(counts))
    return tuple(_to_device(t, device) for t in tables)  # type: ignore[return-value]


def _to_device(table: Tensor, device: torch.device) -> Tensor:
    """A host table on ``device`` (from pinned memory on CUDA: no wait for the copy)."""
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=32)
def _table(addresses: tuple[int, ...], device: torch.device) -> tuple[Tensor, bool]:
    """The addresses as a table on ``device``, made once per list of addresses (the
    parameters stay where they are from step to step, and the caching allocator mostly
    gives a step's gradients the places of the last step's), and whether all of them are
    multiples of 16 (the allocator's blocks are; a view into a tensor may not be)."""
    table = _to_device(torch.tensor(addresses, dtype=torch.int64), device)
    return table, all(address % 16 == 0 for address in addresses)


def _sums(xs: Sequence[Tensor], ys: Sequence[Tensor] | None, scale: Tensor | None,
          mode: int, sizes: tuple[int, ...]) -> Tensor:
    """The kernel's sums per tensor, [P, 3] float64 for :data:`PAIRS`, else [P, 1]."""
    kernel, dtypes = _kernel()
    first = xs[0]
    device = first.device
    owner, start, numels, counts = _programs(sizes, device)
    x_table, aligned = _table(tuple(map(Tensor.data_ptr, xs)), device)
    if ys is None:
        y_table = x_table
    else:
        y_table, y_aligned = _table(tuple(map(Tensor.data_ptr, ys)), device)
        aligned = aligned and y_aligned
    c = x_table if scale is None else scale.detach().to(device, torch.float32).reshape(1)
    width = 3 if mode == PAIRS else 1
    partial = torch.empty(len(owner), width, dtype=torch.float32, device=device)
    kernel[(len(owner),)](x_table, y_table, c, owner, start, numels, partial,
                          DTYPE=dtypes[first.dtype], MODE=mode, HAS_SCALE=scale is not None,
                          WIDTH=width, BLOCK=BLOCK, ITERS=ITERS, ALIGNED=aligned,
                          num_warps=NUM_WARPS)
    # (the counts sum to the programs: no read of the device)
    return torch.segment_reduce(partial.double(), "sum", lengths=counts, axis=0, unsafe=True)
