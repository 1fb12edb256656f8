"""Cockpit's Triton kernels compiled for the GPUs, without one: every launch that a set of
workloads makes under Triton's interpreter on the CPU (where the tests check the kernels'
values) is compiled by Triton's own compiler, with the launch's arguments and
specialization, for NVIDIA targets (sm_90: H100/H200, sm_80: A100, sm_100: B200; any other
with ``--targets``), and ptxas reports each compiled kernel's registers per thread and
spilled bytes, and the PTX its loads from global memory (how many of them are vectors).

    python benchmarks/triton_kernels.py                       # sm_90, sm_80, sm_100
    python benchmarks/triton_kernels.py --targets 90 --check  # exit 1 on a failed compile or spill
    python benchmarks/triton_kernels.py --launch-cost         # also the launcher's Python

The interpreter runs the kernels' Python with numpy and accepts code that Triton's compiler
refuses (a type it cannot cast, an op it does not lower); such a kernel would fail at its
first launch on a GPU and give way to PyTorch's ops for the rest of the process. Compiling
here finds that before a GPU does. Spills (registers written to local memory) are a
kernel's slow path on the GPU. The workloads: each kernel's entry points in every dtype and
mode the callers use, and tracked steps of a small model (economy with ParamNorm and
GradHist2d, AdamW, 34 parameter tensors; six Linear layers of one shape under bfloat16
autocast) with every kernel's size threshold lowered.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Launch:
    """One distinct launch of a kernel, as its specialization sees the arguments: a tensor
    by its dtype and its address modulo 16 (alignment), Triton's dtypes by name, other
    values as they are."""

    module: str  # the module whose ``_kernel()`` builds the kernel
    kernel: str
    args: tuple
    kwargs: tuple
    grid: tuple = field(default=(1,), compare=False)


@dataclass(frozen=True)
class TensorArg:
    dtype: torch.dtype
    misalignment: int  # bytes past a 16-byte boundary

    def make(self) -> torch.Tensor:
        """A tensor of this dtype at this alignment (what the specialization reads)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        base = torch.empty(64, dtype=self.dtype)
        offset = (-base.data_ptr() % 16 + self.misalignment) // size
        return base[offset:]


@dataclass(frozen=True)
class TritonDtype:
    name: str


def _described(value):
    if isinstance(value, torch.Tensor):
        return TensorArg(value.dtype, value.data_ptr() % 16)
    if type(value).__module__.startswith("triton.language") and hasattr(value, "name"):
        return TritonDtype(value.name)
    return value


def _made(value):
    import triton.language as tl

    if isinstance(value, TensorArg):
        return value.make()
    if isinstance(value, TritonDtype):
        return tl.dtype(value.name)
    return value


def record_launches(path: Path) -> None:
    """Run the workloads under the interpreter (in this process: ``TRITON_INTERPRET=1`` set
    before Triton was imported) and pickle every distinct launch to ``path``."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: dict[Launch, None] = {}
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        launch = Launch(self.fn.__module__, self.fn.__name__, tuple(map(_described, args)),
                        tuple(sorted((k, _described(v)) for k, v in kwargs.items())),
                        tuple(grid) if isinstance(grid, (tuple, list)) else (grid,))
        launches.setdefault(launch, None)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    try:
        entry_points()
        tracked_steps()
    finally:
        InterpretedFunction.run = run
    path.write_bytes(pickle.dumps(list(launches)))


def recorded_launches() -> list[Launch]:
    """The workloads' distinct launches, recorded by this script in a process of its own
    under the interpreter (whose patches of ``triton.language`` would break compiling)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "launches.pickle"
        env = {**os.environ, "TRITON_INTERPRET": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                              os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, __file__, "--record", str(path)], env=env, check=True)
        with path.open("rb") as file:
            return _Unpickler(file).load()


class _Unpickler(pickle.Unpickler):
    """The recording process ran this script as ``__main__``: its classes are this module's
    (also where it is imported)."""

    def find_class(self, module: str, name: str):
        return globals()[name] if module == "__main__" else super().find_class(module, name)


def _jit(module: str):
    """The module's compiling ``JITFunction`` (``_kernel()`` returns it, or it first)."""
    kernel = importlib.import_module(module)._kernel()
    return kernel[0] if isinstance(kernel, tuple) else kernel


def _options(kwargs: dict) -> dict:
    """The launch's keyword arguments with the options ``JITFunction.run`` adds."""
    from triton import knobs

    return {**kwargs, "debug": kwargs.get("debug", False),
            "instrumentation_mode": knobs.compilation.instrumentation_mode}


def compile_launch(launch: Launch, capability: int):
    """The launch compiled for ``sm_<capability>`` as ``JITFunction.run`` compiles it on a
    GPU of that kind (the same signature, constants, alignment attributes and options)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    jit = _jit(launch.module)
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    args = [_made(a) for a in launch.args]
    kwargs = _options({k: _made(v) for k, v in launch.kwargs})
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound,
                                                           specialization, options)
    return compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                   options=options.__dict__)


def constants(launch: Launch) -> str:
    """The launch's tensors' dtypes and compile-time arguments, for the table."""
    tensors = "/".join(str(a.dtype).removeprefix("torch.") for a in launch.args
                       if isinstance(a, TensorArg))
    return ", ".join([f"tensors {tensors}"] + [
        f"{k}={v.name if isinstance(v, TritonDtype) else v}" for k, v in launch.kwargs])


class _NoLaunchDriver:
    """A driver for an sm_90 GPU that is not there: Triton's launcher runs its Python
    (binding, specialization key, cache) and launches nothing."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def launch_cost(launches: list[Launch], repeats: int = 2000) -> dict[str, float]:
    """µs of Python a launch of each kernel (its first recorded launch) takes in Triton's
    launcher, ``JITFunction.run`` (argument binding, specialization key, kernel cache),
    with a driver that launches nothing; a GPU's host adds the driver's calls and the C
    launch. Beside it, for scale: ``torch.add`` of two 4-number CPU tensors (aten's
    dispatch)."""
    import triton.compiler.compiler as compiler
    from triton.runtime.driver import driver

    def no_handles(self) -> None:
        self.module, self.function, self.n_regs, self.n_spills = 0, 0, 0, 0
        self.n_max_threads, self._run = 1024, lambda *args: None

    def best(fn) -> float:
        fn()  # (compiled, cached)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            times.append((time.perf_counter() - start) / repeats * 1e6)
        return min(times)

    saved, active = compiler.CompiledKernel._init_handles, driver._active
    driver.set_active(_NoLaunchDriver())
    compiler.CompiledKernel._init_handles = no_handles
    try:
        out = {}
        for launch in launches:
            if launch.kernel in out:
                continue
            launcher = _jit(launch.module)[launch.grid]
            args = [_made(a) for a in launch.args]
            kwargs = {k: _made(v) for k, v in launch.kwargs}
            out[launch.kernel] = best(functools.partial(launcher, *args, **kwargs))
        a = torch.randn(4)
        out["torch.add (CPU)"] = best(lambda: torch.add(a, a))
        return out
    finally:
        compiler.CompiledKernel._init_handles = saved
        driver._active = active  # (no GPU here: the default driver cannot be made)


_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_report(compiled, capability: int) -> tuple[int, int]:
    """Registers per thread and spilled bytes (stores and loads) of the compiled kernel, by
    ptxas -v on its PTX (the ptxas Triton ships)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(compiled.asm["ptx"])
        log = subprocess.run(
            [get_ptxas(capability).path, "-v",
             f"--gpu-name={sm_arch_from_capability(capability)}", str(source),
             "-o", str(Path(folder) / "kernel.cubin")],
            capture_output=True, text=True, check=True).stderr
    registers, spills = _REGISTERS.search(log), _SPILLS.search(log)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas said nothing of registers and spills: {log[:300]}")
    return int(registers.group(1)), int(spills.group(1)) + int(spills.group(2))


_LOADS = re.compile(r"\bld\.global(\.\w+)*")


def global_loads(compiled) -> tuple[int, int]:
    """The kernel's loads from global memory in its PTX: how many load vectors (``.v2``,
    ``.v4``: 8 or 16 bytes a lane at once, where the compiler knows the addresses aligned and
    the mask constant over them), and all of them."""
    loads = [m.group(0) for m in _LOADS.finditer(compiled.asm["ptx"])]
    return sum(".v" in load for load in loads), len(loads)


# ------------------------------------------------------------------ workloads


def entry_points() -> None:
    """Each kernel's entry points in every dtype and mode its callers use."""
    from cockpit.engine import row_dots, tensor_sums
    from cockpit.engine.histograms import device, fused

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xs = [torch.randn(37 + i, generator=gen).to(dtype) for i in range(32)]
        ys = [torch.randn(37 + i, generator=gen).to(dtype) for i in range(32)]
        assert tensor_sums.available(xs, ys), dtype
        tensor_sums.sq_norms(xs)
        tensor_sums.sq_norms_of_differences(xs, ys)
        tensor_sums.sq_norms_of_differences(xs, ys, torch.tensor(0.5))
        tensor_sums.pair_sums(xs, ys)
        # views one element past a 16-byte address: the kernel without the alignment
        shifted = [torch.cat([x[:1], x]).narrow(0, 1, x.numel()) for x in xs]
        tensor_sums.sq_norms(shifted)
        tensor_sums.sq_norms_of_differences(shifted, ys, torch.tensor(0.5))
        tensor_sums.pair_sums(shifted, ys)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for bins in (21, 100):
            thresholds = torch.linspace(-1, 1, bins + 1, dtype=torch.float64)[1:-1].to(dtype)
            edges = device.search_edges(thresholds)
            x = torch.randn(3000, generator=gen, dtype=torch.float64).to(dtype)
            lanes = device.lanes(edges.numel() + 1)
            fused.tally_values(x, edges, lanes)
            fused.tally_values(x, edges, lanes, uniform=(-1.0, 1.0))
            fused.tally_rows(x.reshape(3, -1), edges, lanes)
    for k in (1, 2, 3, 4, row_dots.MAX_DIRECTIONS):
        rows = torch.randn(2, 5, 300, generator=gen)
        row_dots.row_dots(rows, torch.randn(2, k, 300, generator=gen))
    row_dots.sample_dots(torch.randn(6, 3000, generator=gen), torch.randn(3000, generator=gen))


def tracked_steps() -> None:
    """Tracked steps on the accelerators' path with every kernel's threshold lowered."""
    from torch import nn

    from cockpit import Cockpit, configuration, quantities
    from cockpit.engine import row_dots
    from cockpit.engine.histograms import device, fused

    device._forced = True
    fused.MIN_VALUES = 1
    row_dots.MIN_VALUES = 1
    torch.manual_seed(0)
    for shapes, autocast in (([8] * 17, False), ([16] * 7, True)):
        layers = [m for a, b in itertools.pairwise(shapes) for m in (nn.Linear(a, b), nn.Tanh())]
        model = nn.Sequential(*layers, nn.Linear(shapes[-1], 3))
        x, y = torch.randn(10, shapes[0]), torch.randint(0, 3, (10,))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = [*configuration("economy"), quantities.ParamNorm(), quantities.GradHist2d()]
        cockpit = Cockpit(model, config, optimizer=opt, strict=True)
        for step in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                losses = nn.functional.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", type=int, nargs="+", default=[90, 80, 100],
                        help="compute capabilities (90: H100/H200, 80: A100, 100: B200)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 where a launch fails to compile or its kernel spills")
    parser.add_argument("--launch-cost", action="store_true",
                        help="also the µs of Python of a launch in Triton's launcher")
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record is not None:
        record_launches(args.record)
        return 0
    os.environ.pop("TRITON_INTERPRET", None)  # (compiling needs Triton uninterpreted)
    start = time.perf_counter()
    launches = recorded_launches()
    print(f"{len(launches)} distinct launches recorded in {time.perf_counter() - start:.1f} s "
          "(Triton's interpreter on this CPU)")
    failed = spilling = 0
    print(f"{'kernel':7s} {'target':6s} {'regs':>4s} {'spilled':>7s} {'wide':>4s} {'loads':>5s} "
          f"{'s':>4s}  constants")
    for launch in launches:
        for capability in args.targets:
            start = time.perf_counter()
            try:
                compiled = compile_launch(launch, capability)
                registers, spilled = ptxas_report(compiled, capability)
            except Exception as error:
                failed += 1
                print(f"{launch.kernel:7s} sm_{capability:<3d} FAILED ({constants(launch)}): "
                      f"{type(error).__name__}: {str(error)[:800]}")
                continue
            spilling += spilled > 0
            wide, loads = global_loads(compiled)
            print(f"{launch.kernel:7s} sm_{capability:<3d} {registers:4d} {spilled:7d} {wide:4d} "
                  f"{loads:5d} {time.perf_counter() - start:4.1f}  {constants(launch)}")
    kernels = sorted({f"{launch.kernel} ({launch.module})" for launch in launches})
    print(f"kernels: {'; '.join(kernels)}")
    print(f"compiled: {len(launches) * len(args.targets) - failed}, failed: {failed}, "
          f"spilling: {spilling}")
    if args.launch_cost:
        costs = launch_cost(launches)
        print("Python of a launch (µs, a driver that launches nothing): "
              + ", ".join(f"{kernel} {cost:.1f}" for kernel, cost in costs.items()))
    return 1 if args.check and (failed or spilling) else 0


if __name__ == "__main__":
    sys.exit(main())
