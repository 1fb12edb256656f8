"""Models compiled with ``torch.compile``: the compiled graph at untracked steps, the eager
module at tracked ones.

A compiled graph runs its layers as one fused program, so the per-layer hooks that form the
individual gradients (see :mod:`cockpit.engine.tracker`) do not see its layers' outputs and
output gradients. ``Cockpit(torch.compile(model), ...)`` therefore hooks the module the
compiled wrapper holds (``_orig_mod``, so parameter names are those of the eager model) and
runs the wrapper's forward eagerly only when its forward belongs to a tracked step: a
forward pre-hook on the wrapper switches the compiler's stance to ``"force_eager"`` when the
tracker is capturing (``ModuleTracker.capturing``, decided at the previous step from the
schedule) and the forward builds an autograd graph; a forward hook that runs even when the
forward raises switches it back. A module compiled in place (``model.compile()``) gets the
same switch around its compiled call.

Why this and not the alternatives: hooks inside a compiled graph would need dynamo to
trace Cockpit's per-layer work into the graph (each tracked configuration a graph of its
own), and a second graph compiled for tracked steps costs a compilation and still hides the
layers. ``force_eager`` runs the unchanged eager module, so a tracked step is exactly the
eager computation, while untracked steps run the compiled graph untouched: under the stance
dynamo is skipped altogether (no guard is evaluated, nothing is recompiled when it switches),
and the graph compiled while ``capturing`` is False traces Cockpit's hooks to no-ops (dynamo
guards on ``capturing``, which stays False whenever the graph runs).

The eager module runs whenever the tracker captures: the forward passes of tracked steps
(and of the step after each of Alpha's), every forward pass after step numbers jumped until
they ran on consecutively again, and with gradient accumulation the micro-batches after the
first of an untracked step that precedes a tracked one (they cannot be told from that step's
first forward).
"""

from __future__ import annotations

import sys

import torch
from torch import nn


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns. (Its class is
    looked up where ``torch.compile`` has imported it: importing the compiler here would
    take longer, ~0.7 s, than the rest of Cockpit's import.)"""
    wrapper = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    return wrapper is not None and isinstance(module, wrapper)


def uncompiled(model: nn.Module) -> nn.Module:
    """The eager module inside ``torch.compile``'s wrapper (``model`` itself if it is none)."""
    while is_compiled(model):
        model = model._orig_mod
    return model


def _compiled_in_place(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def check_supported(model: nn.Module) -> None:
    """Refuse a compiled model where torch cannot run it eagerly at tracked steps."""
    if hasattr(torch.compiler, "set_stance"):
        return
    if any(is_compiled(m) or _compiled_in_place(m) for m in model.modules()):
        raise NotImplementedError(
            "Cockpit on a model compiled with torch.compile needs torch >= 2.6 "
            "(torch.compiler.set_stance runs the tracked steps eagerly): upgrade torch, or "
            "attach Cockpit to, and train, the uncompiled model")


class EagerAtTrackedSteps:
    """Runs the compiled modules within ``model`` eagerly for the forward passes that the
    tracker records (``tracker.capturing``, with gradients enabled), compiled otherwise.

    Two kinds of compiled module: the wrapper ``torch.compile(module)`` returns (switched by
    a forward pre-hook and a forward hook on the wrapper, which run outside the compiled
    region), and a module compiled in place by ``module.compile()`` (its compiled call
    holds its own hooks, so its ``_compiled_call_impl`` is wrapped, and restored by
    :meth:`remove`)."""

    def __init__(self, model: nn.Module, tracker) -> None:
        self.tracker = tracker
        self._switched: tuple[nn.Module, object] | None = None  # (module, stance context)
        self._handles = []
        self._wrapped: list[tuple[nn.Module, object]] = []  # (module, its compiled call)
        for module in model.modules():
            if is_compiled(module):
                self._handles.append(module.register_forward_pre_hook(self._before))
                self._handles.append(module.register_forward_hook(self._after, always_call=True))
            if _compiled_in_place(module):
                compiled_call = module._compiled_call_impl
                self._wrapped.append((module, compiled_call))
                module._compiled_call_impl = self._eager_when_recorded(module, compiled_call)

    @property
    def active(self) -> bool:
        """Whether ``model`` holds a compiled module (else this object does nothing)."""
        return bool(self._handles or self._wrapped)

    def _before(self, module: nn.Module, args) -> None:
        tracker = self.tracker
        if (self._switched is not None or not tracker.capturing or tracker.is_suspended
                or not torch.is_grad_enabled()):
            return
        try:
            stance = torch.compiler.set_stance("force_eager")
        except RuntimeError:  # called inside another compiled region: that region decides
            return  # (the per-sample instruments then say that the layers were hidden)
        self._switched = (module, stance)

    def _after(self, module: nn.Module, args, output) -> None:
        if self._switched is not None and self._switched[0] is module:
            stance = self._switched[1]
            self._switched = None
            stance.__exit__(None, None, None)  # back to the stance before the forward

    def _eager_when_recorded(self, module: nn.Module, compiled_call):
        def call(*args, **kwargs):
            self._before(module, args)
            try:
                return compiled_call(*args, **kwargs)
            finally:
                self._after(module, args, None)

        return call

    def remove(self) -> None:
        if self._switched is not None:
            self._after(self._switched[0], (), None)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module, compiled_call in self._wrapped:
            if _compiled_in_place(module):  # (not made uncompiled since)
                module._compiled_call_impl = compiled_call
        self._wrapped = []
