"""Names listed in messages."""

from __future__ import annotations


def listed(names: list[str], limit: int = 4) -> str:
    """'a, b and 3 more' for messages."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"
