"""What a per-sample statistic declares, and the registry the engine loops over.

A per-sample statistic is one object (one file of this package) that says

* its ``name``, the string instruments put into ``needs``, and its ``shape`` per parameter;
* how it is formed from a layer's individual gradients (:meth:`Statistic.form`, given the
  parameter's :class:`~cockpit.engine.rules.sample_grads.SampleGrads` and a :class:`LayerContext`);
* how the statistics of two micro-batches B_a, B_b merge into those of B_a ∪ B_b
  (:class:`Merge`): per-sample vectors are concatenated, sums added, centered sums
  combined by the parallel-variance identity, and statistics relative to the batch's own
  mean (g_nᵀḡ) cannot be merged at all;
* optionally, how the values of many small parameters are formed at once
  (:meth:`Statistic.form_side_by_side`: biases and normalization weights side by side), and
  those of Linear weights of one shape (:meth:`Statistic.form_stacked`);
* optionally, how the values of every parameter are finished together when the backward
  pass ends (:meth:`Statistic.finish`: the histograms sum the lanes of all their counts in a
  few ops, not two per parameter);
* how the ranks of a process group combine (:class:`Combine`): sums go into the phase-1
  all-reduce buffer (their slot shape, :meth:`Statistic.pack`, :meth:`Statistic.unpack`),
  per-sample vectors into the phase-2 rows (:mod:`cockpit.engine.reduction.ranks`).

The processing loop (:class:`cockpit.engine.processing.CallProcessor`), the micro-batch merge
(:meth:`BackwardStatistics.merge`) and the rank reduction loop over :data:`REGISTRY`, so a new
statistic is one file that calls :func:`register` (imported by the package's ``__init__``).

Dot products g_nᵀu (``gram_mean``, the projections, the dots with the optimizer's gradient)
are formed together in one ``dots_many`` pass per layer by the processor; ``gram_mean`` is
registered (it merges and combines like a statistic) with ``fused_dot`` set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING, ClassVar, Protocol, cast

import torch
from torch import Tensor

from cockpit.engine.histograms.device import device_path

if TYPE_CHECKING:
    from cockpit.engine.histograms.auto_range import AutoRange
    from cockpit.engine.histograms.device import LaneCounts
    from cockpit.engine.histograms.exact import BinSpec
    from cockpit.engine.rules.sample_grads import SampleGrads
    from cockpit.engine.side_by_side import SideBySide
    from cockpit.engine.stacked import StackedGrads
    from cockpit.engine.statistics.backward import BackwardStatistics


class Merge(Enum):
    """How the values of two micro-batches B_a, B_b (N_a, N_b samples) merge."""

    CONCAT = "concatenate"  # per-sample values: B_a's samples, then B_b's
    ADD = "add"  # sums over samples (and counts)
    CENTERED = "parallel variance"  # V = V_a + V_b + (N_a N_b / N)(ḡ_a − ḡ_b)⊙(ḡ_a − ḡ_b)
    NONE = "cannot merge"  # relative to one batch's own mean: formed over the union instead


class Combine(Enum):
    """How the values of the ranks of a process group combine."""

    SUM = "sum"  # phase 1: one all-reduce of a flat float64 buffer
    GATHER = "gather"  # phase 2: each rank writes its samples' slice of an [N] row per parameter


class StatisticContext(Protocol):
    """What forming and combining statistics may read of the engine."""

    hist_spec: BinSpec | AutoRange
    hist2d_specs: tuple[BinSpec, BinSpec]
    params: dict[str, Tensor]
    # whole θ of sharded parameters (FSDP2), gathered for this step; empty otherwise
    gathered_params: dict[str, Tensor]
    # bytes of per-sample scratch one layer may hold at once (None: no limit)
    memory_budget: int | None


class LayerContext:
    """What every statistic of one parameter's individual gradients shares inside the
    per-layer loop: the parameter, the engine's bin specifications, and (see
    :func:`shared_chunks`) one materialization of the individual gradients."""

    def __init__(self, name: str, context: StatisticContext):
        self.name, self.context = name, context
        # the individual gradients in sample chunks, once a statistic has materialized them
        self.chunks: list[Tensor] | None = None

    @property
    def materialized_on_accelerator(self) -> bool:
        """Whether a statistic formed before materialized the individual gradients on an
        accelerator, whose launches bind the host: norms are then one kernel per chunk
        (a CPU keeps a representation's closed form, the fewer FLOPs)."""
        return self.chunks is not None and device_path(self.chunks[0].device)

    @property
    def param(self) -> Tensor:
        """θ of the parameter (detached; the whole tensor where the parameter is sharded)."""
        gathered = self.context.gathered_params.get(self.name)
        return (self.context.params[self.name] if gathered is None else gathered).detach()


class RankTotals:
    """What unpacking a summed value may read of the all-reduced buffer: N = Σ_r N_r and
    the global mean ḡ = (Σ_r N_r ḡ_r) / N per parameter in float64."""

    def __init__(self, total: int, summed_means: dict[str, Tensor], divisor: int):
        self.total, self._summed, self._divisor = total, summed_means, divisor

    def mean(self, name: str) -> Tensor:
        return self._summed[name] / self._divisor


class Statistic:
    """One per-sample statistic (see the module docstring). Subclasses set the class
    attributes and :meth:`form`; a summed statistic may override the buffer methods."""

    name: ClassVar[str]
    shape: ClassVar[str]  # per parameter, in words: "[N]", "θ", "[bins]", …
    merge: ClassVar[Merge]
    combine: ClassVar[Combine]
    # formed (where the layer has no closed form) in the fused dot-product pass
    fused_dot: ClassVar[bool] = False
    sample_dim: ClassVar[int] = 0  # concatenated statistics: the dimension of the samples

    def form(self, sg: SampleGrads, layer: LayerContext) -> Tensor | LaneCounts | None:
        """The value for one parameter from its individual gradients (None: formed
        elsewhere, see ``fused_dot``; a histogram's lane counts on accelerators, summed by
        :meth:`finish`)."""
        raise NotImplementedError

    def form_side_by_side(self, side: SideBySide, layers: Sequence[LayerContext]
                          ) -> list[Tensor] | None:
        """The values of several small parameters at once, from their individual gradients
        side by side (:mod:`cockpit.engine.side_by_side`; ``layers``: one context per
        parameter, in the order of ``side``), or None: then :meth:`form` per parameter."""
        return None

    def form_stacked(self, stack: StackedGrads, layers: Sequence[LayerContext]
                     ) -> Sequence[Tensor | LaneCounts | None] | None:
        """The values of several Linear weights of one shape at once, from their individual
        gradients stacked (:mod:`cockpit.engine.stacked`; ``layers``: one context per weight,
        in the order of ``stack``; a None value: formed elsewhere, as for :meth:`form`), or
        None: then :meth:`form` per weight (each layer's context holding its slice of the
        stack as its chunks)."""
        return None

    def finish(self, values: Mapping[str, Tensor | LaneCounts]) -> dict[str, Tensor]:
        """The values of every parameter in their final form, formed together when the
        backward pass ends (from what :meth:`form` returned; default: as they are, which
        takes a statistic whose :meth:`form` gives tensors)."""
        return cast(dict[str, Tensor], dict(values))

    # ---- Combine.SUM: one slot per parameter of the phase-1 buffer
    def slot_shape(self, param_shape: torch.Size, context: StatisticContext) -> tuple[int, ...]:
        return tuple(param_shape)

    def pack(self, stats: BackwardStatistics, name: str, shape: tuple[int, ...]
             ) -> Tensor | None:
        """This rank's addend (float64, ``shape``), or None if it holds no value."""
        value = stats[self.name].get(name)
        return None if value is None else value.double().reshape(shape)

    def unpack(self, summed: Tensor, totals: RankTotals, name: str) -> Tensor:
        """The global value from the summed slot (a view of the buffer: copy it)."""
        return summed.clone()


class Counts(Statistic):
    """Histogram counts per parameter: micro-batches and ranks add them, the sum is an
    integer. They count the elements of every sample of the step: where a backward pass
    does not reach a parameter that another micro-batch or process reaches (a branch taken
    by some samples only), its samples' individual gradients are 0 there. Their counts
    (:meth:`absent`) are formed when that backward pass ends, while the parameters are as
    they were during it, and added at the reduction point
    (:meth:`BackwardStatistics.fold_absent`); a parameter no sample reached has no counts,
    split or not."""

    merge = Merge.ADD
    combine = Combine.SUM

    def absent(self, samples: int, name: str, context: StatisticContext) -> Tensor:
        """The counts of ``samples`` individual gradients of parameter ``name`` that are 0
        in every element."""
        raise NotImplementedError

    def unpack(self, summed: Tensor, totals: RankTotals, name: str) -> Tensor:
        return summed.round().to(torch.int64)


REGISTRY: dict[str, Statistic] = {}
_sealed = False  # set once the package has imported its statistics


def register(statistic: Statistic) -> Statistic:
    """Add a statistic to the registry under its name (refused twice, and refused after the
    package was imported: the names instruments may need are fixed then)."""
    if _sealed:
        raise RuntimeError(
            f"per-sample statistic {statistic.name!r} registered after "
            "cockpit.engine.statistics was imported: the engine would not form it for the "
            "instruments that need it; add its module to the cockpit.engine.statistics package "
            "(every module there is imported and registered with the package)")
    if statistic.name in REGISTRY:
        raise ValueError(f"a per-sample statistic {statistic.name!r} is registered already")
    REGISTRY[statistic.name] = statistic
    return statistic


def seal() -> None:
    """Refuse further registrations (called by the package once it imported every module)."""
    global _sealed
    _sealed = True


def requested(needs: frozenset[str] | set[str]) -> list[Statistic]:
    """The registered statistics among ``needs``, in the order of registration."""
    return [statistic for name, statistic in REGISTRY.items() if name in needs]


@contextlib.contextmanager
def shared_chunks(sg: SampleGrads, layer: LayerContext) -> Iterator[None]:
    """Inside the block ``sg.chunks()`` materializes the individual gradients once, into
    ``layer.chunks``, and hands every statistic the same chunks (the sums of squares,
    centered sums and histograms of a factored layer would otherwise each form them again);
    ``sg.iter_chunks()`` hands out those chunks where a statistic formed them, else forms
    one chunk at a time without keeping them. Representations that hold or cache their
    chunks already are left alone. The chunks are dropped when the block ends (peak memory
    stays one layer's |B|×D)."""
    if sg.caches_chunks:
        yield
        return
    original, original_iter = sg.chunks, sg.iter_chunks

    def chunks() -> list[Tensor]:
        if layer.chunks is None:
            layer.chunks = original()
        return layer.chunks

    def iter_chunks() -> Iterator[Tensor]:
        return iter(layer.chunks) if layer.chunks is not None else original_iter()

    sg.chunks = chunks  # type: ignore[method-assign]
    sg.iter_chunks = iter_chunks  # type: ignore[method-assign]
    try:
        yield
    finally:
        del sg.chunks, sg.iter_chunks
        layer.chunks = None
