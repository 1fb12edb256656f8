"""What instruments and curvature code may ask of the engine at a tracked step.

Quantities receive an :class:`EngineView` in ``prepare`` (before the user's backward pass,
while the step's forward graph is alive) and as ``StepData.engine``; the curvature
primitives (:mod:`cockpit.curvature`) take one too. It is the whole surface they see of
the engine (:class:`~cockpit.engine.tracker.ModuleTracker` implements it): the step's
request, the recorded forward pass (model output, activation calls, layer calls), the
parameters, Cockpit's own backpropagations reduced by the layer rules, and a context for
extra autograd work that must leave the step's statistics alone. Nothing here writes the
engine's statistics except :meth:`EngineView.add_sample_sums`.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor, dtype, nn

from cockpit.engine.request import StepRequest

if TYPE_CHECKING:
    from cockpit.engine.capture.hooks import Call, Unit
    from cockpit.engine.rules.sample_grads import SampleGrads

__all__ = ["EngineView"]


@runtime_checkable
class EngineView(Protocol):
    """The engine as instruments and curvature code see it (module docstring)."""

    @property
    def request(self) -> StepRequest:
        """What the tracked instruments ask of this backward pass; ``prepare`` adds its
        directions and direction providers here."""

    @property
    def params(self) -> Mapping[str, nn.Parameter]:
        """The tracked parameters θ (requiring gradients) by name."""

    @property
    def parameter_owners(self) -> Mapping[str, tuple[nn.Module, str]]:
        """Tracked parameter name → (the module that holds it, its attribute there)."""

    @property
    def model_output(self) -> Tensor | None:
        """The network output f(x) of the recorded forward pass, None if not seen."""

    @property
    def activation_calls(self) -> list[tuple[nn.Module, Tensor, Tensor]]:
        """(module, input z, output a) of each recorded call of a smooth activation or
        normalization module (:mod:`cockpit.engine.capture.activations`); recorded only for
        steps that track an instrument with ``needs_activations``."""

    @property
    def curvature_budget(self) -> int | None:
        """Bytes a chunk of the curvature's batched backpropagations may take at most (the
        ``memory_budget`` the user gave); None: the device's default."""

    @property
    def step_cache(self) -> dict[Any, Any]:
        """Work shared by instruments within one backward pass (released at its end)."""

    def suspended(self) -> AbstractContextManager[None]:
        """A context for Cockpit's own autograd work (Hessian-vector products, extra
        backward passes): the engine's hooks ignore it."""

    @property
    def compute_dtypes(self) -> Mapping[str, dtype]:
        """Under ``fully_shard``'s mixed precision: parameter name → the dtype the layers
        compute in (``param_dtype``); empty otherwise."""

    def graph_params(self) -> Mapping[str, Tensor]:
        """The tracked parameters as the recorded forward graph holds them (the leaves of
        Cockpit's own derivatives with respect to θ): :attr:`params`, or under
        ``fully_shard`` the unsharded, whole parameters (an all-gather: every rank must
        ask at the same point of the step)."""

    def add_sample_sums(self, key: str, values: dict[str, Tensor]) -> None:
        """Add per-parameter sums over this backward's samples to the statistics (merged
        over micro-batches and processes like the engine's own)."""

    def sum_sq_of_backprops(self, output: Tensor, grad_outputs: Tensor) -> dict[str, Tensor]:
        """Σ_k Σ_n g_{n,k} ⊙ g_{n,k} per parameter, g_{n,k} = (∂f_n/∂θ)ᵀ v_{n,k} the
        backpropagation of ``grad_outputs[k]`` from ``output``, one backward pass per k."""

    def probe_calls(self) -> list[Call]:
        """The recorded layer calls whose inputs and outputs are still held (those
        Cockpit's own backpropagations from the model output reach)."""

    def used_repeatedly(self, name: str) -> bool:
        """Whether parameter ``name`` is used by several recorded calls (its individual
        gradients are sums over the calls and cannot be reduced call by call)."""

    def unit_param_name(self, unit: Unit, attr: str) -> str:
        """The global name of a unit's parameter ``attr``."""

    def sample_grads(self, call: Call, grads: list[Tensor]) -> dict[str, SampleGrads]:
        """The individual gradients of ``call``'s parameters for the output gradients
        ``grads`` (one per output, batch first), by the unit's layer rule."""
