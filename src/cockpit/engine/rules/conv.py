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
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cockpit.engine.rules.registry import register_rule
from cockpit.engine.sample_grads import DenseSampleGrads, SampleGrads
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
    """Unfolded input ``[N, G, (C_in/G)·K, L]`` of the padded input ``x``.

    A strided view ``[N, C_in, *kernel, *out]`` copied once (into ``out`` if given, a
    buffer of that many elements). The output positions are the innermost (fastest)
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
        view = out.view(view.shape).copy_(view)
    return view.reshape(n, module.groups, -1, math.prod(out_sizes))


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
    padded input x and the output gradient δ.

    * projections never build g_n: with W' = U (a direction in weight space),
      g_nᵀ U = Σ_l δ_{n,:,l}ᵀ (U * patch_l(x_n)) = ⟨δ_n, conv(x_n; U)⟩, one convolution of the
      batch with weight U (padding already applied to x, the layer's stride, dilation and
      groups); K directions share one convolution with K·C_out output channels;
    * every other statistic (norms, Gram, sums of squares, histograms) materializes
      ``[N, *W.shape]`` once by a batched matmul of δ with the unfolded input and caches it,
      so all statistics of one layer share one materialization (memory: one layer's |B|×D,
      freed with this object inside the layer's hook).
    """

    def __init__(
        self, module: nn.modules.conv._ConvNd, x_padded: Tensor, delta: Tensor, key=None,
        scale: float = 1.0,
    ):
        self.module, self.x, self.delta = module, x_padded, delta
        self.scale = scale  # the individual gradients are scale · δ_n U_nᵀ
        self.num_samples = delta.shape[0]
        self.shape = module.weight.shape
        self._grads: Tensor | None = None
        self._ticket: tuple | None = None  # workspace ticket of self._grads, if borrowed
        self._key = key  # identifies the input in the unfold cache, if one is active

    def _unfolded(self) -> Tensor:
        cache = _UNFOLD_CACHE
        if cache is not None and self._key is not None and ("patches", self._key) in cache:
            return cache[("patches", self._key)]
        out_sizes = self.delta.shape[2:]
        if cache is not None and self._key is not None:  # kept for several backprops
            patches = _patches(self.module, self.x, out_sizes)
            cache[("patches", self._key)] = patches
            return patches
        numel = self.x.shape[:2].numel() * math.prod(self.module.kernel_size) * out_sizes.numel()
        buffer, _ = workspace().take("patches", (numel,), self.x.dtype, self.x.device)
        return _patches(self.module, self.x, out_sizes, out=buffer)

    def materialize(self) -> Tensor:
        if self._ticket is not None and not workspace().valid(self._ticket):
            self._grads = None  # another layer reused the buffer
        if self._grads is None:
            if _UNFOLD_CACHE is None and self._method() == "grouped":
                self._grads, self._ticket = self._by_grouped_convolution(), None
            else:
                self._grads = self._by_unfolding()
        return self._grads

    def _by_unfolding(self) -> Tensor:
        """g_n = δ_n U_nᵀ: unfold the input, one batched matrix product."""
        module, delta = self.module, self.delta
        n, groups, c_out = delta.shape[0], module.groups, delta.shape[1]
        patches = self._unfolded()  # [N, G, Cg·K, L]
        delta = delta.reshape(n, groups, c_out // groups, patches.shape[-1])  # [N, G, Og, L]
        grads, self._ticket = workspace().take(
            "grads", (n, groups, c_out // groups, patches.shape[2]), delta.dtype, delta.device)
        if groups == 1:  # scale folded into the batched product
            torch.baddbmm(grads[:, 0], delta[:, 0], patches[:, 0].transpose(1, 2),
                          beta=0, alpha=self.scale, out=grads[:, 0])
        else:
            torch.matmul(delta, patches.transpose(2, 3), out=grads)  # [N, G, Og, Cg·K]
            if self.scale != 1.0:
                grads.mul_(self.scale)
        return grads.reshape(n, *self.shape)

    def _by_grouped_convolution(self) -> Tensor:
        """g_n as the weight gradient of one convolution whose groups are the samples: the
        batch folded into channels, [1, N·C_in, …] ⊛ [N·C_out, C_in/G, …], groups N·G."""
        module, x, delta = self.module, self.x, self.delta
        n = delta.shape[0]
        weight_shape = (n * self.shape[0], *self.shape[1:])
        dims = len(module.kernel_size)
        grads = torch.ops.aten.convolution_backward(
            delta.reshape(1, -1, *delta.shape[2:]), x.reshape(1, -1, *x.shape[2:]),
            x.new_empty(weight_shape), None, list(module.stride), [0] * dims,
            list(module.dilation), False, [0] * dims, n * module.groups, [False, True, False],
        )[1]
        grads = grads.reshape(n, *self.shape)
        return grads.mul_(self.scale) if self.scale != 1.0 else grads

    def _method(self) -> str:
        """The faster of the two ways to materialize, measured once per layer shape (which
        one wins depends on the shapes, the hardware and the load: on a 2-core CPU the grouped
        convolution once measured 1.5× faster for 2C2D's second layer, and 1.4–3.6× slower
        than unfolding into scratch memory on every 3C3D and 2C2D layer in session 3)."""
        key = (tuple(self.x.shape), tuple(self.delta.shape), self.shape, self.module.stride,
               self.module.dilation, self.module.groups, self.x.dtype, self.x.device.type)
        method = _METHODS.get(key)
        if method is None:
            timings = {}
            for name, run in (("unfold", self._by_unfolding),
                              ("grouped", self._by_grouped_convolution)):
                times = []
                for _ in range(2):  # the second run is warm (scratch memory, kernels)
                    start = time.perf_counter()
                    run()
                    if self.x.device.type == "cuda":
                        torch.cuda.synchronize(self.x.device)
                    times.append(time.perf_counter() - start)
                timings[name] = times[-1]
            method = _METHODS[key] = min(timings, key=timings.__getitem__)
        return method

    def materialize_owned(self) -> Tensor:
        grads = self.materialize()
        return grads.clone() if self._ticket is not None else grads  # copy only scratch

    def chunks(self) -> list[Tensor]:
        return [self.materialize()]

    def dots(self, u: Tensor) -> Tensor:
        return self.dots_many([u])[0]

    def _materialize_for_projections(self, num_directions: int) -> bool:
        """Materializing costs about one convolution (the layer's weight-gradient FLOPs) and
        then every projection is a cheap pass over N·D numbers; projecting by convolution
        costs one convolution per direction and never builds g_n. So materialize for two or
        more directions, and for one when D ≤ C_out·L (few input channels per kernel, many
        positions: the gradients are no larger than δ)."""
        positions = self.delta[0, 0].numel()
        return num_directions >= 2 or self.shape[1:].numel() <= positions

    def dots_many(self, us: Sequence[Tensor]) -> Tensor:
        if self._grads is not None or self._materialize_for_projections(len(us)):
            return super().dots_many(us)
        module, delta = self.module, self.delta
        n, groups, c_out = delta.shape[0], module.groups, delta.shape[1]
        k, og = len(us), c_out // groups
        # weights [K, G, Og, Cg, *kernel] → [G·K·Og, Cg, *kernel]: group g's output
        # channels stay together, as the grouped convolution requires
        stacked = torch.stack([u.reshape(self.shape) for u in us]).to(delta.dtype)
        stacked = stacked.reshape(k, groups, og, *self.shape[1:])
        weight = stacked.transpose(0, 1).reshape(k * c_out, *self.shape[1:])
        conv = _CONV[len(module.kernel_size)]
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
        if cache is not None and ("padded", key) in cache:
            x_padded = cache[("padded", key)]
        else:
            x_padded = _explicit_padding(module, x.detach())
            if cache is not None:
                cache[("padded", key)] = x_padded
        grads["weight"] = ConvSampleGrads(module, x_padded, delta, key, scale)
    if module.bias is not None and module.bias.requires_grad:
        bias = delta.flatten(2).sum(2)
        grads["bias"] = DenseSampleGrads(bias * scale if scale != 1.0 else bias)
    return grads


conv_rule.takes_scale = True  # type: ignore[attr-defined]
