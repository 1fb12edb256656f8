"""The statistics of a step over all processes of a ``torch.distributed`` process group.

Each rank r holds the statistics of its own samples (N_r of them); the instruments must
describe the global batch B = ∪_r B_r. Everything the instruments read is a sum over samples
or a per-sample vector, so two all-reduces (sum) of flat float64 buffers suffice, and no
individual gradient crosses the network:

1. :func:`reduce_sums` — the sample counts N_r and the additive values: Σ_n g_n = N_r ḡ_r,
   instruments' sample sums, and every requested statistic that ranks sum
   (:class:`~cockpit.engine.statistics.Combine` ``SUM``: Σ_n g_n ⊙ g_n, histogram counts,
   and for the elementwise variance V_r + N_r ḡ_r ⊙ ḡ_r, from which
   V = Σ_r (V_r + N_r ḡ_r²) − N ḡ² in float64), each packed and unpacked as it declares;
2. :func:`gather_samples` — the per-sample vectors (the statistics that ranks gather, such as
   ‖g_n‖² and g_nᵀḡ, the projections, ℓ_n): each rank writes its own slice
   [offset_r, offset_r + N_r) of a zero buffer of length N, so the sum is their
   concatenation in rank order.

The layout of both buffers comes from the parameter names and the requested statistics, the
same on every rank; a parameter without gradient on a rank contributes zeros (its individual
gradients are zero there: histogram counts add the counts of those zeros) and no presence
flag; a parameter no rank holds is left out. Works for any backend whose tensors live on
the parameters' device (gloo on CPU, NCCL on CUDA).

Every all-reduce goes through :func:`all_reduce_sum`, which keeps the buffer until the backend
has let go of it (see there: otherwise a process can abort at exit).
"""

from __future__ import annotations

import atexit
import itertools
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from cockpit.engine.sharded import check_sharding, is_sharded
from cockpit.engine.statistics import BackwardStatistics, RankTotals, Statistic, StatisticContext
from cockpit.engine.workspace import workspace


def check_supported_wrapper(model) -> None:
    """Models sharded over processes: ``fully_shard`` (FSDP2) is supported
    (:mod:`cockpit.engine.sharded`); FSDP1, tensor parallelism and other meshes are refused
    clearly; so is ``nn.DataParallel`` over several devices (replicas of the model run
    in threads, each on a slice of the batch: their hooks would race), while over one
    device (or none: on a CPU) it only calls the model and is supported."""
    check_sharding(model)
    for module in model.modules():
        if isinstance(module, torch.nn.DataParallel) and len(module.device_ids) > 1:
            raise NotImplementedError(
                f"Cockpit does not support nn.DataParallel over {len(module.device_ids)} "
                "devices: use DistributedDataParallel (one process per device; Cockpit "
                "combines the processes' statistics), or DataParallel over one device")

OTHER_RANK_PROBLEM = (
    "another process could not form its individual gradients (see the warnings of that "
    "process); the global statistics would miss its samples"
)


def stepped_gradient_differs(params: dict[str, Tensor], device: torch.device) -> bool:
    """Whether the processes are about to step on different gradients, i.e. do not train one
    model data-parallel (DDP, or gradients all-reduced by hand): each process' fingerprint
    (‖g‖₂², ‖g‖₁ over the parameters' gradients) is gathered (one small collective) and
    compared. Data-parallel gradients are the same on every rank (the all-reduce gives every
    rank the same result); those of separately trained models differ at order 1. The norms
    are taken in the gradients' dtype (1.3 ms on 3C3D against 7 ms in float64); 1e-4 leaves
    room for reductions in another order on another rank."""
    grads = [p.grad.detach() for p in params.values() if p.grad is not None]
    if any(is_sharded(g) for g in grads):
        return False  # fully_shard: each rank holds a slice of the one reduce-scattered G
    grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
    local = torch.zeros(2, dtype=torch.float64, device=device)
    if grads:  # a missing gradient counts as zero (DDP may leave unused ones None)
        local[0] = torch.stack([torch.linalg.vector_norm(g) for g in grads]).double().square().sum()
        local[1] = torch.stack([torch.linalg.vector_norm(g, 1) for g in grads]).double().sum()
    rows = gather_vector(local, [2] * world_size(), device).view(-1, 2)
    finite = torch.isfinite(rows)
    if not bool(finite.all()):  # DDP spreads a NaN to every rank; NaN on some only: differs
        return not bool((finite == finite[0]).all())
    spread = (rows - rows[0]).abs().amax(0)
    return bool((spread > 1e-4 * rows.abs().amax(0)).any())


# How long the first tracked step waits for every process's Cockpit to attach, before it
# decides that only some processes run Cockpit (their collectives would never be answered).
ATTACH_TIMEOUT = 60.0
_instances = itertools.count()  # the i-th Cockpit of a process pairs with the i-th of every other


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def attach() -> int:
    """Say, in the process group's key-value store, that this process runs a Cockpit; its
    index (the i-th Cockpit of this process) pairs it with the i-th of every other process."""
    index = next(_instances)
    store = _default_store()
    if store is not None:
        store.add(f"cockpit/{index}/attached", 1)
    return index


def every_rank_attached(index: int, timeout: float | None = None) -> bool:
    """Whether Cockpit number ``index`` runs in every process of the group, so that its
    collectives are answered. Waits up to ``timeout`` (``ATTACH_TIMEOUT``) for all to attach;
    the first process to decide writes the answer to the store and every process reads the
    same answer (``compare_set``), so either all combine their statistics or none does.
    A process that runs Cockpit alone would otherwise wait for ever in its first all-reduce.
    Without a store (cannot tell) it assumes every process runs Cockpit."""
    store = _default_store()
    if store is None:
        return True
    key = f"cockpit/{index}"
    world = world_size()
    deadline = time.monotonic() + (ATTACH_TIMEOUT if timeout is None else timeout)
    count = store.add(f"{key}/attached", 0)
    while count < world and time.monotonic() < deadline:
        time.sleep(0.05)
        count = store.add(f"{key}/attached", 0)
    proposal = "all" if count >= world else "some"
    try:
        decided = store.compare_set(f"{key}/mode", "", proposal)
    except RuntimeError:  # a store without compare_set: this process's own view
        decided = proposal.encode()
    return decided == b"all"


def world_size() -> int:
    """Processes of the default group (1 without torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


# Buffers of recent all-reduces that gloo may still hold (see all_reduce_sum), and how long
# settle() waits for them at most.
_held: list[Tensor] = []
_MAX_HELD = 16
_SETTLE_TIMEOUT = 2.0


def all_reduce_sum(buffer: Tensor) -> None:
    """``dist.all_reduce(buffer)`` (sum); the buffer is kept (not freed) until the backend has
    let go of it, so that its Python object is never freed by a backend thread.

    Why: gloo's worker thread marks the collective done first and drops its references to
    the tensors a moment later; measured, after about 1 in 5 calls it still holds them when
    ``all_reduce`` returns (torch 2.13). While it holds them, the tensor holds its Python
    object, and the gloo thread takes the GIL to let go of it — and frees it, if the caller
    has dropped the tensor meanwhile. If the process is exiting by then (interpreter
    finalization has begun), CPython ≤ 3.13 ends that thread with ``pthread_exit``; the
    unwinding meets torch's ``noexcept`` destructor and the process aborts: SIGABRT,
    "terminate called without an active exception" (pytorch/pytorch#190489). Cockpit's
    reductions are often the last collectives before a process exits.

    So a buffer gloo still holds when ``all_reduce`` returns joins ``_held``; each later call
    frees the held buffers gloo is done with, in the calling thread, and :func:`settle` (run
    by ``atexit``, before the interpreter starts finalizing) waits for the rest. Nothing
    waits during training: it goes on while gloo finishes. The callers must not keep the
    buffer (``gather_vector`` returns a copy), or it stays held until :func:`settle` gives
    up. CUDA tensors are not held: NCCL keeps them until the GPU has finished.
    """
    if buffer.device.type != "cpu" or not hasattr(buffer, "_use_count"):
        dist.all_reduce(buffer)
        return
    before = (buffer._use_count(), sys.getrefcount(buffer))
    dist.all_reduce(buffer)
    _release_let_go()
    if (buffer._use_count(), sys.getrefcount(buffer)) == before:
        return  # gloo has let go already (most calls): the caller frees the buffer
    del _held[:-_MAX_HELD]  # a buffer someone else keeps would be held for ever
    _held.append(buffer)


def summed_over_ranks(vector: Tensor) -> Tensor:
    """Σ_r ``vector``_r, the same numbers on every rank (one all-reduce; ``vector`` is used
    as the buffer and left to :func:`all_reduce_sum`, a copy is returned on the CPU)."""
    all_reduce_sum(vector)
    return vector.clone() if vector.device.type == "cpu" else vector


def _release_let_go() -> None:
    """Free, in this thread, the held buffers the backend is done with."""
    _held[:] = [_held[i] for i in range(len(_held)) if not _let_go(i)]


def _let_go(i: int) -> bool:
    """Whether the backend is done with ``_held[i]``: no C++ reference besides the one of its
    Python object, and the Python object referenced by the list alone (while the tensor is
    shared in C++, it holds its Python object: one more reference). No other name may refer
    to the buffer during the call (2 = the list's reference and getrefcount's argument)."""
    return _held[i]._use_count() == 1 and sys.getrefcount(_held[i]) == 2


def settle(timeout: float = _SETTLE_TIMEOUT) -> bool:
    """Wait (sleeping, which hands the GIL and the CPU to gloo's thread) until the backend
    has let go of every held buffer, then free them here. False if some were still held
    after ``timeout`` seconds (they stay held)."""
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while True:
        _release_let_go()
        if not _held:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


atexit.register(settle)


class _Layout:
    """Slots of a flat buffer: (kind, key) → (offset, shape)."""

    def __init__(self) -> None:
        self.slots: dict[tuple[str, str], tuple[int, torch.Size]] = {}
        self.size = 0

    def add(self, kind: str, key: str, shape: Sequence[int]) -> None:
        shape = torch.Size(shape)
        self.slots[(kind, key)] = (self.size, shape)
        self.size += shape.numel()

    def view(self, buffer: Tensor, kind: str, key: str) -> Tensor:
        offset, shape = self.slots[(kind, key)]
        return buffer[offset: offset + shape.numel()].view(shape)


def reduce_sums(stats: BackwardStatistics, shapes: dict[str, torch.Size],
                statistics: Sequence[Statistic], context: StatisticContext,
                sample_sum_keys: Sequence[str], projection_keys: Sequence[str],
                device: torch.device, unmerged: bool = False
                ) -> tuple[BackwardStatistics, list[int], dict[tuple[str, str], int], bool]:
    """Phase 1 (one all-reduce). ``shapes``: every tracked parameter, in the same order on
    every rank; ``statistics``: the requested statistics that ranks sum
    (:attr:`Combine.SUM`), each with one slot per parameter of the shape it declares for
    ``context`` (the layout depends on these arguments only, never on which values a rank
    happens to hold). ``projection_keys``: the keys of the requested projections; their
    number of directions per parameter is exchanged here for phase 2.
    Returns the global statistics without per-sample vectors (``micro_batches``: the most
    of any rank, so that every rank treats the step alike), the ranks' sample counts, the
    number of directions per (projection key, parameter) and whether any rank's g_nᵀḡ is
    undefined (``unmerged``: accumulation learned at its second backward pass)."""
    size, me = world_size(), rank()
    layout = _Layout()
    layout.add("header", "samples", [size])
    layout.add("header", "problems", [size])
    layout.add("header", "micro_batches", [size])
    layout.add("header", "unmerged", [size])
    for name, shape in shapes.items():
        layout.add("batch_grads", name, shape)
        layout.add("batch_grads?", name, [1])
    slots = {}  # statistic name → parameter → slot shape
    for statistic in statistics:
        slots[statistic.name] = {name: statistic.slot_shape(shape, context)
                                 for name, shape in shapes.items()}
        for name, shape in slots[statistic.name].items():
            layout.add(statistic.name, name, shape)
            layout.add(statistic.name + "?", name, [1])
    for key in sample_sum_keys:
        for name, shape in shapes.items():
            layout.add("sample_sums:" + key, name, shape)
            layout.add("sample_sums:" + key + "?", name, [1])
    for key in projection_keys:
        for name in shapes:
            layout.add("directions:" + key, name, [1])
            layout.add("directions:" + key + "?", name, [1])
    # reused from step to step (fresh 7 MB buffers cost page faults); every value read
    # from it below is copied out
    buffer = workspace().take("rank_sums", (layout.size,), torch.float64, device)[0].zero_()
    n = stats.num_samples
    layout.view(buffer, "header", "samples")[me] = n
    layout.view(buffer, "header", "problems")[me] = float(bool(stats.problems))
    layout.view(buffer, "header", "micro_batches")[me] = stats.micro_batches
    layout.view(buffer, "header", "unmerged")[me] = float(unmerged)
    for name, mean in stats.batch_grads.items():
        if name not in shapes:
            continue
        summed = layout.view(buffer, "batch_grads", name)
        summed.copy_(mean.reshape(shapes[name]))
        if n:
            summed.mul_(n)
        layout.view(buffer, "batch_grads?", name).fill_(1)
    for statistic in statistics:
        absent = stats.absent.get(statistic.name, {})
        for name, shape in slots[statistic.name].items():
            value = statistic.pack(stats, name, shape)
            if value is not None:
                layout.view(buffer, statistic.name, name).copy_(value)
                layout.view(buffer, statistic.name + "?", name).fill_(1)
            if name in absent:  # (this rank's samples did not reach it: counted, not flagged)
                layout.view(buffer, statistic.name, name).add_(
                    absent[name].to(buffer.device, torch.float64).reshape(shape))
    for key in sample_sum_keys:
        for name, value in stats.sample_sums.get(key, {}).items():
            if name in shapes:
                layout.view(buffer, "sample_sums:" + key, name).copy_(
                    value.double().reshape(shapes[name]))
                layout.view(buffer, "sample_sums:" + key + "?", name).fill_(1)

    for key in projection_keys:
        for name, value in stats.projections.get(key, {}).items():
            if name in shapes:
                layout.view(buffer, "directions:" + key, name).fill_(value.shape[0])
                layout.view(buffer, "directions:" + key + "?", name).fill_(1)

    all_reduce_sum(buffer)

    counts = [int(c) for c in layout.view(buffer, "header", "samples").tolist()]
    total = sum(counts)
    micro = int(layout.view(buffer, "header", "micro_batches").max().item())  # (ours too)
    out = BackwardStatistics(total, micro_batches=micro, ranks=size)
    out.problems = list(stats.problems)
    if not out.problems and bool(layout.view(buffer, "header", "problems").sum() > 0):
        out.problems.append(OTHER_RANK_PROBLEM)

    def present(kind: str, name: str) -> bool:
        return bool(layout.view(buffer, kind + "?", name).item() > 0)

    divisor = total if total else size
    summed_means = {}
    for name in shapes:
        if not present("batch_grads", name):
            continue
        # (a parameter this process did not reach: the dtype of its gradient elsewhere, the
        # parameter's — not float32, which rounded a float64 model's global mean)
        like = stats.batch_grads.get(name)
        dtype = like.dtype if like is not None else _gradient_dtype(context, name)
        summed_means[name] = summed = layout.view(buffer, "batch_grads", name)
        out.batch_grads[name] = summed.to(dtype, copy=True).div_(divisor)
    totals = RankTotals(total, summed_means, divisor)
    for statistic in statistics:
        target = out[statistic.name]
        for name in shapes:
            # a summed value needs the parameter's gradient on some rank
            if not (name in summed_means and present(statistic.name, name)):
                continue
            target[name] = statistic.unpack(layout.view(buffer, statistic.name, name), totals,
                                            name)
    for key in sample_sum_keys:
        for name in shapes:
            if present("sample_sums:" + key, name):
                out.sample_sums.setdefault(key, {})[name] = layout.view(
                    buffer, "sample_sums:" + key, name).clone()
    directions = {}
    for key in projection_keys:
        for name in shapes:
            ranks_with = layout.view(buffer, "directions:" + key + "?", name).item()
            if ranks_with > 0:
                directions[(key, name)] = round(
                    layout.view(buffer, "directions:" + key, name).item() / ranks_with)
    any_unmerged = bool(layout.view(buffer, "header", "unmerged").sum().item() > 0)
    return out, counts, directions, any_unmerged


def _gradient_dtype(context: StatisticContext, name: str) -> torch.dtype:
    """The dtype of parameter ``name``'s gradient (at least float32)."""
    param = context.params.get(name)
    if param is None or not param.is_floating_point():
        return torch.float32
    return torch.promote_types(param.dtype, torch.float32)


def gather_samples(local: BackwardStatistics, out: BackwardStatistics, counts: list[int],
                   names: Sequence[str], statistics: Sequence[Statistic],
                   directions: dict[tuple[str, str], int], device: torch.device) -> None:
    """Phase 2 (one all-reduce): the per-sample vectors of ``local`` (this rank's samples)
    into ``out`` as vectors over the global batch, in rank order. ``names``: the parameters
    in a fixed order; ``statistics``: the requested statistics that ranks gather
    (:attr:`Combine.GATHER`, [N] per parameter); ``directions``: the number of projection
    directions per (key, parameter), from :func:`reduce_sums`; all three the same on every
    rank. The individual losses ℓ_n always come along."""
    total, me = sum(counts), rank()
    if total == 0:
        return
    start = sum(counts[:me])
    rows: list[tuple[str, str]] = [("losses", "")]
    for statistic in statistics:
        rows.extend((statistic.name, name) for name in names)
    first_row = len(rows)
    buffer_rows = first_row + sum(directions.values())
    buffer = torch.zeros(buffer_rows, total + 1, dtype=torch.float64, device=device)
    # the last column flags rows present on some rank
    for index, (kind, name) in enumerate(rows):
        value = local.losses if kind == "losses" else local[kind].get(name)
        if value is not None:
            buffer[index, start: start + local.num_samples] = value.double().reshape(-1)
            buffer[index, total] = 1
    offset = first_row
    placed = {}
    for (key, name), k in directions.items():
        placed[(key, name)] = offset
        value = local.projections.get(key, {}).get(name)
        if value is not None and value.shape[0] == k:
            buffer[offset: offset + k, start: start + local.num_samples] = value.double()
            buffer[offset: offset + k, total] = 1
        offset += k

    all_reduce_sum(buffer)

    for index, (kind, name) in enumerate(rows):
        if buffer[index, total] == 0:
            continue
        values = buffer[index, :total].clone()
        if kind == "losses":
            out.losses = values
        else:
            out[kind][name] = values
    for (key, name), k in directions.items():
        offset = placed[(key, name)]
        if buffer[offset, total] > 0:
            out.projections.setdefault(key, {})[name] = buffer[offset: offset + k, :total].clone()


def gather_vector(local: Tensor, counts: list[int], device: torch.device) -> Tensor:
    """The per-sample vectors of every rank ([N_r] each) as one [N] vector in rank order
    (one all-reduce)."""
    me = rank()
    start = sum(counts[:me])
    buffer = torch.zeros(sum(counts), dtype=torch.float64, device=device)
    buffer[start: start + counts[me]] = local.double().to(device)
    all_reduce_sum(buffer)
    return buffer.to("cpu", copy=True)  # the buffer itself stays with all_reduce_sum
