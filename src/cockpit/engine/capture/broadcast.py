"""Layers whose output is shared by the whole batch (broadcast over it).

Position embeddings called on ``position_ids`` of shape [1, T], learned queries, prompt
tokens and relative-position biases produce an output y without the batch (or with a batch
dimension of size one) that later meets per-sample tensors in a broadcasting operation
z = f(y, x), z_n = f(y, x_n). Autograd sums the gradient over the batch before it reaches y,
so the layer's own output hook sees Σ_n δ_n only. The individual gradients still exist:
sample n's share of the broadcast is

    δ_n = ∂ℓ_n/∂y = (∂z_n/∂y)ᵀ ∂ℓ_n/∂z_n,

and the layer's individual gradient is its rule applied to δ_n with the shared input.

:func:`find_broadcasts` walks the autograd graph from the per-sample losses (before the
backward pass, while the graph is intact) and finds, for such an output, the consumer nodes
where its gradient is summed over the batch: the first node whose forward output has the
batch size N at the batch dimension where the chain from y has size one (or no dimension).
Between y and that node only shape operations that keep every element (views, permutes,
unsqueeze, casts) are allowed. A pre-hook on each consumer receives ∂L/∂z (per sample),
calls the consumer's backward function on it to get the gradient for y's edge *before*
autograd sums it to y's shape, reduces it per sample to the chain's shape, and carries it
back through the shape operations (vmapped over the samples) to y. The sums over several
consumers (a bias reused by every layer) accumulate; the output hook of y then hands the
stacked [N, ...] δ to the layer rule with the layer's inputs expanded over the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.func import vmap


@dataclass
class Path:
    """One route of y's gradient: the consumer that broadcasts it over the batch, the edge
    of that consumer leading towards y, the chain of shape nodes (nearest the consumer
    first, each with its edge towards y and the shape of the tensor on that edge), the
    shape of the tensor on the consumer's edge and of the consumer's output."""

    consumer: object
    edge: int
    chain: list[tuple[object, int, tuple[int, ...]]]
    chain_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


@dataclass
class BroadcastTap:
    """Collects the per-sample output gradients δ_n of one output of one call."""

    shape: tuple[int, ...]  # y's shape
    batch_dim: int
    num_samples: int
    paths: list[Path]
    problem: str | None = None
    deltas: Tensor | None = None  # [N, *shape] of the user's backward
    probe_deltas: Tensor | None = None  # the same for Cockpit's own backprops
    handles: list = field(default_factory=list)

    @property
    def has_batch_dim(self) -> bool:
        """y keeps a batch dimension of size one (else the batch is a new dimension)."""
        return len(self.shape) > self.batch_dim and self.shape[self.batch_dim] == 1

    def add(self, delta: Tensor, probing: bool) -> None:
        if probing:
            self.probe_deltas = delta if self.probe_deltas is None else self.probe_deltas + delta
        else:
            self.deltas = delta if self.deltas is None else self.deltas + delta

    def take(self, probing: bool, grad: Tensor) -> Tensor:
        """The per-sample gradient in the layout of a batched output ([N, ...] at the batch
        dimension), replacing the batch-summed ``grad`` the output hook received."""
        if probing:
            deltas, self.probe_deltas = self.probe_deltas, None
        else:
            deltas, self.deltas = self.deltas, None
        if self.problem is not None:  # reported by the tracker, never raised in a hook
            return grad.detach()
        if deltas is None:  # no gradient reached the consumers: δ_n = 0
            deltas = grad.new_zeros(self.num_samples, *self.shape)
        if self.has_batch_dim:
            return deltas.squeeze(self.batch_dim + 1).movedim(0, self.batch_dim)
        return deltas.movedim(0, self.batch_dim)

    def expand_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's tensor inputs repeated for every sample (views, no copies)."""
        n, bd = self.num_samples, self.batch_dim

        def expand(value):
            if not isinstance(value, Tensor):
                return value
            if self.has_batch_dim:
                if value.dim() > bd and value.shape[bd] == 1:
                    sizes = list(value.shape)
                    sizes[bd] = n
                    return value.expand(sizes)
                return value
            expanded = value.unsqueeze(bd)
            sizes = list(expanded.shape)
            sizes[bd] = n
            return expanded.expand(sizes)

        return tuple(expand(a) for a in args), {k: expand(v) for k, v in kwargs.items()}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class Consumers:
    """(node, output index) → the nodes that take it as input, with the edge index, in the
    order of a depth-first walk from the graph's root, from the nodes and edges that walk
    recorded (:func:`~cockpit.engine.capture.hooks.reachable_nodes`). Looked up per key, by
    one pass over the recorded edges, and kept: :func:`find_paths` asks for the few nodes
    on its routes, not for all of the graph's (GPT-2: about 600 nodes and 1,300 edges)."""

    def __init__(self, graph: dict):
        self.graph = graph
        self._known: dict[tuple[object, int], list[tuple[object, int]]] = {}

    def get(self, key: tuple[object, int]) -> list[tuple[object, int]]:
        found = self._known.get(key)
        if found is None and key[0] is None:  # (an edge without a node: a constant input)
            return []
        if found is None:
            found = self._known[key] = [
                (node, edge) for node, edges in self.graph.items() if key in edges
                for edge, other in enumerate(edges) if other == key]
        return found


def _output_shape(node) -> tuple[int, ...] | None:
    metadata = node._input_metadata
    if len(metadata) != 1:
        return None
    return tuple(metadata[0].shape)


def _broadcasts_batch(chain: tuple[int, ...], out: tuple[int, ...], bd: int, n: int) -> bool:
    """Whether a node turns a tensor of shape ``chain`` into one with the batch of ``n``
    samples at ``bd`` by broadcasting (the chain has size one there, or no dimension)."""
    if len(out) <= bd or out[bd] != n:
        return False
    j = bd - (len(out) - len(chain))
    return not (0 <= j < len(chain)) or chain[j] == 1


def find_paths(output: Tensor, consumers: Consumers, bd: int, n: int
               ) -> tuple[list[Path], list[str]]:
    """The routes on which ``output``'s gradient is broadcast over the batch, and the names
    of nodes its gradient reaches by other routes (empty for a shared output)."""
    paths: list[Path] = []
    others: list[str] = []
    start = (output.grad_fn, output.output_nr)
    stack: list[tuple[tuple[object, int], tuple[int, ...], list]] = [
        (start, tuple(output.shape), [])]
    steps = 0
    while stack:
        key, shape, chain = stack.pop()
        for consumer, edge in consumers.get(key):
            steps += 1
            if steps > 10_000:
                others.append("(graph too large)")
                return paths, others
            out_shape = _output_shape(consumer)
            if out_shape is None:
                others.append(consumer.name())
                continue
            if _broadcasts_batch(shape, out_shape, bd, n):
                paths.append(Path(consumer, edge, chain, shape, out_shape))
                continue
            inputs = [c for c, _ in consumer.next_functions if c is not None]
            if len(inputs) == 1 and math.prod(out_shape) == math.prod(shape):
                stack.append(((consumer, 0), out_shape, [(consumer, edge, shape), *chain]))
            else:
                others.append(consumer.name())
    return paths, others


def _call(node, *grads: Tensor) -> tuple:
    """A backward node's gradients for all its input edges (a node with one input edge
    returns a bare tensor when called)."""
    out = node(*grads)
    return out if isinstance(out, tuple | list) else (out,)


def per_sample_delta(path: Path, grad_outputs: tuple, bd: int) -> Tensor:
    """δ_n for y from the consumer's output gradient ∂L/∂z ([N, ...]): [N, *y.shape]."""
    consumer = path.consumer
    if consumer.name().startswith("ExpandBackward"):
        unreduced = grad_outputs[0]  # expand is the identity on each sample's copy
    else:
        unreduced = _call(consumer, *grad_outputs)[path.edge]
    if unreduced is None:
        raise ValueError("no gradient")
    if tuple(unreduced.shape) != path.out_shape:
        raise ValueError(
            f"{consumer.name()} sums the gradient over the batch itself; Cockpit cannot "
            "separate the samples' shares of this broadcast")
    chain_shape = path.chain_shape

    def one_sample(u: Tensor) -> Tensor:
        g = u.unsqueeze(bd).sum_to_size(chain_shape)
        for node, edge, shape in path.chain:
            # a node called directly skips autograd's reduction to its input's shape
            g = _call(node, g)[edge].sum_to_size(shape)
        return g

    try:
        return vmap(one_sample, in_dims=bd)(unreduced)
    except Exception:  # a node without a batching rule (e.g. WhereBackward0): one by one
        return torch.stack([one_sample(u) for u in unreduced.unbind(bd)])
