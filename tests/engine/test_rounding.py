"""Products rounded toward −∞ (cockpit.engine.histograms.rounding): exact floors against Fraction,
only in Cockpit's worker threads, the caller's rounding mode untouched, flush-to-zero inherited by a
worker switched off, and a clear fallback where the platform has no directed rounding."""

from __future__ import annotations

import ctypes
import math
import multiprocessing as mp
import threading
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch

from cockpit.engine.histograms import exact as hmod
from cockpit.engine.histograms import rounding
from cockpit.engine.histograms.exact import (
    BinSpec,
    histogram2d_dense,
    histogram_dense,
    histogram_outer,
)
from cockpit.engine.histograms.outer2d import histogram2d_outer
from tests.reference import bin_indices

pytestmark = pytest.mark.skipif(not rounding.available(), reason="no directed rounding here")


def fegetround() -> int:
    return rounding._fenv().lib.fegetround()


@pytest.mark.parametrize("m", [0, 50, -7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("s", [25.0, 20.0, 12.5, 1.75, 3.0])
def test_floor_of_the_product_is_exact(dtype, s, m):
    """⌊fl↓(fl↓(x·s) + m)⌋ = ⌊x·s⌋ + m for values at, just below and just above x·s = j."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4099, generator=gen, dtype=torch.float64).to(dtype)
    edges = torch.tensor([j / s for j in range(-60, 61)], dtype=dtype)
    x = torch.cat([x, edges, torch.nextafter(edges, torch.full_like(edges, math.inf)),
                   torch.nextafter(edges, torch.full_like(edges, -math.inf)),
                   torch.tensor([-1e-44, 1e-44, -0.0, 0.0], dtype=dtype)])
    y = rounding.scale_down_(x, s, torch.empty_like(x), m)
    want = [math.floor(Fraction(v) * Fraction(s)) + m for v in x.tolist()]
    assert [math.floor(v) for v in y.tolist()] == want
    # round to nearest is off by one somewhere on these values (the test can fail)
    assert [math.floor(v) for v in (x * s + m).tolist()] != want


@pytest.mark.cpu_path
def test_only_worker_threads_change_the_rounding_mode(monkeypatch):
    """Called from this (the user's) thread, every product is formed in a worker thread;
    this thread's mode stays round-to-nearest and the worker's is restored."""
    seen = []
    multiply = rounding._Fenv.multiply_down

    def recording(self, x, s, out, m=0):
        multiply(self, x, s, out, m)
        seen.append((threading.current_thread().name, self.lib.fegetround()))

    monkeypatch.setattr(rounding._Fenv, "multiply_down", recording)
    monkeypatch.setattr(hmod, "_CPU_CHUNK", 4096)
    before = fegetround()
    gen = torch.Generator().manual_seed(1)
    spec = BinSpec()
    g = torch.randn(4, 5000, generator=gen)
    histogram_dense(g, spec)
    spec.bin_index(g)
    histogram2d_dense(g, torch.randn(5000, generator=gen), BinSpec(-1.0, 1.0, 40), spec)
    delta, a = torch.randn(8, 300, generator=gen), torch.randn(8, 400, generator=gen)
    histogram_outer(delta, a, spec)
    histogram2d_outer(delta, a, torch.randn(300, 400, generator=gen), BinSpec(-1, 1, 40), spec)
    assert len(seen) > 5
    assert all(name.startswith("cockpit-hist") for name, _ in seen)
    assert {mode for _, mode in seen} == {before}  # restored after every product
    assert fegetround() == before == 0


def test_a_worker_with_flush_to_zero_still_keeps_the_sign_of_subnormals():
    """A worker thread may inherit flush-to-zero/denormals-are-zero (torch.set_flush_denormal
    in the thread that started it): −1e-40 would then count as 0, in the bin above zero."""
    result = {}

    x = np.array([-1e-40, 1e-40, -3e-39], dtype=np.float32)  # made before flushing
    assert (x != 0).all()

    def worker():
        if not torch.set_flush_denormal(True):
            result["skip"] = True
            return
        try:
            result["plain"] = np.multiply(x, np.float32(25.0))
            result["down"] = rounding.scale_down_(torch.from_numpy(x), 25.0, torch.empty(3))
        finally:
            torch.set_flush_denormal(False)

    thread = threading.Thread(target=worker, name="cockpit-hist-test")
    thread.start()
    thread.join()
    if result.get("skip"):
        pytest.skip("this CPU has no flush-denormal mode")
    # read here: converting a subnormal in the flushing thread would flush it again
    assert result["plain"].tolist() == [0.0, 0.0, 0.0]  # flushed: the reset is needed
    down = result["down"].tolist()
    assert down[0] < 0 < down[1] and down[2] < 0
    assert math.floor(down[0]) == -1 and math.floor(down[1]) == 0


def test_overflow_stays_quiet_and_clamps():
    big = torch.tensor([3e38, -3e38, 1e38], dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = rounding.scale_down_(big, 25.0, torch.empty_like(big))
        counts, bad = histogram_dense(big, BinSpec())
    assert y[0] == torch.finfo(torch.float32).max and y[1] == -math.inf
    assert counts[0] == 1 and counts[-1] == 2 and bad == 0


def test_a_platform_without_directed_rounding_warns_once_and_stays_exact(monkeypatch):
    def unavailable():
        raise OSError("no fenv here")

    monkeypatch.setattr(rounding, "_Fenv", unavailable)
    rounding._fenv.cache_clear()
    try:
        with pytest.warns(UserWarning, match="comparison with the edges"):
            assert not rounding.available()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once
            assert not rounding.available()
            spec = BinSpec()
            edges = torch.tensor([j / 25 for j in range(-49, 50)], dtype=torch.float32)
            x = torch.cat([edges, torch.nextafter(edges, torch.full_like(edges, -1.0)),
                           torch.randn(10_000, generator=torch.Generator().manual_seed(2))])
            want = torch.bincount(bin_indices(x, spec.lo, spec.hi, spec.bins), minlength=100)
            assert torch.equal(histogram_dense(x, spec)[0], want)
        with pytest.raises(RuntimeError, match="not available"):
            rounding.scale_down_(x, 25.0, x.clone())
    finally:
        monkeypatch.undo()
        rounding._fenv.cache_clear()
    assert rounding.available()


def test_fenv_buffer_holds_the_c_library_environment():
    """fegetenv writes fenv_t into a buffer of _FENV_BYTES: far larger than the type."""
    lib = rounding._fenv().lib
    buffer = ctypes.create_string_buffer(rounding._FENV_BYTES)
    assert lib.fegetenv(buffer) == 0
    assert buffer.raw[64:] == bytes(rounding._FENV_BYTES - 64)  # fenv_t ≤ 64 bytes here


def _histogram_in_child(x, queue):
    # as in every forked torch process (DataLoader workers do it): OpenMP's threads do not
    # survive a fork, and a parallel op would wait for them for ever, with or without Cockpit
    torch.set_num_threads(1)
    queue.put(histogram_dense(x, BinSpec())[0].tolist())


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="no fork here")
def test_a_forked_child_bins_with_its_own_threads():
    """After the parent used the worker pool, a forked child (Lightning's ddp_fork, a
    notebook launcher) gets a copy of a pool whose threads do not exist: a task handed to it
    never ran and the child hung; and torch ops in new threads of the child fail once the
    parent set up torch's thread pool ("Invalid thread pool!"). The child now bins in the
    calling thread, exactly (edges searched)."""
    torch.set_num_threads(torch.get_num_threads())  # sets up torch's thread pool here
    x = torch.randn(3 * 2**19 + 5, generator=torch.Generator().manual_seed(3))
    want = histogram_dense(x, BinSpec())[0]  # the parent's pool is running
    assert torch.equal(want, torch.bincount(bin_indices(x, -2.0, 2.0, 100), minlength=100))
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_histogram_in_child, args=(x, queue))
    child.start()
    try:
        got = queue.get(timeout=60)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert got == want.tolist()
