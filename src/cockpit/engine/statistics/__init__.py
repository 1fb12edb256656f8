"""Per-sample statistics as registered objects, and the values of a tracked step.

* :mod:`.registry` — what a statistic declares (:class:`Statistic`: name, shape, how it is
  formed from a layer's individual gradients, how micro-batches merge, how ranks combine)
  and the registry the engine loops over;
* one file per statistic: :mod:`.norms`, :mod:`.sq_norms`, :mod:`.gram_mean`, :mod:`.sum_sq`,
  :mod:`.var_sum`, :mod:`.hist1d`, :mod:`.hist2d`, :mod:`.l1_norms`;
* :mod:`.backward` — :class:`BackwardStatistics`, the values of one backward pass (or of a
  merged step), and :class:`GradientDots`.

A new statistic is one more file here that calls :func:`register` (:mod:`.l1_norms` is the
smallest example): the package imports every module in it. The built-in statistics are
imported first, in the order in which a layer's statistics are formed (the order of
registration), the others after them by name. The histograms come first: where they
materialize a layer's individual gradients on an accelerator, the norms are read from those
(one kernel per chunk) instead of their closed forms (a sequence layer's Gram matrices: six
kernels).
"""
# ruff: noqa: I001  (the statistics' imports are in registration order, not sorted)

import importlib
import pkgutil

from cockpit.engine.statistics.backward import (
    PROJECTIONS,
    SAMPLE_GRAD_SUM,
    BackwardStatistics,
    GradientDots,
)
from cockpit.engine.statistics.registry import (
    REGISTRY,
    Combine,
    Counts,
    LayerContext,
    Merge,
    RankTotals,
    Statistic,
    StatisticContext,
    register,
    requested,
    seal,
    shared_chunks,
)
from cockpit.engine.statistics.hist1d import HIST1D
from cockpit.engine.statistics.hist2d import HIST2D
from cockpit.engine.statistics.norms import NORMS
from cockpit.engine.statistics.sq_norms import SQ_NORMS
from cockpit.engine.statistics.gram_mean import GRAM_MEAN
from cockpit.engine.statistics.sum_sq import SUM_SQ
from cockpit.engine.statistics.var_sum import VAR_SUM

# Any other module of this package is a statistic too: imported (registered) by name order.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


# Names an instrument can put into ``needs``: the registered statistics and the projections.
PER_SAMPLE_STATS = frozenset({*REGISTRY, PROJECTIONS})
seal()

__all__ = [
    "GRAM_MEAN", "HIST1D", "HIST2D", "NORMS", "PER_SAMPLE_STATS", "PROJECTIONS", "REGISTRY",
    "SAMPLE_GRAD_SUM", "SQ_NORMS", "SUM_SQ", "VAR_SUM", "BackwardStatistics", "Combine", "Counts",
    "GradientDots", "LayerContext", "Merge", "RankTotals", "Statistic", "StatisticContext",
    "register", "requested", "shared_chunks",
]
