"""One process of a 2-process gloo run that ends right after its last collective, started (with
:func:`run_pair`) by tests/engine/test_distributed_exit.py and scripts/ddp_exit_stress.py:

    python -m tests.exit_worker RANK PORT [--last cockpit|tensor|ddp] [--pin] [--idle]
                                          [--linger SECONDS] [--unsafe-release]
                                          [--exit return|destroy|orderly]

It trains a small MLP with DistributedDataParallel for a few steps and leaves. ``--last``
chooses the last collective: Cockpit's reduction at the end of the last tracked step
(``cockpit``), a ``dist.all_reduce`` of a tensor dropped at once without Cockpit (``tensor``),
or DDP's own gradient all-reduce (``ddp``).

The levers make the exit race of gloo's worker thread (see
``cockpit.engine.reduction.ranks.all_reduce_sum``) happen on purpose instead of by chance under
load: ``--pin`` puts all threads of rank r on one CPU, ``--idle`` gives gloo's worker threads
the SCHED_IDLE policy, so a gloo thread that has just woken the main thread is preempted
before it drops its references to the collective's tensors and runs again only when the
main thread blocks; ``--linger`` makes interpreter finalization block (an object whose
``__del__`` sleeps), as a slow finalizer would. ``--unsafe-release`` runs Cockpit's
reductions with a plain ``dist.all_reduce`` (Cockpit before the fix).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def gloo_worker_threads() -> list[int]:
    """Thread ids of gloo's worker threads ("pt_gloo_runloop") of this process."""
    time.sleep(0.1)  # the threads name themselves after they started
    tids = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as file:
            if file.read().startswith("pt_gloo"):
                tids.append(int(tid))
    return tids


class Linger:
    """Freed during interpreter finalization; its sleep releases the GIL and the CPU."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __del__(self):
        time.sleep(self.seconds)


def run(rank: int, port: int, options: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(options.threads)
    if options.pin:  # gloo's threads, started below, inherit the CPU
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    if options.idle:
        for tid in gloo_worker_threads():
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    torch.manual_seed(0)
    width = options.width
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                              torch.nn.Linear(width, 5))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    cockpit = None
    if options.last == "cockpit":
        import cockpit.engine.reduction.ranks as reduction
        from cockpit import Cockpit, quantities

        if options.unsafe_release:
            reduction.all_reduce_sum = dist.all_reduce
        instruments = [quantities.GradNorm(), quantities.NormTest(), quantities.GradHist1d(),
                       quantities.Alpha()]
        if options.threads > 1:  # its θ bins are a background job of the thread pool
            instruments.append(quantities.GradHist2d())
        cockpit = Cockpit(model, instruments, optimizer=opt)
    for step in range(options.steps):
        x = torch.randn(16, width, generator=generator)
        y = torch.randint(0, 5, (16,), generator=generator)
        opt.zero_grad()
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        if cockpit is not None:
            with cockpit(step, losses=losses):
                losses.mean().backward()
        else:
            losses.mean().backward()
        opt.step()
    if cockpit is not None:
        cockpit.close()
        if options.threads > 1:
            from cockpit.engine.histograms import exact as histogram

            print(f"rank {rank}: Cockpit's histogram thread pool "
                  f"{'ran' if histogram._POOL is not None else 'was not used'}",
                  file=sys.stderr, flush=True)
    if options.last == "tensor":
        dist.all_reduce(torch.zeros(4096))  # its only Python reference is dropped at once
    if options.linger:
        global _LINGER
        _LINGER = Linger(options.linger)
    if options.exit == "orderly":
        leave_process_group()
    elif options.exit == "destroy":
        dist.destroy_process_group()


def leave_process_group() -> None:
    """The end of a test process: a barrier (every rank is done communicating), then the
    process exits at once with ``os._exit(0)``, without interpreter finalization.

    Why not a normal exit: gloo's worker threads may still hold references of the last
    collectives (DDP's gradient all-reduce holds a Python object of the backward pass); one
    of them releasing it while the interpreter finalizes aborts the process (see the module
    docstring). Measured with ``--last ddp --pin`` (no Cockpit): 7 of 20 runs aborted
    leaving normally, 6 of 20 after ``destroy_process_group`` (a DistributedDataParallel
    model keeps the process group and gloo's threads alive even after it was deleted and
    collected), 10 of 20 after a barrier and ``destroy_process_group`` (the barrier itself
    holds the unfinished all-reduce and releases it in a gloo thread); the barrier followed
    by ``os._exit`` leaves no finalization to race with. Only for processes whose results are
    written and closed: ``os._exit`` skips ``atexit`` handlers.
    """
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(worker_args: list[str], cwd: Path | None = None, cores: bool = False,
             timeout: float = 120.0) -> list[tuple[int, str]]:
    """Start both ranks (fresh processes) with ``worker_args`` and wait for them:
    [(exit code, stderr)] in rank order. ``cores``: aborting processes dump core (in
    ``cwd``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])

    def allow_cores():
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY,) * 2)

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "tests.exit_worker", str(r), port,
                               *worker_args], env=env, cwd=cwd or ROOT,
                              stderr=subprocess.PIPE, text=True,
                              preexec_fn=allow_cores if cores else None)
             for r in range(2)]
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        results.append((proc.returncode, err))
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--last", choices=["cockpit", "tensor", "ddp"], default="cockpit")
    p.add_argument("--exit", choices=["return", "destroy", "orderly"], default="return",
                   help="leave without destroy_process_group, with it, or with "
                        "leave_process_group() (barrier, os._exit)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; with more than one, GradHist2d joins the instruments "
                        "and Cockpit's histograms use its thread pool")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--pin", action="store_true")
    p.add_argument("--idle", action="store_true")
    p.add_argument("--linger", type=float, default=0.0)
    p.add_argument("--unsafe-release", action="store_true")
    return p


if __name__ == "__main__":
    run(int(sys.argv[1]), int(sys.argv[2]), parser().parse_args(sys.argv[3:]))
