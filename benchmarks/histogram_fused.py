"""The accelerator path's 1-D histogram with the one-pass Triton kernel against its three
kernels (bucketize, add, histc), on CUDA: GradHist1d's default bins (100 on [−2, 2]) for
values crowded around zero (gradient elements), values spread over every bin, and the
products δ[n, i]·a[n, j] of a Linear layer's individual gradients (|B| = 128, 512 × 1152).
Both paths in one process (``COCKPIT_FUSED_HISTOGRAM`` toggled), CUDA-event medians; then
whole tracked economy steps (``--models``, as in ``host_profile.py``) with the kernel and
without, alternating in one process (the same Cockpit: only the histogram path differs).

    PYTHONPATH=src python benchmarks/histogram_fused.py [--repeats 20] [--pairs 15] [--sweep]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.histograms import fused
from cockpit.engine.histograms.exact import BinSpec, histogram_dense, histogram_outer

SPEC = BinSpec(-2.0, 2.0, 100)


def cuda_ms(fn, repeats: int) -> float:
    fn()
    if not torch.cuda.is_available():  # a dry run in Triton's interpreter
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def steps_with_and_without(model: str, batch: int, pairs: int) -> dict[str, float]:
    """Median tracked-step times (ms) with the kernel ("1") and without ("0"), alternating."""
    from host_profile import make_step

    step, watcher = make_step(model, "economy", batch, "cuda")
    for i in range(4):
        os.environ["COCKPIT_FUSED_HISTOGRAM"] = str(i % 2)
        step(i)
    times: dict[str, list[float]] = {"0": [], "1": []}
    for i in range(pairs):
        for k, flag in enumerate(("0", "1") if i % 2 == 0 else ("1", "0")):
            os.environ["COCKPIT_FUSED_HISTOGRAM"] = flag
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(4 + 2 * i + k)
            torch.cuda.synchronize()
            times[flag].append(1e3 * (time.perf_counter() - start))
    watcher.close()
    return {flag: statistics.median(t) for flag, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--sweep", action="store_true",
                        help="also the binary search and other launch shapes")
    parser.add_argument("--models", nargs="*", default=["3c3d:128", "resnet18_gn:128",
                                                         "gpt2_124m:8"],
                        help="model:batch pairs for whole tracked steps")
    args = parser.parse_args()
    dry = not torch.cuda.is_available()
    if dry and os.environ.get("TRITON_INTERPRET") != "1":
        print("needs CUDA (or TRITON_INTERPRET=1 for a dry run on tiny sizes)")
        return
    device = "cpu" if dry else "cuda"
    if dry:  # the accelerator path on the CPU, every block through the kernel
        fused.MIN_VALUES, args.models, histogram_device._forced = 1, [], True
    generator = torch.Generator(device=device).manual_seed(0)
    n = 2**12 if dry else 2**25
    delta = torch.randn(8 if dry else 128, 512, device=device, generator=generator) * 1e-2
    a = torch.randn(8 if dry else 128, 1152, device=device, generator=generator)
    cases = {
        "2^25 values crowded at 0": (histogram_dense,
                                     (torch.randn(n, device=device, generator=generator)
                                      * 1e-4,)),
        "2^25 values over every bin": (histogram_dense,
                                       (torch.rand(n, device=device, generator=generator)
                                        * 4 - 2,)),
        "products 128×512×1152": (histogram_outer, (delta, a)),
    }
    print(f"{'dry run' if dry else torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"kernel available: {fused.available(delta, fused.MIN_VALUES)}")
    variants = {"3 kernels": {}, "fused": {}, **({
        "binary search": {"MAX_UNIFORM_BINS": 0},
        "B 4096, 8 warps": {"BLOCK": 4096, "NUM_WARPS": 8},
        "64 per lane": {"PROGRAMS_PER_LANE": 64},
        "B 2048, 32 per lane": {"BLOCK": 2048, "PROGRAMS_PER_LANE": 32},
    } if args.sweep else {})}
    print("ms per call (speed-up over 3 kernels; = counts equal to the 3 kernels'):")
    print(f"{'case':28s}" + "".join(f" {v:>22s}" for v in variants))
    defaults = {k: getattr(fused, k) for k in ("MAX_UNIFORM_BINS", "BLOCK", "NUM_WARPS",
                                               "PROGRAMS_PER_LANE")}
    for name, (fn, inputs) in cases.items():
        cells, reference, base = [], None, None
        for variant, settings in variants.items():
            os.environ["COCKPIT_FUSED_HISTOGRAM"] = "0" if variant == "3 kernels" else "1"
            for key, value in {**defaults, **settings}.items():
                setattr(fused, key, value)
            result = [torch.as_tensor(r).cpu() for r in fn(*inputs, SPEC)]
            ms = cuda_ms(functools.partial(fn, *inputs, SPEC), args.repeats)
            if reference is None:
                reference, base = result, ms
            equal = all(torch.equal(p, q) for p, q in zip(reference, result, strict=True))
            cells.append(f"{ms:.3f} ({base / ms:.2f}×){'=' if equal else '≠'}")
        for key, value in defaults.items():
            setattr(fused, key, value)
        print(f"{name:28s}" + "".join(f" {c:>22s}" for c in cells))
    print(f"\n{'tracked economy step':30s} {'3 kernels ms':>13s} {'fused ms':>9s} "
          f"{'speed-up':>9s}")
    for spec in args.models:
        model, batch = spec.split(":")
        ms = steps_with_and_without(model, int(batch), args.pairs)
        print(f"{spec:30s} {ms['0']:13.2f} {ms['1']:9.2f} {ms['0'] / ms['1']:8.2f}×")


if __name__ == "__main__":
    main()
