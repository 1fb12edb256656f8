"""Cockpit in an ordinary training loop: economy every step, curvature every 25 steps, a
run log to look at live (``cockpit view runs/example``) or afterwards (``cockpit plot``).

    python examples/training_loop.py [--steps 200] [--logdir runs/example]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, configuration, every, quantities


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    # one run per run log: a new directory per run by default
    parser.add_argument("--logdir", default=time.strftime("runs/example-%Y%m%d-%H%M%S"))
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    # a small regression-style classification problem with synthetic data
    x_all, y_all = torch.randn(2048, 20), torch.randint(0, 5, (2048,))
    model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 5))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    instruments = [
        *configuration("economy"),
        quantities.HessTrace(every(25)),          # exact Hessian diagonal here (small net)
        quantities.HessMaxEV(every(25)),
        quantities.MeanGSNR(every(5)),
    ]
    cockpit = Cockpit(model, instruments, optimizer=opt, logdir=args.logdir)
    for step in range(args.steps):
        idx = torch.randint(0, len(y_all), (64,))
        x, y = x_all[idx], y_all[idx]
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")   # individual losses
        with cockpit(step, losses=losses):                        # the backward goes inside
            losses.mean().backward()
        opt.step()                                                # seen through step hooks
    cockpit.close()

    output = cockpit.get_output()
    # each instrument has its own schedule: report its last tracked step, not the run's
    for name in ("Loss", "NormTest", "MeanGSNR", "HessTrace", "HessMaxEV"):
        step, value = last_value(output, name)
        print(f"{name:>10}: {value:.4g} at step {step}" if step is not None
              else f"{name:>10}: not computed ({cockpit.get_notes().get(max(output), {})})")
    print(f"run log in {args.logdir}: cockpit plot {args.logdir} -o view.png")
    return output


def last_value(output: dict, name: str) -> tuple[int | None, float | None]:
    """The last step at which ``name`` was computed, and its value."""
    steps = [s for s in sorted(output) if output[s].get(name) is not None]
    return (steps[-1], output[steps[-1]][name]) if steps else (None, None)


if __name__ == "__main__":
    main()
