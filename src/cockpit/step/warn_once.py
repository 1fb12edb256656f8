"""Cockpit's warnings: each kind once per Cockpit, at the user's line; and the guard that
keeps a failing sink from stopping training."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from cockpit._stacklevel import user_stacklevel


class WarnOnce:
    """``warn(message, key)`` warns once per ``key`` (the message itself without one).

    ``strict``: re-raise errors that would otherwise be warned about (tests)."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.warned: set[str] = set()

    def __call__(self, message: str, key: str | None = None) -> None:
        key = key or message
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())

    def guard(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` of a sink: an error is warned about (raised if ``strict``)."""
        try:
            fn(*args)
        except Exception as error:
            if self.strict:
                raise
            self(f"Cockpit sink failed: {error}", key=f"sink:{type(error).__name__}")
