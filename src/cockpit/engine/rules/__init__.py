"""Built-in per-sample gradient rules; importing this package registers them."""

from cockpit.engine.rules import conv, embedding, linear, norms  # noqa: F401
from cockpit.engine.rules.registry import ATOMIC_MODULES, find_rule, register_rule

__all__ = ["ATOMIC_MODULES", "find_rule", "register_rule"]
