"""A model sharded by torch's ``fully_shard`` (FSDP2) is refused with the way out: Cockpit
needs each layer's whole parameter to form individual gradients."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from cockpit import Cockpit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_fully_shard_is_refused_naming_distributed_data_parallel():
    from torch.distributed.fsdp import fully_shard

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(),
                                    torch.nn.Linear(4, 2))
        fully_shard(model[0])
        fully_shard(model)
        with pytest.raises(NotImplementedError, match="DistributedDataParallel"):
            Cockpit(model)
        with pytest.raises(NotImplementedError, match="sharded"):
            Cockpit(model[2])  # an inner module of a sharded model: its parameters are shards
    finally:
        dist.destroy_process_group()
