"""Per-call processing: one recorded layer call → its parameters' per-sample statistics.

When a layer call's output gradients ∂L/∂y have all arrived (inside the user's backward
pass, or after it for deferred units), :class:`CallProcessor` turns them into the individual
losses' gradients δ_n = (∂L/∂y_n) / w_n, asks the layer rule for one :class:`SampleGrads`
per parameter and reduces each to the statistics the step's instruments need:

* the registered per-sample statistics (‖g_n‖², Σ_n g_n ⊙ g_n, histograms, …; see
  :mod:`cockpit.engine.statistics`), in one loop over the registry per parameter that hands
  each the same individual gradients, materialized at most once, and
* the dot products g_nᵀu — with the mean ḡ, with the directions known before the backward
  pass and with those computed from the gradient the optimizer will see — in one
  ``dots_many`` pass per parameter (:meth:`CallProcessor.reduce_dots`). Where a dot product
  needs the parameter's gradient, which arrives right after the layer's output gradient,
  the :class:`SampleGrads` waits for it (``pending``).

On accelerators, whose host the kernels bind, parameters of one kind wait to be formed
together: small ones until the backward pass ends (:mod:`cockpit.engine.side_by_side`),
Linear weights of one shape until a stack of them is full and their gradients have arrived,
and normalization layers of one shape, by their rule's inputs, until a stack of them is
full (:mod:`cockpit.engine.stacked`: a transformer's blocks in the kernels of one layer).
Parameters used by several calls (tied weights) have their individual gradients summed over
the calls (``accumulated``) and are reduced when the backward pass ends. A parameter whose
|B| individual gradients exceed the engine's ``memory_budget`` (bytes) is reduced in sample
chunks that each fit it (:mod:`cockpit.engine.rules.sample_chunks`; exact), its statistics
waiting with its dot products so that one pass over the chunks forms both. The state of the
backward pass itself (the request, the loss weights w_n, the gradients seen so far, the
statistics being filled) belongs to the :class:`~cockpit.engine.tracker.ModuleTracker`
whose hooks record it; the processor reads it there.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.rnn import PackedSequence

from cockpit.engine import side_by_side, stacked
from cockpit.engine.capture.end_of_backward import queue_at_end_of_backward
from cockpit.engine.dtypes import promote
from cockpit.engine.histograms.device import device_path
from cockpit.engine.rules.batchnorm_frozen import (
    FROZEN_STATISTICS,
    frozen_rule,
    is_training_batch_norm,
)
from cockpit.engine.rules.fallback import (
    RandomForwardError,
    batch_dim_of,
    fallback_in_chunks,
    fallback_rule,
    output_batch_dims,
    random_message,
)
from cockpit.engine.rules.norms import SampleMixingError
from cockpit.engine.rules.reparametrized import (
    ComputedWeights,
    Reparametrization,
    originals_grads,
    readable,
)
from cockpit.engine.rules.sample_chunks import (
    CallSum,
    SampleChunks,
    merge_centered,
    samples_per_chunk,
)
from cockpit.engine.rules.sample_grads import (
    DenseSampleGrads,
    Directions,
    SampleGrads,
    outside_autograd,
)
from cockpit.engine.statistics import (
    GRAM_MEAN,
    PER_SAMPLE_STATS,
    PROJECTIONS,
    SAMPLE_GRAD_SUM,
    LayerContext,
    Merge,
    requested,
    shared_chunks,
)

if TYPE_CHECKING:
    from cockpit.engine.tracker import Call, ModuleTracker, Unit


_ONLY_PROJECTIONS = frozenset({PROJECTIONS})


class _Gradient:
    """What a direction provider returns for "the gradient you gave me" (see GRADIENT)."""

    def __repr__(self) -> str:
        return "GRADIENT"


GRADIENT = _Gradient()
"""A direction provider may put GRADIENT into its basis instead of a copy of the gradient it
was given: the tracker then takes g_nᵀ(gradient) from g_nᵀḡ where that is this backward's
own gradient (a closed form for Linear layers, one shared row otherwise)."""


class CallProcessor:
    """Reduces the recorded calls of one tracked backward pass (see the module docstring).

    Args:
        engine: the tracker whose hooks record the backward pass' state.
    """

    def __init__(self, engine: ModuleTracker):
        self.engine = engine
        # individual gradients of parameters used by several calls, summed over the calls
        self.accumulated: dict[str, DenseSampleGrads | CallSum] = {}
        # parameter → its individual gradients, waiting for the parameter's gradient
        self.pending: dict[str, SampleGrads] = {}
        # chunked parameters whose statistics wait to be formed in the dot products' pass
        self.unformed: set[str] = set()
        # small parameters' individual gradients, waiting for the end of the backward pass
        # to be reduced side by side (:meth:`reduce`)
        self.small: dict[str, DenseSampleGrads] = {}
        # Linear weights waiting to be formed with others of their shape: the open stack of
        # each shape, and every waiting weight's stack (:mod:`cockpit.engine.stacked`)
        self.stacks: dict[tuple, stacked.Stack] = {}
        self.stacked: dict[str, stacked.Stack] = {}
        self._stacks_queued = False
        # the weights of each shape in this backward pass, and the shapes the last one had
        # only one weight of (those no longer wait for a partner)
        self._shape_counts: dict[tuple, int] = {}
        self._lone_shapes: set[tuple] = set()
        # normalization layers waiting to be formed with others of their shape (their rule's
        # inputs; :func:`cockpit.engine.stacked.form_norm_stack`)
        self.norm_stacks: dict[tuple, stacked.NormStack] = {}
        self._norms_queued = False
        # the backward pass has ended and its remaining calls are processed (deferred
        # units): the grouped work is formed when they are done, not queued in autograd
        self.after_backward = False
        # calls kept (inputs and individual output gradients) for later projections
        self.kept_calls: list[Call] = []
        # layers' weights computed from their trained tensors (parametrizations)
        self.computed = ComputedWeights(lambda: engine.model.modules(), lambda module: any(
            u.module is module and u.rule is not None for u in engine.capture.units))

    def begin(self) -> None:
        """Forget what an earlier backward pass left (but which of its Linear shapes were
        alone: a model's layers do not change from one step to the next)."""
        self.kept_calls = []
        self.computed.begin()
        self.drop_waiting()
        if self._shape_counts:
            self._lone_shapes = {key for key, n in self._shape_counts.items() if n == 1}
            self._shape_counts = {}

    def drop_waiting(self) -> None:
        """Forget the individual gradients that wait to be reduced (a backward pass ended,
        or failed)."""
        self.accumulated, self.pending, self.small = {}, {}, {}
        self.unformed = set()
        self.stacks, self.stacked, self._stacks_queued = {}, {}, False
        self.norm_stacks, self._norms_queued = {}, False

    def fail(self, message: str) -> None:
        """Record why the per-sample statistics of this backward pass are invalid."""
        stats = self.engine.stats
        assert stats is not None
        if message not in stats.problems:
            stats.problems.append(message)

    # ------------------------------------------------------------------ calls
    def process_guarded(self, call: Call) -> None:
        try:
            self.guarded(call.unit.name or type(call.unit.module).__name__, self.process, call)
        finally:  # the call's inputs and gradients are freed inside its hook
            call.release()

    def process(self, call: Call) -> None:
        engine = self.engine
        stats = engine.stats
        assert stats is not None
        # (a split batch's g_nᵀḡ alone is formed at the reduction point from the kept calls)
        if ((engine.needs.isdisjoint(PER_SAMPLE_STATS) and not engine.keep_calls)
                or stats.problems):
            return
        weights = engine.state.weights
        if engine.state.weights_problem is not None:
            self.fail(engine.state.weights_problem)
            return
        if weights is None:
            self.fail(
                "the backpropagated loss does not depend on the `losses` passed to "
                "cockpit(step, losses=...); pass the per-sample losses whose mean you "
                "backpropagate"
            )
            return
        tensors = [v for v in (*call.args, *call.kwargs.values()) if isinstance(v, Tensor)]
        if [t._version for t in tensors] != call.versions:
            raise RuntimeError(
                "an input of this layer was modified in place after the layer used it"
            )
        for tap in call.taps.values():
            if tap.problem is not None:
                raise ValueError(tap.problem)
        unit = call.unit
        if isinstance(unit.module, parametrize.ParametrizationList):
            self.computed.parametrization_called(unit.name, unit.module)
            return
        computed = self.computed.of(unit.module)  # (weights computed from trained tensors)
        if (unit.rule is None and len(call.outputs) > 1
                and not isinstance(unit.module, nn.RNNCellBase)  # (the cell rule separates)
                and outputs_feed_each_other(call)):
            raise ValueError(
                "one of its outputs is computed from another of its outputs; the gradient "
                "hooks then see the inner path twice and Cockpit cannot separate it: return "
                "the outputs from separate computations (or only one of them)"
            )
        bd = batch_dim_of(unit.module) if unit.rule is None else unit.batch_dim
        first = call.grads[0]
        packed = isinstance(unit.module, nn.RNNBase) and any(
            isinstance(v, PackedSequence) for v in (*call.args, *call.kwargs.values()))
        if (first is not None and first.dim() > bd and first.shape[bd] != stats.num_samples
                and not packed):
            raise ValueError(batch_size_message(first.shape[bd], stats.num_samples,
                                                unit.module))
        rule = unit.rule
        scale = 1.0
        keep_calls = engine.keep_calls
        if packed:  # a packed output has no batch dimension; the weights are uniform
            grads = [g / engine.state.weight_value for g in call.grads]
        elif getattr(rule, "takes_scale", False) and not keep_calls:
            # δ_n = ∂L/∂y_n / w with one uniform w (checked): the rule folds 1/w into its
            # smallest intermediate instead of dividing the whole output gradient
            grads, scale = list(call.grads), 1.0 / engine.state.weight_value
        else:
            dims = (output_batch_dims(unit.module, call.output_positions)
                    if unit.rule is None else (unit.batch_dim,) * len(call.grads))
            grads = [self.individual(g, weights, d) for g, d in zip(call.grads, dims,
                                                                     strict=True)]
        if keep_calls:  # for projections on directions known only after the step
            params = (None if unit.rule is not None and len(grads) == 1
                      else {k: p.detach().clone() for k, p in self.whole_params(unit).items()})
            if params is None and computed:  # (θ_t of W = P(θ_t))
                params = {k: t.detach().clone() for rep in computed.values()
                          for k, t in rep.originals.items()}
            self.kept_calls.append(type(call)(
                unit, call.args, call.kwargs, [], call.versions, grads,
                output_positions=call.output_positions, params=params))
        if engine.needs <= _ONLY_PROJECTIONS and not (engine.directions
                                                   or engine.direction_providers):
            return
        if self._waits_normalized(call, grads, scale):
            return
        results = self.rule(call, grads, scale)
        if computed:
            self.computed.layer_called(unit.name, unit.module)
        for name, sg in results.items():
            if sg.num_samples != stats.num_samples:
                raise ValueError(batch_size_message(sg.num_samples, stats.num_samples,
                                                    unit.module))
            if name in engine.state.multi_use:
                accumulate(self.accumulated, name, sg, engine.memory_budget)
            else:
                self.reduce(name, sg)

    def reduce_accumulated(self) -> None:
        """Reduce the parameters used by several calls (their summed individual gradients),
        after checking that each parametrized weight served its layer's calls alone."""
        problem = self.computed.problem()
        if problem is not None:
            self.fail(problem)
        for name, grads in self.accumulated.items():
            self.reduce_guarded(name, grads)
        self.accumulated = {}

    def reduce_pending(self) -> None:
        """The dot products of parameters whose gradient never arrived in a hook: against
        the batch gradient recorded for them, if any."""
        engine = self.engine
        assert engine.stats is not None
        for name, sg in self.pending.items():
            if name in engine.stats.batch_grads:
                engine.state.seen_grads.setdefault(name, engine.stats.batch_grads[name])
            self.reduce_dots_guarded(name, sg)
        self.pending = {}

    def gradient_arrived(self, name: str) -> None:
        """The parameter's gradient is known: form the dot products that waited for it (and
        a full stack of Linear weights whose last gradient this was)."""
        if name in self.pending:
            self.reduce_dots_guarded(name, self.pending.pop(name))
        stack = self.stacked.get(name)
        if stack is not None and name in stack.waiting:
            stack.waiting.discard(name)
            if stack.full and not stack.waiting:
                self.reduce_stack_guarded(stack)

    @staticmethod
    def individual(grad: Tensor, weights: Tensor, batch_dim: int) -> Tensor:
        """∂L/∂y_n → ∂ℓ_n/∂y_n by dividing by the loss weight w_n of each sample."""
        shape = [1] * grad.dim()
        shape[batch_dim] = -1
        return grad / weights.reshape(shape).to(grad.dtype)

    def guarded(self, label: str, fn, *args) -> None:
        """Run Cockpit's own work inside autograd; a failure is recorded, never raised
        into the user's backward pass (unless ``strict``; a layer that mixes samples is a
        property of the model, not a bug, and is always recorded)."""
        engine = self.engine
        previous, engine.state.suspended = engine.state.suspended, True
        try:
            fn(*args)
        except Exception as error:
            if engine.strict and not isinstance(error, SampleMixingError):
                raise
            self.fail(f"{label}: {error}")
        finally:
            engine.state.suspended = previous

    def rule(self, call: Call, grads: list[Tensor], scale: float = 1.0
             ) -> dict[str, SampleGrads]:
        """The unit's rule on one call, keyed by global parameter names. ``scale``: a factor
        the rule applies to ``grads`` (only rules with ``takes_scale``)."""
        engine = self.engine
        unit = call.unit
        if isinstance(unit.module, parametrize.ParametrizationList):
            return {}  # (its originals are formed by its layer's rule: _reparametrized)
        if engine.compute_dtypes and unit.params:
            grads = as_computed(grads, engine.compute_dtypes.get(
                engine.unit_param_name(unit, next(iter(unit.params)))))
        rule = unit.rule
        if (engine.batchnorm == FROZEN_STATISTICS and not engine.state.probing
                and is_training_batch_norm(unit.module)):
            rule = frozen_rule(unit.module)  # (also where no rule is registered: SyncBatchNorm)
        if rule is not None and len(grads) == 1:
            # kept calls drop outputs; a call keeps only records of those no one reads
            output = (call.outputs[0] if call.outputs and isinstance(call.outputs[0], Tensor)
                      else None)
            extra = {"scale": scale} if scale != 1.0 else {}
            if unit.batch_dim:  # (a sequence-first layer: the rule reads [N, T, …] views)
                args, kwargs, grads, output = batch_in_front(
                    call.args, call.kwargs, grads, output, unit.batch_dim)
            else:
                args, kwargs = call.args, call.kwargs
            args, kwargs, grads = common_precision(
                args, kwargs, grads, widen=not getattr(rule, "widens_when_read", False))
            computed = self.computed.of(unit.module)
            if computed:
                with readable(unit.module, computed):
                    sample_grads = rule(unit.module, args, kwargs, output, grads[0], **extra)
                return self._reparametrized(call, computed, sample_grads)
            sample_grads = rule(unit.module, args, kwargs, output, grads[0], **extra)
        else:
            params = self.whole_params(unit) if call.params is None else call.params
            args, kwargs = call.args, call.kwargs
            if engine.compute_dtypes:  # the rounded values, evaluated in float32 (as above)
                args, kwargs, grads = common_precision(args, kwargs, grads)
                params = {k: v.float() if v.is_floating_point() and v.element_size() < 4
                          else v for k, v in params.items()}
            chunked = (None if engine.memory_budget is None else fallback_in_chunks(
                unit.module, args, kwargs, call.output_positions, grads, params,
                engine.memory_budget))
            try:
                sample_grads = chunked if chunked is not None else fallback_rule(
                    unit.module, args, kwargs, call.output_positions, grads, params
                )
            except RandomForwardError:
                raise RandomForwardError(random_message(unit.module, unit.name)) from None
        return {engine.unit_param_name(unit, attr): sg for attr, sg in sample_grads.items()}

    def _reparametrized(self, call: Call, computed: dict[str, Reparametrization],
                        sample_grads: dict[str, SampleGrads]) -> dict[str, SampleGrads]:
        """A layer rule's individual gradients with those of each computed weight W =
        P(θ_1, …, θ_k) mapped to its originals: g_n(θ_i) = (∂P/∂θ_i)ᵀ g_n(W), at the θ the
        call used (a kept call's copies after the optimizer step)."""
        engine = self.engine
        out: dict[str, SampleGrads] = {}
        for attr, sg in sample_grads.items():
            rep = computed.get(attr)
            if rep is None:
                out[engine.unit_param_name(call.unit, attr)] = sg
                continue
            for key, grads in originals_grads(rep, sg, call.params).items():
                out[engine.param_names[id(rep.originals[key])]] = grads
        return out

    def whole_params(self, unit: Unit) -> dict[str, Tensor]:
        """The unit's parameters, all of each (``fully_shard``: the engine's gathered ones
        in place of the local shards, in the dtype the layer computed in)."""
        gathered, dtypes = self.engine.gathered_params, self.engine.compute_dtypes
        if not gathered:
            return unit.params
        out = {}
        for k, p in unit.params.items():
            name = self.engine.unit_param_name(unit, k)
            # mixed precision: θ rounded to param_dtype, as the layer computed with it
            out[k] = gathered.get(name, p).to(dtypes.get(name, p.dtype))
        return out

    # ------------------------------------------------------------------ statistics
    def reduce_guarded(self, name: str, sg: SampleGrads) -> None:
        self.guarded(name, self.reduce, name, sg)

    def reduce(self, name: str, sg: SampleGrads, alone: bool = False) -> None:
        """Every requested statistic of one parameter from its individual gradients, in one
        loop over the registry that hands them the same :class:`SampleGrads` (materialized
        at most once, :func:`shared_chunks`) and :class:`LayerContext`; then the dot
        products (now, or when the parameter's gradient arrives). Unless ``alone``, small
        parameters and Linear weights may first wait to be formed with others."""
        if not alone and (self._waits_side_by_side(name, sg) or self._waits_stacked(name, sg)):
            return
        engine = self.engine
        stats, needs = engine.stats, engine.needs
        assert stats is not None
        sg = self.within_budget(name, sg)
        chunked = isinstance(sg, SampleChunks)
        if chunked and not (engine.state.frozen_pass or engine.compute_dtypes):
            # the statistics and the dot products in one pass over the chunks
            self.unformed.add(name)
            if self._waits_for_gradient(name, sg):
                self.pending[name] = sg
            else:
                self.reduce_dots(name, sg)
            return
        layer = LayerContext(name, engine)
        with contextlib.nullcontext() if chunked else shared_chunks(sg, layer):
            if chunked:
                self.form_in_chunks(name, sg)
            else:
                for statistic in requested(needs):
                    value = statistic.form(sg, layer)
                    if value is not None:
                        stats[statistic.name][name] = value
            if engine.state.frozen_pass or engine.compute_dtypes:  # their sum (not ∂L/∂θ): keep it
                stats.sample_sums.setdefault(SAMPLE_GRAD_SUM, {})[name] = (
                    sg.batch_mean() * sg.num_samples)
            if self._waits_for_gradient(name, sg):
                # the parameter's gradient arrives right after this layer's output gradient
                self.pending[name] = sg
            else:
                self.reduce_dots(name, sg)

    def _waits_for_gradient(self, name: str, sg: SampleGrads) -> bool:
        """Whether the dot products need the parameter's gradient, not yet arrived."""
        engine = self.engine
        waits = engine.direction_providers or (GRAM_MEAN in engine.needs and sg.fuse_dots)
        return bool(waits) and name not in engine.state.seen_grads and not engine.state.frozen_pass

    def within_budget(self, name: str, sg: SampleGrads) -> SampleGrads:
        """``sg`` as :class:`SampleChunks` where its |B| individual gradients exceed the
        engine's memory budget (and it can form sample ranges alone); recorded in
        ``engine.chunked_layers``."""
        budget = self.engine.memory_budget
        if budget is None or isinstance(sg, SampleChunks) or sg.scratch_bytes() <= budget:
            if isinstance(sg, SampleChunks):
                self.engine.chunked_layers[name] = sg.num_chunks
            return sg
        if sg.num_samples > 1 and sg.selectable:
            per_sample = -(-sg.scratch_bytes() // sg.num_samples)
            sg = SampleChunks(sg.num_samples, sg.shape, sg.dtype, sg.select,
                              samples_per_chunk(per_sample, budget), whole=sg, budget=budget)
            self.engine.chunked_layers[name] = sg.num_chunks
        return sg

    def form_in_chunks(self, name: str, sg: SampleChunks,
                       vectors: list[Tensor] | None = None, keep_mean: bool = True
                       ) -> Tensor | None:
        """Every requested statistic of one parameter, formed per sample chunk (all of a
        chunk's statistics share its one materialization) and merged as each declares:
        per-sample values concatenated, sums added, centered sums by the parallel-variance
        identity; statistics relative to the whole batch's mean on the whole ``sg``. With
        ``vectors`` also the dot products [g_nᵀu_k]_{k,n} from the same chunks (returned).
        ḡ is formed on the way (and kept in ``sg.mean``) where ``keep_mean`` or a centered
        statistic asks for it: per chunk a pass over its N·D numbers."""
        engine = self.engine
        stats = engine.stats
        assert stats is not None
        statistics = requested(engine.needs)
        if not statistics and not vectors:  # (ḡ, if a dot product needs it, when asked)
            return None
        if vectors:  # (their rows stacked by the first chunk, read by every other)
            vectors = Directions(vectors)
        dots: list[Tensor] = []
        values: dict[str, list[Tensor]] = {}
        centered: dict[str, tuple[Tensor, Tensor, int]] = {}
        total: Tensor | None = None  # Σ_n g_n, for the dot products with ḡ later
        with_mean = keep_mean or any(s.merge is Merge.CENTERED for s in statistics)
        for part in sg.parts():
            layer = LayerContext(name, engine)
            with shared_chunks(part, layer):
                if with_mean:
                    mean = part.batch_mean()
                    # (in place: one parameter-sized sum held, not a new one per chunk)
                    total = (mean * part.num_samples if total is None
                             else total.add_(mean * part.num_samples))
                for statistic in statistics:
                    if statistic.merge is Merge.NONE:
                        continue
                    value = statistic.form(part, layer)
                    if value is None:
                        continue
                    if statistic.merge is Merge.CENTERED:
                        centered[statistic.name] = merge_centered(
                            centered.get(statistic.name),
                            (value, mean, part.num_samples))
                    elif statistic.merge is Merge.ADD and statistic.name in values:
                        values[statistic.name][0] = values[statistic.name][0] + value
                    else:
                        values.setdefault(statistic.name, []).append(value)
                if vectors:
                    dots.append(part.dots_many(vectors))
            del part, layer
        if total is not None:
            sg.mean = total.div_(sg.num_samples)
        for statistic in statistics:
            if statistic.merge is Merge.NONE:
                value = statistic.form(sg, LayerContext(name, engine))
            elif statistic.merge is Merge.CENTERED:
                value = centered[statistic.name][0] if statistic.name in centered else None
            elif statistic.name not in values:
                value = None
            elif statistic.merge is Merge.CONCAT:
                value = torch.cat(values[statistic.name], dim=statistic.sample_dim)
            else:
                value = values[statistic.name][0]
            if value is not None:
                stats[statistic.name][name] = value
        return torch.cat(dots, dim=1) if dots else None

    def reduce_dots_guarded(self, name: str, sg: SampleGrads) -> None:
        self.guarded(name, self.reduce_dots, name, sg)

    def reduce_dots(self, name: str, sg: SampleGrads) -> None:
        """The statistics that are dot products g_nᵀu — with ḡ (GRAM_MEAN), with the
        directions known before the backward and with those the providers compute from the
        gradient the optimizer sees — in one pass over the individual gradients. A chunked
        parameter whose statistics waited for this (``unformed``) forms them in the same pass
        over its chunks where its dot products go by chunks (each chunk materialized once),
        unless g_nᵀḡ needs ḡ from a pass of its own."""
        if name in self.unformed:
            self.unformed.discard(name)
            assert isinstance(sg, SampleChunks)
            if self._mean_takes_a_pass(name, sg):
                self.form_in_chunks(name, sg)  # (sets ḡ)
            else:
                plan = self._plan_dots(name, sg)
                by_chunks = bool(plan.vectors) and not sg.dots_at_once(len(plan.vectors))
                dots = self.form_in_chunks(name, sg, plan.vectors if by_chunks else None,
                                           keep_mean=False)
                if plan.vectors and not by_chunks:
                    dots = sg.dots_many(plan.vectors)
                self._record_dots(plan, dots)
                return
        plan = self._plan_dots(name, sg)
        self._record_dots(plan, sg.dots_many(plan.vectors) if plan.vectors else None)

    def _mean_takes_a_pass(self, name: str, sg: SampleGrads) -> bool:
        """Whether g_nᵀḡ needs ḡ from the individual gradients (:meth:`_plan_dots`): unless
        this backward's own gradient G = w·N·ḡ is known."""
        return (GRAM_MEAN in self.engine.needs and sg.fuse_dots
                and not self._own_gradient_scale(name, sg.num_samples))

    def _own_gradient_scale(self, name: str, num_samples: int) -> float | None:
        """w·N where the gradient seen for ``name`` is this backward's own, G = Σ_m w·g_m =
        w·N·ḡ (so g_nᵀG = w·N·g_nᵀḡ); None where it is not (or not seen yet)."""
        engine = self.engine
        seen = engine.state.seen_grads.get(name)
        if seen is None or name not in engine.state.pure_grads or not engine.loss_weight:
            return None
        return engine.loss_weight * num_samples

    def _plan_dots(self, name: str, sg: SampleGrads, bases: dict | None = None) -> _DotPlan:
        """The directions u of :meth:`reduce_dots` and where each statistic finds its rows
        (``bases``: the providers' directions for this parameter, if asked already)."""
        engine = self.engine
        stats = engine.stats
        assert stats is not None
        plan = _DotPlan(name)
        row = plan.row
        seen = engine.state.seen_grads.get(name)
        w_n = plan.w_n = self._own_gradient_scale(name, sg.num_samples)
        gradient_ref: int | Tensor | None = None
        if GRAM_MEAN in engine.needs and sg.fuse_dots:
            if w_n:  # seen ∥ ḡ: one row serves g_nᵀḡ and a provider's GRADIENT
                plan.gram_row = gradient_ref = row(seen)
            else:
                plan.gram_row = row(sg.batch_mean())
        synced = stats.gradient_dots
        if synced is not None and seen is not None and name in synced.gradient:
            plan.synced_row = row(seen)
        for key, directions in engine.directions.items():
            if name in directions:
                plan.projections.append((key, [row(directions[name])]))
        providers = engine.direction_providers
        if not providers or seen is None:
            return plan
        param = engine.params[name]
        for key, provider in providers.items():
            basis = bases[key] if bases is not None else provider(name, param, seen)
            if basis is None:
                continue
            refs: list[int | Tensor] = []
            for v in basis:
                if v is not GRADIENT:
                    refs.append(row(v))
                    continue
                if gradient_ref is None:
                    if w_n and not sg.fuse_dots:  # closed form (Gram matrix for Linear layers)
                        gram = stats.gram_mean.get(name)
                        gram = sg.gram_mean() if gram is None else gram
                        gradient_ref = gram if w_n == 1.0 else w_n * gram  # (×1: no kernel)
                    else:
                        gradient_ref = row(seen)
                refs.append(gradient_ref)
            plan.projections.append((key, refs))
        return plan

    def _record_dots(self, plan: _DotPlan, dots: Tensor | None) -> None:
        """The statistics of :meth:`_plan_dots` from ``dots`` = [g_nᵀu_k]_{k,n}."""
        stats = self.engine.stats
        assert stats is not None
        name = plan.name
        if plan.gram_row is not None:
            assert dots is not None
            stats.gram_mean[name] = _over_weight(dots[plan.gram_row], plan.w_n)
        if plan.synced_row is not None:
            assert dots is not None and stats.gradient_dots is not None
            stats.gradient_dots.dots[name] = dots[plan.synced_row]
        for key, refs in plan.projections:
            stats.projections.setdefault(key, {})[name] = _rows_of(dots, refs)

    # ------------------------------------------------------------------ side by side
    def _waits_side_by_side(self, name: str, sg: SampleGrads) -> bool:
        """Whether this parameter waits for the end of the backward pass, to be reduced
        with the other small ones (:mod:`cockpit.engine.side_by_side`; on accelerators,
        whose host the kernels bind; queued with the first of the pass, or formed by the
        tracker's end for calls processed after the pass; False outside either)."""
        engine = self.engine
        if (not side_by_side.is_small(sg) or engine.state.frozen_pass
                or name in engine.state.multi_use
                # (fully_shard frees the gathered θ after each layer; only it sets
                # compute_dtypes, whose sums of individual gradients are not formed here)
                or engine.sharded):
            return False
        if (not self.small and not self.after_backward
                and not queue_at_end_of_backward(self.reduce_side_by_side)):
            return False
        self.small[name] = sg  # type: ignore[assignment]
        return True

    def reduce_side_by_side(self) -> None:
        """Every statistic of the small parameters that waited for the end of the backward
        pass, formed side by side: the registered statistics (where they have a form for
        it, else per parameter), the providers' directions for all of them at once
        (``many``, e.g. one batched prediction of Adam's update) and the dot products. Never
        raises into the backward pass (a failure is recorded, unless ``strict``)."""
        self.reduce_norm_stacks()  # (their small parameters join these)
        waiting, self.small = self.small, {}
        if not waiting:
            return
        engine = self.engine
        names = list(waiting)
        shapes = [(sg.num_samples, sg.dtype, sg.unscaled.device, sg.shape.numel())
                  for sg in waiting.values()]
        bins = getattr(engine.hist_spec, "bins", 0)
        for members in side_by_side.groups(shapes, bins):
            group = [names[i] for i in members]
            label = f"{len(group)} small parameters ({group[0]}, …)"
            self.guarded(label, self._reduce_group, group, [waiting[k] for k in group])

    def _reduce_group(self, names: list[str], sgs: list[DenseSampleGrads]) -> None:
        engine = self.engine
        stats = engine.stats
        assert stats is not None
        side = side_by_side.SideBySide([sg.unscaled for sg in sgs], [sg.scale for sg in sgs])
        layers = [LayerContext(name, engine) for name in names]
        for statistic in requested(engine.needs):
            values = statistic.form_side_by_side(side, layers)
            if values is None:
                values = [statistic.form(sg, layer) for sg, layer in zip(sgs, layers,
                                                                         strict=True)]
            for name, value in zip(names, values, strict=True):
                if value is not None:
                    stats[statistic.name][name] = value
        self._dots_together(names, sgs, side.dots,
                            lambda index, vectors: sgs[index].dots_many(vectors))

    def _dots_together(self, names: list[str], sgs: Sequence[SampleGrads],
                       together: Callable[[list[list[Tensor]]], Tensor],
                       alone: Callable[[int, list[Tensor]], Tensor]) -> None:
        """The dot products of parameters formed together (side by side, or stacked): by
        ``together`` (every parameter's directions → [g_{n,p}ᵀu_{k,p}]_{k,n,p}) where each
        has the same number of them and every gradient has arrived, else by ``alone``
        (parameter index, its directions → [K, N]); the providers asked once for all. A
        parameter whose gradient has not arrived waits for it (``pending``)."""
        dotted = []
        for index, (name, sg) in enumerate(zip(names, sgs, strict=True)):
            if self._waits_for_gradient(name, sg):  # (its gradient never arrived)
                self.pending[name] = sg
            else:
                dotted.append((index, name, sg))
        if not dotted:
            return
        bases = self._bases([name for _, name, _ in dotted])
        plans = [self._plan_dots(name, sg, bases.get(name)) for _, name, sg in dotted]
        sizes = {len(plan.vectors) for plan in plans}
        if len(sizes) == 1 and 0 not in sizes and len(plans) == len(names):
            block = together([plan.vectors for plan in plans])
            layouts = {plan.rows_read() for plan in plans}
            if len(layouts) == 1 and None not in layouts:
                self._record_dots_together(plans, block)
                return
            dots: list[Tensor | None] = list(block.unbind(2))
        else:
            dots = [alone(index, plan.vectors) if plan.vectors else None
                    for plan, (index, _, _) in zip(plans, dotted, strict=True)]
        for plan, value in zip(plans, dots, strict=True):
            self._record_dots(plan, value)

    # ------------------------------------------------------------------ stacked
    def _waits_for_partners(self, group: tuple, size: int, queued: bool,
                            at_end: Callable[[], None]) -> bool:
        """Whether a layer of shape ``group`` waits to be stacked: a stack holds two or more
        of them (``size``), the shape had more than one layer in the last backward pass, and
        what waits is formed when this pass ends (``at_end``, queued in autograd unless
        ``queued`` already) or at the tracker's end (calls processed after the pass)."""
        if size < 2:
            return False
        self._shape_counts[group] = self._shape_counts.get(group, 0) + 1
        if group in self._lone_shapes:  # (alone in the last backward pass: no partner)
            return False
        return queued or self.after_backward or queue_at_end_of_backward(at_end)

    def _waits_normalized(self, call: Call, grads: list[Tensor], scale: float) -> bool:
        """Whether this normalization layer's call waits to be formed with others of its
        shape (:func:`cockpit.engine.stacked.form_norm_stack`; on accelerators; formed when
        the stack is full, or when the backward pass ends — before the small parameters
        side by side, which its results join)."""
        engine = self.engine
        unit = call.unit
        if (unit.rule not in stacked.NORM_RULES or len(grads) != 1 or unit.batch_dim
                or engine.state.frozen_pass or engine.sharded or self.computed.of(unit.module)
                or not device_path(grads[0].device)
                or any(engine.unit_param_name(unit, k) in engine.state.multi_use
                       for k in unit.params)):
            return False
        args, kwargs, (delta,) = common_precision(call.args, call.kwargs, grads)
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, Tensor):
            return False
        group = stacked.norm_key(unit.module, unit.rule, x, delta, scale)
        if group is None:
            return False
        size = stacked.norm_capacity(x, delta, engine.memory_budget)
        if not self._waits_for_partners(group, size, self._norms_queued,
                                        self.reduce_norm_stacks):
            return False
        self._norms_queued = True
        stack = self.norm_stacks.get(group)
        if stack is None:
            stack = self.norm_stacks[group] = stacked.NormStack(size, unit.rule, scale)
        stack.add(unit, outside_autograd(x), delta)
        if stack.full:
            del self.norm_stacks[group]
            self._reduce_norm_stack_guarded(stack)
        return True

    def reduce_norm_stacks(self) -> None:
        """Form every norm stack still waiting (the backward pass ended)."""
        self._norms_queued = False
        waiting, self.norm_stacks = list(self.norm_stacks.values()), {}
        for stack in waiting:
            self._reduce_norm_stack_guarded(stack)

    def _reduce_norm_stack_guarded(self, stack: stacked.NormStack) -> None:
        first = stack.units[0].name or type(stack.units[0].module).__name__
        label = (first if len(stack.units) == 1
                 else f"{len(stack.units)} stacked normalization layers ({first}, …)")
        self.guarded(label, self._reduce_norm_stack, stack)

    def _reduce_norm_stack(self, stack: stacked.NormStack) -> None:
        engine = self.engine
        for unit, grads in zip(stack.units, stacked.form_norm_stack(stack), strict=True):
            for attr, sg in grads.items():
                self.reduce(engine.unit_param_name(unit, attr), sg)

    def _waits_stacked(self, name: str, sg: SampleGrads) -> bool:
        """Whether this Linear weight waits to be formed with others of its shape
        (:mod:`cockpit.engine.stacked`; on accelerators, whose host the kernels bind). A
        stack is formed when it is full and its last gradient has arrived, or when the
        backward pass ends (or the tracker's end, for calls processed after the pass; False
        outside either)."""
        engine = self.engine
        if (type(sg) not in stacked.STACKABLE or engine.state.frozen_pass
                or name in engine.state.multi_use or engine.sharded):
            return False
        group = stacked.key(sg)  # type: ignore[arg-type]
        if group is None or not device_path(group[-1]):
            return False
        size = stacked.capacity(sg, engine.memory_budget)  # type: ignore[arg-type]
        if not self._waits_for_partners(group, size, self._stacks_queued, self.reduce_stacked):
            return False
        self._stacks_queued = True
        stack = self.stacks.get(group)
        if stack is None:
            stack = self.stacks[group] = stacked.Stack(size)
        stack.add(name, sg)  # type: ignore[arg-type]
        self.stacked[name] = stack
        if self._waits_for_gradient(name, sg):
            stack.waiting.add(name)
        if stack.full:
            del self.stacks[group]
            if not stack.waiting:
                self.reduce_stack_guarded(stack)
        return True

    def reduce_stacked(self) -> None:
        """Form every stack still waiting (the backward pass ended). Never raises into the
        backward pass (a failure is recorded, unless ``strict``)."""
        self._stacks_queued = False
        waiting = list({id(stack): stack for stack in self.stacked.values()}.values())
        self.stacks = {}
        for stack in waiting:
            self.reduce_stack_guarded(stack)

    def reduce_stack_guarded(self, stack: stacked.Stack) -> None:
        label = (stack.names[0] if len(stack.names) == 1
                 else f"{len(stack.names)} stacked Linear weights ({stack.names[0]}, …)")
        self.guarded(label, self._reduce_stack, stack)

    def _reduce_stack(self, stack: stacked.Stack) -> None:
        """Every statistic of a stack's Linear weights from their individual gradients
        formed at once (:class:`~cockpit.engine.stacked.StackedGrads`): the statistics with
        a stacked form by it, the others per weight from its slice (no second
        materialization), then the dot products by one batched product."""
        for name in stack.names:
            self.stacked.pop(name, None)
        names, sgs = stack.names, stack.grads
        if len(names) == 1:
            self.reduce(names[0], sgs[0], alone=True)
            return
        engine = self.engine
        stats = engine.stats
        assert stats is not None
        block = stacked.StackedGrads(sgs)
        layers = [LayerContext(name, engine) for name in names]
        with contextlib.ExitStack() as scope:
            for sg, layer in zip(sgs, layers, strict=True):
                scope.enter_context(shared_chunks(sg, layer))
            for statistic in requested(engine.needs):
                values = statistic.form_stacked(block, layers)
                if values is None:
                    for index, layer in enumerate(layers):  # (each weight's slice of G)
                        layer.chunks = layer.chunks or [block.layer(index)]
                    values = [statistic.form(sg, layer)
                              for sg, layer in zip(sgs, layers, strict=True)]
                for name, value in zip(names, values, strict=True):
                    if value is not None:
                        stats[statistic.name][name] = value
            self._dots_together(names, sgs, block.dots, block.layer_dots)

    def _record_dots_together(self, plans: list[_DotPlan], block: Tensor) -> None:
        """:meth:`_record_dots` of parameters side by side whose plans read the same rows
        (:meth:`_DotPlan.rows_read`) of ``block`` = [g_{n,p}ᵀu_{k,p}]_{k,n,p}: each
        statistic's rows of every parameter by one view of the block and one ``unbind``
        (not a view per parameter and statistic)."""
        stats = self.engine.stats
        assert stats is not None
        first, names = plans[0], [plan.name for plan in plans]

        def per_parameter(rows: Tensor) -> tuple[Tensor, ...]:
            return rows.unbind(-1)  # [..., N, P] → P × [..., N]

        if first.gram_row is not None:
            stats.gram_mean.update(zip(names, per_parameter(
                _over_weight(block[first.gram_row], first.w_n)), strict=True))
        if first.synced_row is not None:
            assert stats.gradient_dots is not None
            stats.gradient_dots.dots.update(zip(names, per_parameter(block[first.synced_row]),
                                                strict=True))
        for key, refs in first.projections:
            start, stop = refs[0], refs[-1] + 1  # (consecutive: rows_read)
            rows = block if (start, stop) == (0, len(block)) else block[start:stop]
            stats.projections.setdefault(key, {}).update(
                zip(names, per_parameter(rows), strict=True))

    def _bases(self, names: list[str]) -> dict[str, dict]:
        """name → provider key → the provider's directions (None: none), every provider
        asked once for all ``names`` where it can (``many``)."""
        engine = self.engine
        if not engine.direction_providers:
            return {}
        params = [engine.params[k] for k in names]
        seen = [engine.state.seen_grads[k] for k in names]
        out: dict[str, dict] = {name: {} for name in names}
        for key, provider in engine.direction_providers.items():
            many = getattr(provider, "many", None)
            bases = (many(names, params, seen) if callable(many) else
                     [provider(*args) for args in zip(names, params, seen, strict=True)])
            for name, basis in zip(names, bases, strict=True):
                out[name][key] = basis
        return out


class _DotPlan:
    """The directions u_k one parameter's dot products g_nᵀu_k need (each tensor once), and
    the rows each statistic reads: an index into them, or a ready [N] tensor."""

    __slots__ = ("gram_row", "name", "projections", "synced_row", "vectors", "w_n")

    def __init__(self, name: str, vectors: list[Tensor] | None = None,
                 gram_row: int | None = None, synced_row: int | None = None,
                 w_n: float | None = None,
                 projections: list[tuple[str, list[int | Tensor]]] | None = None):
        self.name = name
        self.vectors = [] if vectors is None else vectors
        self.gram_row, self.synced_row, self.w_n = gram_row, synced_row, w_n
        self.projections = [] if projections is None else projections

    def row(self, vector: Tensor) -> int:
        for index, known in enumerate(self.vectors):  # one projection per distinct tensor
            if known is vector:
                return index
        self.vectors.append(vector)
        return len(self.vectors) - 1

    def rows_read(self) -> tuple | None:
        """Which rows each statistic reads, where every one reads consecutive rows of the
        dot products (None: one reads a ready tensor or scattered rows). Parameters with
        the same answer are recorded together (:meth:`CallProcessor._record_dots_together`)."""
        projections = []
        for key, refs in self.projections:
            first = refs[0] if refs else None
            if type(first) is not int:
                return None
            if len(refs) > 1 and (not all(type(r) is int for r in refs)
                                  or refs != list(range(first, first + len(refs)))):
                return None
            projections.append((key, first, len(refs)))
        return (len(self.vectors), self.gram_row, self.synced_row, self.w_n,
                tuple(projections))


def _over_weight(rows: Tensor, w_n: float | None) -> Tensor:
    """g_nᵀḡ from the rows g_nᵀG against this backward's gradient G = w·N·ḡ (``w_n`` = w·N;
    None: the rows are against ḡ already; ÷1 needs no kernel)."""
    return rows / w_n if w_n and w_n != 1.0 else rows


def _rows_of(dots: Tensor | None, refs: list[int | Tensor]) -> Tensor:
    """[K, N]: row r of ``dots`` for an index r, the tensor itself otherwise; consecutive
    rows as one slice (no copy, no kernel)."""
    if dots is not None and refs and all(isinstance(r, int) for r in refs):
        first = refs[0]
        if refs == list(range(first, first + len(refs))):  # type: ignore[operator]
            if first == 0 and len(refs) == len(dots):
                return dots  # every row (not even a view)
            return dots[first : first + len(refs)]  # type: ignore[operator]
    return torch.stack([dots[r] if isinstance(r, int) else r for r in refs])  # type: ignore[index]


def as_computed(grads: list[Tensor], dtype: torch.dtype | None) -> list[Tensor]:
    """``fully_shard`` mixed precision: output gradients wider than the dtype the layer
    computed in (an ``output_dtype`` cast after the layer) rounded to it, as the cast's
    backward hands them to the layer."""
    if dtype is None:
        return grads
    bits = torch.finfo(dtype).bits
    return [g.to(dtype) if isinstance(g, Tensor) and g.is_floating_point()
            and torch.finfo(g.dtype).bits > bits else g for g in grads]


def common_precision(args: tuple, kwargs: dict, grads: list[Tensor], widen: bool = True
                     ) -> tuple[tuple, dict, list[Tensor]]:
    """A layer's recorded inputs and output gradient in one floating dtype, at least float32.

    They differ under autocast (mixed precision): a Linear or convolution receives float32
    inputs but computes, and backpropagates, in bfloat16/float16; a normalization layer may
    receive half-precision inputs and compute in float32. The individual gradients are then
    formed in the wider dtype from the values the layer actually used: inputs wider than
    the output gradient are first rounded to its dtype (the layer's own cast), narrower ones
    are widened exactly. Half precision is always widened to float32: sums of squares and
    projections in float16 overflow (a GradScaler's factor 2^16 alone does) and in bfloat16
    keep three digits. Unchanged when all are float32 or float64 alike. ``widen`` False:
    the inputs are only rounded, the output gradients stay as they are (a rule that widens
    them itself, when it reads them: :attr:`widens_when_read`; a Linear layer's half-precision
    factors form its individual gradients as they are, :mod:`cockpit.engine.narrow_products`)."""
    if not grads or not grads[0].is_floating_point():
        return args, kwargs, grads
    dtypes = {v.dtype for v in (*args, *kwargs.values(), *grads)
              if isinstance(v, Tensor) and v.is_floating_point()}
    wide = functools.reduce(promote, dtypes | {torch.float32})
    if dtypes == {wide}:
        return args, kwargs, grads
    computed = grads[0].dtype

    def cast(value):
        if not (isinstance(value, Tensor) and value.is_floating_point()):
            return value
        if torch.finfo(value.dtype).bits > torch.finfo(computed).bits:
            value = value.to(computed)
        return value.detach().to(wide) if widen else value.detach()

    return (tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()},
            [cast(g) for g in grads] if widen else grads)


def batch_in_front(args: tuple, kwargs: dict, grads: list[Tensor], output: Tensor | None,
                   dim: int) -> tuple[tuple, dict, list[Tensor], Tensor | None]:
    """A call's tensors with their batch dimension ``dim`` moved to the front (views; a
    tensor of fewer dimensions as it is)."""
    def front(value):
        return value.movedim(dim, 0) if isinstance(value, Tensor) and value.dim() > dim else value

    return (tuple(front(a) for a in args), {k: front(v) for k, v in kwargs.items()},
            [front(g) for g in grads], front(output))


def outputs_feed_each_other(call: Call) -> bool:
    """Whether one output of the call depends on another in the autograd graph (a custom
    layer returning y and f(y)): the hook on y then receives the path through f(y) as well,
    and a per-sample vector-Jacobian product of both outputs would count it twice. The
    walk stays inside the layer: it stops at the inputs' nodes."""
    outputs = {o.grad_fn for o in call.outputs if o.grad_fn is not None}
    inputs = {v.grad_fn for v in (*call.args, *call.kwargs.values())
              if isinstance(v, Tensor) and v.grad_fn is not None}
    for start in outputs:
        seen: set = set()
        stack = [node for node, _ in start.next_functions]
        while stack:
            node = stack.pop()
            if node is None or node in seen or node in inputs:
                continue
            if node in outputs:
                return True
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def batch_size_message(batch: int, num_losses: int, module: nn.Module | None = None) -> str:
    """Why a layer's batch does not match ``losses``, and what to do. Cockpit reads a
    layer's batch from the first dimension of its input and output (the batch dimension
    of modules with ``batch_first``): either the losses are not one per sample, or the
    layer's input is not batched on that dimension."""
    kind = f"this layer ({type(module).__name__})" if module is not None else "this layer"
    return (
        f"{kind} has {batch} rows along the dimension Cockpit reads as the batch, but "
        f"`losses` has {num_losses} entries. Cockpit takes the batch from the first "
        "dimension of each layer's input and output (the batch dimension of modules with "
        "batch_first), so either `losses` does not hold one loss per sample (average "
        "per-token or per-pixel losses per sample, e.g. losses.view(batch_size, -1).mean(1)), "
        "or this layer's input is not batched along its first dimension: a sequence-first "
        "tensor [T, N, ...] (batch_first=False in nn.LSTM, nn.GRU, nn.Transformer*, "
        "nn.MultiheadAttention, or a transpose before the layer; use batch_first=True and "
        "keep the batch first), or a tensor shared by the whole batch (a table, prototypes, "
        "a memory bank; give the layer a per-sample view, e.g. "
        "layer(table.expand(batch_size, *table.shape)))"
    )


def weights_problem(w: Tensor) -> tuple[str | None, float]:
    """Why the loss weights w_n = ∂L/∂ℓ_n do not allow individual gradients (or None), and
    w_0, read from the device at once."""
    flat = w if w.dim() == 1 else w.reshape(-1)
    # min = max ⟺ all equal (NaN makes both NaN: unequal); ``tolist`` widens exactly
    low, high, value = torch.stack([*torch.aminmax(flat), flat[0]]).tolist()
    if low != high:
        return (
            "the backpropagated loss weights the individual losses unequally; Cockpit "
            "expects the batch loss to be losses.mean() (or losses.sum())"
        ), value
    if value == 0:
        return "the backpropagated loss does not depend on `losses` (zero weights)", value
    return None, value


def accumulate(accumulated: dict[str, DenseSampleGrads | CallSum], name: str,
               sg: SampleGrads, budget: int | None = None) -> None:
    """Sum the individual gradients of a parameter over the calls that use it. Where their
    sum would exceed ``budget`` the calls are kept (:class:`CallSum`) and summed per sample
    chunk later (:meth:`CallProcessor.within_budget`)."""
    if budget is not None and (name in accumulated or sg.scratch_bytes() > budget // 2):
        held = accumulated.get(name)
        if isinstance(held, CallSum):
            if sg.selectable:
                held.add_(sg.compact())
                return
            accumulated[name] = held = DenseSampleGrads(held.materialize())
        elif held is None and sg.num_samples > 1 and sg.selectable:
            accumulated[name] = CallSum([sg.compact()])
            return
    dense = DenseSampleGrads(sg.materialize_owned())
    if name in accumulated:
        accumulated[name].add_(dense)
    else:
        accumulated[name] = dense
