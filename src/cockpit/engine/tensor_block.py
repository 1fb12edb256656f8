"""The norms of many tensors from one block that holds them all.

A multi-tensor norm (``torch._foreach_norm``) is one kernel on a GPU, but it makes a 0-dim
output tensor for each of the P tensors, and every tensor made costs the host an allocation
and a tensor object; the difference of two lists (``torch._foreach_sub``) makes P more. On a
model of many parameters the host then spends more on these tensors than on the kernels
(GPT-2's 148 tensors: the gradient check made 749 tensors in 12 ops). Here the tensors
are copied into one block by one op, ``torch._chunk_cat(tensors, 0, R)``: each tensor is cut
along its first dimension into R pieces, and piece r lies in row r of the block, in columns
of the tensor's own, zero-padded where the tensor has fewer than R pieces' worth of rows.
Then, for the block B [R, W] and the columns c_k of tensor k,

    ‖x_k‖² = Σ_{j ∈ c_k} Σ_r B_{r,j}²:

one norm over the rows per column (R numbers each, summed in float32: no float64 copy
of the block), and one segmented sum of the columns' squares per tensor (float64), whatever
P is. A difference of two lists of equal shapes is one difference of their blocks (equal
layouts; the padding stays zero). The price is the copy of the tensors into the block, on
the device (which the host binds on a GPU), and the block's padding, bounded here to an
eighth of the elements (or 2^20 elements: a small model's).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from cockpit.engine.chunk_cat import chunk_cat_takes
from cockpit.engine.histograms.device import device_path

ROWS = 32
"""R: the rows of a block (the column norms, widened to float64, then hold 1/R of the
elements)."""

# Below this many tensors a multi-tensor op pays: a block takes about four ops more, and an
# op costs the host of a GPU what a few tensors made cost it
_MIN_TENSORS = 32
_PADDING = 8  # padding: at most 1/8 of the elements, or 2^20 elements (a small model's)
_PADDING_ELEMENTS = 2**20


@functools.lru_cache(maxsize=16)
def _layout(shapes: tuple[torch.Size, ...], device: torch.device) -> tuple[Tensor, int] | None:
    """The block's columns per tensor of ``shapes`` (as ``torch._chunk_cat`` lays them
    out), on ``device``, and their sum W; None where a tensor is 0-dim or empty or the
    padding would exceed an eighth of the elements (and 2^20 elements)."""
    if any(len(s) == 0 or 0 in s for s in shapes):
        return None
    widths = [math.ceil(s[0] / ROWS) * (math.prod(s) // s[0]) for s in shapes]
    elements = sum(math.prod(s) for s in shapes)
    if ROWS * sum(widths) - elements > max(elements // _PADDING, _PADDING_ELEMENTS):
        return None
    lengths = torch.tensor(widths)
    if device.type != "cuda":
        return lengths.to(device), sum(widths)
    return lengths.pin_memory().to(device, non_blocking=True), sum(widths)


_PLAIN = frozenset({Tensor, torch.nn.Parameter})


class TensorBlock:
    """Tensors of one dtype and device side by side (see the module docstring): ``values``
    [ROWS, W], ``lengths`` [P] the columns of each."""

    def __init__(self, values: Tensor, lengths: Tensor):
        self.values, self.lengths = values, lengths

    @staticmethod
    def of(tensors: Sequence[Tensor]) -> TensorBlock | None:
        """The tensors in one block, or None where the block does not pay or cannot hold
        them: fewer than 32 tensors, not floating point, a tensor subclass (a DTensor's
        shards), several dtypes or devices, a 0-dim or empty one, a layout with much
        padding, a torch whose ``_chunk_cat`` cannot take them or lays them out otherwise."""
        if len(tensors) < _MIN_TENSORS:
            return None
        first = tensors[0]
        # (one dtype and device, no 0-dim or empty tensor: ``_chunk_cat`` checks those
        # itself, and the layout refuses the last two; the host's work here is a few
        # attribute reads per tensor, at every block of a step)
        if (not first.is_floating_point() or not {type(t) for t in tensors} <= _PLAIN
                or not chunk_cat_takes(tensors)):
            return None
        layout = _layout(tuple([t.shape for t in tensors]), first.device)
        if layout is None:
            return None
        lengths, width = layout
        try:
            values = torch._chunk_cat(list(tensors), 0, ROWS)
        except RuntimeError:  # (inputs this torch's kernel refuses: the multi-tensor ops)
            return None
        if values.shape != (ROWS, width):  # (another layout than the one counted on)
            return None
        return TensorBlock(values, lengths)

    @staticmethod
    def on_accelerator(tensors: Sequence[Tensor]) -> TensorBlock | None:
        """:meth:`of` on an accelerator (and on the CPU where its path is forced: tests);
        None on a CPU, which loops over the tensors either way: a block would copy them
        for nothing."""
        if len(tensors) < _MIN_TENSORS or not device_path(tensors[0].device):
            return None
        return TensorBlock.of(tensors)

    @staticmethod
    def pair(xs: Sequence[Tensor], ys: Sequence[Tensor]
             ) -> tuple[TensorBlock, TensorBlock] | None:
        """Two lists of equal shapes and dtype in a block each, on an accelerator (one
        layout: their difference is one op), or None where either is not taken."""
        x = TensorBlock.on_accelerator(xs)
        y = None if x is None else TensorBlock.of(ys)
        if x is None or y is None or y.lengths is not x.lengths or y.values.dtype != x.values.dtype:
            return None
        return x, y

    def sq_norms(self) -> Tensor:
        """‖x_k‖² of every tensor, [P] float64."""
        return torch.segment_reduce(self.column_sq_sums(), "sum", lengths=self.lengths,
                                    unsafe=True)  # (the lengths sum to W: no device read)

    def sq_total(self) -> Tensor:
        """Σ_k ‖x_k‖², 0-dim float64."""
        return self.column_sq_sums().sum()

    def column_sq_sums(self) -> Tensor:
        """Σ_r B_{r,j}² of every column j, [W] float64: each column's R squares summed in the
        block's dtype (half precision in float32), then widened.

        A float64 norm of the block would widen the block to float64 first (PyTorch
        converts a reduction's input to the dtype it accumulates in, on a GPU too: twice
        the block's memory more, and its traffic); a sum of R non-negative squares has no
        cancellation and keeps the digits of float32, as a CPU's rows do
        (:mod:`cockpit.engine.float_sums`)."""
        values = self.values
        if values.dtype == torch.float64:
            columns = torch.linalg.vector_norm(values, dim=0)
        else:
            columns = torch.linalg.vector_norm(values, dim=0, dtype=torch.float32).double()
        return columns.square_()

    def subtract(self, other: TensorBlock, scale: Tensor | None = None) -> TensorBlock:
        """x_k − c·y_k of every tensor (``other``: the y_k, of the same shapes; c =
        ``scale``, a 0-dim tensor, or 1), in place of this block's values."""
        if scale is None:
            self.values.sub_(other.values)
        else:  # (x + (−1)·y·c: no temporary of the block's size)
            self.values.addcmul_(other.values, scale, value=-1)
        return self
