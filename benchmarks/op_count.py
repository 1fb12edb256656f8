"""The aten ops of one tracked step, counted on the CPU, and where in Cockpit they come from
(3C3D, or with ``--model resnet18_gn`` a CIFAR-size ResNet-18 with GroupNorm).

On a GPU every aten op is a kernel launch (or host work), and a tracked step is bound by the
host issuing them; the count predicts it without a GPU. The third step of SGD with momentum
(|B| = 128 by default) runs under a ``TorchDispatchMode``: the ops of the tracked step, of the
same step without Cockpit, and each Cockpit function's share (the innermost frame in the
package that issued the op; "the user's loop" is the model, the loss and the optimizer).
``--path accelerator`` forces the accelerator paths on the CPU (histograms, batched curvature
backpropagations), as on a GPU.

    python benchmarks/op_count.py                                   # economy, accelerator path
    python benchmarks/op_count.py --config business --path cpu --top 30
    python benchmarks/op_count.py --model resnet18_gn --batch 32   # 62 parameter tensors

It also counts the Python calls of the tracked step (``sys.setprofile``, without the op
counter): Cockpit's own functions, other Python code (torch's), builtins.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cockpit
from cockpit import Cockpit, configuration
from cockpit.benchmark.problems.small_nets import cifar10_3c3d
from cockpit.engine.histograms import device as histogram_device

sys.path.insert(0, str(Path(__file__).parent))
from gpu_overhead import resnet18_groupnorm

PACKAGE = str(Path(cockpit.__file__).parent)
MODELS = {"3c3d": cifar10_3c3d, "resnet18_gn": resnet18_groupnorm}


class CountOps(TorchDispatchMode):
    """Every aten op, by name and by the Cockpit function that issued it."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.where: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(PACKAGE)
                  and "/benchmark/" not in f.filename]
        self.where[(f"{frames[-1].filename[len(PACKAGE) + 1:]}:{frames[-1].name}"
                    if frames else "the user's loop")] += 1
        return func(*args, **(kwargs or {}))


class CountCalls:
    """Python function calls (and calls of builtins), by whether Cockpit's code made them:
    host work per step beside the ops (each call costs the host time a GPU waits for)."""

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()

    def __enter__(self):
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def _event(self, frame, event, arg):
        if event == "call":
            self.calls["cockpit" if frame.f_code.co_filename.startswith(PACKAGE)
                       else "other Python"] += 1
        elif event == "c_call":
            self.calls["builtins"] += 1


def count(config: str | None, batch: int, counter=None, model_name: str = "3c3d"):
    """The third step's ops (``config`` None: without Cockpit); ``counter``: another
    context that watches the step (:class:`CountCalls`)."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    watcher = Cockpit(model, configuration(config), optimizer=opt) if config else None
    data = [(torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))) for _ in range(3)]

    def step(i: int) -> None:
        x, y = data[i]
        opt.zero_grad()
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        if watcher is None:
            losses.mean().backward()
        else:
            with watcher(i, losses=losses):
                losses.mean().backward()
        opt.step()

    step(0)
    step(1)
    counter = CountOps() if counter is None else counter
    with counter:
        step(2)
    if watcher is not None:
        watcher.get_output()
        watcher.close()
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="economy", choices=["economy", "business", "full"])
    parser.add_argument("--path", default="accelerator", choices=["accelerator", "cpu"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--model", default="3c3d", choices=list(MODELS))
    parser.add_argument("--top", type=int, default=20, help="functions listed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    histogram_device._forced = args.path == "accelerator"
    plain = sum(count(None, args.batch, model_name=args.model).ops.values())
    tracked = count(args.config, args.batch, model_name=args.model)
    total = sum(tracked.ops.values())
    print(f"{args.model} {args.config}, {args.path} path, |B| = {args.batch}: {total} aten ops "
          f"in a tracked step, {plain} without Cockpit ({total / plain:.2f}×)")
    print("ops:", ", ".join(f"{k} {v}" for k, v in tracked.ops.most_common(12)))
    calls = count(args.config, args.batch, CountCalls(), args.model).calls
    print(f"Python calls in the tracked step: {sum(calls.values())} ("
          + ", ".join(f"{k} {v}" for k, v in calls.most_common()) + ")")
    for where, n in tracked.where.most_common(args.top):
        print(f"{n:7d}  {where}")


if __name__ == "__main__":
    main()
