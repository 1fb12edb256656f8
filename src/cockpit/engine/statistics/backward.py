"""The statistics of a tracked step: one value per backward pass, merged over micro-batches.

A backward pass over a batch B_k of N_k samples leaves, per parameter tensor θ, the
registered per-sample statistics (:mod:`cockpit.engine.statistics.registry`; by name in
``values``, the built-in ones also as attributes):

* per-sample vectors over n ∈ B_k: ‖g_n‖ (``norms``), ‖g_n‖² (``sq_norms``), g_nᵀ ḡ
  (``gram_mean``), g_nᵀ u for registered directions u (``projections``, [K, N_k]), and the
  individual losses ℓ_n;
* sums over n: Σ_n g_n ⊙ g_n (``sum_sq``), histogram counts (``hist1d``, ``hist2d``) and the
  ``sample_sums`` that instruments add themselves (e.g. N_k times a diagonal curvature);
* the batch mean ḡ_k = (1/N_k) Σ_n g_n (``batch_grads``) and the centered sum
  V_k = Σ_n (g_n − ḡ_k) ⊙ (g_n − ḡ_k) (``var_sum``).

All of them describe the union B = ∪_k B_k of a step's micro-batches exactly after
:meth:`BackwardStatistics.merge`: each registered statistic merges as it declares
(per-sample vectors are concatenated, sums added, centered sums combined by the
parallel-variance identity), projections are concatenated, means weighted by N_k / N:

    V = V_a + V_b + (N_a N_b / N) (ḡ_a − ḡ_b) ⊙ (ḡ_a − ḡ_b).

``gram_mean`` is relative to the mean of the backward that formed it; for a split batch the
engine forms it over the union instead (:meth:`Cockpit`'s reduction point projects the kept
layer calls on the union's ḡ), so merging two ``gram_mean`` is refused. With one backward
per process (DistributedDataParallel), the engine also records g_nᵀG for the gradient G the
optimizer steps on (``gradient_dots``): where G = c·ḡ, that gives g_nᵀḡ = g_nᵀG / c without
a second pass over the layers (:func:`cockpit.engine.reduction.step_reduction.gram_from_gradient`).
:mod:`cockpit.engine.reduction.ranks` reduces the same value over processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from cockpit.engine.dtypes import promote
from cockpit.engine.statistics.registry import REGISTRY, Merge

# g_nᵀ u for registered directions u, per parameter, [K, N]: formed in the fused dot pass
PROJECTIONS = "projections"
# sample_sums key of Σ_n g_n where the individual gradients do not sum to the batch gradient
# (BatchNorm with frozen statistics): the gradient tests then use their own mean
SAMPLE_GRAD_SUM = "sample_grad_sum"


@dataclass
class GradientDots:
    """g_nᵀG per parameter ([N] each) and G, the gradient the optimizer will step on as it
    was when the backward pass ended (a copy: clipping may rescale ``p.grad`` in place)."""

    gradient: dict[str, Tensor]
    dots: dict[str, Tensor] = field(default_factory=dict)


def _statistic(name: str) -> property:
    """``stats.<name>``: the values of a registered statistic, parameter → tensor."""

    def get(self: BackwardStatistics) -> dict[str, Tensor]:
        return self.values.setdefault(name, {})

    def put(self: BackwardStatistics, value: dict[str, Tensor]) -> None:
        self.values[name] = value

    return property(get, put, doc=f"``values[{name!r}]``")


@dataclass
class BackwardStatistics:
    """Additive statistics of one tracked backward pass (or of a merged step), keyed by
    parameter name."""

    num_samples: int
    # statistic name → parameter → value, for the registered statistics (read them as
    # ``stats[name]``; the built-in ones also as ``stats.sq_norms``, …)
    values: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    # ḡ = (1/N) Σ_n g_n of this backward (Cockpit's own copies; a directly following tracked
    # step reuses their memory)
    batch_grads: dict[str, Tensor] = field(default_factory=dict)
    # key → parameter → [K, N]: g_nᵀ u_k for the directions u_k registered under key
    projections: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    # key → parameter → Σ_n of a per-sample quantity (instruments' own additive values)
    sample_sums: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    # g_nᵀG ([N] per parameter) for the gradient G = p.grad after this backward pass, and a
    # copy of G; only for one backward per process (deferred layer processing), else None
    gradient_dots: GradientDots | None = None
    # Counts statistic → parameter this backward pass did not reach → the counts of its
    # samples' individual gradients 0 (:meth:`Counts.absent`), for :meth:`fold_absent`
    absent: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    losses: Tensor | None = None  # ℓ_n, detached, [N]
    problems: list[str] = field(default_factory=list)  # reasons per-sample stats are invalid
    micro_batches: int = 1
    ranks: int = 1

    norms = _statistic("norms")
    sq_norms = _statistic("sq_norms")
    gram_mean = _statistic("gram_mean")
    sum_sq = _statistic("sum_sq")
    var_sum = _statistic("var_sum")
    hist1d = _statistic("hist1d")
    hist2d = _statistic("hist2d")

    def __getitem__(self, name: str) -> dict[str, Tensor]:
        """The values of the registered statistic ``name`` (parameter → tensor)."""
        if name not in REGISTRY:
            raise KeyError(f"{name!r} is not a registered per-sample statistic (registered: "
                           f"{', '.join(REGISTRY)}); register it in cockpit.engine.statistics")
        return self.values.setdefault(name, {})

    @property
    def valid(self) -> bool:
        return not self.problems

    def finish(self) -> None:
        """Every registered statistic's values in their final form (:meth:`Statistic.finish`,
        at the end of the backward pass). A statistic whose finish fails is left empty
        (the failure is the caller's to record)."""
        for name, values in list(self.values.items()):
            statistic = REGISTRY.get(name)
            if statistic is None or not values:
                continue
            try:
                self.values[name] = statistic.finish(values)
            except BaseException:
                self.values[name] = {}
                raise

    def merge(self, other: BackwardStatistics) -> BackwardStatistics:
        """The statistics of the union of both batches (a new value; see the module doc)."""
        for name, statistic in REGISTRY.items():
            if statistic.merge is Merge.NONE and (self.values.get(name)
                                                   or other.values.get(name)):
                raise ValueError(
                    f"{name} depends on the whole batch's mean and cannot be merged; form it "
                    "over the union (engine.project on kept calls)")
        na, nb = self.num_samples, other.num_samples
        n = na + nb
        merged = BackwardStatistics(n, micro_batches=self.micro_batches + other.micro_batches)
        merged.problems = list(dict.fromkeys(self.problems + other.problems))
        for name, statistic in REGISTRY.items():
            mine, theirs = self.values.get(name, {}), other.values.get(name, {})
            if statistic.merge is Merge.CONCAT:
                merged.values[name] = _concat(mine, theirs, na, nb, dim=statistic.sample_dim)
            elif statistic.merge is Merge.ADD:
                merged.values[name] = _add(mine, theirs)
            elif statistic.merge is Merge.CENTERED:  # with the halves' means ḡ_a, ḡ_b
                merged.values[name] = {
                    key: _merge_centered(mine.get(key), self.batch_grads.get(key), na,
                                         theirs.get(key), other.batch_grads.get(key), nb)
                    for key in {**mine, **theirs}}
        merged.absent = {key: _add(self.absent.get(key, {}), other.absent.get(key, {}))
                         for key in {**self.absent, **other.absent}}
        merged.sample_sums = {
            key: _add(self.sample_sums.get(key, {}), other.sample_sums.get(key, {}))
            for key in {**self.sample_sums, **other.sample_sums}
        }
        merged.projections = {
            key: _concat(self.projections.get(key, {}), other.projections.get(key, {}), na, nb,
                         dim=-1)
            for key in {**self.projections, **other.projections}
        }
        if self.losses is not None and other.losses is not None:
            merged.losses = torch.cat([self.losses, other.losses.to(self.losses.device)])
        for name in {**self.batch_grads, **other.batch_grads}:
            a, b = self.batch_grads.get(name), other.batch_grads.get(name)
            if a is not None and b is not None:
                merged.batch_grads[name] = a * (na / n) + b * (nb / n)
            elif a is not None:
                merged.batch_grads[name] = a * (na / n)
            elif b is not None:
                merged.batch_grads[name] = b * (nb / n)
        return merged

    def fold_absent(self) -> None:
        """Add the counts of the samples that did not reach a parameter to its counts where
        other samples reached it; the counts of parameters without any stay in ``absent``
        (another process may have reached them)."""
        if not self.absent:
            return
        for name, absent in self.absent.items():
            values = self.values.get(name, {})
            for key in [key for key in absent if key in values]:
                values[key] = values[key] + absent.pop(key).to(values[key].device)


def _zero_like_samples(reference: Tensor, count: int, dim: int) -> Tensor:
    shape = list(reference.shape)
    shape[dim] = count
    return torch.zeros(shape, dtype=reference.dtype, device=reference.device)


def _concat(a: dict[str, Tensor], b: dict[str, Tensor], na: int, nb: int, dim: int = 0
            ) -> dict[str, Tensor]:
    """Per-sample vectors of both batches, one after the other. A parameter that received no
    gradient from one batch has individual gradients 0 there."""
    out = {}
    for name in {**a, **b}:
        x, y = a.get(name), b.get(name)
        if x is None:
            x = _zero_like_samples(y, na, dim)  # type: ignore[arg-type]
        if y is None:
            y = _zero_like_samples(x, nb, dim)
        out[name] = torch.cat([x, y.to(device=x.device, dtype=promote(x.dtype,
                                                                                  y.dtype))],
                              dim=dim)
    return out


def _add(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, Tensor]:
    out = dict(a)
    for name, value in b.items():
        out[name] = value if name not in out else out[name] + value.to(out[name].device)
    return out


def _merge_centered(va: Tensor | None, ma: Tensor | None, na: int,
                    vb: Tensor | None, mb: Tensor | None, nb: int) -> Tensor:
    """Σ_n (g_n − ḡ)² of the union from both halves' centered sums and means (float64).
    A half without the parameter has individual gradients 0: V = 0, ḡ = 0."""
    n = na + nb

    def parts(v: Tensor | None, m: Tensor | None, like: Tensor) -> tuple[Tensor, Tensor]:
        v = torch.zeros_like(like, dtype=torch.float64) if v is None else v.double()
        m = torch.zeros_like(like, dtype=torch.float64) if m is None else m.double()
        return v, m

    like = va if va is not None else vb
    assert like is not None
    va_, ma_ = parts(va, ma, like)
    vb_, mb_ = parts(vb, mb, like)
    diff = ma_.reshape(va_.shape) - mb_.reshape(va_.shape)
    return va_ + vb_ + (na * nb / n) * diff * diff
