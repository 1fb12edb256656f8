"""Hooks that reduce each layer's per-sample information to additive statistics.

Data flow at a tracked step:

1. forward: a forward hook on every *unit* (a module with a rule, or a module owning
   parameters no rule covers) records the call's inputs and puts a tensor hook on each
   differentiable output;
2. the user's backward: the hook on the per-sample ``losses`` fires first and yields the
   weights w_n = ∂L/∂ℓ_n of the batch loss L (1/|B| for a mean); then each output hook
   receives ∂L/∂y, divides it by w_n to get the individual losses' gradient δ_n, asks the
   layer rule for the :class:`SampleGrads` of the unit's parameters, reduces them to the
   statistics the active instruments need, and drops every reference at once;
3. parameters used by more than one call (tied weights, modules applied twice) cannot be
   reduced per call — ‖Σ_calls g‖² ≠ Σ_calls ‖g‖² — so their individual gradients are
   summed over calls and reduced when the backward context exits.

At untracked steps the hooks return immediately and nothing is recorded. What happens to a
call once its output gradients arrived (step 2 from δ on, and step 3) is
:class:`cockpit.engine.processing.CallProcessor`'s work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

import cockpit.engine.rules  # noqa: F401  (registers the built-in rules)
from cockpit.engine.activations import is_activation
from cockpit.engine.broadcast import BroadcastTap, consumers_of, find_paths, per_sample_delta
from cockpit.engine.histogram import AutoRange, BinSpec
from cockpit.engine.processing import (
    GRADIENT,
    CallProcessor,
    accumulate,
    weights_problem,
)
from cockpit.engine.request import StepRequest
from cockpit.engine.rules.batchnorm_frozen import (
    FROZEN_STATISTICS,
    FrozenStatisticsBackward,
    check_batchnorm_mode,
    is_training_batch_norm,
)
from cockpit.engine.rules.conv import reuse_unfolded_inputs
from cockpit.engine.rules.fallback import output_batch_dims, output_tensors, owned_parameters
from cockpit.engine.rules.norms import batch_norm_message, uses_batch_statistics
from cockpit.engine.rules.registry import ATOMIC_MODULES, Rule, find_rule
from cockpit.engine.sample_grads import SampleGrads
from cockpit.engine.statistics import (  # noqa: F401  (the statistics' names, imported from here)
    GRAM_MEAN,
    HIST1D,
    HIST2D,
    PER_SAMPLE_STATS,
    PROJECTIONS,
    SAMPLE_GRAD_SUM,
    SQ_NORMS,
    SUM_SQ,
    VAR_SUM,
    BackwardStatistics,
    GradientDots,
)

__all__ = ["GRADIENT", "PER_SAMPLE_STATS", "BackwardStatistics", "ModuleTracker", "StepRequest"]



def network_output(output) -> Tensor | None:
    """The network output f(x) the curvature instruments backpropagate from (the GGN's
    J_nᵀ s_n, the Hessian diagonal's graph): the model's output if it is a tensor, the
    ``logits`` of an output object that has them (a Hugging Face ``ModelOutput``, also after
    accelerate's conversion to float32), else None (Cockpit then did not see it)."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, Tensor) else None


@dataclass
class Unit:
    """A module whose calls the tracker reduces, with the parameters it is responsible for."""

    name: str
    module: nn.Module
    params: dict[str, nn.Parameter]  # attribute name (relative to module) → parameter
    rule: Rule | None  # the registered layer rule; None: the torch.func fallback

    @property
    def deferred(self) -> bool:
        """Rules that run torch.func transforms are evaluated after the backward pass:
        autograd re-entered from inside a tensor hook is not reliable for every operator
        (e.g. the CPU attention kernels under vmap)."""
        return self.rule is None


@dataclass
class Call:
    """One forward call of a unit, kept until its output gradients arrived."""

    unit: Unit
    args: tuple | None
    kwargs: dict | None
    outputs: list[Tensor]
    versions: list[int]
    grads: list[Tensor | None]
    received: int = 0
    probe_grads: list[Tensor | None] | None = None  # δ of Cockpit's own backprops
    output_versions: list[int] = field(default_factory=list)
    # positions of ``outputs`` among all tensors of the module's (flattened) output
    output_positions: list[int] = field(default_factory=list)
    # outputs shared by the batch (position embeddings, …): output index → its tap
    taps: dict[int, BroadcastTap] = field(default_factory=dict)
    # θ_t of a kept call whose individual gradients depend on the parameters (the torch.func
    # fallback): projections after the optimizer step must not read θ_{t+1}
    params: dict[str, Tensor] | None = None

    def outputs_unchanged(self) -> bool:
        """Whether no output was modified in place after the call (e.g. by ReLU(inplace))."""
        return [o._version for o in self.outputs] == self.output_versions

    def release(self) -> None:
        """Drop the references to the layer's inputs, outputs and gradients."""
        for tap in self.taps.values():
            tap.remove()
        self.taps = {}
        self.args = self.kwargs = None
        self.outputs, self.grads = [], []



class ModuleTracker:
    """Installs and owns all hooks on ``model``; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        hist_spec: BinSpec | AutoRange,
        hist2d_specs: tuple[BinSpec, BinSpec],
        strict: bool = False,
        batchnorm: str | None = None,
    ):
        self.model = model
        self.batchnorm = check_batchnorm_mode(batchnorm)
        self.frozen_backward = FrozenStatisticsBackward()
        self._frozen_pass = False  # True during the extra backward of frozen statistics
        self.hist_spec = hist_spec
        self.hist2d_specs = hist2d_specs
        self.strict = strict
        self.param_names = {id(p): name for name, p in model.named_parameters()}
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.parameter_owners = {name: owner(model, name) for name in self.params}
        self.units = list(self._discover_units(model))
        self.capturing = True
        self.active = False
        self.needs: frozenset[str] = frozenset()
        self.stats: BackwardStatistics | None = None
        self._calls: list[Call] = []
        self._multi_use: set[str] = set()
        self._weights: Tensor | None = None
        self._weight_value = 1.0  # float(w_n), read once per backward
        self._weights_problem: str | None = None
        # a parameter's gradient arrived twice in one tracked block: two backward passes
        self.repeated_backward = False
        self._suspended = False  # True while rules run the module again (torch.func)
        self._probing = False  # True during Cockpit's own backprops (diagonal curvature)
        # what the instruments of the current tracked step ask of each backward pass
        self.request = StepRequest(frozenset())
        self._seen_grads: dict[str, Tensor] = {}
        self._pure_grads: set[str] = set()  # seen gradient = this backward's Σ_n w·g_n
        # The batch gradients of the last tracked step, reused as the copies of the next one
        # if it follows directly (a fresh parameter-sized tensor costs page faults).
        self._last_batch_grads: dict[str, Tensor] = {}
        self._spare_grads: dict[str, Tensor] = {}
        self.step_cache: dict = {}  # work shared by instruments within one tracked step
        self.processor = CallProcessor(self)
        self._handles: list = []
        for unit in self.units:
            self._handles.append(
                unit.module.register_forward_hook(self._make_forward_hook(unit), with_kwargs=True)
            )
        for name, p in self.params.items():
            self._handles.append(p.register_hook(self._make_param_hook(name)))
        if self.batchnorm == FROZEN_STATISTICS:  # (also BatchNorm without parameters)
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    self._handles.append(module.register_forward_hook(
                        self._attach_frozen_backward, with_kwargs=True))
        self.model_output: Tensor | None = None  # the model's output of the recorded forward
        self._handles.append(model.register_forward_hook(self._record_model_output))
        # (module, input z, output a) of smooth activation modules, for the Hessian diagonal
        self.activation_calls: list[tuple[nn.Module, Tensor, Tensor]] = []
        for module in model.modules():
            if is_activation(module):
                self._handles.append(module.register_forward_hook(self._record_activation))

    # ------------------------------------------------------------------ discovery
    def _discover_units(self, model: nn.Module) -> Iterable[Unit]:
        atomic_prefixes: list[str] = []
        for name, module in model.named_modules():
            if any(name.startswith(prefix + ".") for prefix in atomic_prefixes):
                continue
            atomic = isinstance(module, ATOMIC_MODULES)
            if atomic:
                atomic_prefixes.append(name)
            params = owned_parameters(module, atomic)
            if not params:
                continue
            yield Unit(name, module, params, None if atomic else find_rule(module))

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
            for unit in self.units
            if isinstance(unit.module, nn.modules.batchnorm._BatchNorm)
            and uses_batch_statistics(unit.module)
        ]

    # ------------------------------------------------------------------ forward
    def _make_forward_hook(self, unit: Unit):
        def hook(module, args, kwargs, output):
            if not self.capturing or self._suspended or not torch.is_grad_enabled():
                return None
            flat = output_tensors(output)
            positions = [i for i, t in enumerate(flat) if t.requires_grad]
            if not positions:
                return None
            outputs = [flat[i] for i in positions]
            tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, Tensor)]
            call = Call(unit, args, kwargs, outputs, [t._version for t in tensors],
                        [None] * len(outputs), output_versions=[t._version for t in outputs],
                        output_positions=positions)
            self._calls.append(call)
            for k, out in enumerate(outputs):
                out.register_hook(self._make_output_hook(call, k))
            return None

        return hook

    def _attach_frozen_backward(self, module, args, kwargs, output) -> None:
        if (self.capturing and not self._suspended and torch.is_grad_enabled()
                and is_training_batch_norm(module) and isinstance(output, Tensor)):
            self.frozen_backward.attach(module, args[0] if args else kwargs["input"], output)

    def _record_model_output(self, module, args, output) -> None:
        if self.capturing and not self._suspended and torch.is_grad_enabled():
            self.model_output = network_output(output)

    def _record_activation(self, module, args, output) -> None:
        if (self.capturing and not self._suspended and torch.is_grad_enabled()
                and args and isinstance(args[0], Tensor) and isinstance(output, Tensor)):
            self.activation_calls.append((module, args[0], output))

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def clear_calls(self) -> None:
        for call in self._calls:
            call.release()
        self._calls = []
        self.model_output = None
        self.activation_calls = []

    def drop_calls_outside(self, root: Tensor) -> None:
        """Forget recorded calls whose outputs ``root`` does not depend on: forward passes
        of steps the Cockpit did not see (their graphs are gone), evaluation passes, ….
        Kept, they would make every parameter look used twice and hold stale activations."""
        seen: set = set()
        stack = [root.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
        kept = []
        for call in self._calls:
            if any(o.grad_fn in seen for o in call.outputs):
                kept.append(call)
            else:
                call.release()
        self._calls = kept
        self.activation_calls = [c for c in self.activation_calls if c[2].grad_fn in seen]

    # ------------------------------------------------------------------ backward
    def begin(self, request: StepRequest, losses: Tensor | None) -> BackwardStatistics:
        """Arm the hooks for one tracked backward pass of the individual ``losses``.

        ``request`` stays the engine's until :meth:`end`: instruments preparing the step
        (after ``begin``, before the backward) add their directions to it."""
        num_samples = 0 if losses is None else int(losses.shape[0])
        self.stats = BackwardStatistics(num_samples)
        self.stats.losses = None if losses is None else losses.detach()
        self.request = request
        self.needs = request.needs
        self._weights = None
        self._weights_problem: str | None = None
        self.repeated_backward = False
        uses: dict[str, int] = {}
        for call in self._calls:
            for attr in call.unit.params:
                name = self.unit_param_name(call.unit, attr)
                uses[name] = uses.get(name, 0) + 1
        self._multi_use = {name for name, count in uses.items() if count > 1}
        self._seen_grads = {}
        self._pure_grads = set()
        self._spare_grads, self._last_batch_grads = self._last_batch_grads, {}
        self.processor.begin()
        self.release_step_cache()
        if losses is not None and losses.grad_fn is not None and num_samples > 1:
            # also without per-sample instruments: the diagonal curvature's backprops
            # (sum_sq_of_backprops) need each sample's share of a broadcast output too
            self._tap_broadcasts(losses, num_samples)
        self.active = True
        return self.stats

    def _tap_broadcasts(self, losses: Tensor, n: int) -> None:
        """Find the layer outputs shared by the batch (see :mod:`cockpit.engine.broadcast`)
        and hook the nodes that broadcast them, so that their δ_n arrive per sample.

        Candidates: outputs without the batch size at the batch dimension, and outputs of
        layers whose inputs are all integer tensors (index inputs such as position ids
        [T, T] may have T = N by coincidence); the graph decides."""
        consumers = None
        for call in self._calls:
            if call.args is None or isinstance(call.unit.module, nn.RNNBase) or call.taps:
                continue
            inputs = [v for v in (*call.args, *call.kwargs.values()) if isinstance(v, Tensor)]
            index_inputs = bool(inputs) and not any(v.is_floating_point() or v.is_complex()
                                                    for v in inputs)
            dims = output_batch_dims(call.unit.module, call.output_positions)
            for k, (y, bd) in enumerate(zip(call.outputs, dims, strict=True)):
                mismatch = y.dim() <= bd or y.shape[bd] != n
                if y.grad_fn is None or not (mismatch or index_inputs):
                    continue
                if consumers is None:
                    consumers = consumers_of(losses.grad_fn)
                paths, others = find_paths(y, consumers, bd, n)
                if not paths:
                    continue
                tap = BroadcastTap(tuple(y.shape), bd, n, paths)
                if others:
                    tap.problem = (
                        f"its output is shared by the batch, but part of its gradient flows "
                        f"through {sorted(set(others))[:3]} where Cockpit cannot separate the "
                        "samples' shares: expand the layer's input over the batch by hand")
                else:
                    for path in paths:
                        tap.handles.append(path.consumer.register_prehook(
                            self._make_broadcast_hook(tap, path)))
                if not call.taps:
                    call.args, call.kwargs = tap.expand_inputs(call.args, call.kwargs)
                call.taps[k] = tap

    def _make_broadcast_hook(self, tap: BroadcastTap, path):
        def hook(grad_outputs):
            probing = self._probing
            if not probing and (not self.active or self._suspended):
                return None
            if tap.problem is None:
                try:
                    with torch.no_grad():
                        delta = per_sample_delta(path, grad_outputs, tap.batch_dim)
                    tap.add(delta, probing)
                except Exception as error:  # never raised into the user's backward
                    tap.problem = f"its output is shared by the batch: {error}"
            return None

        return hook

    def losses_hook(self, grad: Tensor) -> None:
        """Hook on the per-sample losses: record w_n = ∂L/∂ℓ_n."""
        if self.active and not self._suspended:
            if grad.numel() == 0:  # an empty batch: no weight to read
                self._weights_problem = "the batch is empty (`losses` has 0 entries)"
                return
            self._weights = grad.detach()
            # the only read of the device in a tracked step's hooks: the weight is a
            # number of the engine's decisions (uniform? zero? the scale of δ_n)
            self._weights_problem, self._weight_value = weights_problem(self._weights)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Extra backward passes of Cockpit's own (curvature) leave the statistics alone."""
        previous, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = previous

    @property
    def is_suspended(self) -> bool:
        """Whether Cockpit's own work runs inside autograd now (:meth:`suspended`)."""
        return self._suspended

    @property
    def in_own_work(self) -> bool:
        """Whether Cockpit's own work runs now: a rule running a module again, curvature
        work, or one of Cockpit's backpropagations (:meth:`sum_sq_of_backprops`)."""
        return self._suspended or self._probing

    def probe_calls(self) -> list[Call]:
        """The recorded calls whose inputs and outputs are still held (those Cockpit's own
        backpropagations from the model output reach)."""
        return [c for c in self._calls if c.args is not None and c.outputs]

    def used_repeatedly(self, name: str) -> bool:
        """Whether parameter ``name`` is used by several recorded calls."""
        return name in self._multi_use

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
        # Ask autograd for the layers' outputs: the backward pass reaches every layer (and
        # fires the output hooks) but computes no parameter gradient and stops at the first
        # layer's output (2× faster on 3C3D: a convolution's bias gradient makes oneDNN
        # compute its weight gradient too). An output modified in place after the call has
        # a new autograd node; for its layer ask for the smallest parameter instead.
        targets: dict[int, Tensor] = {}
        for c in calls:
            chosen = (c.outputs if c.outputs_unchanged()
                      else [min(c.unit.params.values(), key=lambda q: q.numel())])
            targets.update((id(t), t) for t in chosen)
        params = list(targets.values())
        totals: dict[str, Tensor] = {}
        with self.suspended(), reuse_unfolded_inputs():
            for v in grad_outputs:
                for call in calls:
                    call.probe_grads = [None] * len(call.outputs)
                self._probing = True
                try:  # the output hooks record δ (also for outputs modified in place later)
                    torch.autograd.grad(output, params, grad_outputs=v, retain_graph=True,
                                        allow_unused=True)
                finally:
                    self._probing = False
                for call in calls:
                    for tap in call.taps.values():
                        if tap.problem is not None:
                            raise ValueError(f"{call.unit.name}: {tap.problem}")
                accumulated: dict[str, SampleGrads] = {}
                for call in calls:
                    deltas, call.probe_grads = call.probe_grads, None
                    if all(d is None for d in deltas):
                        continue
                    deltas = [torch.zeros_like(o) if d is None else d
                              for d, o in zip(deltas, call.outputs, strict=True)]
                    for name, sg in self.processor.rule(call, deltas).items():
                        if name in self._multi_use:
                            accumulate(accumulated, name, sg)
                        else:
                            totals[name] = totals.get(name, 0) + sg.sum_sq()
                for name, sg in accumulated.items():
                    totals[name] = totals.get(name, 0) + sg.sum_sq()
        return totals

    def run_frozen_pass(self, losses: Tensor) -> None:
        """The per-sample statistics with every BatchNorm layer's batch statistics held
        constant (see :mod:`cockpit.engine.rules.batchnorm_frozen`), from one extra backward
        pass of Σ_n ℓ_n over the recorded graph, before the user's backward pass; that pass
        then only records the batch gradient. Failures are recorded, never raised."""
        stats = self.stats
        assert stats is not None
        if self.request.split:
            self._fail("batchnorm='frozen_statistics' describes one backward pass per step in "
                       "one process (no gradient accumulation, no torch.distributed)")
            return
        calls = self.probe_calls()
        targets: dict[int, Tensor] = {}
        for c in calls:  # the layers' outputs: no parameter gradient is computed
            chosen = (c.outputs if c.outputs_unchanged()
                      else [min(c.unit.params.values(), key=lambda q: q.numel())])
            targets.update((id(t), t) for t in chosen)
        self._frozen_pass = self.frozen_backward.active = True
        try:  # the hooks process each layer (losses_hook reads w_n = 1 of Σ_n ℓ_n)
            torch.autograd.grad(losses, list(targets.values()),
                                grad_outputs=torch.ones_like(losses), retain_graph=True,
                                allow_unused=True)
            for call in self._calls:  # torch.func rules run after the pass
                if call.args is not None and call.received > 0:
                    call.grads = [g if g is not None else torch.zeros_like(out)
                                  for g, out in zip(call.grads, call.outputs, strict=True)]
                    self.processor.process_guarded(call)
            self.processor.reduce_accumulated()
        except Exception as error:
            if self.strict:
                raise
            self._fail(f"the backward pass with frozen BatchNorm statistics failed: {error}")
        finally:
            self._frozen_pass = self.frozen_backward.active = False
            self.processor.accumulated = {}
            self._weights, self._weights_problem, self._weight_value = None, None, 1.0
            for call in self._calls:  # the user's backward pass only records the gradient
                call.release()
            self._calls = []

    def _fail(self, message: str) -> None:
        self.processor.fail(message)

    def _make_param_hook(self, name: str):
        def hook(grad: Tensor):
            if (self.active and not self._suspended and self.stats is not None
                    and not self._frozen_pass):
                if grad.layout != torch.strided:  # Embedding(sparse=True): instruments read
                    grad = grad.to_dense()  # dense vectors (the user's p.grad stays sparse)
                first = name not in self.stats.batch_grads
                if not first:  # (a leaf's hook fires once per backward pass)
                    self.repeated_backward = True
                if first:
                    spare = self._spare_grads.pop(name, None)
                    fits = (spare is not None and spare.shape == grad.shape
                            and spare.dtype == grad.dtype and spare.device == grad.device)
                    self.stats.batch_grads[name] = (spare.copy_(grad.detach()) if fits
                                                    else grad.detach().clone())
                else:
                    self.stats.batch_grads[name] = self.stats.batch_grads[name] + grad.detach()
                if self.direction_providers or GRAM_MEAN in self.needs:
                    param = self.params[name]
                    seen = grad.detach() if param.grad is None else grad.detach() + param.grad
                    self._seen_grads[name] = seen
                    if first and param.grad is None and name not in self._multi_use:
                        self._pure_grads.add(name)
                    else:
                        self._pure_grads.discard(name)
                    self.processor.gradient_arrived(name)
            return None

        return hook

    def _make_output_hook(self, call: Call, k: int):
        def hook(grad: Tensor):
            tap = call.taps.get(k)
            if self._probing:
                if call.probe_grads is not None:
                    call.probe_grads[k] = grad.detach() if tap is None else tap.take(True, grad)
                return None
            if not self.active or self._suspended or call.args is None:
                return None
            call.grads[k] = grad.detach() if tap is None else tap.take(False, grad)
            call.received += 1
            if (call.received == len(call.outputs) and not call.unit.deferred
                    and not self.request.defer):
                self.processor.process_guarded(call)
            return None

        return hook

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
            self._check_output_gradients_arrived()
            if self.request.defer:
                self._see_optimizer_gradients()
            for call in self._calls:
                if call.args is not None and call.received > 0:
                    call.grads = [
                        g if g is not None else torch.zeros_like(out)
                        for g, out in zip(call.grads, call.outputs, strict=True)
                    ]
                    self.processor.process_guarded(call)
            self.processor.reduce_accumulated()
            self.processor.reduce_pending()
        finally:
            self.active = False
            self.processor.accumulated, self.processor.pending = {}, {}
            self.release_step_cache()
            self.clear_calls()
        stats, self.stats = self.stats, None
        self._spare_grads = {}
        self._last_batch_grads = dict(stats.batch_grads)  # own copies, valid until next begin
        weight, n = self.loss_weight, stats.num_samples
        if weight not in (None, 0.0) and n and weight * n != 1.0:
            stats.batch_grads = {k: g * (1.0 / (weight * n)) for k, g in stats.batch_grads.items()}
        return stats

    def _see_optimizer_gradients(self) -> None:
        """Deferred processing: the gradient the optimizer will step on is ``p.grad`` after
        the backward pass (synchronized over processes by DistributedDataParallel)."""
        self._pure_grads = set()
        synced = self.request.union_gram
        if not (self.direction_providers or GRAM_MEAN in self.needs or synced):
            return
        assert self.stats is not None
        if synced:
            self.stats.gradient_dots = GradientDots({})
        for name, param in self.params.items():
            if param.grad is not None:
                grad = param.grad.detach()
                grad = grad.to_dense() if grad.layout != torch.strided else grad
                if synced:  # g_nᵀG for the reduction point, against G as it is now
                    grad = grad.clone()
                    self.stats.gradient_dots.gradient[name] = grad
                self._seen_grads[name] = grad

    def _check_output_gradients_arrived(self) -> None:
        """A layer whose parameters received gradients although no output gradient of any
        of its recorded calls reached Cockpit's hook has individual gradients Cockpit cannot
        form; say so instead of reporting statistics without it (or a 'zero' gradient)."""
        stats = self.stats
        assert stats is not None
        if not (self.needs & PER_SAMPLE_STATS) or stats.problems:
            return
        reached = {id(c.unit) for c in self._calls if c.received > 0}
        for call in self._calls:
            unit = call.unit
            if id(unit) in reached:
                continue
            if any(self.unit_param_name(unit, a) in stats.batch_grads for a in unit.params):
                self._fail(
                    f"{unit.name or type(unit.module).__name__}: its parameters received "
                    "gradients, but its output gradient never reached Cockpit's hook (a model "
                    "compiled with torch.compile runs its layers inside one compiled graph): "
                    "pass the module you call to Cockpit — Cockpit(torch.compile(model), ...), "
                    "or a model compiled by model.compile() before Cockpit was created"
                )
                return

    def drop_spare_gradients(self) -> None:
        """Free the kept batch gradients (the next step is not tracked)."""
        self._spare_grads, self._last_batch_grads = {}, {}

    @property
    def weights_problem(self) -> str | None:
        """Why the loss weights w_n = ∂L/∂ℓ_n of the last tracked backward pass do not
        describe a mean (or sum) of ``losses``, or None."""
        return self._weights_problem

    @property
    def loss_weight(self) -> float | None:
        """The (uniform) weight w = ∂L/∂ℓ_n of this backward, if known."""
        return None if self._weights is None else self._weight_value

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear_calls()
        self.drop_spare_gradients()
        self.active = False


def owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the module holding parameter ``name`` of ``model``, its attribute name there)."""
    prefix, _, attr = name.rpartition(".")
    return model.get_submodule(prefix), attr
