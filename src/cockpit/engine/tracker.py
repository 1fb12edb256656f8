"""The engine of a tracked step: hooks that reduce each layer's per-sample information to
additive statistics.

Data flow at a tracked step:

1. forward: the hooks of :class:`~cockpit.engine.capture.hooks.Capture` record each unit's calls
   (a *unit* is a module with a rule, or a module owning parameters no rule covers), the
   model's output and the smooth activations' inputs and outputs;
2. the user's backward: the hook on the per-sample ``losses`` fires first and yields the
   weights w_n = ∂L/∂ℓ_n of the batch loss L (1/|B| for a mean); then each output hook
   receives ∂L/∂y and hands the call to :class:`~cockpit.engine.processing.CallProcessor`,
   which divides it by w_n to get the individual losses' gradient δ_n, asks the layer rule
   for the :class:`SampleGrads` of the unit's parameters, reduces them to the statistics
   the active instruments need, and drops every reference at once;
3. parameters used by more than one call (tied weights, modules applied twice) cannot be
   reduced per call — ‖Σ_calls g‖² ≠ Σ_calls ‖g‖² — so their individual gradients are
   summed over calls and reduced when the backward context exits.

Before a step no instrument tracks the hooks come off the model
(:attr:`ModuleTracker.capturing`): nothing is recorded and nothing is paid.

:class:`ModuleTracker` holds the state of one tracked backward pass (:meth:`begin` …
:meth:`end`) and composes the two; instruments see it as an
:class:`~cockpit.engine.engine_view.EngineView`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor, nn

from cockpit._listing import listed
from cockpit.engine import sharded
from cockpit.engine.backward_state import BackwardState
from cockpit.engine.capture.batch_gradients import BatchGradientCopies
from cockpit.engine.capture.hooks import Call, Capture, Unit, layer_outputs, owner, zeros_of
from cockpit.engine.capture.outside_uses import outside_message
from cockpit.engine.ddp_held import delayed_all_reduce_held, static_graph_ddp
from cockpit.engine.histograms.auto_range import AutoRange
from cockpit.engine.histograms.exact import BinSpec
from cockpit.engine.processing import CallProcessor, accumulate
from cockpit.engine.request import StepRequest
from cockpit.engine.rules.batchnorm_frozen import (
    FROZEN_STATISTICS,
    check_batchnorm_mode,
    is_training_batch_norm,
)
from cockpit.engine.rules.conv import reuse_unfolded_inputs
from cockpit.engine.rules.norms import batch_norm_message, uses_batch_statistics
from cockpit.engine.rules.sample_grads import SampleGrads
from cockpit.engine.sharded import compute_dtypes, has_sharded, precision_note, whole
from cockpit.engine.statistics import (
    GRAM_MEAN,
    HIST2D,
    PER_SAMPLE_STATS,
    REGISTRY,
    SAMPLE_GRAD_SUM,
    BackwardStatistics,
    Counts,
    GradientDots,
    requested,
)

__all__ = ["Call", "ModuleTracker", "Unit"]


# the histograms' counts, which count the zeros of samples a backward pass did not reach
_COUNTS = tuple(s for s in REGISTRY.values() if isinstance(s, Counts))
_COUNT_NAMES = frozenset(s.name for s in _COUNTS)

class ModuleTracker:
    """The hooks on ``model`` (:attr:`capture`), the per-call processing (:attr:`processor`)
    and the state of the tracked backward pass they share; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        hist_spec: BinSpec | AutoRange,
        hist2d_specs: tuple[BinSpec, BinSpec],
        strict: bool = False,
        batchnorm: str | None = None,
        memory_budget: int | None = None,
        curvature_budget: int | None = None,
    ):
        self.model = model
        self.state = BackwardState()  # what the hooks of a tracked backward pass learned
        # bytes of individual gradients one layer may hold at once (None: no limit); above
        # it a layer is processed in sample chunks (cockpit.engine.rules.sample_chunks)
        self.memory_budget = memory_budget
        # bytes a chunk of the curvature's batched backpropagations may take at most (a
        # memory_budget the user gave; None: the device's default, curvature/batched.py)
        self.curvature_budget = curvature_budget
        self.chunked_layers: dict[str, int] = {}  # parameter → sample chunks, when chunked
        self._chunks_told: set[str] = set()
        self.batchnorm = check_batchnorm_mode(batchnorm)
        self.hist_spec = hist_spec
        self.hist2d_specs = hist2d_specs
        self.strict = strict
        self.param_names = {id(p): name for name, p in model.named_parameters()}
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.parameter_owners = {name: owner(model, name) for name in self.params}
        self.sharded = has_sharded(self.params.values())  # fully_shard (engine/sharded.py)
        self.static_graph_ddp = static_graph_ddp(model)  # its wrappers (engine/ddp_held.py)
        # fully_shard's mixed precision: the dtype each parameter's layer computes in
        self.compute_dtypes = compute_dtypes(model, self.params) if self.sharded else {}
        self.precision_note = precision_note(self.compute_dtypes)  # (None without)
        # fully_shard: all of θ per name while a tracked backward pass is processed
        self.gathered_params: dict[str, Tensor] = {}
        self._capturing = True
        # whether the recorded forward passes keep what only the diagonal curvature reads:
        # the smooth activations' inputs and outputs (:attr:`activation_calls`) and the
        # layers' inputs as given (else rounded to the width a layer computed in under
        # autocast: ``capture.hooks.as_computed_inputs``). Either is often a temporary the
        # forward pass would free at once (GPT-2's float32 GELU outputs: 288 MiB at B = 8,
        # T = 256).
        self.records_activations = True
        self.active = False
        self.needs: frozenset[str] = frozenset()
        self.stats: BackwardStatistics | None = None
        # a parameter's gradient arrived twice in one tracked block: two backward passes
        self.repeated_backward = False
        # what the instruments of the current tracked step ask of each backward pass
        self.request = StepRequest(frozenset())
        # The batch gradients of the last tracked step, reused as the copies of the next one
        # if it follows directly (a fresh parameter-sized tensor costs page faults), unless
        # they took θ_t for the update.
        self._last_batch_grads: dict[str, Tensor] = {}
        self.batch_copies = BatchGradientCopies()
        self.step_cache: dict = {}  # work shared by instruments within one tracked step
        self.processor = CallProcessor(self)
        self.capture = Capture(self)
        self.losses_hook = self.capture.losses_hook  # (registered on ``losses`` by Cockpit)

    @property
    def capturing(self) -> bool:
        """Whether the coming forward passes are recorded (decided by the step sequence
        from the schedule). The hooks are on the model only while they are, or while a
        tracked backward pass runs."""
        return self._capturing

    @capturing.setter
    def capturing(self, value: bool) -> None:
        self._capturing = value
        if value:
            self.capture.install()
        elif not self.active:
            self.capture.uninstall()

    # ------------------------------------------------------------------ the recorded forward
    def unit_param_name(self, unit: Unit, attr: str) -> str:
        return self.param_names[id(unit.params[attr])]

    def has_training_batch_norm(self) -> bool:
        return any(is_training_batch_norm(module) for module in self.model.modules())

    def check_batch_norm(self) -> list[str]:
        """Messages for BatchNorm layers that currently mix samples."""
        if self.batchnorm == FROZEN_STATISTICS:
            return []
        return [
            batch_norm_message(unit.module, unit.name)
            for unit in self.capture.units
            if isinstance(unit.module, nn.modules.batchnorm._BatchNorm)
            and uses_batch_statistics(unit.module)
        ]

    @property
    def num_calls(self) -> int:
        return len(self.capture.calls)

    @property
    def model_output(self) -> Tensor | None:
        """The network output f(x) of the recorded forward pass, None if not seen."""
        return self.capture.model_output

    @property
    def activation_calls(self) -> list[tuple[nn.Module, Tensor, Tensor]]:
        """(module, input z, output a) of the recorded smooth activations' calls."""
        return self.capture.activation_calls

    def clear_calls(self) -> None:
        self.capture.clear()

    def drop_calls_outside(self, root: Tensor) -> dict:
        """Forget recorded calls whose outputs ``root`` does not depend on: forward passes
        of steps the Cockpit did not see (their graphs are gone), evaluation passes, ….
        Kept, they would make every parameter look used twice and hold stale activations.
        Returns the graph's nodes walked for it, for :meth:`begin`."""
        return self.capture.drop_outside(root)

    def probe_calls(self) -> list[Call]:
        """The recorded calls whose inputs and outputs are still held (those Cockpit's own
        backpropagations from the model output reach)."""
        return self.capture.probe_calls()

    def used_repeatedly(self, name: str) -> bool:
        """Whether parameter ``name`` is used by several recorded calls."""
        return name in self.state.multi_use

    # ------------------------------------------------------------------ backward
    def begin(self, request: StepRequest, losses: Tensor | None, graph: dict | None = None
              ) -> BackwardStatistics:
        """Arm the hooks for one tracked backward pass of the individual ``losses``.

        ``request`` stays the engine's until :meth:`end`: instruments preparing the step
        (after ``begin``, before the backward) add their directions to it. ``graph``: the
        losses' graph as :meth:`drop_calls_outside` walked it (else walked again here)."""
        num_samples = 0 if losses is None else int(losses.shape[0])
        self.stats = BackwardStatistics(num_samples)
        self.stats.losses = None if losses is None else losses.detach()
        self.request = request
        self.needs = request.needs
        self.state.weights = None
        self.state.weights_problem = None
        self.repeated_backward = False
        self.capture.install()  # (off if the schedule did not foresee this step)
        self.state.multi_use = self.capture.multi_use()
        self.state.seen_grads = {}
        self.state.pure_grads = set()
        self.state.spare_grads, self._last_batch_grads = self._last_batch_grads, {}
        self.batch_copies.discard()  # (a failed step may not have reached end())
        self.processor.begin()
        if self.sharded:  # the unsharded parameters hold all of θ during the backward pass
            self.gathered_params = self.capture.hook_unsharded_parameters()
            if self.compute_dtypes and HIST2D in self.needs and not request.defer:
                # rounded to param_dtype: GradHist2d draws the full-precision θ instead
                self.gathered_params = {k: whole(p.detach()) for k, p in self.params.items()}
        self.release_step_cache()
        if (graph is not None and not self.sharded
                and not self.needs.isdisjoint(PER_SAMPLE_STATS)):
            outside = self.capture.used_outside(graph)
            if outside:
                self.stats.problems.append(outside_message(outside))
        if losses is not None and losses.grad_fn is not None and num_samples > 1:
            # also without per-sample instruments: the diagonal curvature's backprops
            # (sum_sq_of_backprops) need each sample's share of a broadcast output too
            self.capture.tap_broadcasts(losses, num_samples, graph)
        self.active = True
        return self.stats

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Extra backward passes of Cockpit's own (curvature) leave the statistics alone."""
        previous, self.state.suspended = self.state.suspended, True
        try:
            if previous or not (self.sharded or self.static_graph_ddp):
                yield
            else:  # (DDP's delayed all-reduce, FSDP's backward hooks: the user's pass's)
                with contextlib.ExitStack() as held:
                    if self.static_graph_ddp:
                        held.enter_context(delayed_all_reduce_held(self.static_graph_ddp))
                    if self.sharded:
                        held.enter_context(sharded.fsdp_backward_hooks_held(self.model))
                    yield
        finally:
            self.state.suspended = previous

    def graph_params(self) -> Mapping[str, Tensor]:
        """The tracked parameters as the recorded forward graph holds them, for Cockpit's
        own derivatives with respect to θ (Hessian-vector products): :attr:`params`, or
        under ``fully_shard`` the unsharded parameters, gathered whole
        (:func:`cockpit.engine.sharded.graph_parameters`: all-gathers, so every rank asks
        at the same point of the step)."""
        if not self.sharded:
            return self.params
        return sharded.graph_parameters(self.model, self.params)

    @property
    def is_suspended(self) -> bool:
        """Whether Cockpit's own work runs inside autograd now (:meth:`suspended`)."""
        return self.state.suspended

    @property
    def in_own_work(self) -> bool:
        """Whether Cockpit's own work runs now: a rule running a module again, curvature
        work, or one of Cockpit's backpropagations (:meth:`sum_sq_of_backprops`)."""
        return self.state.suspended or self.state.probing

    def chunking_note(self) -> str | None:
        """Which parameters' individual gradients were formed in sample chunks to stay within
        the memory budget, for those not told before (None: none new)."""
        new = {k: v for k, v in self.chunked_layers.items() if k not in self._chunks_told}
        if not new:
            return None
        self._chunks_told.update(new)
        layers = ", ".join(f"{k} ({v} chunks)" for k, v in new.items())
        return (f"individual gradients formed in sample chunks to stay within memory_budget="
                f"{self.memory_budget} bytes (exact, slower): {layers}")

    def sample_grads(self, call: Call, grads: list[Tensor]) -> dict[str, SampleGrads]:
        """The individual gradients of ``call``'s parameters for its output gradients
        ``grads``, by the unit's rule, keyed by global parameter names."""
        return self.processor.rule(call, grads)

    def sum_sq_of_backprops(self, output: Tensor, grad_outputs: Tensor) -> dict[str, Tensor]:
        """Σ_k Σ_n g_{n,k} ⊙ g_{n,k} per parameter, where g_{n,k} = (∂f_n/∂θ)ᵀ v_{n,k} is the
        backpropagation of the k-th vector ``grad_outputs[k]`` ([K, *output.shape]) from the
        model output f, reduced per layer by the rules (no |B|×D tensor is kept).

        Used for diagonal curvature: with v_{n,k} the columns of a symmetric factor of the
        loss Hessian, the result is |B| times the diagonal of the GGN of the mean loss.
        Must run before the user's backward pass (the recorded layer inputs are needed).
        """
        calls = self.probe_calls()
        twins = ({id(self.params[k]): t for k, t in self.graph_params().items()}
                 if self.sharded else None)
        params = layer_outputs(calls, twins)  # (no parameter gradient is computed)
        totals: dict[str, Tensor] = {}
        with self.suspended(), reuse_unfolded_inputs():
            for v in grad_outputs:
                for call in calls:
                    call.probe_grads = [None] * len(call.outputs)
                self.state.probing = True
                try:  # the output hooks record δ (also for outputs modified in place later)
                    torch.autograd.grad(output, params, grad_outputs=v, retain_graph=True,
                                        allow_unused=True)
                finally:
                    self.state.probing = False
                for call in calls:
                    for tap in call.taps.values():
                        if tap.problem is not None:
                            raise ValueError(f"{call.unit.name}: {tap.problem}")
                accumulated: dict[str, SampleGrads] = {}
                for call in calls:
                    deltas, call.probe_grads = call.probe_grads, None
                    if all(d is None for d in deltas):
                        continue
                    deltas = [zeros_of(o) if d is None else d
                              for d, o in zip(deltas, call.outputs, strict=True)]
                    for name, sg in self.processor.rule(call, deltas).items():
                        if name in self.state.multi_use:
                            accumulate(accumulated, name, sg)
                        else:
                            totals[name] = totals.get(name, 0) + sg.sum_sq()
                for name, sg in accumulated.items():
                    totals[name] = totals.get(name, 0) + sg.sum_sq()
        return totals

    def run_frozen_pass(self, losses: Tensor) -> None:
        """The per-sample statistics with BatchNorm's batch statistics held constant, from
        one extra backward pass before the user's (:meth:`Capture.run_frozen_pass`)."""
        self.capture.run_frozen_pass(losses)

    def release_step_cache(self) -> None:
        for value in self.step_cache.values():
            release = getattr(value, "release", None)
            if callable(release):
                release()
        self.step_cache = {}

    @property
    def directions(self) -> dict[str, dict[str, Tensor]]:
        """Directions u to project individual gradients on, known before the backward pass
        (key → parameter name → tensor)."""
        return self.request.directions

    @property
    def direction_providers(self) -> dict:
        """Providers of directions computed per parameter from the gradient the optimizer
        will see (key → fn(name, param, grad) → basis)."""
        return self.request.direction_providers

    @property
    def keep_calls(self) -> bool:
        """Keep each call's inputs and individual output gradients for projections on
        directions known only later (:meth:`project`)."""
        return self.request.keep_calls or self.request.union_gram

    @property
    def gradient_scale(self) -> float:
        """A GradScaler's factor on the gradients of the tracked backward."""
        return self.request.gradient_scale

    def add_sample_sums(self, key: str, values: dict[str, Tensor]) -> None:
        """Add an instrument's own per-parameter sums over this backward's samples (e.g. N
        times the diagonal curvature of the mean loss) to the statistics: they are merged
        over micro-batches and processes like the engine's own sums."""
        assert self.stats is not None, "add_sample_sums is for a tracked backward pass"
        target = self.stats.sample_sums.setdefault(key, {})
        for name, value in values.items():
            target[name] = value if name not in target else target[name] + value

    def take_kept_calls(self) -> list[Call]:
        calls, self.processor.kept_calls = self.processor.kept_calls, []
        return calls

    def project(self, calls: list[Call], directions: dict[str, Tensor]) -> dict[str, Tensor]:
        """g_nᵀu per parameter ([N] each) for the kept ``calls`` of one backward pass and a
        direction u per parameter name, summed over the calls that use a parameter (the
        individual gradient of a shared parameter is the sum over its calls). Each layer's
        rule evaluates it from the kept input and output gradient — a closed form where the
        layer allows, otherwise that layer's individual gradients, one layer at a time."""
        out: dict[str, Tensor] = {}
        with self.suspended():
            for call in calls:
                for name, sg in self.processor.rule(call, call.grads).items():
                    if name in directions:
                        dots = sg.dots(directions[name])
                        out[name] = dots if name not in out else out[name] + dots
        return out

    def end(self) -> BackwardStatistics:
        """Disarm; reduce calls still waiting for outputs and parameters used repeatedly.
        The statistics come back finished: ``batch_grads`` are the means (1/N) Σ_n g_n of
        the individual gradients (∂L/∂θ of the backpropagated loss divided by its uniform
        weight w = ∂L/∂ℓ_n and by N; unchanged where the weights are unknown)."""
        assert self.stats is not None
        try:
            self.capture.check_output_gradients_arrived()
            if self.request.defer:
                self._see_optimizer_gradients()
            if self.sharded:  # FSDP has freed the unsharded parameters again by now
                self.gathered_params = self._gather_for_end()
            self.processor.after_backward = True  # (grouped work is formed right below)
            self.capture.process_remaining()
            self.processor.reduce_accumulated()
            self.processor.reduce_side_by_side()  # (what the end of the backward pass left)
            self.processor.reduce_stacked()
            self.processor.reduce_pending()
            self.processor.guarded("per-sample statistics", self.stats.finish)
            self._check_complete(self.stats)
            if self.needs & _COUNT_NAMES:
                self.processor.guarded("histogram counts", self._count_absent, self.stats)
        finally:
            self.active = False
            self.processor.after_backward = False
            self.processor.drop_waiting()
            self.release_step_cache()
            self.clear_calls()
            self.gathered_params = {}
        stats, self.stats = self.stats, None
        self.batch_copies.copy(stats.batch_grads, self.state.spare_grads)  # (if still waiting)
        self.state.spare_grads = {}
        self._last_batch_grads = dict(stats.batch_grads)  # own copies, valid until next begin
        weight, n = self.loss_weight, stats.num_samples
        if weight not in (None, 0.0) and n and weight * n != 1.0:
            stats.batch_grads = {k: g * (1.0 / (weight * n)) for k, g in stats.batch_grads.items()}
        if self.compute_dtypes:
            self._mean_of_individual_gradients(stats, weight)
        return stats

    def _check_complete(self, stats: BackwardStatistics) -> None:
        """Every parameter this backward pass reached has individual statistics: a totals'
        sum over the parameters (the gradient tests, the histogram) must not leave one out
        silently. Checked where a registered statistic is requested (projections alone, at
        the step after a tracked one, are asked only for the parameters with directions)."""
        names = [statistic.name for statistic in requested(self.needs)]
        if stats.problems or self.sharded or not names:
            return
        formed: set[str] = set()
        for name in names:
            formed.update(stats.values.get(name, ()))
        missing = [k for k in stats.batch_grads if k not in formed]
        if missing:
            stats.problems.append(
                f"{listed(missing, 3)}: the backward pass reached these parameters but "
                "Cockpit formed no individual gradients for them (no recorded call of their "
                "layers computed their share), so the per-sample instruments would leave "
                "them out")

    def _count_absent(self, stats: BackwardStatistics) -> None:
        """The counts of the individual gradients 0 of this backward pass' samples for every
        parameter it did not reach (:class:`~cockpit.engine.statistics.registry.Counts`),
        formed while θ is as it was during the pass (gathered where sharded)."""
        if stats.problems or not stats.num_samples:
            return
        for statistic in _COUNTS:
            if statistic.name not in self.needs:
                continue
            missing = self.params.keys() - stats.values.get(statistic.name, {}).keys()
            if missing:
                stats.absent[statistic.name] = {
                    name: statistic.absent(stats.num_samples, name, self) for name in missing}

    @staticmethod
    def _mean_of_individual_gradients(stats: BackwardStatistics, weight: float | None) -> None:
        """Mixed precision (:mod:`cockpit.engine.sharded`): ḡ = (1/N) Σ_n g_n summed from
        the individual gradients (float32 or wider), in place of the gradient autograd made in
        param_dtype (rounded once per process: its digits would depend on how the batch is
        split). Parameters without individual gradients at this step keep autograd's
        gradient, widened to at least float32."""
        sums = stats.sample_sums.pop(SAMPLE_GRAD_SUM, {})
        n = stats.num_samples
        for name, grad in stats.batch_grads.items():
            if name in sums and n and weight not in (None, 0.0):
                stats.batch_grads[name] = sums[name].double().reshape(grad.shape) / n
            elif grad.is_floating_point() and torch.finfo(grad.dtype).bits < 32:
                stats.batch_grads[name] = grad.float()

    def _gather_for_end(self) -> dict[str, Tensor]:
        """``fully_shard``: all of θ (gathered, the same names on every rank) for the calls
        processed after the backward pass: the torch.func fallback's layers, and every
        parameter for GradHist2d's (θ_j, g_n,j)."""
        if HIST2D in self.needs:
            names = list(self.params)
        else:
            names = [self.unit_param_name(unit, attr) for unit in self.capture.units
                     if unit.deferred for attr in unit.params]
        return {k: whole(self.params[k].detach()) for k in names if k in self.params}

    def _see_optimizer_gradients(self) -> None:
        """Deferred processing: the gradient the optimizer will step on is ``p.grad`` after
        the backward pass (synchronized over processes by DistributedDataParallel)."""
        self.state.pure_grads = set()
        synced = self.request.union_gram
        if not (self.direction_providers or GRAM_MEAN in self.needs or synced):
            return
        assert self.stats is not None
        if synced:
            self.stats.gradient_dots = GradientDots({})
        for name, param in self.params.items():
            if param.grad is not None:
                grad = whole(param.grad.detach())  # g_nᵀG needs all of G (sharded.py)
                grad = grad.to_dense() if grad.layout != torch.strided else grad
                if synced:  # g_nᵀG for the reduction point, against G as it is now
                    grad = grad.clone()
                    self.stats.gradient_dots.gradient[name] = grad
                self.state.seen_grads[name] = grad

    def drop_spare_gradients(self) -> None:
        """Forget the kept batch gradients: the next step is not tracked, or their memory
        holds θ_t for the update now (``TrackedStep._snapshot``)."""
        if self.state.spare_grads or self._last_batch_grads:
            self.state.spare_grads, self._last_batch_grads = {}, {}

    @property
    def weights_problem(self) -> str | None:
        """Why the loss weights w_n = ∂L/∂ℓ_n of the last tracked backward pass do not
        describe a mean (or sum) of ``losses``, or None."""
        return self.state.weights_problem

    @property
    def loss_weight(self) -> float | None:
        """The (uniform) weight w = ∂L/∂ℓ_n of this backward, if known."""
        return None if self.state.weights is None else self.state.weight_value

    def remove(self) -> None:
        self.capture.remove()
        self.drop_spare_gradients()
        self.active = False
