"""The one reduction point of a tracked step: micro-batches, then processes.

A tracked step may consist of several backward passes (gradient accumulation: several
``with cockpit(step, ...)`` blocks before one optimizer step) on several processes
(torch.distributed). Each backward pass leaves finished :class:`BackwardStatistics`;
:class:`StepReduction` merges them as they come (:meth:`BackwardStatistics.merge`) and, when
the step is complete, combines the ranks (:mod:`cockpit.engine.reduction.ranks`) and forms the
statistics that need the whole batch's mean gradient ḡ: g_nᵀḡ for every sample, by
projecting each backward's kept layer calls on ḡ (the engine's :meth:`project`) — or, with
one backward per process where the synchronized gradient G is c·ḡ (DistributedDataParallel
with the same loss weight on every process), from the dots g_nᵀG the layers formed anyway
(:func:`gram_from_gradient`). The instruments then read one value and never learn whether
the batch was split.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cockpit.engine import float_sums
from cockpit.engine.reduction import ranks as distributed
from cockpit.engine.statistics import GRAM_MEAN, BackwardStatistics, Combine, requested


class StepReduction:
    """Collects the backward passes of one tracked step (see the module docstring).

    Args:
        engine: the :class:`~cockpit.engine.tracker.ModuleTracker` (for :meth:`project`).
        needs: the per-sample statistics the step's instruments read.
        request: the step's first request: with ``split``, g_nᵀḡ is formed here, from the
            kept calls, instead of in the hooks; a second backward pass of a step that was
            not expected to be split (``split`` false, or ``defer``: one per process)
            leaves what needed the whole step's gradient undefined.
        sample_sum_keys: keys of the instruments' own sample sums (same on every rank).
        projection_keys: keys under which the instruments may register directions to
            project on (the same on every rank, also where one rank's instruments
            prepared nothing: the layout of the reduction over processes depends on them).
    """

    def __init__(self, engine, needs: frozenset[str], request,
                 sample_sum_keys: tuple[str, ...] = (), ranks: int | None = None,
                 projection_keys: tuple[str, ...] = ()):
        self.engine, self.needs, self.split = engine, needs, request.split
        # processes whose statistics are combined (1: this process alone)
        self.ranks = distributed.world_size() if ranks is None else ranks
        self.one_backward_expected = not request.split or request.defer
        self.sample_sum_keys = sample_sum_keys
        self.stats: BackwardStatistics | None = None
        self.calls: list[list] = []  # kept layer calls, one list per backward pass
        self.sizes: list[int] = []  # samples per backward pass
        self.unmerged: str | None = None  # why g_nᵀḡ of the union is missing
        self.keeps_calls = False
        self.projection_keys: set[str] = set(projection_keys)  # the same on every process
        self._counts: list[int] = []  # samples per process, known after finish()

    @property
    def micro_batches(self) -> int:
        return 0 if self.stats is None else self.stats.micro_batches

    def add(self, stats: BackwardStatistics, calls: list, request) -> None:
        """One more backward pass of the step, with the request it was made under (its
        calls are kept for projections after the optimizer step if ``keep_calls``)."""
        keeps_calls = request.keep_calls
        self.projection_keys |= {*request.directions, *request.direction_providers}
        self.calls.append(calls)
        self.sizes.append(stats.num_samples)
        self.keeps_calls = keeps_calls
        if self.stats is None:
            self.stats = stats
            return
        if self.one_backward_expected:
            # g_nᵀḡ and update predictions were formed in the hooks against one micro-batch's
            # own (partial) gradient: not the union's
            self.stats.gram_mean, stats.gram_mean = {}, {}
            self.unmerged = (
                "this step's gradient was accumulated over micro-batches, which Cockpit learned "
                "only at its second backward pass; what needs the whole batch's gradient "
                "(g_nᵀḡ, the predicted update) needs every micro-batch's layer inputs: kept "
                "from the next tracked step on (pass Cockpit(..., grad_accumulation=True) to "
                "have it from the first step)"
            )
        self.stats = self.stats.merge(stats)

    def finish(self) -> BackwardStatistics:
        """The statistics of the whole step, over every micro-batch and process."""
        local = self.stats
        assert local is not None
        local.fold_absent()  # (what no sample here reached: another process' to count)
        ranks = self.ranks
        params = self.engine.params
        if ranks > 1:
            shapes = {name: p.shape for name, p in params.items()}
            device = _device(params)
            summed = [s for s in requested(self.needs) if s.combine is Combine.SUM]
            result, counts, directions, unmerged = distributed.reduce_sums(
                local, shapes, summed, self.engine, self.sample_sum_keys,
                sorted(self.projection_keys), device, unmerged=self.unmerged is not None)
            if unmerged and self.unmerged is None:  # (another process learned it)
                self.unmerged = OTHER_RANK_UNMERGED
        else:
            result, counts = local, [local.num_samples]
        if self.split and GRAM_MEAN in self.needs and not result.problems:
            gram = gram_from_gradient(local, result.batch_grads) if ranks > 1 else None
            local.gram_mean = (gram if gram is not None
                               else self._gram_over_union(result.batch_grads))
        if ranks > 1:
            gathered = [s for s in requested(self.needs) if s.combine is Combine.GATHER]
            distributed.gather_samples(local, result, counts, list(params), gathered,
                                       directions, device)
        self._counts = counts
        if not self.keeps_calls:
            self.calls = []
        return result

    def project_samples(self, directions: dict[str, Tensor]) -> Tensor:
        """Σ over parameters of g_nᵀu for every sample of the step (all micro-batches, all
        processes, in the order of the statistics), for directions u known only after the
        optimizer step; frees the kept calls."""
        calls, self.calls = self.calls, []
        parts = []
        for group, size in zip(calls, self.sizes, strict=True):
            dots = self.engine.project(group, directions)
            total = sum(d.double() for d in dots.values()) if dots else None
            parts.append(total if total is not None else torch.zeros(size, dtype=torch.float64))
        if not parts:
            raise ValueError("no layer with parameters was recorded at this step")
        local = torch.cat([p.cpu() for p in parts])
        if len(self._counts) > 1:
            local = distributed.gather_vector(local, self._counts,
                                              _device(self.engine.params))
        return local

    def _gram_over_union(self, mean: dict[str, Tensor]) -> dict[str, Tensor]:
        """g_nᵀḡ per parameter for this process' samples, ḡ the mean over the whole step."""
        if self.unmerged is not None:
            return {}
        parts = [self.engine.project(calls, mean) for calls in self.calls]
        out: dict[str, Tensor] = {}
        for name in mean:
            rows = []
            for part, count in zip(parts, self.sizes, strict=True):
                value = part.get(name)
                rows.append(value.double() if value is not None
                            else torch.zeros(count, dtype=torch.float64,
                                             device=mean[name].device))
            out[name] = torch.cat(rows)
        return out


OTHER_RANK_UNMERGED = (
    "another process split this step's batch over micro-batches, which Cockpit learned only "
    "at its second backward pass there: what needs the whole batch's gradient (g_nᵀḡ, the "
    "predicted update) is undefined at this step on every process (pass Cockpit(..., "
    "grad_accumulation=True) to have it from the first step)")


def gram_from_gradient(local: BackwardStatistics, mean: dict[str, Tensor]
                       ) -> dict[str, Tensor] | None:
    """g_nᵀḡ for this process' samples from g_nᵀG, G the gradient the optimizer steps on,
    where G = c·ḡ: DistributedDataParallel averages the processes' gradients, so with the
    same loss weight w on every process (a sum over the global batch divided by anything,
    or means over equal shards) G = (w·N/R)·ḡ. c is fitted by least squares,
    c = Σ⟨G, ḡ⟩ / Σ‖ḡ‖², and the shortcut is taken only if every parameter satisfies
    ‖G − c·ḡ‖ ≤ 256·ε·‖G‖ (ε of G's dtype, i.e. G and c·ḡ agree to rounding); then
    g_nᵀḡ = g_nᵀG / c with an error below 256·ε·‖g_n‖‖ḡ‖. Otherwise (unequal weights over
    uneven shards, gradients all-reduced by hand after the backward pass, compressed
    communication, gradients held from an earlier step) None: the caller projects the kept
    layer calls on ḡ instead (exact, one more pass over the layers)."""
    synced = local.gradient_dots
    if (synced is None or not mean
            or not set(synced.dots) == set(synced.gradient) == set(mean)):
        return None
    pairs = []  # (G, ḡ) per parameter, flat, in G's dtype
    for name, g_bar in mean.items():
        grad = synced.gradient[name].reshape(-1)
        pairs.append((grad, g_bar.reshape(-1).to(grad.dtype)))
    inner = sum(float(float_sums.dot(grad, g_bar)) for grad, g_bar in pairs)
    sq_mean = sum(float(float_sums.sq_norm(g_bar)) for _, g_bar in pairs)
    if not sq_mean > 0.0 or inner == 0.0:
        return None
    c = inner / sq_mean
    for grad, g_bar in pairs:
        tolerance = 256 * torch.finfo(grad.dtype).eps * float(grad.norm())
        if not float((grad - c * g_bar).norm()) <= tolerance:
            return None
    return {name: synced.dots[name].double() / c for name in mean}


def _device(params: dict[str, Tensor]) -> torch.device:
    for p in params.values():
        return p.device
    return torch.device("cpu")
