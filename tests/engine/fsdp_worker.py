"""One process of a 2-process run of a model sharded by ``fully_shard`` (FSDP2; gloo on
127.0.0.1), started by tests/engine/test_fsdp.py: trains on its shard of each step's batch with
Cockpit attached and saves what Cockpit recorded on this rank, with the gradients the
optimizer stepped on (gathered to full tensors). On a process group of one it is the
reference run of a mixed precision policy, stepping on the gradients of the 2-process run."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import warnings

import torch
import torch.distributed as dist

from cockpit import Cockpit, configuration
from tests.exit_worker import leave_process_group
from tests.models import make_problem
from tests.split_reference import instruments


def shards(total: int, sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def shard_model(model: torch.nn.Module, config: dict) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"reshard_after_forward": config.get("reshard_after_forward", True)}
    if config.get("mixed_precision"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(**config["mixed_precision"])
    for child in model.children():  # each top-level layer or block with parameters
        if any(True for _ in child.parameters()):
            fully_shard(child, **kwargs)
    fully_shard(model, **kwargs)
    return model


def chosen_instruments(name: str) -> list:
    """A configuration by name, or with ``"instruments:<curvature>"`` every instrument of
    tests/split_reference.py with that curvature method (seeded: each rank, and the
    reference run, draw the same probes)."""
    if name.startswith("instruments:"):
        return instruments(name.removeprefix("instruments:"))
    return configuration(name)


def step_on(model: torch.nn.Module, gradients: dict[str, torch.Tensor]) -> None:
    """Put ``gradients`` (whole tensors) into p.grad, each rank its own shard: the optimizer
    then steps on them instead of on this run's own."""
    for name, p in model.named_parameters():
        if hasattr(p.grad, "to_local"):
            from torch.distributed.tensor import distribute_tensor

            shard = distribute_tensor(gradients[name].to(p.dtype), p.device_mesh, p.placements,
                                      src_data_rank=None)
            p.grad.to_local().copy_(shard.to_local())
        else:
            p.grad.copy_(gradients[name])


def train(rank: int, problem, model: torch.nn.Module, config: dict, chosen: list | None):
    """The training loop on this rank's shards, with Cockpit (``chosen``) or without (None);
    with a ``torch.amp.GradScaler`` where ``config["grad_scaler"]`` gives its initial scale.
    Returns the Cockpit and the gradients the optimizer stepped on (as p.grad held them,
    scaled by the GradScaler's factor)."""
    opt = config["make_optimizer"](model)
    micro = config.get("micro_batches", 1)
    scaler = (torch.amp.GradScaler("cpu", init_scale=config["grad_scaler"])
              if "grad_scaler" in config else None)
    cockpit = None if chosen is None else Cockpit(
        model, chosen, optimizer=opt, strict=True, write_on_all_ranks=True,
        grad_accumulation=micro > 1, grad_scaler=scaler)
    stepped = []
    for step, (x, y) in enumerate(config["batches"]):
        opt.zero_grad()
        part = shards(len(x), config["shard_sizes"], rank)
        xs, ys = x[part], y[part]
        if config.get("poisoned") == (rank, step):  # a non-finite batch on this rank only
            xs = torch.full_like(xs, math.nan)
        bounds = torch.linspace(0, len(xs), micro + 1).round().long().tolist()
        for k in range(micro):
            xb, yb = xs[bounds[k]: bounds[k + 1]], ys[bounds[k]: bounds[k + 1]]
            if micro > 1:  # reduce-scatter once, after the last micro-batch
                model.set_requires_gradient_sync(k == micro - 1)
            losses = problem.loss_fn(model(xb), yb)
            loss = losses.sum() / len(xs)
            with contextlib.nullcontext() if cockpit is None else cockpit(step, losses=losses):
                (loss if scaler is None else scaler.scale(loss)).backward()
        if "gradients" in config:  # a reference run: step where another run stepped
            step_on(model, config["gradients"][step])
        stepped.append({k: full(p.grad).clone() for k, p in model.named_parameters()})
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    if cockpit is not None:
        cockpit.close()
    return cockpit, stepped


def run(rank: int, world: int, port: int, config: dict, outdir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # the same initial model everywhere
        problem = make_problem(config["problem"], 48, dtype=config.get("dtype", torch.float64))
        model = shard_model(problem.model, config)
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always")
            chosen = chosen_instruments(config.get("configuration", "economy"))
            cockpit, stepped = train(rank, problem, model, config, chosen)
        plain = None
        if "grad_scaler" in config:  # the same loop without Cockpit, on the same model
            twin = shard_model(make_problem(config["problem"], 48,
                                            dtype=config.get("dtype", torch.float64)).model,
                               config)
            plain = train(rank, problem, twin, config, None)[1]
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as file:
            pickle.dump({"output": cockpit.get_output(), "notes": cockpit.get_notes(),
                         "stepped": stepped, "plain_stepped": plain,
                         "warnings": [str(w.message) for w in recorded]}, file)
        leave_process_group()  # barrier, os._exit(0): no gloo thread can abort our exit
    except BaseException:
        dist.destroy_process_group()
        raise


def run_resumed(rank: int, world: int, port: int, config: dict, outdir: str) -> None:
    """Distance over a resume: steps 0-1 with one Cockpit, whose ``state_dict()`` each rank
    saves; then a new Cockpit with ``resume=True`` loads it (after trying the other rank's,
    which must be refused) for steps 2-3: rank 0 its own slice of θ_0, rank 1 the whole
    θ_0. Saves its output and ‖θ_t − θ_0‖ per parameter from the whole tensors, measured by
    this worker."""
    from cockpit import quantities

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        problem = make_problem(config["problem"], 48)
        model = shard_model(problem.model, config)
        opt = config["make_optimizer"](model)
        initial = {k: full(p).detach().clone() for k, p in model.named_parameters()}
        logdir = os.path.join(outdir, f"log{rank}")
        state_file = os.path.join(outdir, "state{}.pt")
        distances, refused = [], None
        for phase, steps in enumerate((range(2), range(2, 4))):
            cockpit = Cockpit(model, [quantities.Distance()], optimizer=opt, strict=True,
                              write_on_all_ranks=True, logdir=logdir, resume=phase > 0)
            if phase:
                dist.barrier()  # every rank's state is saved
                try:
                    cockpit.load_state_dict(torch.load(state_file.format(1 - rank),
                                                       weights_only=True))
                except ValueError as error:
                    refused = str(error)
                own = torch.load(state_file.format(rank), weights_only=True)
                if rank == 1:  # a whole θ_0 (e.g. gathered by hand) is sliced on loading
                    own = {"initial_params": initial, "last_step": own["last_step"]}
                cockpit.load_state_dict(own)
            for step in steps:
                x, y = config["batches"][step]
                part = shards(len(x), config["shard_sizes"], rank)
                opt.zero_grad()
                distances.append({k: float((full(p).detach() - initial[k]).norm())
                                  for k, p in model.named_parameters()})
                losses = problem.loss_fn(model(x[part]), y[part])
                with cockpit(step, losses=losses):
                    (losses.sum() / len(x[part])).backward()
                opt.step()
            if not phase:
                torch.save(cockpit.state_dict(), state_file.format(rank))
            cockpit.close()
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as file:
            pickle.dump({"output": cockpit.get_output(), "distances": distances,
                         "refused": refused}, file)
        leave_process_group()
    except BaseException:
        dist.destroy_process_group()
        raise
