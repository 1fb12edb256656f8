"""Where Cockpit's Triton kernels (:mod:`cockpit.engine.histograms.fused`,
:mod:`cockpit.engine.row_dots`, :mod:`cockpit.engine.tensor_sums`) run: on CUDA tensors, and
on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, chosen when Triton is
imported), which is how the tests check the kernels without a GPU; and whether each is still
used in this process (:class:`KernelSwitch`)."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

from torch import Tensor


def triton_kernel(build: Callable[[Any, Any], Any]) -> Callable[[], Any]:
    """``build(triton, triton.language)`` made into a function that builds the kernel once,
    at its first call, and returns it, or None where Triton does not import (any failure
    to load means: no kernel)."""

    @functools.lru_cache(maxsize=1)
    def kernel():
        try:
            import triton
            import triton.language as tl
        except Exception:
            return None
        return build(triton, tl)

    functools.update_wrapper(kernel, build)
    return kernel


def runs_kernels(x: Tensor) -> bool:
    """Whether a Triton kernel would run on ``x``'s device."""
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


class KernelSwitch:
    """One kernel's state in this process: on where Triton kernels run unless its
    environment variable is ``0``; used until it fails once (no compiler for Triton, a
    launch error), then never again, said once by a warning that names what runs instead
    (the same values)."""

    def __init__(self, kernel: str, instead: str, variable: str):
        self.kernel, self.instead, self.variable = kernel, instead, variable
        self.broken: str | None = None  # why the kernel failed

    def runs(self, x: Tensor) -> bool:
        """Whether the kernel runs on ``x``'s device: not turned off (``variable=0``), not
        failed, a device where Triton kernels run (:func:`runs_kernels`)."""
        return (self.broken is None and os.environ.get(self.variable, "1") != "0"
                and runs_kernels(x))

    def disable(self, error: Exception) -> None:
        """Stop using the kernel, and say so."""
        self.broken = f"{type(error).__name__}: {error}"[:300]
        warnings.warn(f"Cockpit's CUDA {self.kernel} failed ({self.broken}); {self.instead}",
                      RuntimeWarning, stacklevel=2)
