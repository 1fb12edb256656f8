"""The checks of the vocabulary, one small module per family."""

from __future__ import annotations

from cockpit.diagnose.rule import Rule
from cockpit.diagnose.rules import (
    dead_units,
    frozen,
    learning_rate,
    noise,
    non_finite,
    scale,
    update_ratio,
    zero_grad,
)

RULES: list[Rule] = [
    non_finite.RULE,
    *learning_rate.RULES,
    *scale.RULES,
    dead_units.RULE,
    frozen.RULE,
    zero_grad.RULE,
    noise.RULE,
    update_ratio.RULE,
]
