"""The aten ops of one tracked step, counted on the CPU, and where in Cockpit they come from
(3C3D; ``--model resnet18_gn``: a CIFAR-size ResNet-18 with GroupNorm; ``--model gpt2``: a
small ``transformers`` GPT-2 trained by AdamW, T = 32).

On a GPU every aten op is a kernel launch (or host work), and a tracked step is bound by the
host issuing them; the count predicts it without a GPU. The third step (SGD with momentum;
AdamW for GPT-2; |B| = 128 by default) runs under a ``TorchDispatchMode``: the ops of the
tracked step, of the same step without Cockpit, and each Cockpit function's share (the
innermost frame in the package that issued the op; "the user's loop" is the model, the loss
and the optimizer).
``--path accelerator`` forces the accelerator paths on the CPU (histograms, batched curvature
backpropagations), as on a GPU.

    python benchmarks/op_count.py                                   # economy, accelerator path
    python benchmarks/op_count.py --config business --path cpu --top 30
    python benchmarks/op_count.py --model resnet18_gn --batch 32   # 62 parameter tensors
    python benchmarks/op_count.py --model gpt2 --batch 4           # transformers, AdamW
    python benchmarks/op_count.py --after     # the step after a tracked one (θ_{t+1})

It also counts the Python calls of the tracked step (``sys.setprofile``, without the op
counter): Cockpit's own functions, other Python code (torch's), builtins.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import cockpit
from cockpit import Cockpit, configuration
from cockpit.benchmark.problems.small_nets import cifar10_3c3d
from cockpit.engine.histograms import device as histogram_device
from cockpit.schedules import every

sys.path.insert(0, str(Path(__file__).parent))
from gpu_overhead import resnet18_groupnorm

PACKAGE = str(Path(cockpit.__file__).parent)
USER = "the user's loop"  # where an op no Cockpit function issued comes from


class Problem(NamedTuple):
    """A model, its optimizer and |B| samples of its data with per-sample losses."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list
    losses: Callable[[nn.Module, tuple], Tensor]


def _image_problem(make: Callable[[], nn.Module], batch: int) -> Problem:
    model = make()
    return Problem(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
                   [(torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)))
                    for _ in range(3)],
                   lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"))


AUTOCAST_ON_CPU = False
"""Whether :func:`gpt2_problem`'s ``autocast`` also holds on the CPU (``device_traffic.py
--autocast``: a GPU's bfloat16 step counted on the CPU)."""


def gpt2_problem(batch: int, vocab: int = 1000, length: int = 32, n_layer: int = 2,
                 n_embd: int = 64, n_head: int = 2, autocast: bool = False) -> Problem:
    """A ``transformers`` GPT-2 from its config (by default small: 2 blocks, width 64)
    trained by AdamW: ℓ_n the mean next-token loss of sequence n (``autocast``: the forward
    pass in bfloat16 on CUDA, and on the CPU where :data:`AUTOCAST_ON_CPU`)."""
    import transformers

    config = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                                     vocab_size=vocab, n_positions=length, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)
    model = transformers.GPT2LMHeadModel._from_config(config)

    def losses(m: nn.Module, tokens: Tensor) -> Tensor:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16,
                            enabled=autocast and (tokens.is_cuda or AUTOCAST_ON_CPU)):
            logits = m(tokens).logits[:, :-1]
        return F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1),
                               reduction="none").view(len(tokens), -1).mean(1)

    return Problem(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                   [torch.randint(0, vocab, (batch, length)) for _ in range(3)], losses)


MODELS: dict[str, Callable[[int], Problem]] = {
    "3c3d": lambda batch: _image_problem(cifar10_3c3d, batch),
    "resnet18_gn": lambda batch: _image_problem(resnet18_groupnorm, batch),
    "gpt2": gpt2_problem,
}


class CountOps(TorchDispatchMode):
    """Every aten op, by name and by the Cockpit function that issued it; and the tensors the
    ops made (``made``: Cockpit's and the user's loop's), each of them an allocation and a
    tensor object for the host of a GPU (a multi-tensor op on P tensors makes P)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.where: collections.Counter = collections.Counter()
        self.made: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        where = issuing_site()
        self.where[where] += 1
        out = func(*args, **(kwargs or {}))
        self.made["Cockpit" if where != USER else USER] += sum(
            isinstance(t, Tensor) for t in tree_leaves(out))
        return out


def issuing_site() -> str:
    """The innermost function of Cockpit's package (not its benchmark problems) on the stack
    of the op being dispatched, "path:function", or :data:`USER` where there is none."""
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(PACKAGE)
              and "/benchmark/" not in f.filename]
    return f"{frames[-1].filename[len(PACKAGE) + 1:]}:{frames[-1].name}" if frames else USER


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


def make_step(model_name: str, config: str | None, batch: int, device: str = "cpu",
              schedule=None):
    """One training step of ``model_name`` (tracked by ``config`` at the steps ``schedule``
    picks, every step by default; or untracked: None) on ``device``, and its Cockpit (None
    untracked)."""
    torch.manual_seed(0)
    problem = MODELS[model_name](batch)
    model = problem.model.to(device)  # (in place: the optimizer holds the same parameters)
    data = [tuple(t.to(device) for t in b) if isinstance(b, tuple) else b.to(device)
            for b in problem.batches]
    opt = problem.optimizer
    watcher = (Cockpit(model, configuration(config, schedule), optimizer=opt)
               if config else None)

    def step(i: int) -> None:
        opt.zero_grad()
        losses = problem.losses(model, data[i % len(data)])
        if watcher is None:
            losses.mean().backward()
        else:
            with watcher(i, losses=losses):
                losses.mean().backward()
        opt.step()

    return step, watcher


def count(config: str | None, batch: int, counter=None, model_name: str = "3c3d",
          after: bool = False):
    """The third step's ops (``config`` None: without Cockpit); ``counter``: another
    context that watches the step (:class:`CountCalls`, ``device_traffic.Traffic``).
    ``after``: tracked every other step, the fourth step's, after the tracked third (Alpha
    observes θ_{t+1} there)."""
    step, watcher = make_step(model_name, config, batch, schedule=every(2) if after else None)
    for i in range(3 if after else 2):
        step(i)
    counter = CountOps() if counter is None else counter
    with counter:
        step(3 if after else 2)
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
    parser.add_argument("--after", action="store_true",
                        help="the step after a tracked one (Alpha observes θ_{t+1} there)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    histogram_device._forced = args.path == "accelerator"
    which = "the step after a tracked one" if args.after else "a tracked step"
    plain = sum(count(None, args.batch, model_name=args.model).ops.values())
    tracked = count(args.config, args.batch, model_name=args.model, after=args.after)
    total = sum(tracked.ops.values())
    print(f"{args.model} {args.config}, {args.path} path, |B| = {args.batch}: {total} aten ops "
          f"in {which}, {plain} without Cockpit ({total / plain:.2f}×)")
    print("ops:", ", ".join(f"{k} {v}" for k, v in tracked.ops.most_common(12)))
    made, user = tracked.made["Cockpit"], tracked.made[USER]
    print(f"tensors made: {made} by Cockpit's ops, {user} by the user's step")
    calls = count(args.config, args.batch, CountCalls(), args.model, args.after).calls
    print(f"Python calls in {which}: {sum(calls.values())} ("
          + ", ".join(f"{k} {v}" for k, v in calls.most_common()) + ")")
    for where, n in tracked.where.most_common(args.top):
        print(f"{n:7d}  {where}")


if __name__ == "__main__":
    main()
