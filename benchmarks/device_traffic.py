"""The bytes a tracked step's ops read and write and the products' floating-point operations,
counted on the CPU by the Cockpit function that issued them, and what they would take a GPU:
a roofline estimate, each op the longer of its bytes at the memory's bandwidth and its
operations at the arithmetic peak.

``op_count.py`` counts the launches (the host's side of a GPU step); this counts the
device's side without a GPU. A CPU's own op times are no stand-in for it (a CPU is slow at
what a GPU does in one pass: reductions over a block's rows, ``_chunk_cat``, the histograms'
kernels; ``host_profile.py --by-site``); the bytes and the operations are the same on any
machine. Counted per op: every tensor it reads (at most its storage: a broadcast input is
read once) and every tensor it writes; views move nothing; FLOPs for the matrix products
(``mm``, ``addmm``, ``bmm``, ``baddbmm``) and convolutions (forward 2·N·C_out·L_out·C_in/G·K,
backward twice that), none for the others (bound by memory). The estimate leaves out the
launches (the host's, ``op_count.py``) and any reuse of data in caches, and takes float32
products at the float32 peak (under a GPU's bfloat16 autocast the model's products run
faster; Cockpit's products of recorded bfloat16 inputs too). The histograms are counted as
the CPU runs the accelerators' path, with ``bucketize`` and lane counts by ``histc``
(``engine/histograms/device.py``: ``bin_index``, ``tally``); on CUDA one Triton kernel reads
the values once instead (``histograms/fused.py``), a fraction of those rows' bytes.

    python benchmarks/device_traffic.py                            # 3C3D economy, |B| = 128
    python benchmarks/device_traffic.py --model gpt2_124m --batch 8   # GPT-2 124M, T = 256
    python benchmarks/device_traffic.py --model resnet18_gn --batch 128 --after
    python benchmarks/device_traffic.py --model gpt2_124m --batch 8 --cuda-kernels

``--cuda-kernels`` counts the CUDA kernels Cockpit takes instead where this CPU runs other
paths: the Triton histogram, the stacks' dot products and the sums over many tensors
(norms, differences' norms, dot products of parameter-sized lists), each one read of its
inputs, and the half-precision products of layers under autocast at the tensor cores' rate;
``--autocast`` runs GPT-2 124M's forward pass under bfloat16 autocast here too (products
of bfloat16 inputs, the model's and Cockpit's, at ``--half-flops``).

    python benchmarks/device_traffic.py --model gpt2_124m --batch 8 --cuda-kernels --autocast

Machine constants (``--bandwidth``, ``--flops``): an H200's 4.8 TB/s and 67 TFLOP/s of
float32 (without TF32), taken at 80 % and 75 %. Histograms are not bound by their bytes:
counting takes the rates an H200 measured (:data:`HISTOGRAM_RATE` for the Triton kernel,
:data:`THREE_KERNEL_RATE` for bucketize, add and histc, charged to ``histc``) where they are
slower than the bytes.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cockpit.engine.histograms import device as histogram_device

sys.path.insert(0, str(Path(__file__).parent))
import op_count
from op_count import MODELS, USER, count, gpt2_problem, issuing_site

MODELS["gpt2_124m"] = functools.partial(gpt2_problem, vocab=50257, length=256, n_layer=12,
                                        n_embd=768, n_head=12, autocast=True)

BANDWIDTH = 4.8e12 * 0.8
"""Bytes/s: an H200's memory bandwidth at 80 %."""
PEAK = 67e12 * 0.75
"""FLOP/s: an H200's float32 peak (no TF32) at 75 %."""
HALF_PEAK = 989e12 * 0.75
"""FLOP/s: an H200's dense bfloat16/float16 tensor-core peak at 75 % (products of
half-precision inputs)."""
HISTOGRAM_RATE = 120e9
"""Values/s the Triton histogram kernel counts on an H200 (RESULTS, "Histogram kernel on
CUDA": 2^25 float32 values in 0.268 ms, a Linear layer's 75.5 M products in 0.620 ms):
its binning and warp-level histogram take ≈ 125 PTX instructions a value
(``triton_kernels.py``), a tenth of the bandwidth."""
THREE_KERNEL_RATE = 50e9
"""Values/s of bucketize, add and histc together on an H200 (the same table: 2^25 values
in 0.66–0.69 ms), charged to ``histc`` (the atomic adds on crowded bins)."""
_HALF = (torch.bfloat16, torch.float16)

# ops that make views in their implementation though their schema does not say so
_VIEW_LIKE = {"_unsafe_view", "lift_fresh", "_reshape_alias"}
_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm"}


def _read_bytes(t: Tensor) -> int:
    """Bytes an op reads of ``t``: its elements, at most its storage (an expanded tensor's
    repeated elements come from the cache)."""
    size = t.numel() * t.element_size()
    try:
        return min(size, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # (no storage: a tensor subclass)
        return size


def _flops(name: str, args: tuple, out) -> int:
    """The floating-point operations of a matrix product or a convolution (0 for others)."""
    if name in _PRODUCTS:
        a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
        batch = a.shape[0] if a.dim() == 3 else 1
        return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
    if name == "convolution":
        weight, result = args[1], out
        return 2 * result.numel() * math.prod(weight.shape[1:])
    if name == "convolution_backward":  # (grad_output, input, weight, ...)
        grad_output, weight = args[0], args[2]
        return 2 * 2 * grad_output.numel() * math.prod(weight.shape[1:])
    return 0


class Traffic(TorchDispatchMode):
    """Per Cockpit function (the innermost frame in the package; the user's loop where
    none): ops, bytes read and written, FLOPs."""

    def __init__(self, bandwidth: float = BANDWIDTH, peak: float = PEAK,
                 half_peak: float = HALF_PEAK):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.flops: collections.Counter = collections.Counter()
        self.seconds: collections.Counter = collections.Counter()
        self.bandwidth, self.peak, self.half_peak = bandwidth, peak, half_peak
        self._inside_kernel = 0

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def kernel(self, moved: int, flops: int = 0, half: bool = False, seconds: float = 0.0
               ) -> Iterator[None]:
        """Count what runs inside as one kernel that moves ``moved`` bytes and does
        ``flops`` (``half``: at the half-precision peak), and takes at least ``seconds`` — a
        CUDA kernel the CPU emulates by other ops, which are not counted."""
        where = issuing_site()
        self._inside_kernel += 1
        try:
            yield
        finally:
            self._inside_kernel -= 1
        self.ops[where] += 1
        self.bytes[where] += moved
        self.flops[where] += flops
        self.seconds[where] += max(moved / self.bandwidth, seconds,
                                   flops / (self.half_peak if half else self.peak))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._inside_kernel:
            return out
        name = func.overloadpacket.__name__
        where = issuing_site()
        self.ops[where] += 1
        if func.is_view or name in _VIEW_LIKE:
            return out
        moved = sum(_read_bytes(t) for t in tree_leaves((args, kwargs or {}))
                    if isinstance(t, Tensor))
        moved += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                     if isinstance(t, Tensor))
        flops = _flops(name, args, out)
        half = flops and isinstance(args[1], Tensor) and args[1].dtype in _HALF
        self.bytes[where] += moved
        self.flops[where] += flops
        counting = args[0].numel() / THREE_KERNEL_RATE if name == "histc" else 0.0
        self.seconds[where] += max(moved / self.bandwidth, counting,
                                   flops / (self.half_peak if half else self.peak))
        return out


_ACTIVE: list[Traffic] = []  # the counters inside which the step runs


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _one_kernel(moved: int, flops: int = 0, half: bool = False, seconds: float = 0.0):
    """:meth:`Traffic.kernel` of the counter watching the step (none in its warm-up)."""
    return (_ACTIVE[-1].kernel(moved, flops, half, seconds) if _ACTIVE
            else contextlib.nullcontext())


def model_cuda_kernels() -> None:
    """Cockpit's CUDA kernels in place of the paths this CPU runs, each counted as one kernel
    that reads its inputs once (the CPU computes the same values by other ops, not
    counted): the histograms' one-pass Triton kernel (``histograms/fused.py``: the values
    read once, the lane counts written), the stacks' dot-product kernel
    (``engine/row_dots.py``: G and the directions read once) and the half-precision
    products with a float32 result of layers under autocast (``engine/narrow_products.py``:
    the factors read once, G written, at the half-precision peak) and the sums over many
    tensors (``engine/tensor_sums.py``: each tensor read once)."""
    from cockpit.engine import narrow_products, row_dots, tensor_sums
    from cockpit.engine.histograms import fused

    def products(x: Tensor, y: Tensor, alpha: float = 1.0) -> Tensor:
        batch, m, k = x.shape
        n = y.shape[2]
        with _one_kernel(_nbytes(x, y) + 4 * batch * m * n, 2 * batch * m * k * n, True):
            return alpha * torch.bmm(x.float(), y.float())

    narrow_products._runs = lambda device_type: (True, True)
    narrow_products._bmm = narrow_products._baddbmm = products

    def available(x: Tensor, values: int | None = None) -> bool:
        values = x.numel() if values is None else values
        return values >= fused.MIN_VALUES and x.dtype in fused._DTYPES

    def tally_rows(x: Tensor, edges: Tensor, num_lanes: int, uniform=None) -> Tensor:
        slots = edges.numel() + 1
        counts = x.shape[0] * num_lanes * slots * 4
        with _one_kernel(_nbytes(x, edges) + 2 * counts, seconds=x.numel() / HISTOGRAM_RATE):
            return torch.stack([histogram_device.tally(histogram_device.bin_index(
                row.contiguous(), edges.to(x.dtype)), slots) for row in x])

    def rows_available(rows: Tensor, num_directions: int, threshold: bool = True) -> bool:
        return (rows.dtype == torch.float32 and 0 < num_directions <= row_dots.MAX_DIRECTIONS
                and (not threshold or rows.numel() >= row_dots.MIN_VALUES))

    def dots(rows: Tensor, directions: Tensor) -> Tensor:
        with _one_kernel(_nbytes(rows, directions)):
            return torch.einsum("lnd,lkd->lnk", rows, directions)

    def sums(xs, ys, scale, mode: int, sizes) -> Tensor:
        with _one_kernel(_nbytes(*xs) + (0 if ys is None else _nbytes(*ys))):
            x = [t.double().reshape(-1) for t in xs]
            if mode == tensor_sums.SQUARES:
                return torch.stack([t.square().sum() for t in x]).unsqueeze(1)
            y = [t.double().reshape(-1) for t in ys]
            if mode == tensor_sums.DIFFERENCES:
                c = 1.0 if scale is None else scale.double()
                return torch.stack([(a - c * b).square().sum()
                                    for a, b in zip(x, y, strict=True)]).unsqueeze(1)
            return torch.stack([torch.stack([a.square().sum(), b.square().sum(), a.dot(b)])
                                for a, b in zip(x, y, strict=True)])

    fused.available, fused.tally_rows = available, tally_rows
    row_dots.available, row_dots.row_dots = rows_available, dots
    tensor_sums.SWITCH.runs = lambda x: True  # type: ignore[method-assign]
    tensor_sums._kernel = lambda: (None, {})
    tensor_sums._sums = sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="3c3d", choices=list(MODELS))
    parser.add_argument("--config", default="economy", choices=["economy", "business", "full"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--after", action="store_true",
                        help="the step after a tracked one (Alpha observes θ_{t+1} there)")
    parser.add_argument("--top", type=int, default=15, help="functions listed")
    parser.add_argument("--bandwidth", type=float, default=BANDWIDTH, help="bytes/s")
    parser.add_argument("--flops", type=float, default=PEAK, help="FLOP/s")
    parser.add_argument("--half-flops", type=float, default=HALF_PEAK,
                        help="FLOP/s of products of bfloat16/float16 inputs")
    parser.add_argument("--cuda-kernels", action="store_true",
                        help="count Cockpit's CUDA kernels where this CPU runs other paths "
                        "(the Triton histogram, dot-product and tensor-sums kernels, the "
                        "half-precision products with a float32 result)")
    parser.add_argument("--autocast", action="store_true",
                        help="GPT-2 124M's forward pass under bfloat16 autocast (as on the "
                        "GPU), also here on the CPU")
    args = parser.parse_args()
    histogram_device._forced = True  # (the accelerators' paths, as on a GPU)
    op_count.AUTOCAST_ON_CPU = args.autocast
    if args.cuda_kernels:
        model_cuda_kernels()
    plain, tracked = (count(config, args.batch,
                            Traffic(args.bandwidth, args.flops, args.half_flops), args.model,
                            args.after) for config in (None, args.config))
    which = "the step after a tracked one" if args.after else "a tracked step"
    user = plain.seconds[USER]
    cockpit = sum(v for k, v in tracked.seconds.items() if k != USER)
    print(f"{args.model} {args.config}, |B| = {args.batch}, {which}: estimated device time "
          f"{1e3 * user:.2f} ms without Cockpit, Cockpit's ops {1e3 * cockpit:.2f} ms more "
          f"(device work {(user + cockpit) / max(user, 1e-12):.2f}×) at "
          f"{args.bandwidth / 1e12:.2f} TB/s and {args.flops / 1e12:.1f} TFLOP/s "
          f"({args.half_flops / 1e12:.0f} of half-precision products)")
    print(f"Cockpit's ops: {sum(tracked.ops.values()) - tracked.ops[USER]}, "
          f"{sum(v for k, v in tracked.bytes.items() if k != USER) / 1e9:.2f} GB, "
          f"{sum(v for k, v in tracked.flops.items() if k != USER) / 1e9:.1f} GFLOP; "
          f"the step without Cockpit: {sum(plain.ops.values())} ops, "
          f"{plain.bytes[USER] / 1e9:.2f} GB, {plain.flops[USER] / 1e9:.1f} GFLOP")
    print(f"{'ms':>9s} {'GB':>8s} {'GFLOP':>8s} {'ops':>5s}  function")
    for where, seconds in tracked.seconds.most_common(args.top):
        print(f"{1e3 * seconds:9.3f} {tracked.bytes[where] / 1e9:8.3f} "
              f"{tracked.flops[where] / 1e9:8.2f} {tracked.ops[where]:5d}  {where}")


if __name__ == "__main__":
    main()
