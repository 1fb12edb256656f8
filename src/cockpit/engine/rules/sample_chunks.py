"""Individual gradients formed in sample chunks, to keep a layer's scratch within a budget.

A layer whose |B| individual gradients g_n ∈ R^D take more than the memory budget
(|B| · D · itemsize bytes; GPT-2's token embedding: 8 × 38.6 M floats) is processed in
chunks of samples C_1 ∪ … ∪ C_K = B, each formed only when the previous one is done with.
Every statistic is exact over the union: per-sample values are concatenated, sums over n
added, the mean is ḡ = Σ_k |C_k| ḡ_k / |B|, and a centered sum combines by the
parallel-variance identity V = V_a + V_b + (N_a N_b / N)(ḡ_a − ḡ_b)⊙(ḡ_a − ḡ_b).

:class:`SampleChunks` answers the whole batch's questions (dot products with ḡ and with
directions, which the processor forms over the whole batch) from its chunks, or from the
whole batch's representation where its dot products hold no more than the budget (a
convolution projects by convolution: K times its output gradient, no individual gradients);
the processor forms the other statistics per chunk and merges them
(:mod:`cockpit.engine.processing`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from cockpit.engine.histograms.exact import BinSpec
from cockpit.engine.rules.sample_grads import (
    DenseSampleGrads,
    Directions,
    SampleGrads,
    total_of,
)


def samples_per_chunk(per_sample_bytes: int, budget: int) -> int:
    """The most samples whose individual gradients fit into ``budget`` bytes (at least one)."""
    return max(1, budget // max(per_sample_bytes, 1))


class SampleChunks(SampleGrads):
    """The individual gradients of |B| samples, held as a way to form those of any sample
    range (``part(start, stop)``) and answered chunk by chunk of ``size`` samples."""

    selectable = True

    def __init__(self, num_samples: int, shape: torch.Size, dtype: torch.dtype,
                 part: Callable[[int, int], SampleGrads], size: int,
                 whole: SampleGrads | None = None, budget: int | None = None):
        self.num_samples, self.shape, self._dtype = num_samples, shape, dtype
        self.part, self.size = part, size
        self.mean: Tensor | None = None  # ḡ, once known (saves a pass over the chunks)
        # the whole batch's representation, which answers the dot products at once where
        # they hold no more than ``budget`` bytes (a convolution's projections)
        self.whole, self.budget = whole, budget

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def num_chunks(self) -> int:
        return -(-self.num_samples // self.size)

    def parts(self) -> Iterator[SampleGrads]:
        """The chunks' individual gradients, one at a time (drop each before the next)."""
        for start in range(0, self.num_samples, self.size):
            yield self.part(start, min(start + self.size, self.num_samples))

    def select(self, start: int, stop: int) -> SampleGrads:
        return self.part(start, stop)

    def materialize(self) -> Tensor:
        return torch.cat([p.materialize_owned() for p in self.parts()])

    def chunks(self) -> list[Tensor]:
        return [self.materialize()]

    def norms(self) -> Tensor:
        return torch.cat([p.norms() for p in self.parts()])

    def sq_norms(self) -> Tensor:
        return torch.cat([p.sq_norms() for p in self.parts()])

    def batch_mean(self) -> Tensor:
        if self.mean is None:
            total = None
            for p in self.parts():
                addend = p.batch_mean() * p.num_samples
                total = addend if total is None else total + addend
            assert total is not None
            self.mean = total / self.num_samples
        return self.mean

    def gram_mean(self) -> Tensor:
        return self.dots(self.batch_mean())

    def _whole_within_budget(self, num_directions: int) -> SampleGrads | None:
        whole, budget = self.whole, self.budget
        if whole is None or budget is None:
            return None
        return whole if whole.dots_scratch_bytes(num_directions) <= budget else None

    def dots_at_once(self, num_directions: int) -> bool:
        """Whether :meth:`dots_many` answers ``num_directions`` directions from the whole
        batch's representation (else by chunks)."""
        return self._whole_within_budget(num_directions) is not None

    def dots(self, u: Tensor) -> Tensor:
        whole = self._whole_within_budget(1)
        if whole is not None:
            return whole.dots(u)
        return torch.cat([p.dots(u) for p in self.parts()])

    def dots_many(self, us: Sequence[Tensor]) -> Tensor:
        whole = self._whole_within_budget(len(us))
        if whole is not None:
            return whole.dots_many(us)
        us = us if type(us) is Directions else Directions(us)  # (stacked once, every chunk)
        return torch.cat([p.dots_many(us) for p in self.parts()], dim=1)

    def sum_sq(self) -> Tensor:
        return total_of(p.sum_sq().double() for p in self.parts())

    def centered_sum_sq(self) -> Tensor:
        merged: tuple[Tensor, Tensor, int] | None = None
        for p in self.parts():
            merged = merge_centered(merged, (p.centered_sum_sq(), p.batch_mean(),
                                             p.num_samples))
        assert merged is not None
        return merged[0]

    def histogram(self, spec: BinSpec) -> Tensor:
        return total_of(p.histogram(spec) for p in self.parts())

    def histogram2d(self, theta: Tensor, spec_g: BinSpec, spec_theta: BinSpec) -> Tensor:
        return sum(p.histogram2d(theta, spec_g, spec_theta)  # type: ignore[return-value]
                   for p in self.parts())


def merge_centered(a: tuple[Tensor, Tensor, int] | None, b: tuple[Tensor, Tensor, int]
                   ) -> tuple[Tensor, Tensor, int]:
    """(V, ḡ, N) of the union of two sample sets from theirs, in float64:
    V = V_a + V_b + (N_a N_b / N)(ḡ_a − ḡ_b)⊙(ḡ_a − ḡ_b), ḡ = (N_a ḡ_a + N_b ḡ_b) / N."""
    vb, mb, nb = b[0].double(), b[1].double().reshape(b[0].shape), b[2]
    if a is None:
        return vb, mb, nb
    va, ma, na = a
    n = na + nb
    diff = ma - mb
    return va + vb + (na * nb / n) * diff * diff, (ma * na + mb * nb) / n, n


class CallSum(SampleGrads):
    """g_n = Σ_c g_n^{(c)} over the calls c of a parameter used by several calls (tied
    weights), kept per call and summed per sample range when asked (:meth:`select`)."""

    selectable = True

    def __init__(self, calls: list[SampleGrads]):
        self.calls = calls
        self.num_samples, self.shape = calls[0].num_samples, calls[0].shape

    @property
    def dtype(self) -> torch.dtype:
        return self.calls[0].dtype

    def add_(self, other: SampleGrads) -> None:
        self.calls.append(other)

    def scratch_bytes(self) -> int:
        return 2 * super().scratch_bytes()  # the running sum and one call's addend

    def select(self, start: int, stop: int) -> SampleGrads:
        """The calls' individual gradients of samples start … stop summed: from a call
        that materializes them densely, the others added into it (an embedding's rows by
        their indices, :meth:`SampleGrads.add_to`)."""
        parts = sorted((call.select(start, stop) for call in self.calls),
                       key=lambda part: part.adds_sparsely)  # (stable: else in call order)
        total = parts[0].materialize_owned()
        if isinstance(parts[0], DenseSampleGrads):  # a view of the call's own tensor
            total = total.clone()
        for part in parts[1:]:
            part.add_to(total)
        return DenseSampleGrads(total)

    def materialize(self) -> Tensor:
        return self.select(0, self.num_samples).materialize()

    def dots(self, u: Tensor) -> Tensor:
        return self.dots_many([u])[0]

    def dots_many(self, us: Sequence[Tensor]) -> Tensor:
        """g_nᵀu = Σ_c g_n^{(c)ᵀ}u: one direction by each call's own projection (a factored
        call's δU costs the FLOPs of materializing once, without its N·D numbers); several
        from the materialized sum (a factored call would cost that once per direction)."""
        if len(us) == 1:
            return total_of(call.dots_many(us) for call in self.calls)
        return super().dots_many(us)

    def dots_scratch_bytes(self, num_directions: int) -> int:
        if num_directions == 1:
            return max(call.dots_scratch_bytes(1) for call in self.calls)
        return self.scratch_bytes()
