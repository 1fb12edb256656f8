"""One process of a 2-process DistributedDataParallel run with NCCL, one GPU per process,
started by tests/test_cuda.py: trains on its half of each step's batch with Cockpit attached
and saves what Cockpit recorded on this rank."""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from cockpit import Cockpit
from tests.models import make_problem
from tests.split_reference import instruments


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def run(rank: int, world: int, port: int, data: list, outdir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank)
        model = DistributedDataParallel(make_problem("mlp_relu", 48).model.to(device),
                                        device_ids=[rank])
        problem = make_problem("mlp_relu", 48)
        opt = sgd(model)
        cockpit = Cockpit(model, instruments(), optimizer=opt, strict=True,
                          write_on_all_ranks=True)
        for step, (x, y) in enumerate(data):
            half = len(x) // world
            xs = x[rank * half:(rank + 1) * half].to(device)
            ys = y[rank * half:(rank + 1) * half].to(device)
            opt.zero_grad()
            losses = problem.loss_fn(model(xs), ys)
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as file:
            pickle.dump({"output": cockpit.get_output()}, file)
        dist.barrier()
    finally:
        dist.destroy_process_group()
