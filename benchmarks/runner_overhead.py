"""Overhead of the benchmark runner (``cockpit.benchmark.runner.run``) over a bare training
loop doing the same work, on DeepOBS's CIFAR-10 3C3D (synthetic data of the real shapes).

Both train the same model from the same seed on the same mini-batches for ``--epochs``
epochs and evaluate train-eval / valid / test loss and accuracy before training and after
every epoch (the work the DeepOBS protocol asks for); the bare loop is written plainly
here, the runner adds its bookkeeping (per-step loss readout, LR scheduler, result JSON,
validation of the run). Runs alternate (bare, runner, bare, runner, …) in this process; the
ratio of the medians is reported. With ``--cockpit economy`` the runner also tracks every
step with Cockpit (for reference; the goal of ≤ 2 % is without Cockpit).

    python benchmarks/runner_overhead.py [--epochs 2] [--repeats 5] [--cockpit economy]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from cockpit.benchmark.problems import get_problem
from cockpit.benchmark.runner import RunSpec, _seed_everything, run

PROBLEM = "cifar10_3c3d"


def bare(epochs: int, seed: int = 0) -> float:
    """The same training and evaluation as the runner, written plainly; returns a checksum."""
    _seed_everything(seed)
    problem = get_problem(PROBLEM, seed=seed)
    model = problem.model
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    @torch.no_grad()
    def evaluate():
        model.eval()
        for loader in (problem.train_eval_loader, problem.valid_loader, problem.test_loader):
            total = correct = count = 0.0
            for x, y in loader:
                out = model(x)
                total += float(problem.losses(out, y).sum())
                correct += float(problem.accuracy(out, y)) * len(y)
                count += len(y)
        model.train()
        return total / count

    evaluate()
    for _ in range(epochs):
        for x, y in problem.train_loader:
            opt.zero_grad()
            loss = problem.losses(model(x), y).mean() + problem.regularizer()
            loss.backward()
            opt.step()
        last = evaluate()
    return last


def with_runner(epochs: int, output: str, cockpit: str | None, seed: int = 0) -> float:
    spec = RunSpec(PROBLEM, "sgd", {"lr": 0.01, "momentum": 0.9}, seed=seed, epochs=epochs,
                   cockpit=cockpit, output=output)
    result = run(spec, progress=False, overwrite=True)
    return result["test_losses"][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cockpit", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as output:
        bare(1), with_runner(1, output, args.cockpit)  # warm-up
        times: dict[str, list[float]] = {"bare": [], "runner": []}
        for _ in range(args.repeats):
            for name, fn in (("bare", lambda: bare(args.epochs)),
                             ("runner", lambda: with_runner(args.epochs, output, args.cockpit))):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    b, r = statistics.median(times["bare"]), statistics.median(times["runner"])
    print(json.dumps({
        "problem": PROBLEM, "epochs": args.epochs, "cockpit": args.cockpit,
        "bare_s": round(b, 3), "runner_s": round(r, 3), "ratio": round(r / b, 4),
        "bare_all": [round(t, 3) for t in times["bare"]],
        "runner_all": [round(t, 3) for t in times["runner"]],
        "threads": torch.get_num_threads(), "load": os.getloadavg(),
    }))


if __name__ == "__main__":
    main()
