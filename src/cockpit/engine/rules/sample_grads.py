"""Individual gradients of one parameter tensor, held implicitly.

A layer rule turns a layer's stored input ``a`` and output gradient ``δ`` into one
:class:`SampleGrads` per parameter. It represents the |B| individual gradients

    g_n = ∇_θ ℓ_n ∈ R^{shape(θ)},   n = 1, …, |B|,

(the gradient of the n-th *individual* loss, not ℓ_n / |B|) and answers the questions the
instruments ask, each with a closed form where the layer structure allows one:

* ``norms()``         ‖g_n‖                        shape [N]
* ``sq_norms()``      ‖g_n‖²                       shape [N]
* ``chunk_norms()``   ‖g_n‖ from the materialized gradients (where they are formed anyway)
* ``gram_mean()``     g_nᵀ ḡ  with ḡ = (1/N) Σ_m g_m  shape [N]
* ``dots(u)``         g_nᵀ u for a direction u      shape [N]
* ``dots_many(us)``   g_nᵀ u_k for K directions at once (one pass)  shape [K, N]
* ``sum_sq()``        Σ_n g_n ⊙ g_n                 shape of θ, float64
* ``centered_sum_sq()`` Σ_n (g_n − ḡ) ⊙ (g_n − ḡ)    shape of θ, float64 (no cancellation)
* ``histogram(spec)`` counts of all N·D elements g_{n,j}
* ``histogram2d(theta, spec_g, spec_theta)`` counts of the pairs (g_{n,j}, θ_j)
* ``select(start, stop)`` the samples of a range alone (where ``selectable``), so that a
  layer above the memory budget is processed in sample chunks
  (:mod:`cockpit.engine.rules.sample_chunks`); ``scratch_bytes()`` what its statistics
  would hold at once, ``dots_scratch_bytes(k)`` what ``dots_many`` with k directions holds

:class:`DenseSampleGrads` materializes ``[N, *shape]`` and serves as the general fallback;
:class:`OuterSampleGrads` and :class:`SequenceOuterSampleGrads` hold g_n = Σ_t δ_{n,t} a_{n,t}ᵀ
in factored form (Linear layers) and never build the N×I×J tensor unless a question needs it;
the convolution rule's ``ConvSampleGrads`` (:mod:`cockpit.engine.rules.conv`) answers
projections by a convolution and materializes (once, cached) only for norms and histograms.

Sums of squares accumulate in float64 without a float64 copy of the |B|×D tensor: the squares
are formed in the gradients' dtype and summed with a float64 accumulator.
"""

from __future__ import annotations

import functools
import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from cockpit.engine import narrow_products, row_dots
from cockpit.engine.dtypes import in_dtype, promote
from cockpit.engine.float_sums import sample_sum_sq
from cockpit.engine.histograms.device import DEFAULT_BUDGET, LaneCounts, device_path
from cockpit.engine.histograms.exact import (
    BinSpec,
    histogram2d_dense_counts,
    histogram2d_dense_lanes,
    histogram_dense_counts,
    histogram_dense_lanes,
    histogram_outer_counts,
    histogram_outer_lanes,
)
from cockpit.engine.histograms.outer2d import histogram2d_outer_counts, histogram2d_outer_lanes

# Materialize factored per-sample gradients in chunks of at most this many elements so
# that the extra memory stays near one layer's |B|×D even for sequence inputs.
_CHUNK_ELEMENTS = 2**25

# T·K from which a sequence layer's dot products read G formed on tensor cores rather than
# multiply its factors in float32 (SequenceOuterSampleGrads._projects_by_g)
_G_ROUTE = 64


class SampleGrads(ABC):
    """The |B| individual gradients of one parameter tensor (see module docstring)."""

    num_samples: int
    shape: torch.Size
    # Whether g_nᵀḡ is best computed together with the other dot products, as one
    # ``dots_many`` pass over the gradients (False where gram_mean has its own closed form).
    fuse_dots: bool = True
    # Whether ``chunks()`` is cheap to call again (held or cached); otherwise the per-layer
    # loop memoizes it (:func:`cockpit.engine.statistics.shared_chunks`).
    caches_chunks: bool = False

    @abstractmethod
    def materialize(self) -> Tensor:
        """All individual gradients as one tensor of shape ``[N, *shape]``."""

    def materialize_owned(self) -> Tensor:
        """Like :meth:`materialize`, but never a view of scratch memory that later work
        reuses (:mod:`cockpit.engine.workspace`): safe to keep."""
        return self.materialize()

    # whether :meth:`add_to` adds fewer numbers than the individual gradients hold (an
    # embedding's rows): a sum of calls starts from another call's
    adds_sparsely: bool = False

    def add_to(self, total: Tensor) -> None:
        """``total += G`` for ``total`` of G's shape [N, *shape] (a tied weight's sum of its
        calls' individual gradients)."""
        total += self.materialize()

    def compact(self) -> SampleGrads:
        """Itself, holding no more memory than it needs while it waits (e.g. to be summed
        with the other uses of a tied weight): representations that keep a widened copy of
        narrow factors drop it (made again when read)."""
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the individual gradients are formed in."""
        return self.materialize().dtype

    def scratch_bytes(self) -> int:
        """Bytes of all |B| individual gradients at once: |B| · D · itemsize."""
        return self.num_samples * self.shape.numel() * self.dtype.itemsize

    def dots_scratch_bytes(self, num_directions: int) -> int:
        """Bytes :meth:`dots_many` holds at once for ``num_directions`` directions (by
        default those of :meth:`scratch_bytes`; less where a representation projects without
        materializing the individual gradients)."""
        return self.scratch_bytes()

    # whether :meth:`select` forms a sample range without materializing the others
    selectable: bool = False

    def select(self, start: int, stop: int) -> SampleGrads:
        """The individual gradients of the samples ``start ≤ n < stop`` alone (where
        ``selectable``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot select samples")

    def chunks(self) -> list[Tensor]:
        """Individual gradients in sample chunks ``[n_chunk, ...]`` (default: one chunk of
        shape ``[N, *shape]``). A representation may order each sample's D numbers
        differently (see :meth:`to_rows`)."""
        return [self.materialize()]

    def iter_chunks(self) -> Iterator[Tensor]:
        """The chunks of :meth:`chunks`, each formed only when the previous one is done with
        (factored representations; the others hand out their chunks as they are)."""
        yield from self.chunks()

    def to_rows(self, u: Tensor) -> Tensor:
        """A parameter-shaped tensor as one flat row [D] in the order of ``chunks()``' rows."""
        return u if u.dim() == 1 else u.reshape(-1)

    def from_rows(self, v: Tensor) -> Tensor:
        """The inverse of :meth:`to_rows`: D numbers in row order as a tensor of θ's shape."""
        return v.reshape(self.shape)

    def norms(self) -> Tensor:
        """‖g_n‖: one norm kernel per chunk; from :meth:`sq_norms` where a representation
        has its own closed form for the squares."""
        if type(self).sq_norms is not SampleGrads.sq_norms:
            return self.sq_norms().sqrt()
        return self.chunk_norms()

    def sq_norms(self) -> Tensor:
        return self.chunk_norms() ** 2

    def chunk_norms(self) -> Tensor:
        """‖g_n‖ from the materialized chunks (one norm kernel each), whatever closed form
        the representation has: the cheaper one where a statistic materialized them already."""
        return _cat([torch.linalg.vector_norm(_rows(c), dim=1) for c in self.chunks()])

    def batch_mean(self) -> Tensor:
        # 1ᵀG is a BLAS matrix-vector product: twice as fast as a reduction over dim 0
        total = total_of(c.new_ones(c.shape[0]) @ _rows(c) for c in self.chunks())
        return self.from_rows(total.div_(self.num_samples))  # (in place: a fresh sum)

    def gram_mean(self) -> Tensor:
        return self.dots(self.batch_mean())

    def dots(self, u: Tensor) -> Tensor:
        flat_u = self.to_rows(u)
        return _cat([row_dots.sample_dots(_rows(c), in_dtype(flat_u, c.dtype))
                     for c in self.iter_chunks()])

    def dots_many(self, us: Sequence[Tensor]) -> Tensor:
        """[g_nᵀ u_k]_{k,n} for several directions in one pass over the gradients (a chunk
        at a time where the representation forms them so: :meth:`iter_chunks`)."""
        # (rows in the plain order are shared by the chunks of one parameter)
        shared = type(us) is Directions and type(self).to_rows is SampleGrads.to_rows
        stacked = us.stacked if shared else None  # type: ignore[attr-defined]
        if stacked is None:
            stacked = stack_or_view([self.to_rows(u) for u in us])  # [K, D]
            if shared:
                us.stacked = stacked  # type: ignore[attr-defined]
        return _cat([row_dots.sample_dots(_rows(c), in_dtype(stacked, c.dtype))
                     for c in self.iter_chunks()], dim=1)

    def sum_sq(self) -> Tensor:
        sums = [_block_sum_sq(c) for c in self.chunks()]
        return self.from_rows(total_of([in_dtype(sums[0], torch.float64), *sums[1:]]))

    def centered_sum_sq(self) -> Tensor:
        chunks = self.chunks()
        if chunks[0].dtype == torch.float64 or self.shape.numel() < 2**14:
            mean = total_of(c.sum(0, dtype=torch.float64) for c in chunks) / self.num_samples
            return self.from_rows(total_of((c.double() - mean).pow(2).sum(0) for c in chunks))
        # Shifted sums (stable): with m ≈ ḡ from a float32 product, accumulate d_n = g_n − m
        # and d_n ⊙ d_n row by row in cache; Σ(g_n − ḡ)² = Σ d_n² − (Σ d_n)²/N exactly, and
        # the correction is tiny because m is close to ḡ.
        shift = self.to_rows(self.batch_mean())
        linear, square = torch.zeros_like(shift), torch.zeros_like(shift)
        for c in chunks:
            if device_path(c.device):  # a few kernels per chunk, not three per sample
                d = _rows(c) - shift
                linear += d.sum(0)
                square += (d * d).sum(0)
                continue
            for row in c.reshape(c.shape[0], -1):
                d = row - shift
                linear += d
                square.addcmul_(d, d)
        centered = square.double() - linear.double().pow(2) / self.num_samples
        return self.from_rows(centered)

    def histogram(self, spec: BinSpec) -> Tensor:
        return histogram_dense_counts(self.chunks(), spec)

    def histogram_lanes(self, spec: BinSpec, budget: int | None = DEFAULT_BUDGET
                        ) -> Tensor | LaneCounts:
        """:meth:`histogram`, on accelerators with the lanes not yet summed (the end of the
        backward pass sums those of every parameter at once,
        :func:`~cockpit.engine.histograms.device.sum_lanes`) and the scratch of a block within
        ``budget`` bytes. A representation with its own :meth:`histogram` and not this gets
        its counts as they are."""
        if type(self).histogram is not SampleGrads.histogram:
            return self.histogram(spec)
        return histogram_dense_lanes(self.chunks(), spec, budget)

    def histogram2d(self, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec) -> Tensor:
        return histogram2d_dense_counts([c if c.dim() == 2 else _rows(c) for c in self.chunks()],
                                        self.to_rows(theta), spec_g, spec_theta)

    def histogram2d_lanes(self, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec,
                          budget: int | None = DEFAULT_BUDGET) -> Tensor | LaneCounts:
        """:meth:`histogram2d` as :meth:`histogram_lanes` is :meth:`histogram`."""
        if type(self).histogram2d is not SampleGrads.histogram2d:
            return self.histogram2d(theta, spec_g, spec_theta)
        return histogram2d_dense_lanes([c if c.dim() == 2 else _rows(c) for c in self.chunks()],
                                       self.to_rows(theta), spec_g, spec_theta, budget)


def total_of(tensors: Iterable[Tensor]) -> Tensor:
    """The sum of the tensors (``sum()`` would add its start value 0: one op more)."""
    return functools.reduce(operator.add, tensors)


class Directions(list):
    """Directions u_1 … u_K whose dot products several sample chunks of one parameter form
    in turn: their rows [K, D] stacked by the first chunk, read by the others (GPT-2 124M's
    tied embedding in chunks of one sample stacked 3 × 38.6 M numbers per chunk)."""

    stacked: Tensor | None = None


def stack_or_view(rows: Sequence[Tensor]) -> Tensor:
    """``torch.stack(rows)``; one row as a view of itself (no copy, no kernel)."""
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(list(rows))


def outside_autograd(x: Tensor) -> Tensor:
    """A layer's recorded tensor outside autograd, for a rule to compute with: as it is where
    nothing would record (no gradient needed; or in a backward hook, where grad mode is off
    unless the user's backward creates a graph: a detach per layer would be host work on an
    accelerator), else detached."""
    return x.detach() if x.requires_grad and torch.is_grad_enabled() else x


def _sample_chunks(delta: Tensor, a: Tensor, per_sample: int
                   ) -> Iterable[tuple[Tensor, Tensor]]:
    """The factors of consecutive samples whose individual gradients (``per_sample``
    numbers each) fit :data:`_CHUNK_ELEMENTS` together; all samples at once without a split
    (a view per factor: host work on an accelerator) where they fit."""
    size = max(1, _CHUNK_ELEMENTS // max(per_sample, 1))
    if size >= delta.shape[0]:
        return [(delta, a)]
    return zip(delta.split(size), a.split(size), strict=True)


def _rows(c: Tensor) -> Tensor:
    """A chunk [n, *shape] as rows [n, D] (also for a 0-dim parameter: chunk [n] → [n, 1])."""
    return c if c.dim() == 2 else c.reshape(c.shape[0], -1)


def _cat(parts: list[Tensor], dim: int = 0) -> Tensor:
    """``torch.cat(parts, dim)``; a single part as it is (one chunk: no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _block_sum_sq(c: Tensor) -> Tensor:
    """Σ_n c_n ⊙ c_n of one block of individual gradients: float64, or float32 where an
    accelerator sums a large block (the caller widens once after adding the blocks). A sum
    of |B| squares loses no digits worth a float64 accumulator (unlike the centered sums), so
    it is formed in c's dtype: for large samples one fused multiply-add per sample into a
    cache-resident accumulator (6× faster on a CPU than squaring the whole [N, D] block and
    reducing over dim 0)."""
    if c.shape[0] <= 1 or math.prod(c.shape[1:]) < 2**14 or device_path(c.device):
        return sample_sum_sq(c, widen=False)  # (accelerators: few kernels)
    total = c[0] * c[0]
    for row in c[1:]:
        total.addcmul_(row, row)
    return total.double()


class RowNorms:
    """‖x_n‖ of the rows of an [N, D] tensor, formed once for every representation that
    shares the tensor (a Linear layer's δ: the bias's g_n = δ_n and the weight's ‖δ_n‖‖a_n‖)."""

    def __init__(self, x: Tensor):
        self.x = x
        self._norms: Tensor | None = None

    def __call__(self) -> Tensor:
        if self._norms is None:
            self._norms = torch.linalg.vector_norm(self.x, dim=1)
        return self._norms


class DenseSampleGrads(SampleGrads):
    """Individual gradients stored explicitly as ``G[n] = g_n`` = ``scale`` · ``grads``
    (``row_norms``: their norms, where another representation shares them). The scale (the
    loss weight's 1/w) is multiplied in when G is first asked for: small parameters side by
    side take theirs by one multiplication of all of them (``unscaled``, ``scale``)."""

    caches_chunks = True
    selectable = True

    def __init__(self, grads: Tensor, row_norms: RowNorms | None = None, scale: float = 1.0):
        self.unscaled, self.scale = grads, scale
        self._grads = grads if scale == 1.0 else None
        self.num_samples = grads.shape[0]
        self.shape = grads.shape[1:]
        self.row_norms = (row_norms if row_norms is not None and row_norms.x is grads
                          and scale == 1.0 else None)

    @property
    def grads(self) -> Tensor:
        if self._grads is None:
            self._grads = self.unscaled * self.scale
        return self._grads

    @grads.setter
    def grads(self, value: Tensor) -> None:
        self.unscaled, self.scale, self._grads = value, 1.0, value

    def norms(self) -> Tensor:
        return super().norms() if self.row_norms is None else self.row_norms()

    def materialize(self) -> Tensor:
        return self.grads

    @property
    def dtype(self) -> torch.dtype:
        return self.unscaled.dtype

    def select(self, start: int, stop: int) -> SampleGrads:
        return DenseSampleGrads(self.unscaled[start:stop], scale=self.scale)

    def add_(self, other: SampleGrads) -> None:
        """Accumulate another use of the same parameter (tied weights, reused modules)."""
        self.grads = self.grads + other.materialize()
        self.row_norms = None


class OuterSampleGrads(SampleGrads):
    """g_n = δ_n a_nᵀ for δ ∈ R^{N×I}, a ∈ R^{N×J} (a Linear weight without sequence dims).

    Closed forms:  ‖g_n‖² = ‖δ_n‖² ‖a_n‖²;   g_nᵀ g_m = (δ_nᵀδ_m)(a_nᵀa_m), so
    g_nᵀ ḡ = (1/N) Σ_m (δδᵀ ⊙ aaᵀ)_{nm};   g_nᵀ U = δ_nᵀ U a_n;
    Σ_n g_n⊙g_n = (δ⊙δ)ᵀ (a⊙a).
    """

    selectable = True

    @property  # type: ignore[override]
    def fuse_dots(self) -> bool:
        """On accelerators g_nᵀḡ is one more row of the fused dot products (δ_nᵀU_k a_n:
        fewer kernels than the Gram matrices); on a CPU the closed form of
        :meth:`gram_mean`, the cheaper in FLOPs."""
        return device_path(self.delta.device)

    def __init__(self, delta: Tensor, a: Tensor, delta_norms: RowNorms | None = None):
        self.delta, self.a = delta, a
        self.num_samples = delta.shape[0]
        self.shape = torch.Size((delta.shape[1], a.shape[1]))
        self.delta_norms = (delta_norms if delta_norms is not None and delta_norms.x is delta
                            else RowNorms(delta))

    def materialize(self) -> Tensor:
        return self.delta.unsqueeze(2) * self.a.unsqueeze(1)

    @property
    def dtype(self) -> torch.dtype:
        return promote(self.delta.dtype, self.a.dtype)

    def select(self, start: int, stop: int) -> SampleGrads:
        return OuterSampleGrads(self.delta[start:stop], self.a[start:stop])

    def scratch_bytes(self) -> int:
        """Every statistic has a closed form or forms one chunk of at most 2^25 elements
        at a time (the automatic histogram range), never all |B| gradients at once."""
        per_chunk = min(self.num_samples * self.shape.numel(), _CHUNK_ELEMENTS)
        return per_chunk * self.dtype.itemsize

    def chunks(self) -> list[Tensor]:
        return list(self.iter_chunks())

    def iter_chunks(self) -> Iterator[Tensor]:
        for d, a in _sample_chunks(self.delta, self.a, self.shape.numel()):
            yield d.unsqueeze(2) * a.unsqueeze(1)

    def norms(self) -> Tensor:
        # ‖δ_n a_nᵀ‖ = ‖δ_n‖‖a_n‖: two norms and a product (‖δ_n‖ shared with the bias)
        return self.delta_norms() * torch.linalg.vector_norm(self.a, dim=1)

    def sq_norms(self) -> Tensor:
        return self.norms().square()

    def batch_mean(self) -> Tensor:
        return (self.delta.T @ self.a).div_(self.num_samples)

    def gram_mean(self) -> Tensor:
        n, (i, j) = self.num_samples, self.shape
        if n < 2 * i * j / (i + j):
            gram = (self.delta @ self.delta.T) * (self.a @ self.a.T)
            return gram.mean(1)
        return self.dots(self.batch_mean())

    def _as_weight(self, u: Tensor) -> Tensor:
        """``u`` as an [I, J] matrix in δ's dtype (no view op where it is one already)."""
        u = u if u.shape == self.shape else u.reshape(self.shape)
        return in_dtype(u, self.delta.dtype)

    def dots(self, u: Tensor) -> Tensor:
        return ((self.delta @ self._as_weight(u)) * self.a).sum(1)

    def dots_many(self, us: Sequence[Tensor]) -> Tensor:
        """δ_nᵀ U_k a_n. On a CPU one matmul δ U_k per direction (concatenating the directions
        would copy K parameter-sized tensors for no gain in the products); on accelerators,
        whose host the launches bind, the directions side by side, [U_1 … U_K], in one matmul,
        one product and one sum (four kernels for any K instead of 3K + 1)."""
        if len(us) == 1 or not device_path(self.delta.device):
            return stack_or_view([((self.delta @ self._as_weight(u)) * self.a).sum(1)
                                  for u in us])
        n, j = self.a.shape
        side_by_side = torch.cat([self._as_weight(u) for u in us], dim=1)  # [I, K·J]
        left = (self.delta @ side_by_side).view(n, len(us), j)  # [N, K, J]
        return (left * self.a.unsqueeze(1)).sum(2).T

    def sum_sq(self) -> Tensor:
        return self.delta.double().pow(2).T @ self.a.double().pow(2)

    def centered_sum_sq(self) -> Tensor:
        delta, a = self.delta.double(), self.a.double()
        mean = delta.T @ a / self.num_samples
        return delta.pow(2).T @ a.pow(2) - self.num_samples * mean.pow(2)

    def histogram(self, spec: BinSpec) -> Tensor:
        return histogram_outer_counts(self.delta, self.a, spec)

    def histogram_lanes(self, spec: BinSpec, budget: int | None = DEFAULT_BUDGET
                        ) -> Tensor | LaneCounts:
        return histogram_outer_lanes(self.delta, self.a, spec, budget)

    def histogram2d(self, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec) -> Tensor:
        return histogram2d_outer_counts(self.delta, self.a, theta, spec_g, spec_theta)

    def histogram2d_lanes(self, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec,
                          budget: int | None = DEFAULT_BUDGET) -> Tensor | LaneCounts:
        return histogram2d_outer_lanes(self.delta, self.a, theta, spec_g, spec_theta, budget)


class SequenceOuterSampleGrads(SampleGrads):
    """g_n = Σ_t δ_{n,t} a_{n,t}ᵀ for δ ∈ R^{N×T×I}, a ∈ R^{N×T×J} (Linear on sequences).

    ‖g_n‖² = Σ_{t,t'} (δ_{n,t}ᵀδ_{n,t'})(a_{n,t}ᵀa_{n,t'}) by per-sample Gram matrices when
    that is cheaper than materializing;  g_nᵀ U = Σ_t δ_{n,t}ᵀ U a_{n,t}.
    """

    selectable = True

    def __init__(self, delta: Tensor, a: Tensor, wide: torch.dtype | None = None,
                 scale: float = 1.0, scaled: int = 0):
        """``wide``: the dtype the gradients are formed in where a factor is narrower (a
        layer under autocast): that factor is held as it is and widened when first read
        (:meth:`compact` drops the widened copy: a tied output layer's δ waits for the end
        of the backward pass at half the memory). ``scale``: a factor c of every g_n, held
        apart and multiplied into the factor ``scaled`` (0: ``delta``, 1: ``a``) when it is
        first read, after the widening (a stack of layers multiplies their concatenated
        factor once: :class:`cockpit.engine.stacked.StackedGrads`)."""
        self._factors = (delta, a)
        self._read: list[Tensor | None] = [None, None]
        self.wide, self.scale, self.scaled = wide, scale, scaled
        self.num_samples, self.positions = delta.shape[0], delta.shape[1]
        self.shape = torch.Size((delta.shape[2], a.shape[2]))

    def _factor(self, index: int) -> Tensor:
        x = self._factors[index]
        scaled = self.scale != 1.0 and index == self.scaled
        if not scaled and (self.wide is None or x.dtype == self.wide):
            return x
        read = self._read[index]
        if read is None:
            # (first read after the backward pass maybe, in grad mode: no graph recorded)
            read = x.detach() if x.requires_grad else x
            read = read if self.wide is None else in_dtype(read, self.wide)
            self._read[index] = read = read * self.scale if scaled else read
        return read

    @property
    def factors(self) -> tuple[Tensor, Tensor]:
        """(δ, a) as the layer handed them, before any widening to ``wide`` and without
        ``scale``."""
        return self._factors

    @property
    def delta(self) -> Tensor:
        return self._factor(0)

    @property
    def a(self) -> Tensor:
        return self._factor(1)

    def compact(self) -> SampleGrads:
        self._read = [None, None]
        return self

    def materialize(self) -> Tensor:
        if self.half_products():
            delta, a = self._raw_factors()
            return narrow_products.wide_products(delta.transpose(1, 2), a, self.scale)
        return torch.bmm(self.delta.transpose(1, 2), self.a)

    def half_products(self) -> bool:
        """Whether g_n is formed from the half-precision factors as they are, summed in
        float32, c in the product (:mod:`cockpit.engine.narrow_products`): where the
        device has the op."""
        delta, a = self._factors  # (a call only where the factors are narrow)
        return delta.dtype in narrow_products.NARROW and narrow_products.available(
            delta, a, self.wide)

    def _raw_factors(self) -> tuple[Tensor, Tensor]:
        """(δ, a) as handed, outside autograd (read after the backward pass maybe, in grad
        mode)."""
        return tuple(x.detach() if x.requires_grad else x  # type: ignore[return-value]
                     for x in self._factors)

    @property
    def dtype(self) -> torch.dtype:
        if self.wide is not None:
            return self.wide
        return promote(self._factors[0].dtype, self._factors[1].dtype)

    def select(self, start: int, stop: int) -> SampleGrads:
        delta, a = self._factors
        return SequenceOuterSampleGrads(delta[start:stop], a[start:stop], self.wide,
                                        self.scale, self.scaled)

    def chunks(self) -> list[Tensor]:
        return list(self.iter_chunks())

    def iter_chunks(self) -> Iterator[Tensor]:
        if self.half_products():
            for d, a in _sample_chunks(*self._raw_factors(), self.shape.numel()):
                yield narrow_products.wide_products(d.transpose(1, 2), a, self.scale)
            return
        for d, a in _sample_chunks(self.delta, self.a, self.shape.numel()):
            yield torch.bmm(d.transpose(1, 2), a)

    def _by_grams(self) -> bool:
        """Whether per-sample Gram matrices (T×T) are cheaper than materializing g_n (I×J)."""
        t = self.positions
        i, j = self.shape
        return t * (i + j) < i * j

    def norms(self) -> Tensor:
        if self._by_grams():  # (a sum of Gram products may round below 0 where g_n ≈ 0)
            return self.sq_norms().clamp_min_(0).sqrt_()
        return self.chunk_norms()

    def sq_norms(self) -> Tensor:
        if self._by_grams():
            gram_delta = torch.bmm(self.delta, self.delta.transpose(1, 2))
            gram_a = torch.bmm(self.a, self.a.transpose(1, 2))
            return (gram_delta * gram_a).sum((1, 2))
        return self.chunk_norms() ** 2

    def batch_mean(self) -> Tensor:
        return torch.einsum("nti,ntj->ij", self.delta, self.a).div_(self.num_samples)

    def dots(self, u: Tensor) -> Tensor:
        if self._projects_by_g(1):
            return super().dots(u)
        return ((self.delta @ in_dtype(u.reshape(self.shape), self.delta.dtype)) * self.a).sum(
            (1, 2))

    def dots_scratch_bytes(self, num_directions: int) -> int:
        """δ U_k for every position: N·T·K·J numbers (no individual gradients); G of a chunk
        of samples where the dot products read G (:meth:`_projects_by_g`)."""
        if self._projects_by_g(num_directions):
            per_sample = self.shape.numel()
            samples = min(self.num_samples, max(1, _CHUNK_ELEMENTS // per_sample))
            return samples * per_sample * self.dtype.itemsize
        return (self.num_samples * self.positions * num_directions * self.shape[1]
                * self.dtype.itemsize)

    def _projects_by_g(self, num_directions: int) -> bool:
        """Whether the dot products read G (the base class's :meth:`dots_many`: G formed
        chunk by chunk on tensor cores from the half-precision factors, float32 sums, each
        chunk read once for all directions) rather than multiply the factors, δ U_k: where
        the half-precision products run and T·K ≥ :data:`_G_ROUTE`. Per sample the factors'
        route costs 2·T·K·I·J FLOPs at the float32 rate (GPT-2's tied output layer, 50257 ×
        768: 158 GFLOP at B = 8, T = 256), G's 8·I·J bytes written and read (its FLOPs at the
        tensor cores' rate): equal at T·K ≈ 50 on an H200 (50 TFLOP/s of float32 against
        3.8 TB/s)."""
        return self.positions * num_directions >= _G_ROUTE and self.half_products()

    def dots_many(self, us: Sequence[Tensor]) -> Tensor:
        if self._projects_by_g(len(us)):
            return super().dots_many(us)
        i, j = self.shape
        n, t = self.num_samples, self.positions
        shaped = [u if u.shape == self.shape else u.reshape(i, j) for u in us]
        # (a lone direction as it is: no copy into a concatenation)
        stacked = in_dtype(shaped[0] if len(shaped) == 1 else torch.cat(shaped, dim=1),
                           self.delta.dtype)
        left = (self.delta @ stacked).view(n, t, len(us), j)  # [N, T, K, J]
        # Σ_{t,j} (δ_{n,t}ᵀU_k)_j a_{n,t,j}: one product and one sum (an einsum takes ~8 ops)
        return (left * self.a.unsqueeze(2)).sum((1, 3)).T
