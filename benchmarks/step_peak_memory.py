"""Peak allocated memory of one tracked step on the CPU, above what was allocated when the
step began, and what is live at that peak by the innermost Cockpit function that allocated
it — a predictor of a GPU's peak without a GPU.

The CPU allocator's events come from ``torch.profiler`` (``profile_memory``: every
allocation and free), the equivalent of ``torch.cuda.max_memory_allocated`` on the CPU.
``--path accelerator`` (the default) forces the accelerators' paths, as ``op_count.py``
does, so the scratch memory is the one a GPU would hold (3C3D business at |B| = 128:
2457 MiB here before the sums of squares stopped making float64 copies, +2.52 GiB on an
H200). The third step of SGD with momentum on the image problems of ``gpu_overhead.py``.

    python benchmarks/step_peak_memory.py                             # 3C3D business, |B| = 128
    python benchmarks/step_peak_memory.py --problem cifar100_allcnnc --config full --batch 16
    python benchmarks/step_peak_memory.py --config none               # the step without Cockpit
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from cockpit import Cockpit, configuration
from cockpit.engine.histograms import device as histogram_device

sys.path.insert(0, str(Path(__file__).parent))
from _common import allocations, cockpit_frame, peak_of
from gpu_overhead import PROBLEMS, make_problem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problem", default="cifar10_3c3d", choices=[*PROBLEMS, "resnet18_gn"])
    parser.add_argument("--config", default="business",
                        choices=["none", "economy", "business", "full"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--path", default="accelerator", choices=["accelerator", "cpu"])
    parser.add_argument("--top", type=int, default=8, help="allocation sites listed")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.path == "accelerator":
        histogram_device._forced = True
    make, shape, classes = make_problem(args.problem)
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    cockpit = (Cockpit(model, configuration(args.config), optimizer=opt)
               if args.config != "none" else None)
    x, y = torch.randn(args.batch, *shape), torch.randint(0, classes, (args.batch,))

    def step(i: int) -> None:
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(i, losses=losses) if cockpit is not None else torch.enable_grad():
            losses.mean().backward()
        opt.step()

    for i in range(2):
        step(i)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True, with_stack=True) as prof:
        step(2)
    if cockpit is not None:
        cockpit.close()
    events = allocations(prof)
    peak, at = peak_of(events)
    live: dict[int, tuple[int, object]] = {}
    for _, size, node in events[:at + 1]:
        ptr = node.extra_fields.ptr
        if size > 0:
            live[ptr] = (size, node)
        else:
            live.pop(ptr, None)
    sites: collections.Counter = collections.Counter()
    for size, node in live.values():
        sites[cockpit_frame(node)] += size
    where = cockpit_frame(events[at][2]) if at >= 0 else "–"
    print(f"{args.problem} {args.config}, |B| = {args.batch}, {args.path} path: the step's "
          f"peak {peak / 2**20:.0f} MiB above its start, at {where}")
    for site, size in sites.most_common(args.top):
        print(f"  {size / 2**20:9.1f} MiB  {site}")


if __name__ == "__main__":
    main()
