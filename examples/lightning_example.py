"""Cockpit in a Lightning Trainer: one callback, and ``training_step`` returns the individual
losses next to the loss. Gradient accumulation of 2 micro-batches; a run log to look at live
(``cockpit view runs/lightning``) or afterwards (``cockpit plot runs/lightning``); the
scalars also in Lightning's CSV logger.

    python examples/lightning_example.py [--steps 100] [--logdir runs/lightning]
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cockpit.integrations.lightning import CockpitCallback


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 5))

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = F.cross_entropy(self.model(x), y, reduction="none")
        return {"loss": losses.mean(), "losses": losses}   # individual losses for Cockpit

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    # one run per run log: a new directory per run by default
    parser.add_argument("--logdir", default=time.strftime("runs/lightning-%Y%m%d-%H%M%S"))
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2048, 20), torch.randint(0, 5, (2048,)))
    cockpit = CockpitCallback("economy", logdir=args.logdir)
    trainer = pl.Trainer(max_steps=args.steps, accumulate_grad_batches=2, callbacks=[cockpit],
                         logger=CSVLogger(args.logdir, name="csv"), accelerator="cpu",
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Classifier(), DataLoader(data, batch_size=32, shuffle=True))

    output = cockpit.cockpit.get_output()
    last = max(output)
    print(f"step {last}: loss {output[last]['Loss']:.3f} on {output[last]['BatchSize']:.0f} "
          f"samples, norm test {output[last]['NormTest']:.3f}")
    print(f"run log in {args.logdir}: cockpit plot {args.logdir} -o view.png")
    return output


if __name__ == "__main__":
    main()
