"""One process of a 2-process DDP run of the Hugging Face Trainer (gloo on 127.0.0.1, the
processes started by tests/engine/test_transformers.py): saves what Cockpit recorded on
this rank."""

from __future__ import annotations

import os
import pickle
from pathlib import Path


def run(rank: int, world: int, port: int, outdir: str, micro: int = 1) -> None:
    """``micro``: the Trainer's gradient_accumulation_steps (each rank's half of a batch cut
    in ``micro`` micro-batches)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch

    torch.set_num_threads(1)
    from tests.engine.test_transformers import bert, ddp_data, ddp_instruments, hf_train

    _, shards = ddp_data(micro)
    # the Trainer's IterableDatasetShard hands process r the items r, r + world, …
    items = [item for group in zip(*shards, strict=True) for item in group]
    callback, stepped = hf_train(bert(), items, micro, Path(outdir) / f"r{rank}",
                                 ddp_instruments(), max_grad_norm=0.0, ddp=True)
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as file:
        pickle.dump({"output": callback.cockpit.get_output(), "stepped": stepped}, file)
    from tests.exit_worker import leave_process_group

    leave_process_group()  # barrier, os._exit(0): no gloo thread can abort our exit
