"""Steps Cockpit cannot describe: each check names a reason, and the step's instruments it
touches are recorded as None with that reason (warned once), never as a value of some other
batch, model or loss. A reason has a scope: which instruments it touches."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from cockpit.engine.readout import Noted
from cockpit.engine.sharded import unsharded_parameters
from cockpit.loop_checks.gradient import listed

# The scopes a problem voids (which instruments read what: their descriptors say)
from cockpit.quantities.descriptor import BATCH, GRADIENT, MODEL

REPEATED_BACKWARD = (
    "two backward passes inside one `with cockpit({step}, ...)` block (e.g. "
    "backward(retain_graph=True) and a second loss term): the gradient is their sum, which no "
    "batch of individual losses describes; backpropagate one loss per block — the sum of the "
    "loss terms (`(losses.mean() + other).backward()`) — or give each micro-batch its own "
    "block of the same step")
STEPPED_BEFORE_BACKWARD = (
    "optimizer.step() ran inside `with cockpit({step}, ...)` before the block's backward pass "
    "(a closure optimizer such as LBFGS around which the block was put?): the parameters "
    "moved while the block was open, so the step describes no one θ; put the block inside "
    "the closure, around its backward pass (the closure's first evaluation is the step)")
SAME_FORWARD_AGAIN = (
    "a second backward pass through the forward pass that an earlier block of step {step} "
    "backpropagated already (retain_graph=True): the step's gradient is then the sum of both, "
    "which no batch of individual losses describes; backpropagate the sum of the loss terms "
    "once, inside one block")
LOSSES_NOT_BACKPROPAGATED = (
    "the backward pass inside `with cockpit({step}, losses=...)` did not go through the "
    "`losses` passed (losses of another batch or forward pass, detached or made-up losses): "
    "pass losses = loss_fn(output, target, reduction='none') of the batch you backpropagate, "
    "and backpropagate losses.mean()")
EMPTY_BATCH = (
    "the batch is empty (`losses` has 0 entries): there is no batch to describe (skip empty "
    "batches before the forward pass)")
STEP_BACKWARDS = (
    "step {step} comes after step {last}: Cockpit records each step number once and never "
    "overwrites a recorded step, so a step number that repeats or goes back is not recorded "
    "(warned once). Number the steps over the whole run (a global step counter, not the "
    "batch index within an epoch); a run continued in its run log (resume=True) records the "
    "steps after the last one logged")


def parameters_changed(model: torch.nn.Module, known: dict[int, str],
                       trainable: dict[str, Tensor]) -> str | None:
    """The reason Cockpit cannot describe ``model`` any more, if its parameters changed
    since Cockpit was created: parameters added (``model.append``), replaced
    (``model[2] = nn.Linear(...)``) or made trainable; else None. ``known``: id → name of
    every parameter at construction; ``trainable``: the tracked ones (frozen later is
    harmless: a parameter without a gradient adds nothing to any instrument)."""
    if _as_known(model, known, trainable):
        return None
    names = set(known.values())
    added: list[str] = []
    replaced: list[str] = []
    unfrozen: list[str] = []
    twins: dict[int, str] | None = None
    for name, p in model.named_parameters():
        if id(p) not in known and twins is None:  # fully_shard's unsharded parameters
            twins = {id(t): n for n, t in unsharded_parameters(model, trainable).items()}
            known = {**known, **twins}
        if id(p) not in known:
            (replaced if name in names else added).append(name)
        elif p.requires_grad and known[id(p)] not in trainable:
            unfrozen.append(name)
    if not (added or replaced or unfrozen):
        return None
    parts = [f"{what}: {listed(found)}" for what, found in
             (("added", added), ("replaced", replaced), ("made trainable", unfrozen)) if found]
    return (f"the model's parameters changed after Cockpit was created ({'; '.join(parts)}): "
            "its hooks, θ_0 and the optimizer's groups it reads cover the parameters it was "
            "created with, so only Loss, BatchSize and Time are recorded from here on; create "
            "a new Cockpit for the changed model (cockpit.close(); Cockpit(model, ..., "
            "logdir=<new directory>))")


def _as_known(model: torch.nn.Module, known: dict[int, str], trainable: dict[str, Tensor]
              ) -> bool:
    """Whether every parameter of ``model`` is a known one, and none of the untracked ones
    requires a gradient: :func:`parameters_changed`'s answer None where it is, from one walk
    over the modules' own dictionaries and set operations on the parameters' ids
    (``named_parameters`` nests a generator per module and level: about ten Python calls
    per parameter at every tracked step)."""
    stack: list[torch.nn.Module | None] = [model]
    seen: set[int] = set()
    params: list[Tensor | None] = []
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        params.extend(module._parameters.values())
        stack.extend(module._modules.values())
    ids = set(map(id, params))
    ids.discard(id(None))
    if not ids <= known.keys():
        return False
    untracked = {i for i, name in known.items() if name not in trainable}
    return not (untracked & ids) or not any(
        p.requires_grad for p in params if p is not None and id(p) in untracked)


def first_problem(problems: list[tuple[str, str]], scopes: tuple[str, ...]) -> str | None:
    """The first reason among ``problems`` (scope, reason) of one of ``scopes``."""
    return next((reason for scope, reason in problems if scope in scopes), None)


def check_losses(losses: Tensor | None, step: int, needing: Sequence[str] = ()) -> Tensor:
    """``losses`` if they are the batch's individual losses, else a ValueError or TypeError
    that says what to pass (``needing``: the names of the instruments that need them)."""
    if losses is None:
        names = sorted(set(needing))
        raise ValueError(
            f"{', '.join(names) or 'these instruments'} need the individual losses at "
            f"step {step}: call cockpit(step, losses=losses) with losses = loss_fn(output, "
            "target, reduction='none') of shape [batch], and backpropagate losses.mean() "
            "(or track only instruments that need no losses, e.g. GradNorm, Distance, "
            "UpdateSize)"
        )
    if not isinstance(losses, Tensor) or losses.dim() != 1:
        shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise ValueError(
            f"losses must be a 1-d tensor of individual losses [batch], got {shape}; "
            "use reduction='none' (and .mean() over non-batch dims, e.g. "
            "F.mse_loss(out, y, reduction='none').mean(1))"
        )
    if not losses.is_floating_point():
        raise TypeError(
            f"losses must be the floating-point individual losses of the batch you "
            f"backpropagate, got a tensor of dtype {losses.dtype}: pass losses = "
            "loss_fn(output, target, reduction='none')")
    return losses


def step_problems(step: int, losses: Tensor | None, model_changed: str | None,
                  earlier_forwards: set | None, warn: Callable[..., None]
                  ) -> list[tuple[str, str]]:
    """What makes the step indescribable, known before its backward pass: (scope, reason)
    pairs, each warned once. ``model_changed``: :func:`parameters_changed`'s reason;
    ``earlier_forwards``: the graph nodes the step's earlier blocks backpropagated (None at
    its first block)."""
    problems = []
    if model_changed is not None:
        problems.append((MODEL, model_changed))
    if losses is not None and losses.numel() == 0:
        problems.append((BATCH, EMPTY_BATCH))
    if (earlier_forwards is not None and losses is not None and losses.grad_fn is not None
            and losses.grad_fn in earlier_forwards):
        problems.append((GRADIENT, SAME_FORWARD_AGAIN.format(step=step)))
    warn_problems(step, problems, warn)
    return problems


def backward_problems(step: int, tracker: Any, losses: Tensor | None, reached: bool,
                      warn: Callable[..., None]) -> list[tuple[str, str]]:
    """What makes the step indescribable, seen in a backward pass that ``tracker`` watched
    (``losses``: the block's, ``reached``: whether it reached a parameter)."""
    problems = []
    if tracker.repeated_backward:
        problems.append((GRADIENT, REPEATED_BACKWARD.format(step=step)))
    if losses is not None and losses.numel() > 0 and reached:
        if tracker.loss_weight is None and tracker.weights_problem is None:
            problems.append((BATCH, LOSSES_NOT_BACKPROPAGATED.format(step=step)))
        elif tracker.weights_problem is not None:
            problems.append((GRADIENT, tracker.weights_problem))
    warn_problems(step, problems, warn)
    return problems


def warn_problems(step: int, problems: list[tuple[str, str]], warn: Callable[..., None]
                  ) -> None:
    for _, reason in problems:
        kind = reason.replace(str(step), "")[:60]
        warn(f"step {step}: {reason}; these instruments are recorded as None with this "
             "reason (see get_notes())", key=f"problem:{kind}")


def nonfinite_warning(step: int) -> Callable[[Any], Noted]:
    """The verdict on the step's losses' finite witness (finite iff every loss is, see
    :func:`cockpit.quantities.base.finite_witness`), read with the step's numbers."""
    def warn(witness) -> Noted:
        if math.isfinite(float(witness)):
            return Noted({})
        return Noted({}, warnings=((f"step {step}: non-finite loss; instruments of this step "
                                    "are recorded as NaN", "nonfinite"),))

    return warn
