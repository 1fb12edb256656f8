"""Registry that maps layer types to per-sample gradient rules.

A rule is a function ``rule(module, args, kwargs, output, grad_output) -> dict[str,
SampleGrads]`` that receives one call of ``module`` (its positional and keyword inputs as
captured in the forward pass, the output and the gradient of the *individual* losses with
respect to that output, batch dimension first) and returns the individual gradients of the
module's own trainable parameters, keyed by the parameter's attribute name (``"weight"``,
``"bias"``, …). Rules are looked up by exact type first, then along the MRO, so subclasses of
``nn.Linear`` use the Linear rule unless they register their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from cockpit.engine.rules.sample_grads import SampleGrads

Rule = Callable[[nn.Module, tuple, dict, Any, Tensor], dict[str, SampleGrads]]

_RULES: dict[type, Rule] = {}
# Modules whose children's parameters are used inside the parent's forward without calling
# the children (e.g. MultiheadAttention reads out_proj.weight directly). The fallback rule
# treats such a module as one unit that owns all of its parameters.
ATOMIC_MODULES: tuple[type, ...] = (nn.MultiheadAttention,)


def register_rule(*module_types: type) -> Callable[[Rule], Rule]:
    """Decorator that registers ``rule`` for the given module types."""

    def decorate(rule: Rule) -> Rule:
        for module_type in module_types:
            _RULES[module_type] = rule
        return rule

    return decorate


# Rules for classes of other packages, by the class's qualified name (``module.QualName``):
# registered without importing the package, found when a model uses the class.
_NAMED_RULES: dict[str, Rule] = {}


def register_rule_for_class_named(*qualified_names: str) -> Callable[[Rule], Rule]:
    """Decorator that registers ``rule`` for the classes ``qualified_names`` (e.g.
    ``"transformers.pytorch_utils.Conv1D"``) without importing their package."""

    def decorate(rule: Rule) -> Rule:
        for name in qualified_names:
            _NAMED_RULES[name] = rule
        return rule

    return decorate


def find_rule(module: nn.Module) -> Rule | None:
    """The registered rule for ``module``'s type (nearest in its MRO, a rule registered for
    the type itself before one registered by its name), or None."""
    for cls in type(module).__mro__:
        if cls in _RULES:
            return _RULES[cls]
        if _NAMED_RULES:
            named = _NAMED_RULES.get(f"{cls.__module__}.{cls.__qualname__}")
            if named is not None:
                return named
    return None
