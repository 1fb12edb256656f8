"""Where Cockpit's Triton kernels (:mod:`cockpit.engine.histograms.fused`,
:mod:`cockpit.engine.row_dots`) run: on CUDA tensors, and on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``, chosen when Triton is imported), which is how the tests
check the kernels without a GPU."""

from __future__ import annotations

import os

from torch import Tensor


def runs_kernels(x: Tensor) -> bool:
    """Whether a Triton kernel would run on ``x``'s device."""
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
