"""Counts of the individual-gradient elements g_{n,j} in the bins of the engine's
``hist_spec`` (GradHist1d eq. 15), or in the magnitude keys of an undecided
:class:`~cockpit.engine.histograms.auto_range.AutoRange` (regrouped into bins at the
reduction point).

Per parameter [bins]; micro-batches and ranks add (with the zeros of the samples that did not
reach the parameter: :meth:`Hist1d.absent`). On accelerators a parameter's counts are formed as lane
counts (:class:`~cockpit.engine.histograms.device.LaneCounts`), in blocks whose scratch fits
the engine's ``memory_budget``, and their lanes are summed for every parameter at once when
the backward pass ends (:meth:`Hist1d.finish`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor

from cockpit.engine.histograms.auto_range import AutoRange, magnitude_counts
from cockpit.engine.histograms.device import LaneCounts, device_path, sum_lanes
from cockpit.engine.histograms.exact import BinSpec
from cockpit.engine.rules.sample_grads import (
    SampleGrads,
)
from cockpit.engine.side_by_side import SideBySide
from cockpit.engine.stacked import StackedGrads
from cockpit.engine.statistics.registry import (
    Counts,
    LayerContext,
    StatisticContext,
    register,
)

# Peak bytes per element of magnitude_counts' temporaries (CPU allocator, 4 M elements):
# 14 for float32 values (int32 keys), 18 for float16/bfloat16, 26 for float64.
_KEY_BYTES_PER_ELEMENT = 28


def _within_budget(chunks: Iterator[Tensor], budget: int | None) -> Iterator[Tensor]:
    """The chunks' elements in flat pieces whose key temporaries fit ``budget`` bytes (None:
    the chunks as they are); counts add over pieces, so this is exact."""
    for chunk in chunks:
        if budget is None or chunk.numel() * _KEY_BYTES_PER_ELEMENT <= budget:
            yield chunk
        else:
            yield from chunk.reshape(-1).split(max(1, budget // _KEY_BYTES_PER_ELEMENT))


@functools.lru_cache(maxsize=16)
def zero_slot(spec: BinSpec | AutoRange) -> int:
    """The bin (or undecided range's magnitude key) that holds 0."""
    zero = torch.zeros(1)
    if isinstance(spec, AutoRange):
        return int(magnitude_counts([zero]).argmax())
    return int(spec.bin_index(zero))


class Hist1d(Counts):
    name = "hist1d"
    shape = "[bins]"

    def form(self, sg: SampleGrads, layer: LayerContext) -> Tensor | LaneCounts:
        spec = layer.context.hist_spec
        if isinstance(spec, AutoRange):
            # (one chunk formed at a time, or the layer's chunks where another statistic
            # formed them: :func:`shared_chunks`)
            return magnitude_counts(_within_budget(sg.iter_chunks(),
                                                   layer.context.memory_budget))
        return sg.histogram_lanes(spec, layer.context.memory_budget)

    def form_side_by_side(self, side: SideBySide, layers: Sequence[LayerContext]
                          ) -> list[Tensor] | None:
        spec = layers[0].context.hist_spec
        if isinstance(spec, AutoRange) or not device_path(side.rows.device):
            return None  # (the range's keys, and the CPU's exact counts: per parameter)
        return side.histograms(spec)

    def form_stacked(self, stack: StackedGrads, layers: Sequence[LayerContext]
                     ) -> list[Tensor | LaneCounts] | None:
        spec = layers[0].context.hist_spec
        if isinstance(spec, AutoRange):
            return None  # (the range's keys: per layer, from its slice)
        return stack.histograms(spec, layers[0].context.memory_budget)

    def finish(self, values: Mapping[str, Tensor | LaneCounts]) -> dict[str, Tensor]:
        return sum_lanes(values)

    def slot_shape(self, param_shape: torch.Size, context: StatisticContext) -> tuple[int, ...]:
        return (context.hist_spec.bins,)

    def absent(self, samples: int, name: str, context: StatisticContext) -> Tensor:
        """samples·D zeros, all in the bin of 0."""
        param, spec = context.params[name], context.hist_spec
        counts = torch.zeros(spec.bins, dtype=torch.int64, device=param.device)
        counts[zero_slot(spec)] = samples * param.numel()
        return counts


HIST1D = register(Hist1d()).name
