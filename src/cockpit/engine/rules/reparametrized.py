"""Layers whose weight is computed from other tensors: ``torch.nn.utils.parametrize``
(``parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal``, users' own
parametrizations) and the hook-based ``torch.nn.utils.weight_norm`` and
``torch.nn.utils.spectral_norm``.

Such a layer computes W = P(θ_1, …, θ_k) from its original tensors θ_i (the trained
parameters) and uses W as a plain weight. The layer rule gives the individual gradients
G_n = ∂ℓ_n/∂W; those of the originals follow by the chain rule,

    g_n(θ_i) = (∂P/∂θ_i)ᵀ G_n,

a linear map of G_n: the vector-Jacobian product of P at the call's θ, vmapped over the
samples (exact). P is evaluated with its parametrizations in eval mode: spectral norm's power
iteration updates its vectors u, v in training mode, and the layer's weight was formed with
the updated ones, as constants (``σ = uᵀ W v``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from cockpit.engine.rules.fallback import without_batching_rule_notes
from cockpit.engine.rules.sample_grads import DenseSampleGrads, SampleGrads


@dataclass
class Reparametrization:
    """W = ``compute(originals)`` for the layer's tensor ``attr``.

    ``originals``: the original tensors by their name relative to the layer (``"weight_g"``,
    ``"parametrizations.weight.original0"``); ``parametrizations``: the modules of
    ``torch.nn.utils.parametrize`` that compute W (evaluated in eval mode), if any."""

    attr: str
    originals: dict[str, Tensor]
    compute: Callable[[dict[str, Tensor]], Tensor]
    parametrizations: nn.Module | None = None
    # whether each use of the weight forms it anew from state that changes (spectral norm's
    # power iteration in training mode): several calls of the layer then used different W
    varies: Callable[[], bool] = lambda: False


def reparametrizations(module: nn.Module) -> dict[str, Reparametrization]:
    """The layer's computed tensors by attribute name (empty for most layers)."""
    found: dict[str, Reparametrization] = {}
    if parametrize.is_parametrized(module):
        plists: nn.ModuleDict = module.parametrizations  # type: ignore[assignment]
        for attr, plist in plists.items():
            found[attr] = _parametrized(attr, plist)
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm):
            found[hook.name] = _weight_norm(module, hook)
        elif isinstance(hook, SpectralNorm):
            found[hook.name] = _spectral_norm(module, hook)
    return found


def _parametrized(attr: str, plist: nn.Module) -> Reparametrization:
    count: int = getattr(plist, "ntensors", 1)
    names = ["original"] if hasattr(plist, "original") else [
        f"original{i}" for i in range(count)]

    def compute(values: dict[str, Tensor]) -> Tensor:
        inner = {name: values[f"parametrizations.{attr}.{name}"] for name in names}
        return functional_call(plist, inner, ())

    def varies() -> bool:
        return any(isinstance(m, _SpectralNorm) and m.training for m in plist.modules())

    return Reparametrization(attr, {f"parametrizations.{attr}.{name}": getattr(plist, name)
                                    for name in names}, compute, plist, varies)


def _weight_norm(module: nn.Module, hook: WeightNorm) -> Reparametrization:
    """W = g · v / ‖v‖ (norms over every dimension but ``dim``)."""
    g, v = f"{hook.name}_g", f"{hook.name}_v"

    def compute(values: dict[str, Tensor]) -> Tensor:
        return torch._weight_norm(values[v], values[g], hook.dim)

    return Reparametrization(hook.name, {g: getattr(module, g), v: getattr(module, v)},
                             compute)


def _spectral_norm(module: nn.Module, hook: SpectralNorm) -> Reparametrization:
    """W = W_orig / σ, σ = uᵀ mat(W_orig) v with the vectors u, v of the last forward pass."""
    orig = f"{hook.name}_orig"

    def compute(values: dict[str, Tensor]) -> Tensor:
        weight = values[orig]
        u, v = getattr(module, f"{hook.name}_u"), getattr(module, f"{hook.name}_v")
        sigma = torch.dot(u, torch.mv(hook.reshape_weight_to_matrix(weight), v))
        return weight / sigma

    return Reparametrization(hook.name, {orig: getattr(module, orig)}, compute,
                             varies=lambda: module.training)


@contextlib.contextmanager
def evaluated(found: dict[str, Reparametrization]) -> Iterator[None]:
    """The parametrizations in eval mode (reading a computed weight then changes no state:
    no power iteration), their modes restored after."""
    modules = [m for rep in found.values() if rep.parametrizations is not None
               for m in rep.parametrizations.modules()]
    modes = [m.training for m in modules]
    try:
        for m in modules:
            m.training = False
        yield
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.training = mode


@contextlib.contextmanager
def readable(module: nn.Module, found: dict[str, Reparametrization]) -> Iterator[None]:
    """The layer's computed weights as a rule reads them: formed once, in eval mode (no
    state changes), with autograd on, so that they show ``requires_grad`` like the weight
    of the layer's forward pass (a rule runs inside the backward pass, without autograd),
    and cached while the rule runs (``parametrize.cached``)."""
    with evaluated(found), parametrize.cached():
        with torch.enable_grad():
            for attr, rep in found.items():
                if rep.parametrizations is not None:
                    getattr(module, attr)
        yield


def originals_grads(rep: Reparametrization, grads: SampleGrads,
                    values: dict[str, Tensor] | None = None) -> dict[str, SampleGrads]:
    """g_n(θ_i) = (∂P/∂θ_i)ᵀ G_n for every trainable original θ_i (relative names), from the
    individual gradients ``grads`` of the computed tensor; ``values``: the originals the call
    used, where they have changed since (else the layer's current ones)."""
    current = {k: (values[k] if values is not None and k in values else t).detach()
               for k, t in rep.originals.items()}
    trainable = [k for k, t in rep.originals.items() if t.requires_grad]
    if not trainable:
        return {}
    fixed = {k: t for k, t in current.items() if k not in trainable}

    def computed(*tensors: Tensor) -> Tensor:
        return rep.compute({**fixed, **dict(zip(trainable, tensors, strict=True))})

    with evaluated({rep.attr: rep}):
        weight, vjp_fn = vjp(computed, *(current[k] for k in trainable))[:2]
    g = grads.materialize().to(weight.dtype)
    with without_batching_rule_notes():
        per_sample = vmap(vjp_fn)(g.reshape(g.shape[0], *weight.shape))
    return {k: DenseSampleGrads(t.detach()) for k, t in zip(trainable, per_sample,
                                                            strict=True)}


class ComputedWeights:
    """The computed weights of a model's layers (found once per layer) and the checks of
    one backward pass: each parametrized weight computed once per call of its layer (else
    it was read outside the layer's forward, or cached across calls, and its individual
    gradients from the layer's calls would be incomplete), a weight whose every use forms
    it anew from changing state (spectral norm in training mode) used by one call only.

    Args:
        modules: the tracked model's modules (asked where a parametrization's layer is
            looked up).
        has_rule: whether a module is a unit with a layer rule.
    """

    def __init__(self, modules: Callable[[], Iterator[nn.Module]],
                 has_rule: Callable[[nn.Module], bool]):
        self.modules, self.has_rule = modules, has_rule
        self._found: dict[int, dict[str, Reparametrization]] = {}  # id of a layer → its
        self._layers: dict[int, nn.Module | None] = {}  # parametrization module → its layer
        # per parametrization module: the calls of its layer minus its own calls
        self._balance: dict[int, tuple[str, int]] = {}
        self._varying: dict[int, tuple[str, int]] = {}  # calls per layer of a varying W

    def begin(self) -> None:
        """A backward pass begins: its counts start at zero."""
        self._balance, self._varying = {}, {}

    def of(self, module: nn.Module) -> dict[str, Reparametrization]:
        """The layer's computed tensors by attribute name (empty for most layers)."""
        found = self._found.get(id(module))
        if found is None:
            found = self._found[id(module)] = reparametrizations(module)
        return found

    def layer_called(self, name: str, module: nn.Module) -> None:
        """A call of a layer with computed weights was processed."""
        for rep in self.of(module).values():
            if rep.varies():
                label, count = self._varying.get(id(module), (name, 0))
                self._varying[id(module)] = (label, count + 1)
            if rep.parametrizations is not None:
                key = id(rep.parametrizations)
                label, count = self._balance.get(key, (name, 0))
                self._balance[key] = (label, count + 1)

    def parametrization_called(self, name: str, plist: nn.Module) -> None:
        """A parametrization module computed its layer's weight (its individual gradients
        are formed by the layer's rule). Raises where the layer has no rule."""
        if id(plist) not in self._layers:
            self._layers[id(plist)] = next(
                (m for m in self.modules() if parametrize.is_parametrized(m)
                 and any(r.parametrizations is plist for r in self.of(m).values())), None)
        layer = self._layers[id(plist)]
        if layer is None or not self.has_rule(layer):
            kind = type(layer).__name__ if layer is not None else "a layer"
            raise ValueError(
                f"its tensor is a parametrization (torch.nn.utils.parametrize: "
                f"weight_norm, spectral_norm, …) of {kind}, a layer without a Cockpit layer "
                "rule; the general rule re-runs such a layer per sample but cannot carry the "
                "individual gradients of the computed weight back to its original tensors. "
                "Per-sample instruments support parametrized weights of Linear, "
                "convolution, Embedding and normalization layers; remove the "
                "parametrization (torch.nn.utils.parametrize.remove_parametrizations) "
                "or freeze its original tensors to use them")
        label, count = self._balance.get(id(plist), (name, 0))
        self._balance[id(plist)] = (label, count - 1)

    def problem(self) -> str | None:
        """Why this backward pass's computed weights have incomplete individual gradients,
        or None (the counts start again)."""
        balance, varying = self._balance, self._varying
        self.begin()
        for label, count in varying.values():
            if count > 1:
                return (
                    f"{label}: this layer's weight is spectrally normalized in training mode, "
                    "which runs a power iteration at every use of the weight: the layer's "
                    f"{count} calls in this forward pass used different weights, which Cockpit "
                    "cannot replay; call the layer once per forward pass, or put its "
                    "spectral norm in eval mode (its power iteration then pauses)")
        for label, count in balance.values():
            if count != 0:
                return (
                    f"{label}: the parametrized weight of this layer was computed "
                    f"{'fewer' if count > 0 else 'more'} times than the layer was called "
                    "(read outside the layer's forward, e.g. as layer.weight, or cached with "
                    "torch.nn.utils.parametrize.cached()); Cockpit forms its individual "
                    "gradients only for its use inside the layer: use the weight only "
                    "through the layer's forward, without parametrize.cached()")
        return None
