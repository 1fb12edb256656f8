"""Products rounded toward −∞, for exact histogram bins (:mod:`cockpit.engine.histograms.exact`).

With round-to-nearest, fl(x·s) may round *up* onto an integer j although x·s < j: a value
just below a bin edge j/s is then counted one bin high. Rounded toward −∞ instead,

    fl↓(x·s) ≥ j  ⟺  x·s ≥ j       for every integer j the dtype represents,

so ⌊fl↓(x·s)⌋ = ⌊x·s⌋ exactly, at every edge and for tiny values of both signs (a negative
product never rounds up to 0). The same holds for adding an integer m in the same mode:
fl↓(y + m) ≥ j ⟺ y + m ≥ j, so ⌊fl↓(fl↓(x·s) + m)⌋ = ⌊x·s⌋ + m, and the sign of the result
says whether x·s + m < 0. Two operations at the cost of rounding to nearest, and no floor
pass: a result clamped to [0, bins − 1] is floored by the truncating cast to an integer.

How. The rounding mode is per-thread state of the floating-point unit (MXCSR on x86-64,
FPCR on AArch64). :func:`scale_down_` sets it with C's ``fesetenv``/``fesetround`` around a
single NumPy multiply (NumPy's loops run in the calling thread; torch's could move to its
OpenMP threads, which keep their own mode) and restores the previous environment. It runs
only in Cockpit's own worker threads: a call from any other thread is handed to one, so the
user's threads never see a changed mode (not even a Python signal handler between the
calls). The default environment is set first, which also switches off flush-to-zero and
denormals-are-zero a worker may have inherited (they would put −1e-40 into the bin above 0).

A self-test at first use multiplies values next to every edge of a few specs, subnormals of
both signs and values beyond the range, in float32 and float64, against exact floors. Where
it fails or the C library is missing (another OS, another CPU), :func:`available` is False
and the histogram kernels compare values with the edges instead (exact, ~10× slower).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import platform
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np
from torch import Tensor

_WORKER_PREFIX = "cockpit-hist"
MAX_WORKERS = 8
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()

# FE_DOWNWARD of <fenv.h> per CPU family (the rounding-control bits of MXCSR/x87, FPCR).
_FE_DOWNWARD = {"x86_64": 0x400, "amd64": 0x400, "i386": 0x400, "i686": 0x400,
                "aarch64": 0x800000, "arm64": 0x800000}
_FENV_BYTES = 512  # larger than fenv_t on every supported platform


_FORKED = False  # this process was forked from one that had imported Cockpit


def _forget_pool_in_child() -> None:
    """A forked process has none of its parent's threads, but a copy of the pool that looks
    idle: a task handed to it would never run (the child would hang). Nor can it use torch
    in new threads once the parent has set up torch's thread pool ("Invalid thread pool!"
    at the first parallel op): Cockpit then works in the calling thread alone."""
    global _POOL, _POOL_LOCK, _FORKED
    _POOL, _POOL_LOCK, _FORKED = None, threading.Lock(), True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def pool() -> ThreadPoolExecutor:
    """Cockpit's worker threads (shared by the histogram kernels)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix=_WORKER_PREFIX)
        return _POOL


def threads_usable() -> bool:
    """Whether Cockpit may work in its own threads (not in a forked process, see
    :func:`_forget_pool_in_child`)."""
    return not _FORKED


def in_worker() -> bool:
    return threading.current_thread().name.startswith(_WORKER_PREFIX)


def work_here() -> bool:
    """Whether work is done in the calling thread rather than handed to Cockpit's threads:
    it already is one of them, or a forked process cannot use them."""
    return in_worker() or not threads_usable()


class _Fenv:
    """fegetenv/fesetenv/fesetround of the C library, with the default environment."""

    def __init__(self):
        name = ctypes.util.find_library("m") or ctypes.util.find_library("c")
        downward = _FE_DOWNWARD.get(platform.machine().lower())
        if name is None or downward is None:
            raise OSError(f"no C math library or unknown CPU {platform.machine()!r}")
        lib = ctypes.PyDLL(name)  # keeps the GIL: no hand-over to other threads per call
        for fn in ("fegetenv", "fesetenv"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
            getattr(lib, fn).restype = ctypes.c_int
        lib.fesetround.argtypes = [ctypes.c_int]
        lib.fesetround.restype = ctypes.c_int
        if sys.platform.startswith("linux"):
            self.default = ctypes.c_void_p(-1)  # glibc and musl: FE_DFL_ENV = (fenv_t *) −1
        elif sys.platform == "darwin":
            self.default = ctypes.c_void_p(ctypes.addressof(
                ctypes.c_char.in_dll(lib, "_FE_DFL_ENV")))
        else:
            raise OSError(f"no default floating-point environment known for {sys.platform}")
        self.lib, self.downward = lib, downward

    def multiply_down(self, x: np.ndarray, s: float, out: np.ndarray, m: int = 0) -> None:
        saved = ctypes.create_string_buffer(_FENV_BYTES)
        lib = self.lib
        if lib.fegetenv(saved) != 0:
            raise OSError("fegetenv failed")
        try:
            if lib.fesetenv(self.default) != 0 or lib.fesetround(self.downward) != 0:
                raise OSError("could not set the rounding mode")
            with np.errstate(all="ignore"):  # overflow to ±max/−inf is handled by the caller
                np.multiply(x, x.dtype.type(s), out=out)
                if m:
                    np.add(out, out.dtype.type(m), out=out)
        finally:
            lib.fesetenv(saved)


def _self_test_values(dtype: np.dtype) -> tuple[np.ndarray, float]:
    """Values at and next to every edge j/25 of (−2, 2, 100), subnormals and zeros of both
    signs, values beyond the range; repeated so SIMD bodies and scalar tails both run."""
    edges = np.array([j / 25 for j in range(-60, 61)], dtype=dtype)
    near = [edges]
    for direction in (np.inf, -np.inf):
        e = edges
        for _ in range(3):
            e = np.nextafter(e, dtype.type(direction))
            near.append(e)
    tiny = np.finfo(dtype).smallest_subnormal
    special = np.array([tiny, -tiny, tiny * 1000, -tiny * 1000, 1e-30, -1e-30, 0.0, -0.0, 7.5,
                        -7.5], dtype=dtype)
    values = np.concatenate([*near, special])
    return np.concatenate([values, values[:-3], values[:5]]), 25.0


def _passes_self_test(fenv: _Fenv) -> bool:
    for dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        x, s = _self_test_values(dtype)
        out = np.empty_like(x)
        for m in (0, 50):
            fenv.multiply_down(x, s, out, m)
            want = [math.floor(Fraction(float(v)) * Fraction(s)) + m for v in x]
            if [math.floor(v) for v in out.tolist()] != want:
                return False
    # the mode was restored: round to nearest again (0.1·3 in float64 rounds up)
    return float(np.multiply(np.float64(0.1), np.float64(3.0))) == 0.30000000000000004


@functools.cache
def _fenv() -> _Fenv | None:
    def probe() -> _Fenv | None:
        try:
            fenv = _Fenv()
            return fenv if _passes_self_test(fenv) else None
        except (OSError, AttributeError, ValueError):
            return None

    fenv = probe() if in_worker() else pool().submit(probe).result()
    if fenv is None:
        warnings.warn("Cockpit: this platform gives no products rounded toward −∞ "
                      f"({sys.platform}, {platform.machine()}); histogram bins are found by "
                      "comparison with the edges (exact, about 10× slower)", stacklevel=3)
    return fenv


def available() -> bool:
    """Whether :func:`scale_down_` works here (checked once, by the self-test); never in a
    forked process, where Cockpit's threads are not used (the edges are searched instead)."""
    return threads_usable() and _fenv() is not None


def in_own_thread(fn, *args):
    """fn(*args) in a Cockpit worker thread: this one, or handed to one while this waits."""
    return fn(*args) if in_worker() else pool().submit(fn, *args).result()


def multiply_down(x: np.ndarray, s: float, out: np.ndarray, m: int = 0) -> np.ndarray:
    """out ← fl↓(fl↓(x·s) + m) elementwise (float32/float64, ``out`` may be ``x``; m an
    integer the dtype holds exactly), so ⌊out⌋ = ⌊x·s⌋ + m; requires :func:`available`.
    Runs in a Cockpit worker thread (this one, or handed to one)."""
    fenv = _fenv()
    if fenv is None:
        raise RuntimeError("products rounded toward −∞ are not available on this platform")
    if not in_worker():
        return pool().submit(multiply_down, x, s, out, m).result()
    fenv.multiply_down(x, s, out, m)
    return out


def scale_down_(x: Tensor, s: float, out: Tensor, m: int = 0) -> Tensor:
    """:func:`multiply_down` for CPU tensors."""
    multiply_down(x.detach().numpy(), s, out.detach().numpy(), m)
    return out
