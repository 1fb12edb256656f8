"""The checks of the vocabulary, one small module per family."""

from __future__ import annotations

from cockpit.diagnose.rule import Rule

RULES: list[Rule] = []
