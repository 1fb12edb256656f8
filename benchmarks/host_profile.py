"""Where a tracked step spends the host's time: the step's Python functions (``cProfile``)
and its device calls (``torch.profiler``), on CUDA where present.

A tracked step on a GPU is bound by the host issuing kernels while the device idles; the
aten-op count (``op_count.py``) predicts the launches, this shows which of Cockpit's
functions take the host's time and how much device time a step holds. Models as in
``op_count.py`` (3C3D, a CIFAR-size ResNet-18 with GroupNorm, a small GPT-2 with AdamW).

    python benchmarks/host_profile.py                         # 3C3D economy, |B| = 128
    python benchmarks/host_profile.py --model resnet18_gn --config economy --top 30
    python benchmarks/host_profile.py --model gpt2_124m --batch 8   # bf16 autocast
    python benchmarks/host_profile.py --model gpt2_124m --batch 8 --device-only --steps 3
    python benchmarks/host_profile.py --device cpu --batch 8 --steps 2   # dry run
    python benchmarks/host_profile.py --device cpu --path accelerator  # as on a GPU
    python benchmarks/host_profile.py --model gpt2_124m --batch 2 --device cpu \
        --path accelerator --device-only --steps 1 --by-site  # a device's work, by site

``--path accelerator`` takes the accelerators' histogram path on any device (as
``op_count.py`` does); on the CPU its kernels (``bucketize``, ``histc``) are slow, so the
times there are no proxy for a GPU's host. ``--by-site`` adds the ops' own time by the
Cockpit function that issued them: on a CPU at a model's real size, where the arithmetic
and the memory traffic a GPU would do go (the CPU's own slow spots aside: reductions
over a block's rows, ``_chunk_cat``, the histograms' kernels).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import io
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from cockpit.engine.histograms import device as histogram_device

sys.path.insert(0, str(Path(__file__).parent))
from _common import cockpit_frame
from op_count import MODELS, gpt2_problem, make_step

# GPT-2 124M (the GPU baseline's language model, bf16 autocast on CUDA), T = 256
MODELS["gpt2_124m"] = functools.partial(gpt2_problem, vocab=50257, length=256, n_layer=12,
                                        n_embd=768, n_head=12, autocast=True)


# CUDA runtime calls counted per tracked step: launches, copies, waits for the device, and
# the allocator's own calls (a cudaMalloc or cudaFree in every step: transients of sizes the
# caching allocator does not hold; cudaFree also waits for the device)
RUNTIME_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemcpy",
                 "cudaMemsetAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                 "cudaEventSynchronize", "cudaStreamWaitEvent", "cudaMalloc", "cudaFree",
                 "cudaHostAlloc", "cudaFreeHost")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_time(step, device: str, first: int, steps: int) -> float:
    times = []
    for i in range(first, first + steps):
        _sync(device)
        start = time.perf_counter()
        step(i)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextlib.contextmanager
def backward_thread_profiled(profilers: list):
    """Profile the backward pass where autograd runs it on its own thread (CUDA): a second
    profiler enabled by a hook on that thread, disabled at the end of each backward pass.
    (Where ``cProfile`` sees every thread, as on Python 3.12, the second one cannot start and
    the first has the calls already.)"""
    main_thread = threading.get_ident()
    extra: list = []
    active = [False]

    def stop() -> None:
        extra[0].disable()
        active[0] = False

    def on_backward(grad: torch.Tensor) -> torch.Tensor:
        if threading.get_ident() != main_thread and not active[0]:
            if not extra:
                extra.append(cProfile.Profile())
            try:
                extra[0].enable()
            except ValueError:
                return grad
            active[0] = True
            torch.autograd.Variable._execution_engine.queue_callback(stop)
        return grad

    def watch(module, inputs, output) -> None:
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            output.register_hook(on_backward)

    handle = torch.nn.modules.module.register_module_forward_hook(watch)
    try:
        yield
    finally:
        handle.remove()
        profilers.extend(p for p in extra if p.getstats())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="3c3d", choices=list(MODELS))
    parser.add_argument("--config", default="economy", choices=["economy", "business", "full"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8, help="profiled tracked steps")
    parser.add_argument("--top", type=int, default=25, help="functions and ops listed")
    parser.add_argument("--device-only", action="store_true",
                        help="only torch.profiler's tables (no cProfile of the Python functions)")
    parser.add_argument("--path", default="auto", choices=["auto", "accelerator"],
                        help="accelerator: the accelerators' histogram path on any device")
    parser.add_argument("--by-site", action="store_true",
                        help="also the ops' own time by the Cockpit function that issued them")
    args = parser.parse_args()
    if args.path == "accelerator":
        histogram_device._forced = True

    plain, _ = make_step(args.model, None, args.batch, args.device)
    tracked, watcher = make_step(args.model, args.config, args.batch, args.device)
    for i in range(3):
        plain(i)
        tracked(i)
    t_plain = median_time(plain, args.device, 3, args.steps)
    t_tracked = median_time(tracked, args.device, 3, args.steps)
    print(f"{args.model} {args.config}, |B| = {args.batch}, {args.device}: tracked "
          f"{t_tracked * 1e3:.2f} ms, untracked {t_plain * 1e3:.2f} ms "
          f"({t_tracked / t_plain:.2f}×), medians of {args.steps}")

    first = 3 + args.steps
    if not args.device_only:
        python_functions(tracked, args, first)
    device_calls(tracked, args, first + args.steps)
    if args.by_site:
        ops_by_site(tracked, args, first + 2 * args.steps)
    if watcher is not None:
        watcher.close()


def python_functions(tracked, args, first: int) -> None:
    """The tracked steps' Python functions by own and by cumulative time."""
    profilers = [cProfile.Profile()]
    _sync(args.device)
    with backward_thread_profiled(profilers):
        profilers[0].enable()
        for i in range(first, first + args.steps):
            tracked(i)
        _sync(args.device)
        profilers[0].disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        stats = pstats.Stats(*profilers, stream=text)
        stats.sort_stats(key).print_stats(args.top)
        print(f"\n== Python functions by {key} over {args.steps} tracked steps "
              f"({len(profilers)} thread(s) profiled)")
        print(text.getvalue().replace(str(Path(__file__).parents[1]), ""))


def device_calls(tracked, args, first: int) -> None:
    """torch.profiler's ops by host time and, on CUDA, by device time, with the runtime's
    launches and synchronizations per step."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(first, first + args.steps):
            tracked(i)
        _sync(args.device)
    events = prof.key_averages()
    print(f"\n== torch.profiler over {args.steps} tracked steps, by self CPU time")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.device.startswith("cuda"):
        print("\n== by device time")
        print(events.table(sort_by="self_device_time_total", row_limit=args.top))
        calls = {e.key: (e.count, e.self_cpu_time_total) for e in events
                 if e.key in RUNTIME_CALLS}
        print("runtime calls per tracked step (count, host ms):",
              {k: (round(n / args.steps, 1), round(t / args.steps / 1e3, 3))
               for k, (n, t) in calls.items()})
        print(heaviest_kernel(events, args.steps))


def ops_by_site(tracked, args, first: int) -> None:
    """The aten ops' own host time (without the ops they call) by the innermost Cockpit
    function on their stack ("training" for the user's step). On a CPU at a model's real
    size the ops' time is their arithmetic and memory traffic: where a GPU's device time
    goes, by Cockpit's function, without a GPU."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                with_stack=True) as prof:
        for i in range(first, first + args.steps):
            tracked(i)
        _sync(args.device)
    sites: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()

    def walk(nodes) -> None:
        for node in nodes:
            if node.name.startswith("aten::"):
                own = node.duration_time_ns - sum(
                    c.duration_time_ns for c in node.children if c.name.startswith("aten::"))
                where = cockpit_frame(node)
                sites[where] += own
                ops[(where, node.name)] += own
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    per_step = 1e6 * args.steps
    print(f"\n== the ops' own time by Cockpit's function, ms per tracked step (all ops "
          f"{sum(sites.values()) / per_step:.1f}, the user's step "
          f"{sites['training'] / per_step:.1f})")
    for where, ns in sites.most_common(args.top):
        print(f"{ns / per_step:10.2f}  {where}")
    print("\n== by op and function")
    for (where, name), ns in ops.most_common(args.top):
        print(f"{ns / per_step:10.2f}  {name:32s} {where}")


def heaviest_kernel(events, steps: int) -> str:
    """One line on the kernel with the most device time: a kernel that takes milliseconds
    where the others take microseconds is a shape its library handles badly."""
    try:
        kernels = [e for e in events
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
                   and e.count]
        if not kernels:
            return "heaviest kernel: none recorded"
        total = sum(e.self_device_time_total for e in kernels)
        top = max(kernels, key=lambda e: e.self_device_time_total)
        return (f"heaviest kernel: {top.key[:90]} — {top.count / steps:.1f} a step, "
                f"{top.self_device_time_total / top.count / 1e3:.3f} ms each, "
                f"{100 * top.self_device_time_total / max(total, 1e-9):.0f} % of the "
                f"kernels' {total / steps / 1e3:.2f} ms a step")
    except Exception as error:  # (profiler fields differ between torch versions)
        return f"heaviest kernel: not read ({type(error).__name__}: {error})"


if __name__ == "__main__":
    main()
