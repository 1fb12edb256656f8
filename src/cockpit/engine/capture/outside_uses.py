r"""Parameters the loss also depends on outside the recorded calls of their layer.

Cockpit forms the individual gradients g_n of a parameter θ from the recorded calls of the
layer that owns it: g_n = Σ_calls (∂ℓ_n/∂y) ∂y/∂θ over those calls' outputs y. Where the
loss also reaches θ by another path — a tied output layer written ``F.linear(h,
emb.weight)`` or ``h @ emb.weight.T``, a Linear layer whose weight is used without calling
the layer, a bias added by hand — that path's share of ∂ℓ_n/∂θ is not in any call, and
every statistic of the individual gradients (the gradient tests, the histogram, Alpha's
variances, …) would describe a vector that is not g_n.

In the losses' autograd graph a use of θ is an edge into θ's ``AccumulateGrad`` node.
The nodes a call made are those reachable from its outputs' nodes that were made after
its inputs' nodes (autograd numbers nodes in the order they are made): inputs, and
whatever was made before them, lie below that floor. A use of θ from a node that none of
the calls of θ's layers made is a use outside them.

The answer depends on the model's code, not on the batch: it is kept for a graph of the
same size and the same calls (the walk costs one pass over the graph's edges).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from torch import Tensor

from cockpit._listing import listed

if TYPE_CHECKING:
    from cockpit.engine.capture.hooks import Call


def used_outside(graph: Mapping, calls: Iterable[Call], param_names: Mapping[int, str]
                 ) -> list[str]:
    """The names of the parameters with a use in ``graph`` (node → its edges, the losses'
    graph as :func:`~cockpit.engine.capture.hooks.reachable_nodes` walked it) that no
    recorded call of a layer owning them made (``param_names``: id of a parameter → its
    name; the parameters of interest)."""
    accumulators = {}
    for node in graph:
        variable = getattr(node, "variable", None)  # (only AccumulateGrad nodes have one)
        if variable is not None and id(variable) in param_names:
            accumulators[node] = param_names[id(variable)]
    if not accumulators:
        return []
    users: dict[str, set] = {}  # parameter → the nodes that use it
    for node, edges in graph.items():
        for child, _ in edges:
            name = accumulators.get(child) if child is not None else None
            if name is not None:
                users.setdefault(name, set()).add(node)
    made: dict[str, set] = {}  # parameter → the nodes its layers' calls made
    for call in calls:
        names = [param_names.get(id(p)) for p in call.unit.params.values()]
        names = [n for n in names if n is not None and n in users]
        if not names:
            continue
        nodes = nodes_made_by(call)
        for name in names:
            made.setdefault(name, set()).update(nodes)
    return [name for name, nodes in users.items() if not nodes <= made.get(name, set())]


def nodes_made_by(call: Call) -> set:
    """The autograd nodes between ``call``'s outputs and its inputs: reachable from the
    outputs' nodes and made after every input's node (the parameters' accumulators are
    not nodes of the call)."""
    floor = call.inputs_floor
    if floor is None:
        floor = newest_node([v for v in (*call.args, *call.kwargs.values())
                             if isinstance(v, Tensor)]) if call.args is not None else -1
    stack = [o.grad_fn for o in call.outputs]
    made: set = set()
    while stack:
        node = stack.pop()
        if node is None or node in made or hasattr(node, "variable"):
            continue
        if node._sequence_nr() <= floor:
            continue
        made.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return made


def newest_node(tensors: Iterable[Tensor]) -> int:
    """The largest sequence number of the tensors' autograd nodes (−1: none has one)."""
    return max((t.grad_fn._sequence_nr() for t in tensors if t.grad_fn is not None),
               default=-1)


def outside_message(names: list[str]) -> str:
    """Why the individual gradients of a backward pass are not formed: ``names`` are used
    outside their layers' calls."""
    which = "these parameters" if len(names) > 1 else "this parameter"
    return (
        f"{listed(names, 3)}: the loss also depends on {which} outside the calls of the layer that "
        "owns it (e.g. a tied output layer written `F.linear(h, emb.weight)` or "
        "`h @ emb.weight.T`, or a weight used without calling its layer); individual "
        "gradients are formed from a layer's calls and would miss that use. Use the "
        "parameter through a layer call, e.g. tie it to a layer of its own "
        "(`head = nn.Linear(d, vocab, bias=False); head.weight = emb.weight`)")
