"""A process using Cockpit with torch.distributed (gloo) exits cleanly right after Cockpit's
last reduction.

The abort this guards against (SIGABRT, "terminate called without an active exception"):
gloo's worker thread marks a collective done, wakes the caller, and drops its references to
the collective's tensors a moment later. While it holds them, a tensor holds its Python
object, and the gloo thread takes the GIL to let go of it (core dump: runLoop →
~AsyncAllreduceWork → TensorImpl::decref_pyobject → take_gil → pthread_exit →
std::terminate). If the interpreter is finalizing by then, CPython ≤ 3.13 ends the thread
with pthread_exit and the unwinding aborts the process in a ``noexcept`` destructor.
``cockpit.engine.reduction.ranks.all_reduce_sum`` keeps Cockpit's buffers until gloo has let
go of them (``settle`` waits for the rest at exit, before the interpreter finalizes).

The exit test makes the race nearly certain instead of rare (tests/exit_worker.py): all
threads of a process on one CPU, gloo's worker threads with the SCHED_IDLE policy (preempted
by the main thread they wake, before they drop the tensors) and a finalizer that sleeps
50 ms. Measured on the 2-core development machine (scripts/ddp_exit_stress.py,
benchmarks/RESULTS.md): with Cockpit's reductions as plain ``dist.all_reduce`` (before the
fix) 28 of 30 runs had an aborting process (51 of 60 processes); with the fix 0 of 26 (and
0 of 44 with two earlier versions of it). The old code passes the three
runs here with probability about (2/30)³ ≈ 3e-4.
"""

from __future__ import annotations

import sys
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

from cockpit.engine.reduction import ranks as distributed
from cockpit.engine.reduction.ranks import all_reduce_sum, settle
from tests.exit_worker import free_port, run_pair

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="the exit race is provoked with Linux scheduling policies"),
]


def test_no_reduction_buffer_is_freed_by_a_gloo_thread():
    """Every buffer of ``all_reduce_sum`` is freed in the calling thread (a finalizer records
    where), and :func:`settle` leaves none held. With a plain ``dist.all_reduce`` a gloo
    thread freed 158–421 of 2000 such tensors in a 1-process group on the development
    machine (the frees that abort a process if they come during interpreter shutdown)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    main = threading.get_ident()
    freed_in = []
    try:
        for i in range(2000):
            buffer = torch.full((100,), float(i), dtype=torch.float64)
            weakref.finalize(buffer, lambda: freed_in.append(threading.get_ident()))
            all_reduce_sum(buffer)
            assert torch.equal(buffer, torch.full((100,), float(i), dtype=torch.float64))
            del buffer
        assert settle()
        assert not distributed._held
    finally:
        dist.destroy_process_group()
    assert len(freed_in) == 2000
    elsewhere = sum(ident != main for ident in freed_in)
    assert elsewhere == 0, f"{elsewhere} of 2000 buffers were freed by another thread"


def test_processes_exit_cleanly_right_after_cockpits_last_reduction():
    for run in range(3):
        results = run_pair(["--last", "cockpit", "--pin", "--idle", "--linger", "0.05"])
        for rank, (code, err) in enumerate(results):
            assert code == 0, f"run {run}, rank {rank}: exit code {code}\n{err[-2000:]}"
