"""What stands between the ops of a tracked step and a CUDA graph, phase by phase.

A CUDA graph replays the kernels it captured with the arguments they had: the same input
addresses, the same numbers passed from the host. Capturing Cockpit's work outside the
user's backward pass (``replay_bound.py``'s first capture target) is sound only where
every tracked step issues the same ops, reads its inputs from the same memory, and passes
no host number that changes from step to step (a learning rate, a step count, a loss
weight given to an op as a Python float would be replayed with its first value: a plausible
wrong number). This audit records the ops Cockpit issues in two consecutive tracked steps
(``replay_bound.Recorder``'s selection, with the line of Cockpit that issued each) and
compares them op by op:

* **sequence**: whether both steps issued the same ops in each phase (a data-dependent
  branch or shape would need one graph per variant);
* **constants that change**: the non-tensor arguments (numbers, sizes, lists) that differ
  between the steps, with the line that passes them — each one a value to move into a
  device tensor before that phase can be captured;
* **inputs**: the tensors the ops read that no earlier op of the same phase made (each
  counted once per phase), by where they live — parameters, gradients (``p.grad``), the
  optimizer's state, tensors made by Cockpit's ops in an earlier phase of the step (the
  layers' statistics), and others (Cockpit's buffers, the losses) — and whether the second
  step read them from the same memory (read in place by a graph) or from other memory (a
  graph needs them copied into static buffers first);
* **host reads**: ops that read the device on the host (none is the accelerators' rule);
* **copy-in**: the time of copying the tensors each phase outside the backward pass reads
  from new memory into buffers made once (a multi-tensor copy per device and dtype): what a
  graph of that phase would add to every step, beside its launch (``replay_bound.py
  --device cuda`` times the graph).

    python benchmarks/capture_audit.py                       # 3C3D, GPT-2, ResNet-18
    python benchmarks/capture_audit.py --problems gpt2 --every 2   # the step after, too
    python benchmarks/capture_audit.py --device cuda --problems 3c3d gpt2   # on a GPU

``--every 2`` tracks every other step and audits the tracked step and the step after it
(where Alpha observes θ_{t+1}) against the next cycle's. Between the recorded steps the
learning rate decays by 1 % a step, as under a scheduler. The first step's tensors are held
while the second runs, so an input in the same storage is memory that persisted, on a CPU
as on a GPU. The problems, paths and selection are ``replay_bound.py``'s
(``host_overhead.py``'s tiny models, accelerator paths forced).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))
from cockpit import every
from gpu_overhead import Clock
from op_count import PACKAGE, make_step
from replay_bound import (
    HOST_READS,
    OUTSIDE_BACKWARD,
    OUTSIDE_PHASES,
    _registered,
    cockpits_frame,
    histogram_device,
    innermost_phases,
)

ORIGINS = ("parameter", "gradient", "optimizer state", "earlier phase", "other")


@dataclass
class Op:
    name: str
    phase: str
    site: str  # the innermost line of Cockpit that issued it
    constants: list[Any]
    inputs: list[tuple[str, int]]  # (origin, storage address) of each input from outside
    host_read: bool
    tensors: list[torch.Tensor] = field(default_factory=list)  # those inputs (held)


@dataclass
class StepOps:
    ops: list[Op] = field(default_factory=list)
    held: list[torch.Tensor] = field(default_factory=list)  # the outputs, kept in memory


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # (a tensor without storage)
        return 0


class AuditRecorder(TorchDispatchMode):
    """Records Cockpit's ops of one step (``replay_bound.Recorder``'s selection) with their
    constants, the origins of their inputs and the phase and line that issued them."""

    def __init__(self, params: list[torch.Tensor], optimizer, phases: list[str]):
        super().__init__()
        self.step = StepOps()
        self.params, self.optimizer = params, optimizer
        # storage address → parameter, gradient or optimizer state (looked up afresh where
        # an address is not known: gradients set to None are allocated anew each step)
        self.places = _places(params, optimizer)
        self.phases = phases
        self._made: dict[int, tuple[torch.Tensor, str]] = {}  # id → (tensor, its phase)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        issuer = cockpits_frame(sys._getframe(1))  # (the line of Cockpit that led to the op)
        if issuer is None:  # (the user's op)
            return out
        site = f"{issuer.f_code.co_filename[len(PACKAGE) + 1:]}:{issuer.f_lineno}"
        phase = self.phases[-1] if self.phases else OUTSIDE_PHASES
        leaves, _ = tree_flatten((args, kwargs))
        constants, inputs, tensors = [], [], []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                constants.append(leaf)
                continue
            found = self._made.get(id(leaf))
            if found is not None and found[0] is leaf:
                if found[1] != phase:
                    inputs.append(("earlier phase", _storage(leaf)))
                    tensors.append(leaf)
                continue
            address = _storage(leaf)
            if address not in self.places:
                self.places.update(_places(self.params, self.optimizer))
            inputs.append((self.places.get(address, "other"), address))
            tensors.append(leaf.detach())
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self._made[id(leaf)] = (leaf, phase)
                self.step.held.append(leaf)
        self.step.ops.append(Op(func.overloadpacket.__name__, phase, site, constants,
                                inputs, func.overloadpacket.__name__ in HOST_READS, tensors))
        return out


def _places(model_params: list[torch.Tensor], optimizer) -> dict[int, str]:
    """Storage address → what lives there now: the parameters, their gradients, the
    optimizer's state."""
    places = {}
    for p in model_params:
        places[_storage(p)] = "parameter"
        if p.grad is not None:
            places[_storage(p.grad)] = "gradient"
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    places[_storage(value)] = "optimizer state"
    return places


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    return type(a) is type(b) and a == b


def record(step: Callable[[int], None], watcher, index: int) -> StepOps:
    """Cockpit's ops in step ``index``."""
    phases: list[str] = []
    recorder = AuditRecorder(list(watcher.model.parameters()), watcher.optimizer, phases)
    with innermost_phases(phases), recorder:
        step(index)
    return recorder.step


def compare(a: StepOps, b: StepOps) -> dict[str, dict[str, Any]]:
    """Per phase: both steps' op counts, whether they issued the same ops, the constants
    that changed (site, op, both values), the tensors read from outside the phase by origin
    and memory (each once), host reads."""
    out: dict[str, dict[str, Any]] = {}
    by_phase_a: dict[str, list[Op]] = {}
    by_phase_b: dict[str, list[Op]] = {}
    for op in a.ops:
        by_phase_a.setdefault(op.phase, []).append(op)
    for op in b.ops:
        by_phase_b.setdefault(op.phase, []).append(op)
    for phase in dict.fromkeys([*by_phase_a, *by_phase_b]):
        ops_a, ops_b = by_phase_a.get(phase, []), by_phase_b.get(phase, [])
        same = [o.name for o in ops_a] == [o.name for o in ops_b]
        row: dict[str, Any] = {"ops": (len(ops_a), len(ops_b)), "same ops": same,
                               "changed": [], "host reads": sum(o.host_read for o in ops_b),
                               "inputs": {}, "copy in": []}
        if not same:
            first = next((i for i, (x, y) in enumerate(zip(ops_a, ops_b, strict=False))
                          if x.name != y.name), min(len(ops_a), len(ops_b)))
            row["first difference"] = (
                first, ops_a[first].name if first < len(ops_a) else None,
                ops_b[first].name if first < len(ops_b) else None,
                (ops_a[first] if first < len(ops_a) else ops_b[first]).site)
        counted: set[tuple[str, int]] = set()
        for x, y in zip(ops_a, ops_b, strict=False):
            if x.name != y.name:
                break
            if len(x.constants) != len(y.constants) or not all(
                    map(_same, x.constants, y.constants)):
                row["changed"].append((y.site, y.name, x.constants, y.constants))
            held = y.tensors or [None] * len(y.inputs)
            for (origin, address), (_, address_b), tensor in zip(x.inputs, y.inputs, held,
                                                                 strict=False):
                if (origin, address_b) in counted:  # (each tensor once per phase)
                    continue
                counted.add((origin, address_b))
                kind = "same memory" if address == address_b else "other memory"
                if kind == "other memory" and tensor is not None:
                    row["copy in"].append(tensor)
                counts = row["inputs"].setdefault(origin, {"same memory": 0,
                                                           "other memory": 0})
                counts[kind] += 1
        out[phase] = row
    return out


def _short(values: list[Any]) -> str:
    text = ", ".join(repr(v) for v in values)
    return text if len(text) <= 60 else text[:57] + "..."


def copy_in_seconds(tensors: list[torch.Tensor], clock: Clock, repeats: int = 20) -> float:
    """Median seconds of copying ``tensors`` into buffers made once (one multi-tensor copy
    per device and dtype): what a graph of a phase would add at each step to bring its
    inputs from new memory into its static buffers."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for t in tensors:
        if t.numel() and t.layout == torch.strided:
            sources, buffers = groups.setdefault((t.device, t.dtype), ([], []))
            sources.append(t)
            buffers.append(torch.empty_like(t))

    def copy() -> None:
        for sources, buffers in groups.values():
            torch._foreach_copy_(buffers, sources)

    copy()  # (warm)
    return statistics.median(clock.time(copy) for _ in range(repeats))


def report(title: str, rows: dict[str, dict[str, Any]], clock: Clock | None = None) -> None:
    print(title)
    print(f"  {'phase (* outside the backward pass)':38s} {'ops':>5s} {'same':>5s} "
          f"{'changed':>8s} {'reads':>6s}  inputs from outside the phase: same memory / "
          "other memory")
    for phase, row in rows.items():
        inputs = ", ".join(f"{origin} {c['same memory']}/{c['other memory']}"
                           for origin in ORIGINS if (c := row["inputs"].get(origin)))
        mark = "*" if phase in OUTSIDE_BACKWARD else " "
        print(f" {mark}{phase:38s} {row['ops'][1]:5d} {'yes' if row['same ops'] else 'NO':>5s} "
              f"{len(row['changed']):8d} {row['host reads']:6d}  {inputs}")
        if not row["same ops"]:
            index, x, y, site = row["first difference"]
            print(f"      ops differ from op {index} on: {x} / {y} ({site})")
    if clock is not None:
        copies = [f"{phase} {len(row['copy in'])} tensors "
                  f"{1000 * copy_in_seconds(row['copy in'], clock):.3f} ms"
                  for phase, row in rows.items() if phase in OUTSIDE_BACKWARD and row["copy in"]]
        print("  copying the new memory into static buffers (*), median of one multi-tensor "
              "copy per device and dtype: " + "; ".join(copies))
    changed = {(phase, site, name): (x, y) for phase, row in rows.items()
               for site, name, x, y in row["changed"]}
    if changed:
        print("  constants that changed between the steps (the first at each line):")
        for (phase, site, name), (x, y) in changed.items():
            print(f"    {phase}: {name} at {site}: ({_short(x)}) → ({_short(y)})")


def audit(problem: str, config: str, cycle: int, device: str = "cpu"
          ) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    """The comparisons of :func:`compare` for ``problem``: two consecutive tracked steps
    (``cycle`` 1), or (``cycle`` 2: tracked every other step) two tracked steps and the two
    steps after them; the learning rate decays by 1 % a step, as under a scheduler."""
    step, watcher = make_step(_registered(problem), config, 2, device,
                              every(cycle) if cycle > 1 else None)
    assert watcher is not None
    optimizer = watcher.optimizer

    def decayed(i: int, recorded: bool = False) -> StepOps | None:
        ops = record(step, watcher, i) if recorded else step(i)
        for group in optimizer.param_groups:
            group["lr"] *= 0.99
        return ops

    for i in range(6):
        decayed(i)
    steps = [decayed(i, True) for i in range(6, 6 + 2 * cycle)]
    watcher.close()
    if cycle == 1:
        return [(f"{problem} {config}, tracked steps 6 and 7:", compare(steps[0], steps[1]))]
    return [(f"{problem} {config} every 2nd, tracked steps 6 and 8:",
             compare(steps[0], steps[2])),
            (f"{problem} {config} every 2nd, the steps after them (7 and 9):",
             compare(steps[1], steps[3]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=["3c3d", "gpt2", "resnet18_gn"],
                        choices=["3c3d", "resnet18_gn", "gpt2"])
    parser.add_argument("--config", default="economy", choices=["economy", "business", "full"])
    parser.add_argument("--every", type=int, default=1, choices=[1, 2],
                        help="2: the tracked step and the step after it, each against the "
                             "next cycle's")
    parser.add_argument("--device", default="cpu",
                        help="cuda: the same audit there, and the copies timed on the GPU")
    args = parser.parse_args()
    torch.set_num_threads(1)
    histogram_device._forced = True  # (the accelerators' paths, as on a GPU)
    clock = Clock(torch.device(args.device))
    for problem in args.problems:
        for title, rows in audit(problem, args.config, args.every, args.device):
            report(title, rows, clock)


if __name__ == "__main__":
    main()
