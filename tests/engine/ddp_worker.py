"""One process of a 2-process DistributedDataParallel run (gloo on 127.0.0.1), started by
tests/engine/test_distributed.py: trains on its shard of each step's batch with Cockpit attached
and saves what Cockpit recorded on this rank."""

from __future__ import annotations

import contextlib
import os
import pickle
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from cockpit import Cockpit
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.reduction import ranks as cockpit_distributed
from cockpit.engine.reduction.step_reduction import StepReduction
from tests.exit_worker import leave_process_group
from tests.models import make_problem
from tests.split_reference import instruments


def shards(total: int, sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _count_union_projections() -> list[int]:
    """Count the reduction point's passes over kept layer calls that form g_nᵀḡ (taken
    when the synchronized gradient is not proportional to the global mean)."""
    count = [0]
    original = StepReduction._gram_over_union

    def counted(self, mean):
        count[0] += 1
        return original(self, mean)

    StepReduction._gram_over_union = counted
    return count


def all_reduce_mean(model: torch.nn.Module, world: int) -> None:
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= world


def run(rank: int, world: int, port: int, config: dict, outdir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        problem = make_problem(config["problem"], 48)  # the same initial model everywhere
        batches = config["batches"]
        # "inside"/"after": no DDP, gradients all-reduced by hand inside or after the block;
        # "never": each process trains on its own shards without synchronizing
        by_hand = config.get("allreduce_by_hand")
        model = problem.model if by_hand else DistributedDataParallel(
            problem.model, **config.get("ddp_kwargs", {}))
        projections = _count_union_projections()
        opt = config["make_optimizer"](model)
        # micro-batches per step of each process (a process may split its shard, the other
        # not), and the shard sizes of each step where they change
        micro = config.get("micro_batches_per_rank", [config.get("micro_batches", 1)] * world)[rank]
        hint = config.get("grad_accumulation", micro > 1)
        caught = warnings.catch_warnings(record=True)
        recorded = caught.__enter__()
        warnings.simplefilter("always")
        # the histograms' accelerator path (what a GPU runs), on the CPU
        histogram_device._forced = config.get("accelerator_path", False)
        if "attach_timeout" in config:
            cockpit_distributed.ATTACH_TIMEOUT = config["attach_timeout"]
        # the processes that run Cockpit (default: all); the others train without it
        watched = rank in config.get("cockpit_ranks", range(world))
        chosen = config.get("instruments", instruments)()
        cockpit = Cockpit(model, chosen, optimizer=opt, strict=True,
                          write_on_all_ranks=True, grad_accumulation=hint,
                          **config.get("cockpit_kwargs", {})) if watched else None
        stepped = []
        # "join": DDP's join() for uneven inputs, this rank training on its first
        # ``steps_per_rank`` batches
        steps = config.get("steps_per_rank", [len(batches)] * world)[rank]
        with model.join() if config.get("join") else contextlib.nullcontext():
            for step, (x, y) in enumerate(batches[:steps]):
                opt.zero_grad()
                part = shards(len(x), config.get("shard_sizes_per_step", {}).get(
                    step, config["shard_sizes"]), rank)
                xs, ys = x[part], y[part]
                bounds = torch.linspace(0, len(xs), micro + 1).round().long().tolist()
                for k in range(micro if len(xs) else 1):
                    xb, yb = xs[bounds[k]: bounds[k + 1]], ys[bounds[k]: bounds[k + 1]]
                    last = k == micro - 1
                    context = model.no_sync() if not last else contextlib.nullcontext()
                    with context:
                        losses = problem.loss_fn(model(xb), yb)
                        with cockpit(step, losses=losses) if watched else contextlib.nullcontext():
                            (losses.sum() / len(xs)).backward()
                            if by_hand == "inside":
                                all_reduce_mean(model, world)
                if by_hand == "after":
                    all_reduce_mean(model, world)
                stepped.append({k.removeprefix("module."): p.grad.clone()
                                for k, p in model.named_parameters()})
                opt.step()
        if watched:
            cockpit.close()
        caught.__exit__(None, None, None)
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as file:
            pickle.dump({"output": cockpit.get_output() if watched else None,
                         "notes": cockpit.get_notes() if watched else None,
                         "stepped": stepped, "union_projections": projections[0],
                         "warnings": [str(w.message) for w in recorded]}, file)
        leave_process_group()  # barrier, os._exit(0): no gloo thread can abort our exit
    except BaseException:
        dist.destroy_process_group()
        raise
