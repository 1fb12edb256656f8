"""Warnings attributed to the user's line: the stack level of the first caller outside
Cockpit, torch and the standard library's context managers.

Cockpit warns from deep inside torch's hooks (an optimizer's step hook, a tensor hook in
the backward pass, a ``with`` block's exit): a fixed ``stacklevel`` names a line of
Cockpit or of torch, or ``sys:1`` when the stack is shallower than assumed.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch

# as imported and with links resolved: a frame's file name is the path it was imported by
_INTERNAL = tuple(dict.fromkeys([
    *(str(d) + os.sep for f in (__file__, torch.__file__)
      for d in (Path(f).parent, Path(f).resolve().parent)),
    contextlib.__file__, str(Path(contextlib.__file__).resolve()), "<frozen "]))


def user_stacklevel() -> int:
    """``stacklevel`` for ``warnings.warn`` called by the caller of this function, such
    that the warning names the first frame outside Cockpit and torch (1 if there is none)."""
    frame = sys._getframe(1)  # the function that will call warnings.warn: stacklevel 1
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    return level if not frame.f_code.co_filename.startswith(_INTERNAL) else 1
