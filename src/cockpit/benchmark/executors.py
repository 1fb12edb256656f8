"""Where benchmark runs execute: in this process, in a local process pool, or on Ray.

An executor takes runs (:class:`~cockpit.benchmark.runner.RunSpec`) with a key and hands
back finished ones; the sweep keeps at most ``capacity`` runs in flight. Each run writes its
own result file, so no executor shares state with another run.

* ``serial``: one run at a time in this process (``workers=1``).
* ``pool``: a ``concurrent.futures.ProcessPoolExecutor`` of ``workers`` spawned processes;
  torch in each worker uses ``cpu_count // workers`` threads so workers do not oversubscribe
  the cores.
* ``ray``: one Ray task per run (``num_cpus=1`` each) on the cluster ``ray.init(address)``
  connects to — a local instance when no address is given, or an existing cluster
  (``address="auto"`` or ``ray://host:port``); Ray is an optional extra (``pip install
  'torch-cockpit[ray]'``). A Ray already initialised by the caller is used as it is.
"""

from __future__ import annotations

import os
from concurrent import futures
from typing import Any

from cockpit.benchmark.runner import RunSpec


def run_quietly(spec: RunSpec) -> dict[str, Any]:
    """Run ``spec`` without a progress bar (the worker entry point)."""
    from cockpit.benchmark.runner import run

    return run(spec, progress=False)


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(max(1, threads))


class SerialExecutor:
    """Runs one spec at a time in this process, at :meth:`wait`."""

    def __init__(self) -> None:
        self.capacity = 1
        self._pending: list[tuple[Any, RunSpec]] = []

    def submit(self, key: Any, spec: RunSpec) -> None:
        self._pending.append((key, spec))

    def wait(self) -> list[tuple[Any, dict | BaseException]]:
        key, spec = self._pending.pop(0)
        try:
            return [(key, run_quietly(spec))]
        except Exception as error:  # reported by the sweep, the other runs go on
            return [(key, error)]

    def close(self) -> None:
        self._pending.clear()


class PoolExecutor:
    """A local pool of ``workers`` spawned processes.

    If a worker process dies (killed, out of memory), the pool is replaced by a fresh one and
    each run that was in flight is retried once; a run that breaks the pool again is reported
    as failed.
    """

    def __init__(self, workers: int) -> None:
        import multiprocessing

        self.capacity = int(workers)
        threads = max(1, (os.cpu_count() or 1) // self.capacity)
        self._make = lambda: futures.ProcessPoolExecutor(
            max_workers=self.capacity, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker, initargs=(threads,),
        )
        self._pool = self._make()
        self._futures: dict[futures.Future, tuple[Any, RunSpec, int]] = {}

    def submit(self, key: Any, spec: RunSpec, retries: int = 1) -> None:
        self._futures[self._pool.submit(run_quietly, spec)] = (key, spec, retries)

    def wait(self) -> list[tuple[Any, dict | BaseException]]:
        out: list[tuple[Any, dict | BaseException]] = []
        while not out:
            done, _ = futures.wait(list(self._futures), return_when=futures.FIRST_COMPLETED)
            broken = []
            for future in done:
                key, spec, retries = self._futures.pop(future)
                error = future.exception()
                if isinstance(error, futures.process.BrokenProcessPool) and retries > 0:
                    broken.append((key, spec, retries - 1))
                else:
                    out.append((key, error if error is not None else future.result()))
            if broken:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._make()
                for key, spec, retries in broken:
                    self.submit(key, spec, retries)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class RayExecutor:
    """One Ray task per run on the cluster at ``address`` (local instance if None)."""

    def __init__(self, workers: int | None = None, address: str | None = None) -> None:
        try:
            import ray
        except ImportError as error:
            from cockpit._extras import missing_extra

            raise missing_extra(error, "ray", "ray", "--executor ray") from None
        self._ray = ray
        if not ray.is_initialized():
            path = os.environ.get("PYTHONPATH")
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": path}} if path else None)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.capacity = int(workers) if workers else max(1, cpus)
        self._remote = ray.remote(num_cpus=1)(_ray_run)
        self._refs: dict[Any, Any] = {}

    def submit(self, key: Any, spec: RunSpec) -> None:
        self._refs[self._remote.remote(spec)] = key

    def wait(self) -> list[tuple[Any, dict | BaseException]]:
        ready, _ = self._ray.wait(list(self._refs), num_returns=1)
        out = []
        for ref in ready:
            key = self._refs.pop(ref)
            try:
                out.append((key, self._ray.get(ref)))
            except Exception as error:
                out.append((key, error))
        return out

    def close(self) -> None:
        for ref in self._refs:
            self._ray.cancel(ref)
        self._refs.clear()


def _ray_run(spec: RunSpec) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    return run_quietly(spec)


def make_executor(kind: str = "pool", workers: int = 1, address: str | None = None):
    """``serial`` / ``pool`` (serial when ``workers`` is 1) / ``ray``."""
    if kind == "ray":
        return RayExecutor(workers if workers > 1 else None, address)
    if kind not in ("pool", "serial"):
        raise ValueError(f"unknown executor {kind!r}; choose pool, serial or ray")
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if kind == "serial" or workers == 1:
        return SerialExecutor()
    return PoolExecutor(workers)
