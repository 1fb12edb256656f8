"""What the engine records of the user's forward and backward passes: the hooks.

1. forward: a forward hook on every *unit* (a module with a rule, or a module owning
   parameters no rule covers) records the call's inputs and puts a tensor hook on each
   differentiable output; hooks on the model record its output f(x), on smooth activation
   and normalization modules their (z, a) for the Hessian diagonal, and on training
   BatchNorm layers attach the backward with frozen statistics where asked for;
2. the user's backward: the hook on the per-sample ``losses`` fires first and yields the
   weights w_n = ∂L/∂ℓ_n of the batch loss L (1/|B| for a mean); each output hook records
   ∂L/∂y and hands the call to the :class:`~cockpit.engine.processing.CallProcessor` once
   all its outputs' gradients arrived; each parameter's hook records the batch gradient
   (and the gradient the optimizer will see, for projections on it);
3. layer outputs shared by the batch (position embeddings, …) get hooks on the nodes that
   broadcast them (:mod:`cockpit.engine.capture.broadcast`), so that their δ_n arrive per sample.

During Cockpit's own backpropagations (``probing``) the output hooks record δ apart, for
:meth:`~cockpit.engine.tracker.ModuleTracker.sum_sq_of_backprops`. While no forward pass is
recorded the hooks are off the model (:meth:`Capture.install`); while Cockpit's own work runs
(``suspended``) they return at once. The state of the
backward pass (statistics, loss weights, the flags) is the tracker's; :class:`Capture` is
the part of it that owns the hooks and the recorded forward pass.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

import cockpit.engine.rules  # noqa: F401  (registers the built-in rules)
from cockpit.engine import gc_pause, sharded
from cockpit.engine.capture.activations import is_activation
from cockpit.engine.capture.broadcast import (
    BroadcastTap,
    Consumers,
    find_paths,
    per_sample_delta,
)
from cockpit.engine.capture.outside_uses import newest_node, used_outside
from cockpit.engine.capture.removed_hooks import forget_removed_hooks
from cockpit.engine.processing import weights_problem
from cockpit.engine.rules.batchnorm_frozen import (
    FROZEN_STATISTICS,
    FrozenStatisticsBackward,
    is_training_batch_norm,
)
from cockpit.engine.rules.fallback import output_batch_dims, output_tensors, owned_parameters
from cockpit.engine.rules.registry import ATOMIC_MODULES, Rule, find_rule
from cockpit.engine.statistics import GRAM_MEAN, PER_SAMPLE_STATS

if TYPE_CHECKING:
    from cockpit.engine.tracker import ModuleTracker


def _detached(grad: Tensor) -> Tensor:
    """``grad`` outside the autograd graph: itself unless the backward pass builds a graph
    (``create_graph=True``); a detach is host work per tensor on an accelerator."""
    return grad.detach() if grad.requires_grad else grad


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
    # the batch dimension of a rule's inputs and outputs: 1 inside a sequence-first
    # transformer layer (nn.TransformerEncoderLayer(batch_first=False), …), whose layers
    # see [T, N, …]; the rule then reads them with the batch moved to the front
    batch_dim: int = 0

    @property
    def deferred(self) -> bool:
        """Rules that run torch.func transforms are evaluated after the backward pass:
        autograd re-entered from inside a tensor hook is not reliable for every operator
        (e.g. the CPU attention kernels under vmap)."""
        return self.rule is None


class OutputRecord:
    """What a recorded call keeps of an output no instrument of the step reads as a tensor:
    its autograd node and place there, shape, dtype and device (enough to route, count and
    zero its gradient). Kept itself, the tensor would stay in memory through the forward
    pass where autograd frees it: a Linear layer's output before a ReLU (which keeps its
    own), a LayerNorm's float32 output that the next layer rounds under autocast."""

    __slots__ = ("_version", "device", "dtype", "grad_fn", "output_nr", "shape")

    def __init__(self, t: Tensor):
        self.grad_fn, self.output_nr = t.grad_fn, t.output_nr
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self._version = t._version

    def dim(self) -> int:
        return len(self.shape)


def zeros_of(output: Tensor | OutputRecord) -> Tensor:
    """A zero gradient for ``output`` (an output no gradient reached)."""
    return torch.zeros(output.shape, dtype=output.dtype, device=output.device)


@dataclass
class Call:
    """One forward call of a unit, kept until its output gradients arrived. ``outputs`` are
    the tensors where the step reads them (the diagonal curvature, Cockpit's own backward
    passes, a rule that reads its output), else their :class:`OutputRecord`."""

    unit: Unit
    args: tuple | None
    kwargs: dict | None
    outputs: list[Tensor | OutputRecord]
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
    # the newest autograd node of its inputs, where ``args`` hold rounded copies (outside
    # autograd) instead: :func:`cockpit.engine.capture.outside_uses.nodes_made_by`
    inputs_floor: int | None = None

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


def as_computed_inputs(args: tuple, kwargs: dict, dtype: torch.dtype,
                       held: Callable[[Tensor], bool]) -> tuple[tuple, dict]:
    """A layer's floating-point inputs wider than its output's ``dtype`` rounded to it,
    unless they stay in memory anyway (``held``, or saved by autograd as the result of the
    op that made them: ReLU, sigmoid, tanh, softmax keep their outputs).

    Under autocast a Linear layer or convolution rounds its float32 input to bfloat16 or
    float16 and computes with that; the float32 input is often a temporary the forward pass
    frees at once (GPT-2's float32 GELU outputs, 288 MiB at B = 8, T = 256). Kept rounded,
    the recorded call holds half of it, and the individual gradients are formed from the
    same values (:func:`cockpit.engine.processing.common_precision` rounds such inputs so).
    Not for the diagonal curvature, which reads the inputs as given."""
    if not dtype.is_floating_point:
        return args, kwargs
    bits = torch.finfo(dtype).bits

    def rounded(value):
        if (isinstance(value, Tensor) and value.is_floating_point()
                and torch.finfo(value.dtype).bits > bits and not held(value)
                and not _saved_as_result(value)):
            return value.detach().to(dtype)
        return value

    return tuple(rounded(a) for a in args), {k: rounded(v) for k, v in kwargs.items()}


# the dtypes autocast computes in (a layer with such an output may have rounded its input)
_HALF = (torch.bfloat16, torch.float16)


def _saved_as_result(t: Tensor) -> bool:
    """Whether autograd keeps ``t`` (or the tensor it views) for the backward pass of the op
    that made it (an op whose derivative reads its own output)."""
    base = t._base if t._base is not None else t
    return base.grad_fn is not None and hasattr(base.grad_fn, "_saved_result")


def discover_units(model: nn.Module) -> list[Unit]:
    """The units of ``model``: modules with a registered rule or owning parameters; an
    atomic module (:data:`ATOMIC_MODULES`) is one unit with all its parameters."""
    units: list[Unit] = []
    atomic_prefixes: list[str] = []
    sequence_first: set[str] = set()  # the layers inside a sequence-first transformer layer
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in atomic_prefixes):
            continue
        atomic = isinstance(module, ATOMIC_MODULES)
        if atomic:
            atomic_prefixes.append(name)
        params = owned_parameters(module, atomic)
        if params:
            rule = None if atomic else find_rule(module)
            units.append(Unit(name, module, params, rule,
                              batch_dim=1 if rule is not None and name in sequence_first else 0))
        if isinstance(module, _SEQUENCE_FIRST_LAYERS) and not module.self_attn.batch_first:
            sequence_first.update(f"{name}.{child}" if name else child
                                  for child, _ in module.named_modules() if child)
    return units


# PyTorch's transformer layers: with batch_first=False (their default) every layer inside
# sees sequence-first tensors [T, N, …]
_SEQUENCE_FIRST_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the module holding parameter ``name`` of ``model``, its attribute name there)."""
    prefix, _, attr = name.rpartition(".")
    return model.get_submodule(prefix), attr


_first = operator.itemgetter(0)


def reachable_nodes(root: Tensor) -> dict:
    """The autograd nodes ``root`` depends on, each with its edges (``next_functions``), in
    the order of a depth-first walk (a dict: :class:`~cockpit.engine.capture.broadcast.
    Consumers` reads the edges in that order without walking the graph again)."""
    seen: dict = {}
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen[node] = edges = node.next_functions
        stack.extend(map(_first, edges))  # (no Python frame per edge)
    return seen


def _index_inputs(args: tuple, kwargs: dict) -> bool:
    """Whether a call's tensor inputs are all integer (indices), and there is one: a
    floating first argument, the common case, answers at once."""
    first = args[0] if args else None
    if isinstance(first, Tensor) and (first.is_floating_point() or first.is_complex()):
        return False
    inputs = [v for v in (*args, *kwargs.values()) if isinstance(v, Tensor)]
    return bool(inputs) and not any(v.is_floating_point() or v.is_complex() for v in inputs)


def keep_place(hooks: dict[int, Callable], key: int, place: int) -> None:
    """Move the hook ``key`` (just registered, last) back to where the hook ``place`` was
    registered: hook ids grow with registration, so every hook registered after ``place``
    moves behind it, in its order."""
    for later in [k for k in hooks if k > place and k != key]:
        hooks[later] = hooks.pop(later)


class Capture:
    """Installs and owns the hooks on ``engine.model`` and holds the recorded forward pass
    (module docstring); fills the backward pass' state (``engine.state``)."""

    def __init__(self, engine: ModuleTracker):
        self.engine = engine
        self.units = discover_units(engine.model)
        self.calls: list[Call] = []
        self.model_output: Tensor | None = None  # the model's output of the recorded forward
        # (module, input z, output a) of smooth activation modules, for the Hessian diagonal
        self.activation_calls: list[tuple[nn.Module, Tensor, Tensor]] = []
        self.frozen_backward = FrozenStatisticsBackward()
        self._handles: list = []  # the hooks while installed (see install)
        self._hooked_twins: dict[int, Tensor] = {}  # the unsharded parameters hooked
        # parameters used outside their layers' calls, for a graph of this (size, calls)
        self._outside: list[str] = []
        self._outside_key: tuple[int, int] | None = None
        self.installed = False
        self._removed = False  # for good (Cockpit closed)
        self._places: dict[int, int] = {}  # module → the id of its unit hook's first handle
        self.install()

    def install(self) -> None:
        """Put the hooks on the model (nothing if they are on). Cockpit takes them off
        while no forward pass is recorded and no tracked backward pass runs (see
        :meth:`uninstall`): a hook that returns at once still costs a Python call per
        module and parameter, which an untracked step should not pay. A unit's hook keeps its
        place among the module's forward hooks: it records the output of the hooks
        registered before Cockpit, not what a later one replaces it with."""
        if self.installed or self._removed:
            return
        self.installed = True
        model, engine = self.engine.model, self.engine
        for unit in self.units:
            handle = unit.module.register_forward_hook(self._make_forward_hook(unit),
                                                       with_kwargs=True)
            place = self._places.setdefault(id(unit.module), handle.id)
            keep_place(unit.module._forward_hooks, handle.id, place)
            self._handles.append(handle)
        for name, p in engine.params.items():
            self._handles.append(p.register_hook(self._make_param_hook(name)))
        if engine.batchnorm == FROZEN_STATISTICS:  # (also BatchNorm without parameters)
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    self._handles.append(module.register_forward_hook(
                        self._attach_frozen_backward, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._record_model_output))
        for module in model.modules():
            if is_activation(module):
                self._handles.append(module.register_forward_hook(self._record_activation))

    def uninstall(self) -> None:
        """Take the hooks off the model (the recorded forward pass stays)."""
        if not self.installed:
            return
        for handle in self._handles:
            handle.remove()
        forget_removed_hooks([*self.engine.params.values(), *self._hooked_twins.values()])
        self._handles = []
        self._hooked_twins = {}
        self.installed = False

    def hook_unsharded_parameters(self) -> dict[str, Tensor]:
        """``fully_shard``: the parameter hooks go on the unsharded parameters the backward
        pass reaches (see :func:`cockpit.engine.sharded.unsharded_parameters`), each once.
        Returns them by name."""
        twins = sharded.unsharded_parameters(self.engine.model, self.engine.params)
        for name, twin in twins.items():
            if id(twin) not in self._hooked_twins:
                self._hooked_twins[id(twin)] = twin
                self._handles.append(twin.register_hook(self._make_param_hook(name)))
        return twins

    def remove(self) -> None:
        """Take the hooks off for good."""
        self.uninstall()
        self._removed = True
        self.clear()

    # ------------------------------------------------------------------ forward
    def _recording(self) -> bool:
        """Whether a forward pass now is one to record."""
        engine = self.engine
        return engine.capturing and not engine.is_suspended and torch.is_grad_enabled()

    def _make_forward_hook(self, unit: Unit):
        def hook(module, args, kwargs, output):
            if not self._recording():
                return None
            if isinstance(output, Tensor):  # (most layers)
                if not output.requires_grad:
                    return None
                outputs, positions = [output], [0]
            else:
                flat = output_tensors(output)
                positions = [i for i, t in enumerate(flat) if t.requires_grad]
                if not positions:
                    return None
                outputs = [flat[i] for i in positions]
            floor = None
            if (outputs[0].dtype in _HALF and unit.rule is not None and len(outputs) == 1
                    and not self.engine.records_activations):
                if not torch.compiler.is_compiling():  # (no autograd node in a trace)
                    floor = newest_node(v for v in (*args, *kwargs.values())
                                        if isinstance(v, Tensor))
                args, kwargs = as_computed_inputs(args, kwargs, outputs[0].dtype, self._holds)
            tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, Tensor)]
            kept: list[Tensor | OutputRecord] = (
                list(outputs) if self._reads_outputs(unit)
                else [OutputRecord(o) for o in outputs])
            call = Call(unit, args, kwargs, kept, [t._version for t in tensors],
                        [None] * len(outputs), output_versions=[t._version for t in outputs],
                        output_positions=positions, inputs_floor=floor)
            if not self.calls and not torch.compiler.is_compiling():
                gc_pause.hold()  # a recorded forward pass starts (the module says why)
            self.calls.append(call)
            for k, out in enumerate(outputs):  # (the hooks stay on the nodes)
                out.register_hook(self._make_output_hook(call, k))
            return None

        return hook

    def _reads_outputs(self, unit: Unit) -> bool:
        """Whether this forward pass's calls of ``unit`` keep their output tensors: for the
        diagonal curvature (its backward passes from the layers' outputs and checks of
        them), the frozen-BatchNorm pass (also from the layers' outputs) and a rule that
        reads its output (``reads_output``; no built-in rule does). While torch.compile
        traces the module the tensors are kept too: reading their autograd nodes would break
        the compiled graph."""
        engine = self.engine
        return (engine.records_activations or engine.batchnorm == FROZEN_STATISTICS
                or getattr(unit.rule, "reads_output", False) or torch.compiler.is_compiling())

    def _holds(self, t: Tensor) -> bool:
        """Whether ``t`` is the output of a recorded call (held as it is anyway); asked only
        under autocast, the latest calls first (a normalization feeding the layer)."""
        return any(o is t for call in reversed(self.calls) for o in call.outputs)

    def _attach_frozen_backward(self, module, args, kwargs, output) -> None:
        if (self._recording() and is_training_batch_norm(module)
                and isinstance(output, Tensor)):
            self.frozen_backward.attach(module, args[0] if args else kwargs["input"], output)

    def _record_model_output(self, module, args, output) -> None:
        if self._recording():
            self.model_output = network_output(output)

    def _record_activation(self, module, args, output) -> None:
        if (self.engine.records_activations and self._recording() and args
                and isinstance(args[0], Tensor)
                and isinstance(output, Tensor)):
            self.activation_calls.append((module, args[0], output))

    def clear(self) -> None:
        """Forget the recorded forward pass."""
        if not self.calls and self.model_output is None and not self.activation_calls:
            return
        for call in self.calls:
            call.release()
        self.calls = []
        self.model_output = None
        self.activation_calls = []

    def drop_outside(self, root: Tensor) -> dict:
        """Forget the recorded calls whose outputs ``root`` does not depend on; the graph's
        nodes walked for it (:func:`reachable_nodes`)."""
        seen = reachable_nodes(root)
        kept = []
        for call in self.calls:
            if any(o.grad_fn in seen for o in call.outputs):
                kept.append(call)
            else:
                call.release()
        self.calls = kept
        self.activation_calls = [c for c in self.activation_calls if c[2].grad_fn in seen]
        return seen

    def used_outside(self, graph: dict) -> list[str]:
        """The tracked parameters the losses' ``graph`` uses outside the recorded calls of
        their layers (:mod:`cockpit.engine.capture.outside_uses`; kept while the graph's
        size and the number of calls stay the same: a property of the model's code)."""
        key = (len(graph), len(self.calls))
        if key != self._outside_key:
            params = {id(p): name for name, p in self.engine.params.items()}
            self._outside = used_outside(graph, self.calls, params)
            self._outside_key = key
        return self._outside

    def probe_calls(self) -> list[Call]:
        """The recorded calls whose inputs and outputs are still held. Raises where this
        step's forward pass kept only records of the outputs: no instrument of the step
        declared that it backpropagates from them (``needs_activations``)."""
        calls = [c for c in self.calls if c.args is not None and c.outputs]
        if any(isinstance(o, OutputRecord) for c in calls for o in c.outputs):
            raise RuntimeError(
                "the layers' outputs of this step's forward pass were not kept: an "
                "instrument that backpropagates from them (the diagonal curvature, "
                "Cockpit's own backward passes through the recorded calls) sets the class "
                "attribute needs_activations = True")
        return calls

    def multi_use(self) -> set[str]:
        """The parameters used by more than one recorded call."""
        uses: dict[str, int] = {}
        for call in self.calls:
            for attr in call.unit.params:
                name = self.engine.unit_param_name(call.unit, attr)
                uses[name] = uses.get(name, 0) + 1
        return {name for name, count in uses.items() if count > 1}

    # ------------------------------------------------------------------ backward
    def losses_hook(self, grad: Tensor) -> None:
        """Hook on the per-sample losses: record w_n = ∂L/∂ℓ_n."""
        engine = self.engine
        if engine.active and not engine.is_suspended:
            if grad.numel() == 0:  # an empty batch: no weight to read
                engine.state.weights_problem = "the batch is empty (`losses` has 0 entries)"
                return
            state = engine.state
            if engine.stats is not None and engine.static_graph_ddp:
                # (DDP's static graph queues its all-reduce before the first parameter hook)
                engine.batch_copies.reserve(engine.stats.batch_grads, state.spare_grads)
            state.weights = grad.detach()
            # the only read of the device in a tracked step's hooks: the weight is a
            # number of the engine's decisions (uniform? zero? the scale of δ_n)
            state.weights_problem, state.weight_value = weights_problem(state.weights)

    def _make_output_hook(self, call: Call, k: int):
        engine = self.engine

        def hook(grad: Tensor):
            tap = call.taps.get(k)
            if engine.state.probing:
                if call.probe_grads is not None:
                    call.probe_grads[k] = _detached(grad) if tap is None else tap.take(True, grad)
                return None
            if not engine.active or engine.is_suspended or call.args is None:
                return None
            call.grads[k] = _detached(grad) if tap is None else tap.take(False, grad)
            call.received += 1
            if (call.received == len(call.outputs) and not call.unit.deferred
                    and not engine.request.defer):
                engine.processor.process_guarded(call)
            return None

        return hook

    def _make_param_hook(self, name: str):
        engine = self.engine

        def hook(grad: Tensor):
            stats = engine.stats
            if (not engine.active or engine.is_suspended or stats is None
                    or engine.state.frozen_pass):
                return None
            if grad.layout != torch.strided:  # Embedding(sparse=True): instruments read
                grad = grad.to_dense()  # dense vectors (the user's p.grad stays sparse)
            first = name not in stats.batch_grads
            if not first:  # (a leaf's hook fires once per backward pass)
                engine.repeated_backward = True
            alias = grad.detach()  # (not the hook's tensor: autograd could not steal it)
            if first:  # copied at the end of the backward pass, with every other parameter
                engine.batch_copies.keep(name, alias, stats.batch_grads,
                                         engine.state.spare_grads)
            else:
                stats.batch_grads[name] = stats.batch_grads[name] + alias
            if engine.direction_providers or GRAM_MEAN in engine.needs:
                param = engine.params[name]
                held = None if sharded.is_sharded(param.grad) else param.grad  # (deferred)
                seen = alias if held is None else alias + held
                engine.state.seen_grads[name] = seen
                # (a tied weight's gradient sums its calls, as its individual gradients do:
                # they are accumulated over the calls and reduced after the backward pass)
                if first and param.grad is None:
                    engine.state.pure_grads.add(name)
                else:
                    engine.state.pure_grads.discard(name)
                engine.processor.gradient_arrived(name)
            return None

        return hook

    def process_remaining(self) -> None:
        """Hand the calls that received output gradients but are not processed yet (deferred
        units, outputs without a gradient: zero) to the processor, after a backward pass."""
        for call in self.calls:
            if call.args is not None and call.received > 0:
                call.grads = [g if g is not None else zeros_of(out)
                              for g, out in zip(call.grads, call.outputs, strict=True)]
                self.engine.processor.process_guarded(call)

    def check_output_gradients_arrived(self) -> None:
        """A layer whose parameters received gradients although no output gradient of any
        of its recorded calls reached Cockpit's hook has individual gradients Cockpit cannot
        form; say so instead of reporting statistics without it (or a 'zero' gradient)."""
        engine = self.engine
        stats = engine.stats
        assert stats is not None
        if not (engine.needs & PER_SAMPLE_STATS) or stats.problems:
            return
        reached = {id(c.unit) for c in self.calls if c.received > 0}
        for call in self.calls:
            unit = call.unit
            if id(unit) in reached:
                continue
            if any(engine.unit_param_name(unit, a) in stats.batch_grads for a in unit.params):
                engine.processor.fail(
                    f"{unit.name or type(unit.module).__name__}: its parameters received "
                    "gradients, but its output gradient never reached Cockpit's hook (a model "
                    "compiled with torch.compile runs its layers inside one compiled graph): "
                    "pass the module you call to Cockpit — Cockpit(torch.compile(model), ...), "
                    "or a model compiled by model.compile() before Cockpit was created"
                )
                return

    # ------------------------------------------------------------------ broadcast taps
    def tap_broadcasts(self, losses: Tensor, n: int, graph: dict | None = None) -> None:
        """Find the layer outputs shared by the batch (see :mod:`cockpit.engine.capture.broadcast`)
        and hook the nodes that broadcast them, so that their δ_n arrive per sample
        (``graph``: the losses' graph as :meth:`drop_outside` walked it, if it did).

        Candidates: outputs without the batch size at the batch dimension, and outputs of
        layers whose inputs are all integer tensors (index inputs such as position ids
        [T, T] may have T = N by coincidence); the graph decides."""
        consumers = None
        for call in self.calls:
            if call.args is None or isinstance(call.unit.module, nn.RNNBase) or call.taps:
                continue
            assert call.kwargs is not None
            index_inputs = _index_inputs(call.args, call.kwargs)
            dims = output_batch_dims(call.unit.module, call.output_positions)
            for k, (y, bd) in enumerate(zip(call.outputs, dims, strict=True)):
                mismatch = y.dim() <= bd or y.shape[bd] != n
                if y.grad_fn is None or not (mismatch or index_inputs):
                    continue
                if consumers is None:
                    consumers = Consumers(reachable_nodes(losses) if graph is None else graph)
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

    def _make_broadcast_hook(self, tap: BroadcastTap, path) -> Callable:
        engine = self.engine

        def hook(grad_outputs):
            probing = engine.state.probing
            if not probing and (not engine.active or engine.is_suspended):
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

    # ------------------------------------------------------------------ frozen BatchNorm
    def run_frozen_pass(self, losses: Tensor) -> None:
        """The per-sample statistics with every BatchNorm layer's batch statistics held
        constant (see :mod:`cockpit.engine.rules.batchnorm_frozen`), from one extra backward
        pass of Σ_n ℓ_n over the recorded graph, before the user's backward pass; that pass
        then only records the batch gradient. Failures are recorded, never raised."""
        engine = self.engine
        processor = engine.processor
        assert engine.stats is not None
        if engine.request.split:
            processor.fail("batchnorm='frozen_statistics' describes one backward pass per "
                           "step in one process at the layers' own precision (no gradient "
                           "accumulation, no torch.distributed, no mixed precision policy "
                           "of fully_shard)" if engine.compute_dtypes else
                           "batchnorm='frozen_statistics' describes one backward pass per "
                           "step in one process (no gradient accumulation, no "
                           "torch.distributed)")
            return
        engine.state.frozen_pass = self.frozen_backward.active = True
        try:  # the hooks process each layer (losses_hook reads w_n = 1 of Σ_n ℓ_n)
            torch.autograd.grad(losses, layer_outputs(self.probe_calls()),
                                grad_outputs=torch.ones_like(losses), retain_graph=True,
                                allow_unused=True)
            self.process_remaining()  # torch.func rules run after the pass
            processor.reduce_accumulated()
        except Exception as error:
            if engine.strict:
                raise
            processor.fail(f"the backward pass with frozen BatchNorm statistics failed: {error}")
        finally:
            engine.state.frozen_pass = self.frozen_backward.active = False
            processor.accumulated = {}
            state = engine.state
            state.weights, state.weights_problem, state.weight_value = None, None, 1.0
            for call in self.calls:  # the user's backward pass only records the gradient
                call.release()
            self.calls = []


def layer_outputs(calls: list[Call], twins: Mapping[int, Tensor] | None = None) -> list[Tensor]:
    """What Cockpit's own backward passes ask autograd for: the layers' outputs. The pass
    then reaches every layer (and fires the output hooks) but computes no parameter
    gradient and stops at the first layer's output (2× faster on 3C3D: a convolution's bias
    gradient makes oneDNN compute its weight gradient too). An output modified in place
    after the call has a new autograd node; for its layer ask for the smallest parameter,
    as the graph holds it (``twins``: id of a ``fully_shard`` parameter → its unsharded
    parameter, the graph's leaf; :func:`cockpit.engine.sharded.graph_parameters`)."""
    twins = twins or {}
    targets: dict[int, Tensor] = {}
    for c in calls:
        if c.outputs_unchanged():
            chosen = c.outputs
        else:
            smallest = min(c.unit.params.values(), key=lambda q: q.numel())
            chosen = [twins.get(id(smallest), smallest)]
        targets.update((id(t), t) for t in chosen)
    return list(targets.values())
