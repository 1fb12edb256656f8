r"""Layers of one shape stacked: their statistics in the kernels of one layer.

A tracked step on an accelerator is bound by the host issuing kernels, and every Linear
layer costs the same dozen of them whatever its size (its individual gradients, their
norms, a histogram's three, the dot products). Transformers repeat a few shapes many
times (GPT-2's blocks: four Linear shapes, each once per block), so the processor
(:class:`~cockpit.engine.processing.CallProcessor`) holds the factors (δ, a) of Linear
weights with the same shape, number of samples and dtype until a stack of them is full (or
the backward pass ends) and forms the individual gradients of all L layers at once,

    G = [G_1; …; G_L] ∈ R^{L × N × D},   G_l = [g_{l,1} … g_{l,N}]ᵀ,
    g_{l,n} = Σ_t δ_{l,n,t} a_{l,n,t}ᵀ   (one ``bmm`` of the concatenated factors; under
                                        autocast of their half-precision values,
                                        :mod:`cockpit.engine.narrow_products`),

from which

* ‖g_{l,n}‖: one norm over the L·N rows;
* Σ_n g_{l,n} ⊙ g_{l,n} (TICDiag eq. 29): the squares of G summed over the samples, as one
  layer's (:func:`cockpit.engine.float_sums.sample_sum_sq`);
* the counts of GradHist1d (eq. 15) per layer: every element's search index (the same
  edges as one layer alone) plus its lane's and its layer's offset, counted by one
  ``histc`` over L·(lanes)·(bins + 2) slots (:func:`cockpit.engine.histograms.device.tally`
  for one layer); where the one-pass kernel counts (CUDA, many values) one launch for all
  layers, each counted apart (:func:`cockpit.engine.histograms.fused.tally_rows`);
* g_{l,n}ᵀu_{l,k} for K directions per layer: on CUDA one pass of a Triton kernel over G
  for all K (:mod:`cockpit.engine.row_dots`), elsewhere per direction one product with G
  and one sum over D, [L, N] (a batched matrix product [K, D] × [D, N] ran 20× slower on a
  GPU); where no statistic needs G (one direction: the step after a tracked one projects
  on s_t) from the factors, Σ_t δ_{l,n,t}ᵀ U a_{l,n,t}, and G is never formed.

Normalization layers of one shape (LayerNorm, RMSNorm, GroupNorm: GPT-2's 25 LayerNorms,
a ResNet's GroupNorms per stage) are stacked one step earlier, by their rule's inputs: x̂ of
the concatenated inputs [x_1; …; x_L] is one normalization (each sample is normalized on its
own), g(γ) = Σ δ ⊙ x̂ and g(β) = Σ δ one product and two sums for all L layers
(:func:`form_norm_stack`), and the L layers' small individual gradients then go side by side
as before. A norm stack holds at most a quarter of the budget of inputs and output gradients.

A Linear stack's individual gradients take at most half the memory budget and its histogram's
search and spread index (8 bytes a value, in blocks of layers) the other half, so that its
scratch stays within what one large layer may hold. The values equal those of
one layer at a time up to the order of float additions (the same products G; the norms and
dot products summed over G instead of the factors).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from cockpit.engine import narrow_products, row_dots
from cockpit.engine.dtypes import in_dtype
from cockpit.engine.float_sums import sample_sum_sq
from cockpit.engine.histograms import fused
from cockpit.engine.histograms.device import (
    COUNTER_LIMIT,
    DEFAULT_BUDGET,
    LaneCounts,
    bin_index,
    dense_tallies,
    lane_counts_1d,
    lanes,
)
from cockpit.engine.histograms.exact import BinSpec, device_edges
from cockpit.engine.rules.norms import group_norm_rule, layer_norm_rule, rms_norm_rule
from cockpit.engine.rules.sample_grads import (
    DenseSampleGrads,
    OuterSampleGrads,
    SampleGrads,
    SequenceOuterSampleGrads,
)

STACKABLE = (OuterSampleGrads, SequenceOuterSampleGrads)
"""The representations whose individual gradients a stack forms together (Linear weights)."""

_WIDE = (torch.float32, torch.float64)


def key(sg: OuterSampleGrads | SequenceOuterSampleGrads) -> tuple | None:
    """What layers stacked together share (their representation, N, the factors' shapes
    and dtypes, the device, the scale held apart and which factor takes it), or None where
    ``sg`` is not stacked (half-precision gradients: one layer at a time, as their
    histograms bin them)."""
    if type(sg) is OuterSampleGrads:
        delta, a, wide = sg.delta, sg.a, None
        if delta.dtype != a.dtype or delta.dtype not in _WIDE:
            return None
        scale: tuple = ()
    elif type(sg) is SequenceOuterSampleGrads:
        delta, a = sg.factors
        wide, scale = sg.wide, (sg.scale, sg.scaled)
        if sg.dtype not in _WIDE:
            return None
    else:
        return None
    return (type(sg), tuple(delta.shape), tuple(a.shape), delta.dtype, a.dtype, wide,
            *scale, delta.device)  # (the device last: the processor reads it there)


def capacity(sg: OuterSampleGrads | SequenceOuterSampleGrads, budget: int | None) -> int:
    """How many layers like ``sg`` one stack holds: their |B| individual gradients within
    half the memory budget (None: :data:`DEFAULT_BUDGET`)."""
    half = (DEFAULT_BUDGET if budget is None else budget) // 2
    return half // max(sg.num_samples * sg.shape.numel() * sg.dtype.itemsize, 1)


class Stack:
    """The Linear weights of one :func:`key` waiting to be formed together (at most
    ``size`` of them), and the names whose parameter gradient has not arrived yet."""

    def __init__(self, size: int):
        self.size = size
        self.names: list[str] = []
        self.grads: list[OuterSampleGrads | SequenceOuterSampleGrads] = []
        self.waiting: set[str] = set()

    @property
    def full(self) -> bool:
        return len(self.names) >= self.size

    def add(self, name: str, sg: OuterSampleGrads | SequenceOuterSampleGrads) -> None:
        self.names.append(name)
        self.grads.append(sg)


class StackedGrads:
    """G = [G_1; …; G_L], [L, N, D], of L Linear weights of one :func:`key`: the factors
    concatenated at once, G (``rows``) formed when a statistic first reads it; dot products
    before that from the factors, without G (:meth:`dots`)."""

    def __init__(self, grads: Sequence[OuterSampleGrads | SequenceOuterSampleGrads]):
        first = grads[0]
        self.num_layers, self.num_samples = len(grads), first.num_samples
        self.shape = first.shape
        # whether G is formed from the half-precision factors as they are (summed in
        # float32), with the stack's one scale c (as its key says) in the product
        self._narrow = False
        self._factors: tuple[Tensor, Tensor] | None = None  # (δ, a) widened, with c
        if type(first) is SequenceOuterSampleGrads:
            deltas, inputs = zip(*[sg.factors for sg in grads], strict=True)  # type: ignore[union-attr]
            delta, a = torch.cat(deltas), torch.cat(inputs)
            self._joined = (delta, a)  # [L·N, T, I], [L·N, T, J]
            self._wide, self._scale, self._scaled = first.wide, first.scale, first.scaled
            self._narrow = first.half_products()  # (the concatenation: the same dtypes)
            self.positions = delta.shape[1]
        else:
            self._factors = (torch.cat([sg.delta for sg in grads]),  # type: ignore[union-attr]
                             torch.cat([sg.a for sg in grads]))  # type: ignore[union-attr]
            self.positions = 1
        self._rows: Tensor | None = None

    def _widened(self) -> tuple[Tensor, Tensor]:
        """(δ, a) of all layers in the gradients' dtype, c multiplied into one of them
        (formed when first read; never where G comes from the half-precision factors)."""
        if self._factors is None:
            wide = self._wide
            factors = [x if wide is None or x.dtype == wide else x.to(wide)
                       for x in self._joined]
            if self._scale != 1.0:  # in place: the concatenation (or its widened copy) is
                factors[self._scaled].mul_(self._scale)  # Cockpit's own, not a layer's
            self._factors = (factors[0], factors[1])
        return self._factors

    @property
    def rows(self) -> Tensor:
        """G, [L, N, D] (formed once, when first read)."""
        if self._rows is None:
            if self._narrow:
                delta, a = self._joined
                rows = narrow_products.wide_products(delta.transpose(1, 2), a, self._scale)
            elif (factors := self._widened())[0].dim() == 3:
                rows = torch.bmm(factors[0].transpose(1, 2), factors[1])  # [L·N, I, J]
            else:
                rows = factors[0].unsqueeze(2) * factors[1].unsqueeze(1)
            self._rows = rows.view(self.num_layers, self.num_samples, -1)
        return self._rows

    def layer(self, index: int) -> Tensor:
        """G_l as the individual gradients of layer l, [N, I, J] (a view)."""
        return self.rows[index].view(self.num_samples, *self.shape)

    def norms(self) -> list[Tensor]:
        """‖g_{l,n}‖, [N] per layer: one norm over every row."""
        norms = torch.linalg.vector_norm(self.rows, dim=2)  # [L, N]
        return list(norms.unbind(0))

    def sum_sq(self) -> list[Tensor]:
        """Σ_n g_{l,n} ⊙ g_{l,n} per layer, float64 of the weight's shape: the squares in
        G's dtype summed over the samples as one layer's materialized form
        (:func:`~cockpit.engine.float_sums.sample_sum_sq`)."""
        sums = sample_sum_sq(self.rows, dim=1)  # [L, D]
        return list(sums.view(self.num_layers, *self.shape).unbind(0))

    def dots(self, directions: Sequence[Sequence[Tensor]]) -> Tensor:
        """[g_{l,n}ᵀu_{l,k}]_{k,n,l}, [K, N, L] (``directions[l]``: layer l's K directions,
        each of the weight's shape or flat): from G where a statistic formed it, else from
        the factors, g_{l,n}ᵀu = Σ_t δ_{l,n,t}ᵀ U a_{l,n,t} (:meth:`_factor_dots`)."""
        k = len(directions[0])
        every = [u for us in directions for u in us]
        if len({u.shape for u in every}) > 1:  # (θ's shape and flat ones: all flat)
            every = [u.reshape(-1) for u in every]
        stacked = torch.stack(every)  # [L·K, *shape]
        if self._rows is None and self._factors_pay(k):
            return self._factor_dots(stacked, k)
        rows = self.rows
        u = in_dtype(stacked.view(self.num_layers, k, -1), rows.dtype)
        if row_dots.available(rows, k):  # (CUDA: one pass over G for all K directions)
            try:
                return row_dots.row_dots(rows, u).permute(2, 1, 0)
            except Exception as error:  # e.g. no compiler for Triton: as below
                row_dots.disable(error)
        # One product and sum over D per direction, not ``bmm(u, Gᵀ)``: for K ≥ 2 cuBLAS
        # reduced D (millions) for the tiny [K, N] outputs with a kernel that took 18–23 ms
        # a stack of GPT-2 124M's weights on an H200, 0.8 ms this way
        # (``benchmarks/stacked_dots.py``).
        return torch.stack([(rows * u[:, i].unsqueeze(1)).sum(2)
                            for i in range(k)]).transpose(1, 2)

    def _factors_pay(self, k: int) -> bool:
        """Whether K directions' dot products from the factors take no more FLOPs than
        forming G (one direction, or no positions: a product with U_k costs I·J per position
        and direction, G as much per position once) and no more memory than G (T·K·min(I, J)
        ≤ I·J: the product has the narrower factor's width). Not where G comes from
        half-precision factors on tensor cores: there its FLOPs cost a fraction of the
        factors' float32 products (they multiply the direction in float32)."""
        positions = self.positions
        return (not self._narrow and (k == 1 or positions == 1)
                and positions * k <= max(self.shape))

    def _factor_dots(self, stacked: Tensor, k: int) -> Tensor:
        """:meth:`dots` without G, g_{l,n}ᵀu = Σ_t δ_{l,n,t}ᵀ U a_{l,n,t}: per layer the K
        directions side by side and one batched product for all layers, δ [U_1 … U_K]
        (J ≤ I) or a [U_1ᵀ … U_Kᵀ], then a product with the other factor and a sum over the
        positions and the width. The FLOPs of forming G for K = 1 (the step after a tracked
        one, where only s_t is projected), without G's memory and traffic (GPT-2 124M at
        B = 8: 2.7 GB of individual gradients written, then read with the direction: 8 GB
        less of a GPU's memory traffic in that step)."""
        layers, n = self.num_layers, self.num_samples
        i, j = self.shape
        delta, a = self._widened()
        u = in_dtype(stacked, delta.dtype).view(layers, k, i, j)
        if j <= i:  # [U_1 … U_K] ∈ R^{I × K·J}
            weights = u.transpose(1, 2).reshape(layers, i, k * j)
            first, second, width = delta.view(layers, -1, i), a, j
        else:  # [U_1ᵀ … U_Kᵀ] ∈ R^{J × K·I}
            weights = u.permute(0, 3, 1, 2).reshape(layers, j, k * i)
            first, second, width = a.view(layers, -1, j), delta, i
        products = torch.bmm(first, weights).view(layers, n, -1, k, width)  # [L, N, T, K, ·]
        return (products * second.view(layers, n, -1, 1, width)).sum((2, 4)).permute(2, 1, 0)

    def layer_dots(self, index: int, directions: Sequence[Tensor]) -> Tensor:
        """[g_{l,n}ᵀu_k]_{k,n} of layer l alone, [K, N] (on CUDA by the dot-product kernel
        where G is large, as :meth:`dots`)."""
        u = in_dtype(torch.stack([v.reshape(-1) for v in directions]), self.rows.dtype)
        return row_dots.sample_dots(self.rows[index], u)

    def histograms(self, spec: BinSpec, budget: int | None) -> list[Tensor | LaneCounts]:
        """Counts [bins] of every layer's N·D elements in ``spec``'s bins, with the edges of
        one layer alone (see the module docstring), int64: by one launch of the one-pass
        kernel where it counts, else the layers in blocks whose index and spread index
        (8 bytes a value) fit half of ``budget``."""
        values, edges = device_edges(self.rows, spec)
        slots = edges.numel() + 1
        per_layer = values.shape[1] * values.shape[2]
        uniform = (spec.lo, spec.hi)
        if fused.available(values) and per_layer <= fused.block_limit(lanes(slots)):
            try:
                tallies = fused.tally_rows(values.view(self.num_layers, -1), edges,
                                           lanes(slots), uniform)
                return list(_finite(tallies.view(self.num_layers, -1, slots)).unbind(0))
            except Exception as error:  # e.g. no compiler for Triton: count without it
                fused.disable(error)
        num_lanes = lanes(self.num_layers * slots)
        if per_layer % num_lanes or per_layer > num_lanes * COUNTER_LIMIT:
            # (an odd size, or more values than the stack's fewer lanes count exactly)
            return [lane_counts_1d(dense_tallies([layer], edges, budget, uniform), spec.bins)
                    for layer in values.unbind(0)]
        flat = values.view(self.num_layers, -1, num_lanes)
        scratch = (DEFAULT_BUDGET if budget is None else budget) // 16  # (half the budget)
        step = max(1, scratch // per_layer)
        counts: list[Tensor | LaneCounts] = []
        for part in flat.split(step):
            layers = part.shape[0]
            spread = torch.add(bin_index(part, edges),
                               _offsets(layers, num_lanes, slots, part.device))
            total = layers * num_lanes * slots
            tally = torch.histc(spread, bins=total, min=0, max=total)
            counts += _finite(tally.view(layers, num_lanes, slots)).unbind(0)
        return counts


def _finite(tallies: Tensor) -> Tensor:
    """The counts of the finite values, [layers, bins] int64, from lane counts
    [layers, lanes, slots] (slots 1 … bins; float32 counts of at most 2^24: exact)."""
    return tallies[:, :, 1:-1].sum(1, dtype=torch.long)


@functools.lru_cache(maxsize=32)
def _offsets(layers: int, num_lanes: int, slots: int, device: torch.device) -> Tensor:
    """l·L·slots + k·slots + ½ for lane k of layer l, [layers, 1, L] float32 (exact: below
    2^24)."""
    lane = torch.arange(num_lanes, dtype=torch.float32) * slots
    layer = torch.arange(layers, dtype=torch.float32) * (num_lanes * slots)
    return (layer.view(-1, 1, 1) + lane.view(1, 1, -1) + 0.5).to(device)


NORM_RULES = (layer_norm_rule, rms_norm_rule, group_norm_rule)
"""The normalization rules whose layers a norm stack forms together (BatchNorm in eval mode
normalizes by each layer's own running statistics: one layer at a time)."""


def norm_key(module: nn.Module, rule, x: Tensor, delta: Tensor, scale: float) -> tuple | None:
    """What normalization layers stacked together share (the rule and its settings, the
    input's and output gradient's shapes and dtypes, the device, the loss weight's scale,
    which affine parameters are trained), or None where the layer is not stacked."""
    if rule not in NORM_RULES or type(module) not in (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm):
        return None
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    settings = getattr(module, "normalized_shape", None) or getattr(module, "num_groups", None)
    return (rule, settings, module.eps, tuple(x.shape), x.dtype, tuple(delta.shape),
            delta.dtype, x.device, scale, weight is not None and weight.requires_grad,
            bias is not None and bias.requires_grad)


def norm_capacity(x: Tensor, delta: Tensor, budget: int | None) -> int:
    """How many normalization layers like this one a norm stack holds: their inputs and
    output gradients within a quarter of the memory budget (None: :data:`DEFAULT_BUDGET`)
    (forming them takes about as much again, and x̂ and δ ⊙ x̂ one input each)."""
    quarter = (DEFAULT_BUDGET if budget is None else budget) // 4
    held = x.numel() * x.element_size() + delta.numel() * delta.element_size()
    return quarter // max(held, 1)


class NormStack:
    """Normalization layers of one :func:`norm_key` waiting to be formed together (at most
    ``size``): each layer's unit, input x and output gradient δ, as its rule reads them."""

    def __init__(self, size: int, rule, scale: float):
        self.size, self.rule, self.scale = size, rule, scale
        self.units: list = []
        self.inputs: list[Tensor] = []
        self.deltas: list[Tensor] = []

    @property
    def full(self) -> bool:
        return len(self.units) >= self.size

    def add(self, unit, x: Tensor, delta: Tensor) -> None:
        self.units.append(unit)
        self.inputs.append(x)
        self.deltas.append(delta)


def form_norm_stack(stack: NormStack) -> list[dict[str, SampleGrads]]:
    """Each layer's individual gradients (attribute → :class:`DenseSampleGrads`, the rule's
    own) from one call of the rule on the concatenated inputs and output gradients: the
    samples of layer l are rows l·N … (l + 1)·N − 1 of every result (views)."""
    x, delta = torch.cat(stack.inputs), torch.cat(stack.deltas)
    extra = {"scale": stack.scale} if stack.scale != 1.0 else {}
    joined = stack.rule(stack.units[0].module, (x,), {}, None, delta, **extra)
    n = stack.inputs[0].shape[0]
    out: list[dict[str, SampleGrads]] = [{} for _ in stack.units]
    for attr, sg in joined.items():
        assert isinstance(sg, DenseSampleGrads)
        for index, part in enumerate(sg.unscaled.split(n)):
            out[index][attr] = DenseSampleGrads(part, scale=sg.scale)
    return out
