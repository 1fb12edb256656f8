"""The autograd graph is walked once per tracked backward pass: the broadcast taps read the
edges the walk from the losses recorded, and must see the same consumers, in the same order
(the order in which a broadcast output's per-path shares are summed)."""

from __future__ import annotations

import torch
from torch import nn

from cockpit.engine.capture.broadcast import Consumers
from cockpit.engine.capture.hooks import reachable_nodes


class _Shared(nn.Module):
    """A parameter broadcast over the batch, used by three consumers (two of them the same
    op type), and a residual branch: nodes with several consumers and several inputs."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, 5))
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x):
        shared = self.bias * 2.0
        h = torch.tanh(self.a(x + shared)) + shared
        return self.b(h * shared) + h


def fresh_consumers(root) -> dict:
    """The consumer map by its own depth-first walk from ``root``, recording each edge as
    the walk meets it (the reference)."""
    consumers: dict = {}
    seen: set = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for edge, (child, nr) in enumerate(node.next_functions):
            if child is not None:
                consumers.setdefault((child, nr), []).append((node, edge))
                stack.append(child)
    return consumers


def test_consumers_from_the_walked_nodes_equal_a_fresh_walk():
    torch.manual_seed(0)
    model = _Shared()
    losses = (model(torch.randn(4, 5)) ** 2).sum(1)
    walked = reachable_nodes(losses)
    fresh = fresh_consumers(losses.grad_fn)
    reused = Consumers(walked)
    for key, consumers in fresh.items():
        assert reused.get(key) == consumers, key  # same consumers, same order
    assert reused.get((losses.grad_fn, 0)) == []  # (the root: no node takes it)
    assert any(len(c) == 3 for c in fresh.values())  # the shared output has three
    # every node the walk found is a root or some node's input
    inputs = {node for node, _ in fresh}
    assert set(walked) == inputs | {losses.grad_fn}
