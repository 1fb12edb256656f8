"""How much of a tracked step's host time is Cockpit's Python, and how much its ops: the ops
Cockpit issued in one tracked step, recorded and replayed without Cockpit's code.

A tracked step on a GPU is bound by its host (``host_overhead.py``): Python deciding what to
form, and the ops it dispatches and launches. This benchmark splits the two. One tracked step
of ``host_overhead.py``'s tiny problems runs under a ``TorchDispatchMode`` that records every
aten op issued with a frame of Cockpit's package on the Python stack (its hooks, its
rules, its instruments, its optimizer hooks; not the model, the loss or the optimizer), with
its arguments: the tensors an earlier recorded op made, or those it found (parameters,
activations, Cockpit's buffers) as they are. Then, alternated with tracked and untracked
steps,

* **replay**: the recorded ops run again in their order on the recorded inputs, one
  dispatch each and nothing else (the host's floor of an eager tracked step that issued
  the same ops with no Python of its own: what a plan decided once and replayed costs);
* on CUDA also **graph**: the replay captured once in a CUDA graph and launched as one
  (the floor without the host: what capturing the step's work would leave; ops that read
  the device on the host, such as ``.item()``, are left out of the capture and counted);
* and a first capture's estimate: the ops of the phases outside the user's backward pass
  (:data:`OUTSIDE_BACKWARD`: the step's end, the gradient check, the update's instruments,
  the block's start) as one CUDA graph, the others replayed one by one (on a CPU the
  latter alone: what would be left of the ops).

    python benchmarks/replay_bound.py                          # 3C3D, GPT-2, ResNet-18
    python benchmarks/replay_bound.py --problems gpt2 --steps 30
    python benchmarks/replay_bound.py --device cuda            # with the CUDA graph

Printed per problem (ms per tracked step, medians): Cockpit's extra time (tracked −
untracked), the replay of its ops, its Python (the difference), and on CUDA the graph; the
ops that take the replay's time (each timed alone); then per phase of the pipeline
(``host_overhead.py --phases``, each phase's own time without the phases inside it) its
ops, the tensors they made (each an allocation and a tensor object for a GPU's host), their
replay and the phase's whole time in a tracked step: the difference is the phase's Python.
A replayed op costs the host about 1 µs more than in the step (its arguments rebuilt, the
op called through its Python overload): the Python shares printed are lower bounds. The
recorded values are not checked: the replay only measures (its ops run on one step's tensors
again; in-place ops on Cockpit's own buffers repeat).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from cockpit.engine.histograms import device as histogram_device

sys.path.insert(0, str(Path(__file__).parent))
from gpu_overhead import Clock
from host_overhead import PHASES, _registered, wrapped_phases
from op_count import PACKAGE, make_step

MODELS_IN_PACKAGE = PACKAGE + "/benchmark/"  # (the problems' models: the user's code here)

# ops that read the device on the host: not capturable, left out of the CUDA graph
HOST_READS = {"_local_scalar_dense", "nonzero", "repeat_interleave", "masked_select",
              "equal", "is_nonzero", "unique_consecutive", "_unique2"}


@dataclass(frozen=True)
class _Ref:
    """An argument made by an earlier recorded op: its index and output position."""

    op: int
    position: int


def _argument_maker(value: Any):
    """(constant, value) or (None, fn(outputs) → value) for one argument: a recorded op's
    output, a list holding some (multi-tensor ops), or anything else as it is."""
    if isinstance(value, _Ref):
        return None, lambda outputs, r=value: outputs[r.op][r.position]
    if isinstance(value, (list, tuple)) and any(isinstance(v, _Ref) for v in value):
        makers = [_argument_maker(v) for v in value]
        kind = type(value)
        return None, lambda outputs: kind(c if f is None else f(outputs) for c, f in makers)
    return value, None


def _leaves(out: Any) -> Any:
    """An op's outputs as ``tree_flatten`` lists them (its positions in :class:`_Ref`)."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (list, tuple)) and all(isinstance(o, torch.Tensor) for o in out):
        return out
    return tree_flatten(out)[0]


@dataclass
class Tape:
    """The recorded ops: (op, its arguments as (constant, None) or (None, a maker that
    reads the earlier ops' outputs)), and per op its phase, its outputs in the step and the
    ops it reads from."""

    ops: list[tuple[Any, list, dict]] = field(default_factory=list)
    # id → (the output it is, the tensor: held, so that no later tensor takes its id)
    made: dict[int, tuple[_Ref, torch.Tensor]] = field(default_factory=dict)
    phases: list[str] = field(default_factory=list)  # per op: the phase that issued it
    recorded: list[Any] = field(default_factory=list)  # per op: its outputs in the step
    reads: list[list[int]] = field(default_factory=list)  # per op: the ops it reads from

    def argument(self, value: Any) -> Any:
        """A recorded op's output as its :class:`_Ref`; a tensor found elsewhere as an alias
        of its data (holding the tensor itself would keep autograd from stealing a
        gradient into ``p.grad``: the recorded step would copy it)."""
        if isinstance(value, torch.Tensor):
            found = self.made.get(id(value))
            if found is not None and found[1] is value:
                return found[0]
            return value.detach()
        return value

    def add(self, func, args: tuple, kwargs: dict, out: Any, phase: str) -> None:
        index = len(self.ops)
        self.phases.append(phase)
        leaves_in = tree_flatten((args, kwargs))[0]
        self.reads.append(sorted({found[0].op for t in leaves_in if isinstance(t, torch.Tensor)
                                  and (found := self.made.get(id(t))) is not None
                                  and found[1] is t}))
        self.ops.append((func, [_argument_maker(a) for a in tree_map(self.argument, args)],
                         {k: _argument_maker(v)
                          for k, v in tree_map(self.argument, kwargs).items()}))
        leaves, _ = tree_flatten(out)
        self.recorded.append(leaves)
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                self.made[id(leaf)] = (_Ref(index, position), leaf)

    def _run(self, index: int, outputs: list) -> None:
        """Op ``index`` on its arguments (the recorded ops' among ``outputs``), its outputs
        appended to ``outputs`` (the arguments rebuilt by closures made once: no tree walk
        per op)."""
        func, args, kwargs = self.ops[index]
        out = func(*[c if f is None else f(outputs) for c, f in args],
                   **{k: c if f is None else f(outputs) for k, (c, f) in kwargs.items()})
        outputs.append(_leaves(out))

    def replay(self, skip: frozenset = frozenset()) -> None:
        """The ops in their order but those at the indices ``skip`` (whose outputs the
        others read as the step made them)."""
        outputs: list[Any] = []
        with torch.no_grad():  # (what Cockpit's ops record into autograd is not timed)
            for index in range(len(self.ops)):
                if index in skip:
                    outputs.append(self.recorded[index])
                else:
                    self._run(index, outputs)

    def tensors_made(self) -> dict[str, int]:
        """The tensors the ops made in the step, by phase (each an allocation and a tensor
        object for the host of a GPU: a multi-tensor op on P tensors makes P)."""
        made: dict[str, int] = {}
        for label, leaves in zip(self.phases, self.recorded, strict=True):
            made[label] = made.get(label, 0) + sum(isinstance(t, torch.Tensor) for t in leaves)
        return made

    def time_by_phase(self) -> dict[str, float]:
        """Seconds of the host in one replay by the phase that issued each op (the device
        not waited for: the host's time, as :func:`host_overhead.timed_phases` measures)."""
        totals: dict[str, float] = {}
        outputs: list[Any] = []
        with torch.no_grad():
            start, phase = time.perf_counter(), self.phases[0] if self.phases else ""
            for index, label in enumerate(self.phases):
                if label != phase:
                    now = time.perf_counter()
                    totals[phase] = totals.get(phase, 0.0) + now - start
                    start, phase = now, label
                self._run(index, outputs)
            totals[phase] = totals.get(phase, 0.0) + time.perf_counter() - start
        return totals

    def time_by_op(self, clock: Clock) -> dict[str, float]:
        """Seconds of one replay by op name (each op timed alone, on CUDA to its end)."""
        totals: dict[str, float] = {}
        outputs: list[Any] = []
        with torch.no_grad():
            for index, (func, _, _) in enumerate(self.ops):
                seconds = clock.time(functools.partial(self._run, index, outputs))
                name = func.overloadpacket.__name__
                totals[name] = totals.get(name, 0.0) + seconds
        return totals

    def host_reads(self) -> int:
        return sum(func.overloadpacket.__name__ in HOST_READS for func, _, _ in self.ops)

    def host_ops(self) -> frozenset:
        """The indices of the ops a CUDA graph cannot hold: those that read the device on
        the host, and those with a tensor on the host among their arguments or outputs (the
        step's numbers copied out, small tensors made on the host) or depending on one of
        them."""
        skipped: set[int] = set()
        for index, (func, args, kwargs) in enumerate(self.ops):
            values = [c for c, f in args] + [c for c, f in kwargs.values()]
            refs = [r for r in self._refs(index) if r in skipped]
            on_host = any(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                          for v in (*values, *self.recorded[index])
                          for t in (v if isinstance(v, (list, tuple)) else [v]))
            if func.overloadpacket.__name__ in HOST_READS or on_host or refs:
                skipped.add(index)
        return frozenset(skipped)

    def _refs(self, index: int) -> list[int]:
        """The ops whose outputs op ``index`` reads."""
        return self.reads[index]


def cockpits_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of Cockpit's package (not the problems' models) from ``frame``
    outwards, or None."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE) and not name.startswith(MODELS_IN_PACKAGE):
            return frame
        frame = frame.f_back
    return None


def _is_cockpits() -> bool:
    """Whether a frame of Cockpit's package is on the stack (above the dispatch mode that
    asks)."""
    return cockpits_frame(sys._getframe(2)) is not None


class Recorder(TorchDispatchMode):
    """Records the ops issued from Cockpit's code (module docstring), each with the
    innermost of ``host_overhead.PHASES`` it ran in (``phases``: the labels entered)."""

    def __init__(self):
        super().__init__()
        self.tape = Tape()
        self.users = 0
        self.phases: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_cockpits():
            self.tape.add(func, args, kwargs, out,
                          self.phases[-1] if self.phases else OUTSIDE_PHASES)
        else:
            self.users += 1
        return out


OUTSIDE_PHASES = "forward hooks and others"


@contextlib.contextmanager
def innermost_phases(entered: list[str], totals: dict[str, float] | None = None):
    """While inside, ``entered`` lists the :data:`host_overhead.PHASES` entered (their
    methods wrapped; restored after) and ``totals`` gets each one's own time, without the
    phases inside it (the host's time, Python and ops)."""
    clock = {"start": 0.0}

    def charge(now: float) -> None:
        if entered and totals is not None:
            totals[entered[-1]] = totals.get(entered[-1], 0.0) + now - clock["start"]
        clock["start"] = now

    def entering(label: str, original):
        stripped = label.strip()

        def wrapped(*args, **kwargs):
            charge(time.perf_counter())
            entered.append(stripped)
            try:
                return original(*args, **kwargs)
            finally:
                charge(time.perf_counter())
                entered.pop()

        return wrapped

    with wrapped_phases(entering):
        yield


# the phases outside the user's backward pass: where a captured graph would replace the
# eager ops first (between backward and optimizer.step(), after it, at a block's start)
OUTSIDE_BACKWARD = frozenset({"step end (before the optimizer)", "gradient check",
                              "update's instruments (after it)", "block start",
                              "reading back the previous step"})


def _graphed(tape: Tape, only: frozenset | None = None
             ) -> tuple[torch.cuda.CUDAGraph | None, int]:
    """The replay without the ops on the host (:meth:`Tape.host_ops`; with ``only``, of
    the ops of those phases alone) captured in a CUDA graph (None where the capture fails:
    said), and how many ops were left out."""
    skip = tape.host_ops()
    left_out = len(skip)
    if only is not None:
        skip = skip | {i for i, label in enumerate(tape.phases) if label not in only}
        left_out = sum(label in only for label in tape.phases) - (len(tape.ops) - len(skip))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # (a warm-up outside the capture, as CUDA asks)
        tape.replay(skip)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            tape.replay(skip)
    except Exception as error:  # (an op CUDA cannot capture: the measurement says so)
        print(f"  the CUDA graph capture failed: {type(error).__name__}: {error}"[:300])
        torch.cuda.synchronize()
        return None, left_out
    return graph, left_out


def measure(problem: str, config: str, steps: int, device: str) -> dict[str, float]:
    """Medians (ms) of Cockpit's extra time, the replay and (CUDA) the graph, and counts."""
    name = _registered(problem)
    plain, _ = make_step(name, None, 2, device)
    tracked, watcher = make_step(name, config, 2, device)
    for i in range(5):
        plain(i)
        tracked(i)
    recorder = Recorder()
    with innermost_phases(recorder.phases), recorder:
        tracked(5)
    tape = recorder.tape
    cuda = device.startswith("cuda")
    graph, left_out = _graphed(tape) if cuda else (None, 0)
    outside, outside_left = _graphed(tape, OUTSIDE_BACKWARD) if cuda else (None, 0)
    inside = frozenset(i for i, label in enumerate(tape.phases) if label in OUTSIDE_BACKWARD)
    clock = Clock(torch.device(device))
    times: dict[str, list[float]] = {"plain": [], "tracked": [], "replay": [], "graph": [],
                                     "rest": [], "outside": []}
    for i in range(6, 6 + steps):
        times["plain"].append(clock.time(lambda i=i: plain(i)))
        times["tracked"].append(clock.time(lambda i=i: tracked(i)))
        times["replay"].append(clock.time(tape.replay))
        times["rest"].append(clock.time(functools.partial(tape.replay, inside)))
        if graph is not None:
            times["graph"].append(clock.time(graph.replay))
        if outside is not None:
            times["outside"].append(clock.time(outside.replay))
    by_op: dict[str, list[float]] = {}
    for _ in range(5):
        for name, seconds in tape.time_by_op(clock).items():
            by_op.setdefault(name, []).append(seconds)
    phase_ops: dict[str, list[float]] = {}
    phase_all: dict[str, list[float]] = {}
    for i in range(6 + steps, 6 + 2 * steps):
        for label, seconds in tape.time_by_phase().items():
            phase_ops.setdefault(label, []).append(seconds)
        totals: dict[str, float] = {}
        with innermost_phases([], totals):
            tracked(i)
        for label, seconds in totals.items():
            phase_all.setdefault(label, []).append(seconds)
    assert watcher is not None
    watcher.close()
    med = {k: 1000 * statistics.median(v) for k, v in times.items() if v}
    return {"extra": med["tracked"] - med["plain"], "plain": med["plain"],
            "replay": med["replay"], "graph": med.get("graph", float("nan")),
            "rest": med["rest"], "outside": med.get("outside", float("nan")),
            "outside ops": len(inside), "outside left out": outside_left,
            "ops": len(tape.ops), "host reads": tape.host_reads(), "user ops": recorder.users,
            "left out": left_out,
            "by op": {k: 1000 * statistics.median(v) for k, v in by_op.items()},
            "phase ops": {k: 1000 * statistics.median(v) for k, v in phase_ops.items()},
            "phase all": {k: 1000 * statistics.median(v) for k, v in phase_all.items()},
            "phase counts": {k: tape.phases.count(k) for k in set(tape.phases)},
            "phase made": tape.tensors_made(), "counts": _counts(tape)}


def _counts(tape: Tape) -> dict[str, int]:
    counts: dict[str, int] = {}
    for func, _, _ in tape.ops:
        counts[func.overloadpacket.__name__] = counts.get(func.overloadpacket.__name__, 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=["3c3d", "gpt2", "resnet18_gn"],
                        choices=["3c3d", "resnet18_gn", "gpt2"])
    parser.add_argument("--config", default="economy", choices=["economy", "business", "full"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each kind")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--top", type=int, default=8,
                        help="the ops that take the replay's time, each timed alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    histogram_device._forced = True  # (the accelerators' paths, as on a GPU)
    for problem in args.problems:
        r = measure(problem, args.config, args.steps, args.device)
        python = r["extra"] - r["replay"]
        graph = ("" if args.device == "cpu" else
                 f", as one CUDA graph {r['graph']:.2f} ({r['left out']} ops on the host "
                 "left out)")
        print(f"{problem} {args.config} ({args.device}): untracked {r['plain']:.2f} ms; "
              f"Cockpit's extra {r['extra']:.2f} ms = its {r['ops']} ops (making "
              f"{sum(r['phase made'].values())} tensors) replayed "
              f"{r['replay']:.2f} + its Python {python:.2f} ({100 * python / r['extra']:.0f} %)"
              f"{graph}; {r['host reads']} host reads of the device, {r['user ops']} ops of "
              "the user's step")
        outside = ("" if args.device == "cpu" else
                   f" + those {r['outside']:.2f} as one CUDA graph ({r['outside left out']} "
                   "on the host left out)")
        print(f"  the ops outside the backward pass ({r['outside ops']} of them) captured: "
              f"the others replayed {r['rest']:.2f}{outside}")
        ranked = sorted(r["by op"].items(), key=lambda kv: -kv[1])[:args.top]
        print("  " + ", ".join(f"{name} ×{r['counts'][name]} {ms:.2f}" for name, ms in ranked))
        print(f"  {'phase (own time, ms)':40s} {'ops':>5s} {'made':>5s} {'replayed':>9s} "
              f"{'all':>7s} {'Python':>7s}")
        for label in [label.strip() for label, _, _ in PHASES] + [OUTSIDE_PHASES]:
            ops, replayed = r["phase counts"].get(label, 0), r["phase ops"].get(label, 0.0)
            whole = r["phase all"].get(label)
            if not ops and whole is None:
                continue
            rest = (f"{whole:7.2f} {whole - replayed:7.2f}" if whole is not None
                    else f"{'–':>7s} {'–':>7s}")
            made = r["phase made"].get(label, 0)
            print(f"  {label:40s} {ops:5d} {made:5d} {replayed:9.2f} {rest}")


if __name__ == "__main__":
    main()
