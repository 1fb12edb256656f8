"""A Lightning run of a test problem with Cockpit's callback, used by
tests/integrations/test_lightning.py (in the test process, or as one process of a 2-process
DDP run started by the test)."""

from __future__ import annotations

import os
import pickle

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from cockpit.integrations.lightning import CockpitCallback
from tests.split_reference import instruments


class Batches(Dataset):
    """Ready-made micro-batches, served in order (one item = one micro-batch)."""

    def __init__(self, items: list[tuple]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple:
        return self.items[i]


class Module(pl.LightningModule):
    def __init__(self, model: torch.nn.Module, loss_fn, make_optimizer):
        super().__init__()
        self.model, self.loss_fn, self.make_optimizer = model, loss_fn, make_optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = self.loss_fn(self.model(x), y)
        return {"loss": losses.mean(), "losses": losses}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.loss_fn(self.model(x), y).mean())

    def configure_optimizers(self):
        return self.make_optimizer(self.model)


class StepRecorder(pl.Callback):
    """The gradient the optimizer stepped on (after clipping), per step."""

    def __init__(self):
        self.stepped: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module):
        def record(optimizer, args, kwargs):
            self.stepped.append({k: p.grad.detach().clone().double()
                                 for k, p in pl_module.model.named_parameters()})

        self._handle = trainer.optimizers[0].register_step_post_hook(record)


def micro_batches(batches: list[tuple], micro: int, part: slice | None = None) -> list[tuple]:
    """Each step's batch (or its ``part``) cut into ``micro`` equal micro-batches."""
    items = []
    for x, y in batches:
        if part is not None:
            x, y = x[part], y[part]
        for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
            items.append((xs, ys))
    return items


def fit(problem, items: list[tuple], make_optimizer, steps: int, accumulate: int = 1,
        callback: CockpitCallback | None = None, ckpt_path: str | None = None,
        extra_callbacks: tuple = (), val_items: list[tuple] | None = None, **trainer_kwargs
        ) -> tuple[CockpitCallback, StepRecorder, pl.Trainer]:
    callback = callback or CockpitCallback(instruments(), strict=True)
    recorder = StepRecorder()
    trainer_kwargs.setdefault("logger", False)
    trainer_kwargs.setdefault("enable_checkpointing", False)
    if val_items is None:
        trainer_kwargs.setdefault("limit_val_batches", 0)
    trainer = pl.Trainer(
        max_steps=steps, accumulate_grad_batches=accumulate,
        callbacks=[callback, recorder, *extra_callbacks],
        accelerator="cpu", enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, **trainer_kwargs)
    module = Module(problem.model, problem.loss_fn, make_optimizer)
    loader = DataLoader(Batches(items), batch_size=None, shuffle=False)
    validation = (None if val_items is None
                  else DataLoader(Batches(val_items), batch_size=None, shuffle=False))
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=validation,
                ckpt_path=ckpt_path)
    return callback, recorder, trainer


def run_ddp(rank: int, world: int, port: int, config: dict, outdir: str) -> None:
    """One process of a DDP run launched by the test (Lightning sees LOCAL_RANK and does
    not launch processes itself)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      NODE_RANK="0", LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    from tests.integrations.test_lightning import shard
    from tests.models import make_problem

    problem = make_problem(config["problem"], 48)
    part = shard(config["shard_sizes"], rank)
    items = micro_batches(config["batches"], config["micro"], part)
    callback, recorder, _ = fit(problem, items, config["make_optimizer"], len(config["batches"]),
                                accumulate=config["micro"], strategy="ddp", devices=world,
                                use_distributed_sampler=False)
    assert callback.cockpit is not None
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as file:
        pickle.dump({"output": callback.cockpit.get_output(),
                     "notes": callback.cockpit.get_notes(), "stepped": recorder.stepped}, file)
    from tests.exit_worker import leave_process_group

    leave_process_group()  # barrier, os._exit(0): no gloo thread can abort our exit
