"""torch.distributed: with DistributedDataParallel on 2 processes (gloo, 127.0.0.1) every
rank's instruments describe the global batch, exactly as one process on the whole batch
(tests/split_reference.py), also with uneven shards and with gradient accumulation."""

from __future__ import annotations

import pickle
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cockpit import Cockpit
from tests import ddp_worker
from tests.models import make_problem
from tests.split_reference import MISUSE, assert_same_values, whole_batch_run

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def strip(output: dict) -> dict:
    """DDP's parameter names carry the wrapper's "module." prefix."""
    return {step: {k.replace("/module.", "/"): v for k, v in values.items()}
            for step, values in output.items()}


@pytest.mark.parametrize(("name", "shard_sizes", "micro", "make_optimizer"), [
    ("mlp_relu", [12, 12], 1, sgd),
    ("cnn", [7, 13], 1, adam),  # uneven shards: DDP's mean of shard means is not uniform
    ("mlp_relu", [10, 14], 2, sgd),  # accumulation inside each process (no_sync)
])
def test_every_rank_reports_the_global_batch(tmp_path, name, shard_sizes, micro,
                                             make_optimizer):
    problem = make_problem(name, 48)
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(STEPS):
        index = torch.randint(0, 48, (sum(shard_sizes),), generator=generator)
        batches.append((problem.x[index], problem.y[index]))
    config = {"problem": name, "batches": batches, "shard_sizes": shard_sizes,
              "micro_batches": micro, "make_optimizer": make_optimizer}
    mp.start_processes(ddp_worker.run, args=(2, free_port(), config, str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    ranks = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as file:
            ranks.append(pickle.load(file))
    uniform = len(set(shard_sizes)) == 1 and micro == 1
    expected, _ = whole_batch_run(make_problem(name, 48), batches, make_optimizer,
                                  gradients=None if uniform else ranks[0]["stepped"])
    for result in ranks:
        assert not [m for m in result["warnings"] if MISUSE.search(m)], result["warnings"]
        output = strip(result["output"])
        assert assert_same_values(output, expected, range(STEPS)) > 30 * STEPS
        for step in range(STEPS):
            assert output[step]["BatchSize"] == sum(shard_sizes)
            assert output[step]["HessMaxEV"] is None
        assert all(output[step]["Alpha"] is not None for step in range(STEPS - 1))


def test_sharded_models_are_refused_with_the_way_out():
    class FSDPLinear(torch.nn.Linear):  # the class name fully_shard gives a module
        pass

    with pytest.raises(NotImplementedError, match="DistributedDataParallel"):
        Cockpit(torch.nn.Sequential(FSDPLinear(2, 2)))
