"""General rule for any module with parameters: vmap the module's own vector-Jacobian
product over the batch.

For one call y = m(x; θ) with output gradient δ, the individual gradient of sample n is

    g_n = (∂y_n/∂θ)ᵀ δ_n,

obtained by running the module on sample n alone (batch size one) under
``torch.func.functional_call`` and ``torch.func.vjp``, vectorized over n with
``torch.func.vmap``. This covers ``nn.MultiheadAttention`` and users' custom layers. The
module must treat samples independently and deterministically (no dropout inside the
module with p > 0 in training mode, no batch statistics).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.nn.utils.rnn import PackedSequence

from cockpit.engine.rules.embedding import embedding_bag_rule
from cockpit.engine.rules.recurrent import (
    cell_forward,
    cell_message,
    packed_output_grad,
    recurrent_forward,
    recurrent_message,
    unpack_input,
)
from cockpit.engine.rules.sample_chunks import SampleChunks, samples_per_chunk
from cockpit.engine.rules.sample_grads import DenseSampleGrads, SampleGrads

# Start of the warning torch.func.vmap gives for an operator without a batching rule.
_NO_BATCHING_RULE = "There is a performance drop because we have not yet implemented the batching"


@contextlib.contextmanager
def without_batching_rule_notes() -> Iterator[None]:
    """vmap's note that an operator (CPU flash attention, weight norm's backward) runs
    without a batching rule silenced: it concerns Cockpit's own computation, the user can do
    nothing about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_BATCHING_RULE, category=UserWarning)
        yield
# Part of the error torch.func.vmap raises for a random operation (dropout) inside it.
_RANDOM_OPERATION = "called random operation while in randomness error mode"


# Start of the error autograd raises where the one-sample output's shape differs from its
# gradient's: the layer's batch is not where the general rule slices it.
_SHAPE_MISMATCH = "Mismatch in shape: grad_output"


def layout_message(module: nn.Module, error: str) -> str:
    """Why the general rule could not re-run a layer on one sample at a time."""
    dim = batch_dim_of(module)
    return (
        f"Cockpit re-runs this layer ({type(module).__name__}) on one sample at a time, "
        f"slicing every input tensor with |B| entries along dimension {dim}, and its output "
        f"for one sample did not have the shape of the batch's output cut there ({error}). "
        f"Give the layer its batch along dimension {dim} of each input and output tensor, "
        "as tensors (not inside tuples or lists), with inputs shared by the whole batch "
        "of another size there"
    )


class RandomForwardError(ValueError):
    """A layer handled by the general rule drew random numbers in its forward pass."""


def random_message(module: nn.Module, name: str | None = None) -> str:
    """Why a layer that draws random numbers in its forward pass has no individual
    gradients, and what to do (``name``: the layer's name in the model, if known).

    The general rule recomputes the layer's vector-Jacobian product for each sample alone;
    a re-run draws another dropout mask than the one the training step used, so the
    individual gradients of such a layer cannot be recomputed exactly (and are not
    approximated)."""
    kind = type(module).__name__
    layer = f"model.{name}" if name else "layer"
    if isinstance(module, nn.MultiheadAttention):
        return (
            f"{kind} with dropout={module.dropout} in training mode drops attention weights "
            "at random in its forward pass; Cockpit recomputes each sample's gradient by "
            "running the layer again, which would draw another mask, so it cannot form "
            "the individual gradients of this layer. Set its attention dropout to 0 "
            f"(`{layer}.dropout = 0.0`; the dropout layers of a Transformer layer around "
            f"it can stay), or put it in eval mode (`{layer}.eval()` after each "
            "model.train())"
        )
    return (
        f"this layer ({kind}) draws random numbers in its forward pass in training mode "
        "(dropout: nn.Dropout, F.dropout or scaled_dot_product_attention(dropout_p > 0) "
        "inside it); Cockpit recomputes each sample's gradient by running the layer again, "
        "which would draw another mask, so it cannot form the individual gradients of "
        "this layer. Set its dropout probability to 0, put it in eval mode "
        f"(`{layer}.eval()` after each model.train()), or apply the dropout outside the "
        "module that owns the parameters (to its input or output, e.g. an nn.Dropout in "
        "the parent's forward)"
    )


def batch_dim_of(module: nn.Module) -> int:
    """The batch dimension of the module's main inputs and outputs (``batch_first``, where
    the module has it: an attribute of the instance, or of its class such as a property)."""
    flag = module.__dict__.get("batch_first", _ABSENT)
    if flag is _ABSENT:
        # (most layers have none: asked of the class, without nn.Module.__getattr__'s
        # search of the parameters, buffers and submodules and its exception)
        if getattr(type(module), "batch_first", _ABSENT) is _ABSENT:
            return 0
        flag = module.batch_first
    return 0 if flag else 1


_ABSENT = object()


def output_tensors(output) -> list[Tensor]:
    """The tensors of a module's output, nested tuples and lists flattened in order (an
    LSTM returns ``(output, (h_n, c_n))``)."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, tuple | list):
        return [t for item in output for t in output_tensors(item)]
    return []


def output_batch_dims(module: nn.Module, positions: list[int]) -> tuple[int, ...]:
    """The batch dimension of the output tensors at ``positions`` of :func:`output_tensors`.
    MultiheadAttention's attention weights are [batch, L, S] and a recurrent layer's final
    states [layers, batch, H], whatever ``batch_first`` says about the other tensors."""
    bd = batch_dim_of(module)
    if isinstance(module, nn.MultiheadAttention):
        return tuple(0 if i == 1 else bd for i in positions)
    if isinstance(module, nn.RNNBase):
        return tuple(bd if i == 0 else 1 for i in positions)
    return tuple(bd for _ in positions)


def _input_dims(module: nn.Module, args: tuple, kwargs: dict, n: int,
                params: dict[str, Tensor] | None = None, positions: list[int] | None = None
                ) -> tuple[tuple, dict]:
    """vmap in_dims for every input: the batch dim for batched tensors, None otherwise.
    Where several inputs have |B| entries along the batch dimension, those the call shares
    with every sample are told apart by running the layer (:func:`_shared_inputs`; with
    ``params`` and ``positions``)."""
    arg_dims, kwarg_dims = _candidate_dims(module, args, kwargs, n)
    if params is not None and positions is not None:
        shared = _shared_inputs(module, args, kwargs, n, params, positions, arg_dims,
                                kwarg_dims)
        if shared:
            arg_dims = tuple(None if i in shared else d for i, d in enumerate(arg_dims))
            kwarg_dims = {k: None if k in shared else d for k, d in kwarg_dims.items()}
    return arg_dims, kwarg_dims


# per layer: the inputs it shares with every sample, by the shapes of its inputs
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shared_inputs(module: nn.Module, args: tuple, kwargs: dict, n: int,
                   params: dict[str, Tensor], positions: list[int], arg_dims: tuple,
                   kwarg_dims: dict) -> frozenset:
    """The inputs (positions of ``args``, names of ``kwargs``) with |B| entries along the
    batch dimension that the layer nonetheless shares with every sample — a causal mask
    [T, T] or a table [C, E] where T or C equals |B| —, found where two or more inputs have
    that size: the layer's output for sample 0 is computed with each of them taken whole
    instead of sliced, and compared with its output for the batch (once per layer and input
    shapes; on copies of its buffers and with the random number generators restored, so
    that the training sees no trace of it). Empty where slicing every one reproduces the
    batch, or none does."""
    candidates = [i for i, d in enumerate(arg_dims) if d is not None] + [
        k for k, d in kwarg_dims.items() if d is not None]
    if len(candidates) < 2 or n < 2:
        return frozenset()
    values = {**dict(enumerate(args)), **kwargs}
    signature = (n, tuple(positions), tuple((c, tuple(values[c].shape)) for c in candidates))
    known = _SHARED.setdefault(module, {})
    if signature not in known:
        try:
            known[signature] = _find_shared(module, args, kwargs, params, positions, arg_dims,
                                            kwarg_dims, candidates)
        except Exception:  # (a layer that cannot run so: every such input batched, as before)
            known[signature] = frozenset()
    return known[signature]


def _find_shared(module: nn.Module, args: tuple, kwargs: dict, params: dict[str, Tensor],
                 positions: list[int], arg_dims: tuple, kwarg_dims: dict,
                 candidates: list) -> frozenset:
    frozen = {k: v.detach() for k, v in params.items()}
    buffers = _buffers(module, frozen)
    device = next(iter(params.values())).device if params else torch.device("cpu")

    def outputs(call_args: tuple, call_kwargs: dict) -> list[Tensor]:
        flat = output_tensors(functional_call(module, _with_buffer_copies(frozen, buffers),
                                              call_args, call_kwargs))
        return [flat[i] for i in positions]

    def first_sample(shared: frozenset) -> list[Tensor]:
        def cut(key, value, dim):
            return value if dim is None or key in shared else value.narrow(dim, 0, 1)

        return outputs(tuple(cut(i, v, d) for i, (v, d) in enumerate(zip(args, arg_dims,
                                                                            strict=True))),
                       {k: cut(k, v, kwarg_dims[k]) for k, v in kwargs.items()})

    devices = [device] if device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        batch = outputs(args, kwargs)
        target = [t.narrow(d, 0, 1) for t, d in zip(batch, output_batch_dims(
            module, positions), strict=True)]

        def reproduces(shared: frozenset) -> bool:
            got = first_sample(shared)
            return all(a.shape == b.shape and bool(
                torch.linalg.vector_norm((a - b).double()) <= 1e-4 * torch.linalg.vector_norm(
                    b.double()) + 1e-30) for a, b in zip(got, target, strict=True))

        if reproduces(frozenset()):
            return frozenset()
        return frozenset(c for c in candidates if reproduces(frozenset({c})))


def _candidate_dims(module: nn.Module, args: tuple, kwargs: dict, n: int
                    ) -> tuple[tuple, dict]:
    """vmap in_dims by shape: the batch dim for every tensor with |B| entries there."""
    bd = batch_dim_of(module)

    def dim_of(name: str | None, value):
        if not isinstance(value, Tensor):
            return None
        if isinstance(module, nn.MultiheadAttention):
            if name == "key_padding_mask":
                return 0
            if name == "attn_mask":
                if value.dim() == 3:
                    raise ValueError(
                        "MultiheadAttention with a per-sample 3-D attn_mask is not supported "
                        "by Cockpit's per-sample rule; use key_padding_mask or a 2-D mask."
                    )
                return None
        if value.dim() > bd and value.shape[bd] == n:
            return bd
        return None

    mha_names = ("query", "key", "value")
    arg_dims = tuple(
        dim_of(mha_names[i] if isinstance(module, nn.MultiheadAttention) and i < 3 else None, v)
        for i, v in enumerate(args)
    )
    kwarg_dims = {k: dim_of(k, v) for k, v in kwargs.items()}
    return arg_dims, kwarg_dims


def fallback_rule(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    positions: list[int],
    grad_outputs: list[Tensor],
    params: dict[str, Tensor],
) -> dict[str, SampleGrads]:
    """Individual gradients of ``params`` (names relative to ``module``) for one call.

    ``positions``: which tensors of the module's flattened output (:func:`output_tensors`)
    the gradients ``grad_outputs`` belong to (already those of the individual losses).
    """
    if isinstance(module, nn.RNNBase):
        return recurrent_rule(module, args, kwargs, positions, grad_outputs, params)
    if isinstance(module, nn.RNNCellBase):
        return cell_rule(module, args, kwargs, positions, grad_outputs, params)
    if isinstance(module, nn.EmbeddingBag):
        # (on the general path: max mode reads the table the call used, which the general
        # path keeps for projections after the optimizer step)
        return ({} if "weight" not in params else
                embedding_bag_rule(module, args, kwargs, grad_outputs[0], params["weight"]))
    n = grad_outputs[0].shape[batch_dim_of(module)]
    arg_dims, kwarg_dims = _input_dims(module, args, kwargs, n, params, positions)
    detached_args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
    detached_kwargs = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    frozen = {k: v.detach() for k, v in params.items()}
    buffers = _buffers(module, frozen)

    def tensor_outputs(result) -> list[Tensor]:
        tensors = output_tensors(result)
        return [tensors[i] for i in positions]

    def one_sample(theta, sample_args, sample_kwargs, sample_deltas):
        def with_batch(value, dim):
            return value.unsqueeze(dim) if dim is not None else value

        call_args = tuple(with_batch(v, d) for v, d in zip(sample_args, arg_dims, strict=True))
        call_kwargs = {k: with_batch(v, kwarg_dims[k]) for k, v in sample_kwargs.items()}

        def forward(p):
            # (copies made inside the transform: a captured tensor may not be mutated)
            return tuple(tensor_outputs(functional_call(
                module, _with_buffer_copies(p, buffers), call_args, call_kwargs)))

        _, vjp_fn = vjp(forward, theta)
        cotangents = tuple(d.unsqueeze(dim) for d, dim in zip(sample_deltas, delta_dims,
                                                              strict=True))
        return vjp_fn(cotangents)[0]

    delta_dims = output_batch_dims(module, positions)
    with without_batching_rule_notes():
        try:
            per_sample = vmap(one_sample, in_dims=(None, arg_dims, kwarg_dims, delta_dims))(
                frozen, detached_args, detached_kwargs, tuple(grad_outputs)
            )
        except RuntimeError as error:
            if _RANDOM_OPERATION in str(error):
                raise RandomForwardError(random_message(module)) from None
            if _SHAPE_MISMATCH in str(error):
                raise ValueError(layout_message(module, str(error))) from None
            raise
    # a module whose children own other parameters (e.g. a scale around a Linear) is called
    # with those real parameters: the result must not carry a graph to them
    return {name: DenseSampleGrads(g.detach()) for name, g in per_sample.items()}


def _buffers(module: nn.Module, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """The layer's buffers (those ``params`` does not replace)."""
    return {k: b for k, b in module.named_buffers() if k not in params}


def _with_buffer_copies(params: dict[str, Tensor], buffers: dict[str, Tensor]
                        ) -> dict[str, Tensor]:
    """The state a re-run of the layer reads: ``params`` and copies of its ``buffers``, so
    that a forward pass changing a buffer in place (a call counter, running statistics)
    leaves the layer's own untouched."""
    return {**{k: b.clone() for k, b in buffers.items()}, **params} if buffers else params


def fallback_in_chunks(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    positions: list[int],
    grad_outputs: list[Tensor],
    params: dict[str, Tensor],
    budget: int,
) -> dict[str, SampleGrads] | None:
    """:func:`fallback_rule` run on sample chunks of the call, each chunk only when a
    statistic asks for it, where all |B| individual gradients of the unit (|B| · Σ D ·
    itemsize bytes) would exceed ``budget``; None where they fit (or for recurrent layers,
    whose packed inputs have no batch dimension to slice)."""
    if isinstance(module, nn.RNNBase | nn.RNNCellBase | nn.EmbeddingBag) or not params:
        return None
    bd = batch_dim_of(module)
    n = grad_outputs[0].shape[bd]
    itemsize = grad_outputs[0].dtype.itemsize
    per_sample = sum(p.numel() for p in params.values()) * itemsize
    if n * per_sample <= budget:
        return None
    arg_dims, kwarg_dims = _input_dims(module, args, kwargs, n, params, positions)
    delta_dims = output_batch_dims(module, positions)
    last: dict = {}  # the chunk formed last: every parameter of the unit shares it

    def run(start: int, stop: int) -> dict[str, SampleGrads]:
        if last.get("range") != (start, stop):
            last.clear()

            def cut(value, dim):
                return value if dim is None else value.narrow(dim, start, stop - start)

            last["grads"] = fallback_rule(
                module, tuple(cut(v, d) for v, d in zip(args, arg_dims, strict=True)),
                {k: cut(v, kwarg_dims[k]) for k, v in kwargs.items()}, positions,
                [cut(g, d) for g, d in zip(grad_outputs, delta_dims, strict=True)], params)
            last["range"] = (start, stop)
        return last["grads"]

    size = samples_per_chunk(per_sample, budget)
    return {name: SampleChunks(n, p.shape, grad_outputs[0].dtype,
                               lambda start, stop, name=name: run(start, stop)[name], size)
            for name, p in params.items()}


def _detached(value):
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, tuple | list):
        return tuple(_detached(v) for v in value)
    return value


def recurrent_rule(
    module: nn.RNNBase,
    args: tuple,
    kwargs: dict,
    positions: list[int],
    grad_outputs: list[Tensor],
    params: dict[str, Tensor],
) -> dict[str, SampleGrads]:
    """Individual gradients of a recurrent layer: vmap over the vjp of the unrolled
    recurrence (:mod:`cockpit.engine.rules.recurrent`) instead of the fused kernel.

    The flattened output is [output (or a PackedSequence's tensors), h_n(, c_n)]: position
    0 is the output, the last one or two are the final states (batch at dim 1)."""
    message = recurrent_message(module, args, kwargs)
    if message is not None:
        raise ValueError(message)
    x, lengths, hx = unpack_input(module, args, kwargs)
    packed = args[0] if args and isinstance(args[0], PackedSequence) else kwargs.get("input")
    num_states = 2 if module.mode == "LSTM" else 1
    first_state = (len(output_tensors(packed)) if isinstance(packed, PackedSequence) else 1)
    bd = batch_dim_of(module)
    n = x.shape[bd]
    deltas: list[Tensor | None] = [None] * (1 + num_states)
    for position, grad in zip(positions, grad_outputs, strict=True):
        if position == 0:
            if isinstance(packed, PackedSequence):
                grad = packed_output_grad(module, packed, grad, x.shape[1 - bd])
            deltas[0] = grad
        elif position >= first_state:
            deltas[1 + position - first_state] = grad
    frozen = {k: v.detach() for k, v in params.items()}
    x = x.detach()
    hx = _detached(hx)
    hx_dims = None if hx is None else ((1, 1) if module.mode == "LSTM" else 1)
    used = [k for k, d in enumerate(deltas) if d is not None]
    delta_dims = tuple(bd if k == 0 else 1 for k in used)

    def one_sample(theta, x_n, lengths_n, hx_n, sample_deltas):
        def with_batch(value, dim):
            if value is None:
                return None
            if isinstance(value, tuple):
                return tuple(with_batch(v, d) for v, d in zip(value, dim, strict=True))
            return value.unsqueeze(dim)

        def forward(p):
            output, states = recurrent_forward(module, p, with_batch(x_n, bd),
                                               with_batch(lengths_n, 0), with_batch(hx_n, hx_dims))
            flat = [output, *(states if isinstance(states, tuple) else (states,))]
            return tuple(flat[k] for k in used)

        _, vjp_fn = vjp(forward, theta)
        cotangents = tuple(d.unsqueeze(dim) for d, dim in zip(sample_deltas, delta_dims,
                                                              strict=True))
        return vjp_fn(cotangents)[0]

    per_sample = vmap(one_sample, in_dims=(None, bd, None if lengths is None else 0, hx_dims,
                                           delta_dims))(
        frozen, x, lengths, hx, tuple(deltas[k] for k in used))
    if per_sample and next(iter(per_sample.values())).shape[0] != n:
        raise ValueError("internal: recurrent individual gradients have the wrong batch size")
    return {name: DenseSampleGrads(g) for name, g in per_sample.items()}



def cell_rule(
    module: nn.RNNCellBase,
    args: tuple,
    kwargs: dict,
    positions: list[int],
    grad_outputs: list[Tensor],
    params: dict[str, Tensor],
) -> dict[str, SampleGrads]:
    """Individual gradients of one step of nn.RNNCell, nn.GRUCell or nn.LSTMCell: vmap over
    the vjp of the cell written in plain torch (:func:`~cockpit.engine.rules.recurrent.
    cell_forward`; a missing hx is zeros, as in the cell). The flattened output is h, or
    [h, c] for an LSTM cell, whose h is formed from c: its hooks' gradient of c holds the
    path through h, which the vjp then takes through c only (``separate_state``)."""
    message = cell_message(module, args, kwargs)
    if message is not None:
        raise ValueError(message)
    x = (args[0] if args else kwargs["input"]).detach()
    hx = _detached(args[1] if len(args) > 1 else kwargs.get("hx"))
    lstm = isinstance(module, nn.LSTMCell)
    hx_dims = None if hx is None else ((0, 0) if lstm else 0)
    frozen = {k: v.detach() for k, v in params.items()}

    def one_sample(theta, x_n, hx_n, sample_deltas):
        if hx_n is not None:
            hx_n = (tuple(v.unsqueeze(0) for v in hx_n) if lstm else hx_n.unsqueeze(0))

        def forward(p):
            out = cell_forward(module, p, x_n.unsqueeze(0), hx_n, separate_state=True)
            flat = list(out) if lstm else [out]
            return tuple(flat[k] for k in positions)

        _, vjp_fn = vjp(forward, theta)
        return vjp_fn(tuple(d.unsqueeze(0) for d in sample_deltas))[0]

    per_sample = vmap(one_sample, in_dims=(None, 0, hx_dims, 0))(
        frozen, x, hx, tuple(grad_outputs))
    return {name: DenseSampleGrads(g) for name, g in per_sample.items()}


def owned_parameters(module: nn.Module, atomic: bool) -> dict[str, nn.Parameter]:
    """Trainable parameters a fallback unit differentiates: its own, or all for atomic ones."""
    named = module.named_parameters(recurse=atomic)
    return {name: p for name, p in named if p.requires_grad}

