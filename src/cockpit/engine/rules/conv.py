"""Convolutions (1d, 2d, 3d; stride, padding incl. "same" and non-zero padding modes,
dilation, groups).

With the input unfolded into patches U_n ∈ R^{(C_in/G)·K × L} per group (K kernel elements,
L output positions), the individual gradient of the weight is the per-sample matrix product
g_n(W) = δ_n U_nᵀ ∈ R^{C_out/G × (C_in/G)·K} per group, and g_n(b) = Σ_l δ_{n,:,l}. The
patches are a strided view of the padded input, which works alike in 1, 2 and 3 dimensions
and is several times faster on a CPU than ``F.unfold`` (im2col). Projections g_nᵀU need no
patches at all: they are one convolution of the input with weight U (see
:class:`ConvSampleGrads`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cockpit.engine.dtypes import in_dtype
from cockpit.engine.float_sums import sample_sum_sq
from cockpit.engine.histograms.device import device_path
from cockpit.engine.rules.registry import register_rule
from cockpit.engine.rules.sample_grads import (
    DenseSampleGrads,
    SampleGrads,
    outside_autograd,
)
from cockpit.engine.workspace import workspace


def _explicit_padding(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """Apply the module's padding to ``x`` explicitly, so the convolution itself uses none."""
    dims = len(module.kernel_size)
    if module.padding == "valid":
        return x
    if module.padding == "same":
        pads: list[int] = []
        for k, d in zip(reversed(module.kernel_size), reversed(module.dilation), strict=True):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
    else:
        pads = [p for p in reversed(module.padding) for _ in range(2)]
    if not any(pads):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    assert len(pads) == 2 * dims
    return F.pad(x, pads, mode=mode)


def _patches(
    module: nn.modules.conv._ConvNd, x: Tensor, out_sizes: torch.Size, out: Tensor | None = None
) -> Tensor:
    """Unfolded input ``[N, G, (C_in/G)·K, L]`` of the padded input ``x`` (``[N, C_in·K, L]``
    for one group).

    A strided view ``[N, C_in, *kernel, *out]`` copied once (into ``out`` if given, a
    buffer of that shape). The output positions are the innermost (fastest)
    dimension, so the copy moves runs of contiguous input rows; with the kernel innermost
    (as in im2col's transpose) the copy is several times slower on a CPU.
    """
    n, c_in = x.shape[:2]
    spatial_strides = x.stride()[2:]
    view = x.as_strided(
        (n, c_in, *module.kernel_size, *out_sizes),
        (
            x.stride(0),
            x.stride(1),
            *(st * d for st, d in zip(spatial_strides, module.dilation, strict=True)),
            *(st * s for st, s in zip(spatial_strides, module.stride, strict=True)),
        ),
    )
    if out is not None:
        view = out.copy_(view)
    if module.groups == 1:  # no group dimension: [N, C_in·K, L]
        return view.reshape(n, -1, math.prod(out_sizes))
    return view.reshape(n, module.groups, -1, math.prod(out_sizes))


def _patches_channels_last(
    module: nn.modules.conv._ConvNd, x: Tensor, out_sizes: torch.Size,
    out: Tensor | None = None, x_buffer: Tensor | None = None,
) -> Tensor:
    """Unfolded input ``[N, L, K·C_in]`` of the padded input ``x`` (groups 1, no dilation
    along the last kernel dimension), each patch ordered (*kernel, C_in).

    The input is first made channels-last (into ``x_buffer`` if given, a buffer of shape
    ``[N, *spatial, C_in]``; no copy when it already is), so that a patch's last kernel row
    over all channels is one contiguous run of K_last·C_in numbers, then the strided view
    ``[N, *out, *kernel[:-1], K_last·C_in]`` is copied once (into ``out`` if given, a
    buffer of that shape).
    """
    dims = len(module.kernel_size)
    n, c_in = x.shape[:2]
    x_last = x.permute(0, *range(2, dims + 2), 1)
    if not x_last.is_contiguous():
        x_last = x_last.contiguous() if x_buffer is None else x_buffer.copy_(x_last)
    strides = x_last.stride()[1:-1]
    view = x_last.as_strided(
        (n, *out_sizes, *module.kernel_size[:-1], module.kernel_size[-1] * c_in),
        (
            x_last.stride(0),
            *(st * s for st, s in zip(strides, module.stride, strict=True)),
            *(st * d for st, d in zip(strides[:-1], module.dilation[:-1], strict=True)),
            1,
        ),
    )
    view = view.contiguous() if out is None else out.copy_(view)
    return view.view(n, math.prod(out_sizes), -1)


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}

# Measured choice of materialization per layer shape (see ConvSampleGrads._method).
_METHODS: dict[tuple, str] = {}

# While Cockpit backpropagates several vectors through the same forward pass (diagonal
# curvature), the padded and unfolded inputs of each layer are computed once and reused.
_UNFOLD_CACHE: dict | None = None


@contextlib.contextmanager
def reuse_unfolded_inputs():
    """Within this context, layers unfold each recorded input only once."""
    global _UNFOLD_CACHE
    previous, _UNFOLD_CACHE = _UNFOLD_CACHE, {}
    try:
        yield
    finally:
        _UNFOLD_CACHE = previous


class ConvSampleGrads(SampleGrads):
    """Individual weight gradients of a convolution, g_n(W) = δ_n U_nᵀ per group, held as the
    input x (padded when first needed: projections by a convolution with zero padding take
    the layer's padding themselves, no padded copy) and the output gradient δ.

    * projections never build g_n: with W' = U (a direction in weight space),
      g_nᵀ U = Σ_l δ_{n,:,l}ᵀ (U * patch_l(x_n)) = ⟨δ_n, conv(x_n; U)⟩, one convolution of the
      batch with weight U (padding already applied to x, the layer's stride, dilation and
      groups); K directions share one convolution with K·C_out output channels;
    * every other statistic (norms, Gram, sums of squares, histograms) materializes the
      |B|×D gradients once (see :meth:`_method` for the three ways) and caches them, so all
      statistics of one layer share one materialization (memory: one layer's |B|×D, freed
      with this object inside the layer's hook). With the channels-last way each sample's
      row is ordered (C_out, *kernel, C_in) instead of θ's (C_out, C_in, *kernel);
      :meth:`to_rows` and :meth:`from_rows` translate parameter-shaped tensors.
    """

    caches_chunks = True  # (see chunks)
    selectable = True

    def __init__(
        self, module: nn.modules.conv._ConvNd, x_padded: Tensor | None, delta: Tensor, key=None,
        scale: float = 1.0, x: Tensor | None = None,
    ):
        """``x_padded``: the input with the layer's padding applied, or None with the input
        ``x`` as the layer received it (padded when first needed)."""
        self.module, self.delta = module, delta
        self._padded, self._input = x_padded, x
        self.scale = scale  # the individual gradients are scale · δ_n U_nᵀ
        self.num_samples = delta.shape[0]
        self.shape = module.weight.shape
        self._rows: Tensor | None = None  # [N, D] once materialized
        self._ticket: tuple | None = None  # workspace ticket of self._rows, if borrowed
        self._key = key  # identifies the input in the unfold cache, if one is active
        self._channels_last: bool | None = None  # row order, known once the method is

    @property
    def dtype(self) -> torch.dtype:
        return self.delta.dtype

    @property
    def x(self) -> Tensor:
        """The padded input."""
        if self._padded is None:
            assert self._input is not None
            self._padded = _explicit_padding(self.module, self._input)
        return self._padded

    def select(self, start: int, stop: int) -> SampleGrads:
        key = None if self._key is None else (self._key, start, stop)
        padded = None if self._padded is None else self._padded[start:stop]
        given = None if self._input is None else self._input[start:stop]
        return ConvSampleGrads(self.module, padded, self.delta[start:stop], key, self.scale,
                               x=given)

    def _unfolded(self, channels_last: bool = False) -> Tensor:
        """The unfolded input of :func:`_patches` (or :func:`_patches_channels_last`): in
        scratch memory, or once per input while several backprops share it."""
        cache, out_sizes, x = _UNFOLD_CACHE, self.delta.shape[2:], self.x
        unfold = _patches_channels_last if channels_last else _patches
        if cache is not None and self._key is not None:  # kept for several backprops
            key = ("patches_cl" if channels_last else "patches", self._key)
            if key not in cache:
                cache[key] = unfold(self.module, x, out_sizes)
            return cache[key]
        ws, dtype, device, (n, c_in) = workspace(), x.dtype, x.device, x.shape[:2]
        kernel = self.module.kernel_size
        if not channels_last:
            buffer, _ = ws.take("patches", (n, c_in, *kernel, *out_sizes), dtype, device)
            return unfold(self.module, x, out_sizes, out=buffer)
        buffer, _ = ws.take("patches", (n, *out_sizes, *kernel[:-1], kernel[-1] * c_in),
                            dtype, device)
        x_buffer, _ = ws.take("channels_last_input", (n, *x.shape[2:], c_in), dtype, device)
        return unfold(self.module, x, out_sizes, buffer, x_buffer)

    def materialize(self) -> Tensor:
        rows = self.chunks()[0]
        if not self._is_channels_last():
            return rows.view(self.num_samples, *self.shape)
        dims = len(self.module.kernel_size)
        c_out, c_in = self.shape[:2]
        shaped = rows.view(self.num_samples, c_out, *self.module.kernel_size, c_in)
        return shaped.permute(0, 1, dims + 2, *range(2, dims + 2))  # a view, θ's shape

    def chunks(self) -> list[Tensor]:
        if self._ticket is not None and not workspace().valid(self._ticket):
            self._rows = None  # another layer reused the buffer
        if self._rows is None:
            method = self._method()
            if method == "grouped" and _UNFOLD_CACHE is None:
                self._rows, self._ticket = self._by_grouped_convolution(), None
            elif method == "channels_last":
                self._rows = self._by_unfolding_channels_last()
            else:
                self._rows = self._by_unfolding()
        return [self._rows]

    def _is_channels_last(self) -> bool:
        """Whether the rows are ordered (C_out, *kernel, C_in) (the channels-last way)."""
        if self._channels_last is None:
            self._channels_last = self._method() == "channels_last"
        return self._channels_last

    def to_rows(self, u: Tensor) -> Tensor:
        if not self._is_channels_last():
            return u.reshape(-1)
        dims = len(self.module.kernel_size)
        u = u.reshape(self.shape).permute(0, *range(2, dims + 2), 1)
        return u.reshape(-1)

    def from_rows(self, v: Tensor) -> Tensor:
        if not self._is_channels_last():
            return v.reshape(self.shape)
        dims = len(self.module.kernel_size)
        c_out, c_in = self.shape[:2]
        v = v.reshape(c_out, *self.module.kernel_size, c_in)
        return v.permute(0, dims + 1, *range(1, dims + 1)).contiguous()

    def _directions(self, us: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
        """K parameter-shaped tensors as rows [K, D] in row order (:meth:`to_rows` of each)
        and ``dtype``, in scratch memory: one ``stack`` writes them, for the channels-last
        order into the permuted view of the rows' buffer (one contiguous direction in θ's
        order is a view of itself)."""
        shaped = [u if u.shape == self.shape else u.reshape(self.shape) for u in us]
        ws, k, device = workspace(), len(us), self.delta.device
        if k == 1 and not self._is_channels_last() and shaped[0].is_contiguous():
            return in_dtype(shaped[0].reshape(1, -1), dtype)  # (a view: no copy)
        if not self._is_channels_last():
            out, _ = ws.take("directions", (k, *self.shape), dtype, device)
            torch.stack(shaped, out=out)
        else:
            dims = len(self.module.kernel_size)
            c_out, c_in = self.shape[:2]
            out, _ = ws.take("directions", (k, c_out, *self.module.kernel_size, c_in), dtype,
                             device)
            # the view [K, C_out, C_in, *kernel] of the rows (C_out, *kernel, C_in)
            torch.stack(shaped, out=out.permute(0, 1, dims + 2, *range(2, dims + 2)))
        return ws.take("directions", (k, self.shape.numel()), dtype, device)[0]

    def _by_unfolding(self) -> Tensor:
        """g_n = δ_n U_nᵀ: unfold the input, one batched matrix product. Rows [N, D]."""
        module, delta = self.module, self.delta
        n, groups, c_out = delta.shape[0], module.groups, delta.shape[1]
        patches = self._unfolded()  # [N, G, Cg·K, L] ([N, C_in·K, L] for one group)
        if groups == 1:  # scale folded into the batched product
            grads, self._ticket = workspace().take(
                "grads", (n, c_out, patches.shape[1]), delta.dtype, delta.device)
            torch.baddbmm(grads, delta.reshape(n, c_out, -1), patches.transpose(1, 2),
                          beta=0, alpha=self.scale, out=grads)
            return self._grads_rows(n, delta)
        delta = delta.reshape(n, groups, c_out // groups, patches.shape[-1])  # [N, G, Og, L]
        grads, self._ticket = workspace().take(
            "grads", (n, groups, c_out // groups, patches.shape[2]), delta.dtype, delta.device)
        torch.matmul(delta, patches.transpose(2, 3), out=grads)  # [N, G, Og, Cg·K]
        if self.scale != 1.0:
            grads.mul_(self.scale)
        return self._grads_rows(n, delta)

    def _by_unfolding_channels_last(self) -> Tensor:
        """g_n = δ_n U_n with the patches U_n ∈ R^{L × K·C_in} unfolded from the channels-last
        input, so that each copied run is a whole kernel row of all channels (K_last·C_in
        contiguous numbers instead of one output row). Rows [N, D] in the order
        (C_out, *kernel, C_in)."""
        delta = self.delta
        n, c_out = delta.shape[:2]
        patches = self._unfolded(channels_last=True)  # [N, L, K·C_in]
        grads, self._ticket = workspace().take(
            "grads", (n, c_out, patches.shape[2]), delta.dtype, delta.device)
        torch.baddbmm(grads, delta.reshape(n, c_out, -1), patches, beta=0, alpha=self.scale,
                      out=grads)
        return self._grads_rows(n, delta)

    def _grads_rows(self, n: int, delta: Tensor) -> Tensor:
        """The "grads" scratch just written, as rows [N, D] (the workspace's cached view of
        the same numbers: no reshape per step)."""
        rows, self._ticket = workspace().take("grads", (n, self.shape.numel()), delta.dtype,
                                              delta.device)
        return rows

    def _by_grouped_convolution(self) -> Tensor:
        """g_n as the weight gradient of one convolution whose groups are the samples: the
        batch folded into channels, [1, N·C_in, …] ⊛ [N·C_out, C_in/G, …], groups N·G.
        Rows [N, D]."""
        module, x, delta = self.module, self.x, self.delta
        n = delta.shape[0]
        weight_shape = (n * self.shape[0], *self.shape[1:])
        dims = len(module.kernel_size)
        grads = torch.ops.aten.convolution_backward(
            delta.reshape(1, -1, *delta.shape[2:]), x.reshape(1, -1, *x.shape[2:]),
            x.new_empty(weight_shape), None, list(module.stride), [0] * dims,
            list(module.dilation), False, [0] * dims, n * module.groups, [False, True, False],
        )[1]
        grads = grads.reshape(n, -1)
        return grads.mul_(self.scale) if self.scale != 1.0 else grads

    def _methods(self) -> dict[str, Callable[[], Tensor]]:
        """The ways to materialize that apply to this layer."""
        methods = {"unfold": self._by_unfolding}
        if _UNFOLD_CACHE is None:
            methods["grouped"] = self._by_grouped_convolution
        if self.module.groups == 1 and self.module.dilation[-1] == 1:
            methods["channels_last"] = self._by_unfolding_channels_last
        return methods

    def _method(self) -> str:
        """The fastest way to materialize, measured once per layer shape: unfolding the
        input (channels first or channels last) into patches for one batched product, or a
        grouped convolution. Which one wins depends on the shapes, the hardware and the load:
        on a 2-core CPU the channels-last patches win on 2C2D's second layer (41 → 32 ms) and
        on every 3C3D layer (e.g. the third, 26 → 16 ms) but lose on a first layer with one
        input channel; the grouped convolution lost everywhere when measured."""
        x = self.x
        key = (tuple(x.shape), tuple(self.delta.shape), self.shape, self.module.stride,
               self.module.dilation, self.module.groups, x.dtype, x.device.type,
               _UNFOLD_CACHE is None)
        method = _METHODS.get(key)
        if method is None:
            timings = {}
            for name, run in self._methods().items():
                times = []
                for _ in range(3):  # the first run is cold (scratch memory, kernels)
                    start = time.perf_counter()
                    run()
                    if x.device.type == "cuda":
                        torch.cuda.synchronize(x.device)
                    times.append(time.perf_counter() - start)
                timings[name] = min(times[1:])
            method = _METHODS[key] = min(timings, key=timings.__getitem__)
        return method

    def materialize_owned(self) -> Tensor:
        grads = self.materialize()
        if self._ticket is None:
            return grads
        return grads.clone(memory_format=torch.contiguous_format)  # copy only scratch

    def dots(self, u: Tensor) -> Tensor:
        return self.dots_many([u])[0]

    def _materialize_for_projections(self, num_directions: int) -> bool:
        """Materializing costs about one convolution (the layer's weight-gradient FLOPs) and
        then every projection is a cheap pass over N·D numbers; projecting by convolution
        costs one convolution per direction and never builds g_n. So materialize for two or
        more directions; for one on a CPU when D ≤ C_out·L (few input channels per kernel,
        many positions: the gradients are no larger than δ), never on an accelerator (the
        same FLOPs in two or three kernels instead of the unfolding's five or more and the
        product, whose launches bind the step; no patches in memory)."""
        positions = math.prod(self.delta.shape[2:])  # (not a view of δ: no op)
        return num_directions >= 2 or (not device_path(self.delta.device)
                                       and self.shape[1:].numel() <= positions)

    def dots_scratch_bytes(self, num_directions: int) -> int:
        """Projected by convolution: the K convolutions' outputs, K times δ's size (no
        individual gradients); materialized: those of :meth:`scratch_bytes`."""
        if self._rows is not None or self._materialize_for_projections(num_directions):
            return self.scratch_bytes()
        return num_directions * self.delta.numel() * self.delta.element_size()

    def dots_many(self, us: Sequence[Tensor]) -> Tensor:
        if self._rows is not None or self._materialize_for_projections(len(us)):
            rows = self.chunks()[0]  # one chunk [N, D]
            return self._directions(us, rows.dtype) @ rows.T
        module, delta = self.module, self.delta
        n, groups, c_out = delta.shape[0], module.groups, delta.shape[1]
        k, og = len(us), c_out // groups
        # weights [K, G, Og, Cg, *kernel] → [G·K·Og, Cg, *kernel]: group g's output
        # channels stay together, as the grouped convolution requires
        if k == 1:  # (the direction as the weight itself: no copy)
            weight = in_dtype(us[0].reshape(self.shape), delta.dtype)
        else:
            stacked = in_dtype(torch.stack([u.reshape(self.shape) for u in us]), delta.dtype)
            stacked = stacked.reshape(k, groups, og, *self.shape[1:])
            weight = stacked.transpose(0, 1).reshape(k * c_out, *self.shape[1:])
        conv = _CONV[len(module.kernel_size)]
        if self._padded is None and module.padding_mode == "zeros":  # (no padded copy)
            out = conv(self._input, weight, None, module.stride, module.padding,
                       module.dilation, groups)
        else:
            out = conv(self.x, weight, None, module.stride, 0, module.dilation, groups)
        if groups == 1:  # ⟨conv(x_n; U_k), δ_n⟩ for all k by one batched matvec
            dots = torch.bmm(out.reshape(n, k, -1), delta.reshape(n, -1, 1))  # [N, K, 1]
            return dots.reshape(n, k).T * self.scale
        out = out.reshape(n, groups, k, og, -1)  # [N, G, K, Og, L]
        dots = torch.einsum("ngkol,ngol->kn", out, delta.reshape(n, groups, og, -1))
        return dots * self.scale


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_rule(
    module: nn.modules.conv._ConvNd, args: tuple, kwargs: dict, output: Tensor,
    grad_output: Tensor, scale: float = 1.0,
) -> dict[str, SampleGrads]:
    """Individual gradients of a convolution's weight and bias from its input and
    ``scale · grad_output`` (the scale is folded into the small results, see tracker)."""
    x = args[0] if args else kwargs["input"]
    if x.dim() != len(module.kernel_size) + 2:
        raise ValueError(
            f"{type(module).__name__} received an input of shape {tuple(x.shape)} without "
            "batch dimension; Cockpit needs batched inputs [batch, channels, ...]."
        )
    grads: dict[str, SampleGrads] = {}
    delta = grad_output
    if module.weight.requires_grad:
        cache, key = _UNFOLD_CACHE, (id(module), id(x), x._version)
        if cache is None:  # (padded where first needed)
            grads["weight"] = ConvSampleGrads(module, None, delta, key, scale,
                                              x=outside_autograd(x))
        else:
            if ("padded", key) not in cache:
                cache[("padded", key)] = _explicit_padding(module, outside_autograd(x))
            grads["weight"] = ConvSampleGrads(module, cache[("padded", key)], delta, key,
                                              scale)
    if module.bias is not None and module.bias.requires_grad:
        bias = delta.sum(tuple(range(2, delta.dim())))  # Σ_l δ_{n,:,l}
        grads["bias"] = DenseSampleGrads(bias, scale=scale)
    return grads


conv_rule.takes_scale = True  # type: ignore[attr-defined]


def folded_weight_sum_sq(module: nn.modules.conv._ConvNd, x: Tensor, folded: Tensor,
                         budget_bytes: int, separate: bool = False) -> Tensor | None:
    """Σ_k Σ_n g_{k,n} ⊙ g_{k,n} of the weight of a convolution with one group, for the
    output gradients δ_{k,n} of K vectors per sample (``folded``: [K·N, C_out, *out], k
    major; ``x``: the recorded input [N, C_in, *in]), float64 of the weight's shape (with
    ``separate`` each vector's Σ_n apart, [K, *weight.shape]); None where the input's
    patches alone exceed ``budget_bytes``.

    g_{k,n} = δ_{k,n} U_nᵀ with the same patches U_n for every k, so the K vectors are K·C_out
    output channels of one product per sample, [δ_{1,n}; …; δ_{K,n}] U_nᵀ: the patches of N
    samples are formed once instead of those of K·N repeated inputs. Vectors are taken in
    groups whose K'·N individual gradients (squared in place) and output gradients fit the
    budget beside the patches."""
    n = x.shape[0]
    k, c_out = len(folded) // n, folded.shape[1]
    out_sizes = folded.shape[2:]
    positions = math.prod(out_sizes)
    patch_numbers = n * module.weight.shape[1:].numel() * positions
    itemsize = max(folded.element_size(), x.element_size())
    free = budget_bytes - patch_numbers * itemsize
    per_vector = n * (module.weight.numel() + c_out * positions) * itemsize
    if free < per_vector:
        return None
    patches = _patches(module, _explicit_padding(module, outside_autograd(x)), out_sizes)
    patches = in_dtype(patches, folded.dtype).transpose(1, 2)  # [N, L, C_in·K]
    step = min(k, free // per_vector)
    parts: list[Tensor] = []
    for start in range(0, k, step):
        vectors = min(step, k - start)
        deltas = folded[start * n:(start + vectors) * n].reshape(vectors, n, c_out, positions)
        stacked = deltas.transpose(0, 1).reshape(n, vectors * c_out, positions)
        grads = torch.bmm(in_dtype(stacked, patches.dtype), patches)  # [N, K'·C_out, C_in·K]
        parts.append(sample_sum_sq(grads, owned=True, widen=False).view(vectors, -1))  # [K', D]
    each = in_dtype(parts[0] if len(parts) == 1 else torch.cat(parts), torch.float64)  # [K, D]
    return each.view(k, *module.weight.shape) if separate else each.sum(0).view(module.weight.shape)
