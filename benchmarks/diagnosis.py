"""Bug zoo: calibrate ``cockpit.diagnose`` on deliberately broken and on healthy runs.

Every run trains a small model for 60 steps with the economy configuration (DeadUnits included)
tracked at every step, then ``diagnose`` reads the recorded values. A bug run counts as named
when its code is among the *warnings or errors*; a healthy run counts as clean when it raises
no warning or error at all.

Problems: scikit-learn's digits (real 8×8 images, shipped with the package) with an MLP and
the demo CNN; DeepOBS-shaped synthetic problems (the input shapes of
``cockpit.benchmark.problems.paper_models``, standard-normal inputs) whose labels come from a
fixed random linear teacher so that they can be learned (uniform random labels would leave a
healthy run nothing to learn).

    python benchmarks/diagnosis.py --jobs 3       # the full zoo (2 seeds), a table at the end
    python benchmarks/diagnosis.py --seeds 1      # one seed per case (quicker)
    python benchmarks/diagnosis.py --only dead_units healthy

(``PYTHONPATH=src`` if the package is not installed.)
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cockpit import Cockpit, configuration, diagnose, quantities
from cockpit.benchmark.problems.digits import digits_cnn, load_digits_tensors, minibatches
from cockpit.benchmark.problems.paper_models import INPUT_SHAPES

STEPS = 60
Batches = Iterator[tuple[Tensor, Tensor]]


# ---------------------------------------------------------------------- problems
def digits_batches(seed: int, batch_size: int = 64, raw: bool = False) -> Batches:
    """Digits mini-batches, standardized (raw=False) or raw pixel values 0…16 (raw=True)."""
    from sklearn.datasets import load_digits

    if raw:
        data = load_digits()
        x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1)
        y = torch.tensor(data.target, dtype=torch.long)
    else:
        x, y, _, _ = load_digits_tensors(seed)
    yield from minibatches(x, y, batch_size, seed)


def teacher_batches(problem: str, seed: int, batch_size: int = 64, scale: float = 1.0,
                    shift: float = 0.0) -> Batches:
    """DeepOBS-shaped synthetic inputs (standard normal, then ·scale + shift) with labels of a
    fixed random linear teacher on the standardized inputs."""
    shape = INPUT_SHAPES[problem]
    dim = math.prod(shape)
    teacher = torch.randn(dim, 10, generator=torch.Generator().manual_seed(1234)) / dim**0.5
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(batch_size, *shape, generator=generator)
        y = (x.flatten(1) @ teacher).argmax(1)
        yield x * scale + shift, y


def mlp(inputs: int, widths: list[int], act: type[nn.Module] = nn.ReLU,
        gain: float | None = None) -> nn.Sequential:
    """Flatten – (Linear – act)* – Linear(→10). ``gain``: weights drawn N(0, gain²/fan_in)."""
    layers: list[nn.Module] = [nn.Flatten()]
    sizes = [inputs, *widths]
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), act()]
    layers.append(nn.Linear(sizes[-1], 10))
    if gain is not None:
        for module in layers:
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=gain / module.in_features**0.5)
                nn.init.zeros_(module.bias)
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------- runs
@dataclass
class Setup:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: Batches
    zero_grad: bool = True
    nan_at: int | None = None  # a NaN pixel in the inputs from this step on


@dataclass
class Case:
    """One kind of run: ``expected`` is the code it must raise (None: healthy)."""

    name: str
    expected: str | None
    build: Callable[[int], Setup]
    steps: int = STEPS
    tags: list[str] = field(default_factory=list)


def _sgd(model, lr, momentum=0.9):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def _adam(model, lr=1e-3):
    return torch.optim.Adam(model.parameters(), lr=lr)


def _seeded(fn: Callable[[int], Setup]) -> Callable[[int], Setup]:
    def build(seed: int) -> Setup:
        torch.manual_seed(seed)
        return fn(seed)
    return build


def _dead_mlp(seed: int) -> Setup:
    model = mlp(64, [128, 64])
    with torch.no_grad():  # 70 % of the first hidden layer's units start dead
        model[1].bias[: int(0.7 * 128)] = -100.0
    return Setup(model, _sgd(model, 0.05), digits_batches(seed))


def _dead_logreg_mlp(seed: int) -> Setup:
    model = mlp(784, [64, 64])
    with torch.no_grad():
        model[3].bias[: int(0.6 * 64)] = -100.0
    return Setup(model, _adam(model), teacher_batches("mnist_mlp", seed))


def _frozen_first(seed: int) -> Setup:
    model = mlp(64, [64, 64])
    params = [p for name, p in model.named_parameters() if not name.startswith("1.")]
    return Setup(model, torch.optim.SGD(params, lr=0.05, momentum=0.9), digits_batches(seed))


def _frozen_cnn(seed: int) -> Setup:
    model = digits_cnn()
    params = [p for name, p in model.named_parameters() if not name.startswith("6.")]
    return Setup(model, torch.optim.Adam(params, lr=1e-3), digits_batches(seed))


def _frozen_synth(seed: int) -> Setup:
    model = mlp(784, [64])
    return Setup(model, torch.optim.AdamW(model[3].parameters()),
                 teacher_batches("mnist_mlp", seed))


def _one_layer_lr(model: nn.Module, prefix: str, make, lr: float, factor: float = 100.0
                  ) -> torch.optim.Optimizer:
    """An optimizer whose parameters under ``prefix`` get ``factor`` × the learning rate (a
    wrong parameter group)."""
    fast = [p for name, p in model.named_parameters() if name.startswith(prefix)]
    rest = [p for name, p in model.named_parameters() if not name.startswith(prefix)]
    return make([{"params": rest}, {"params": fast, "lr": factor * lr}], lr=lr)


CASES: list[Case] = [
    # healthy runs: tuned SGD with momentum, default Adam/AdamW
    Case("healthy: digits MLP, SGD momentum", None,
         _seeded(lambda s: (m := mlp(64, [64, 64]),
                            Setup(m, _sgd(m, 0.05), digits_batches(s)))[1])),
    Case("healthy: digits CNN, SGD momentum", None,
         _seeded(lambda s: (m := digits_cnn(), Setup(m, _sgd(m, 0.05), digits_batches(s)))[1])),
    Case("healthy: digits MLP, Adam", None,
         _seeded(lambda s: (m := mlp(64, [64, 64]), Setup(m, _adam(m), digits_batches(s)))[1])),
    Case("healthy: digits CNN, AdamW", None,
         _seeded(lambda s: (m := digits_cnn(),
                            Setup(m, torch.optim.AdamW(m.parameters()), digits_batches(s)))[1])),
    Case("healthy: synthetic logreg 784→10, SGD lr 0.01 momentum", None,
         _seeded(lambda s: (m := mlp(784, []),
                            Setup(m, _sgd(m, 0.01), teacher_batches("mnist_logreg", s)))[1])),
    Case("healthy: synthetic MLP 784-64-64-10, Adam", None,
         _seeded(lambda s: (m := mlp(784, [64, 64]),
                            Setup(m, _adam(m), teacher_batches("mnist_mlp", s)))[1])),
    # non_finite
    Case("NaN pixel in the data from step 30", "non_finite",
         _seeded(lambda s: (m := mlp(64, [64, 64]),
                            Setup(m, _sgd(m, 0.05), digits_batches(s), nan_at=30))[1])),
    Case("SGD lr 1e3 on the digits CNN", "non_finite",
         _seeded(lambda s: (m := digits_cnn(), Setup(m, _sgd(m, 1e3), digits_batches(s)))[1])),
    # lr_too_large
    Case("SGD lr 2.0 (no momentum), digits MLP", "lr_too_large",
         _seeded(lambda s: (m := mlp(64, [64, 64]),
                            Setup(m, _sgd(m, 2.0, 0.0), digits_batches(s)))[1])),
    Case("SGD lr 1.0 momentum 0.9, digits CNN", "lr_too_large",
         _seeded(lambda s: (m := digits_cnn(), Setup(m, _sgd(m, 1.0), digits_batches(s)))[1])),
    Case("Adam lr 0.1, synthetic MLP", "lr_too_large",
         _seeded(lambda s: (m := mlp(784, [64, 64]),
                            Setup(m, _adam(m, 0.1), teacher_batches("mnist_mlp", s)))[1])),
    # lr_too_small
    Case("SGD lr 1e-5, digits MLP", "lr_too_small",
         _seeded(lambda s: (m := mlp(64, [64, 64]),
                            Setup(m, _sgd(m, 1e-5, 0.0), digits_batches(s)))[1])),
    Case("Adam lr 1e-7, digits CNN", "lr_too_small",
         _seeded(lambda s: (m := digits_cnn(), Setup(m, _adam(m, 1e-7), digits_batches(s)))[1])),
    Case("SGD lr 1e-4 momentum, synthetic logreg", "lr_too_small",
         _seeded(lambda s: (m := mlp(784, []),
                            Setup(m, _sgd(m, 1e-4), teacher_batches("mnist_logreg", s)))[1])),
    # unscaled_inputs
    Case("raw digits pixels 0…16, MLP, SGD lr 1e-3", "unscaled_inputs",
         _seeded(lambda s: (m := mlp(64, [64, 64]),
                            Setup(m, _sgd(m, 1e-3), digits_batches(s, raw=True)))[1])),
    Case("raw digits pixels 0…16, CNN, Adam", "unscaled_inputs",
         _seeded(lambda s: (m := digits_cnn(),
                            Setup(m, _adam(m), digits_batches(s, raw=True)))[1])),
    Case("synthetic inputs ·50 + 100, MLP, Adam", "unscaled_inputs",
         _seeded(lambda s: (m := mlp(784, [64, 64]),
                            Setup(m, _adam(m), teacher_batches("mnist_mlp", s, scale=50.0,
                                                               shift=100.0)))[1])),
    # vanishing_gradients
    Case("deep sigmoid MLP (8 layers), digits, SGD", "vanishing_gradients",
         _seeded(lambda s: (m := mlp(64, [64] * 8, nn.Sigmoid),
                            Setup(m, _sgd(m, 0.05), digits_batches(s)))[1])),
    Case("deep sigmoid MLP (6 layers), synthetic, Adam", "vanishing_gradients",
         _seeded(lambda s: (m := mlp(784, [64] * 6, nn.Sigmoid),
                            Setup(m, _adam(m), teacher_batches("mnist_mlp", s)))[1])),
    # exploding_gradients
    Case("deep ReLU MLP, init gain 3, digits, Adam", "exploding_gradients",
         _seeded(lambda s: (m := mlp(64, [64] * 6, gain=3.0),
                            Setup(m, _adam(m), digits_batches(s)))[1])),
    Case("deep ReLU MLP, init gain 3, synthetic, Adam", "exploding_gradients",
         _seeded(lambda s: (m := mlp(784, [64] * 5, gain=3.0),
                            Setup(m, _adam(m), teacher_batches("mnist_mlp", s)))[1])),
    # dead_units
    Case("70 % of a ReLU layer's units dead (bias −100), digits", "dead_units",
         _seeded(_dead_mlp)),
    Case("60 % of a ReLU layer's units dead, synthetic, Adam", "dead_units",
         _seeded(_dead_logreg_mlp)),
    # frozen_parameters
    Case("first layer left out of the optimizer, digits MLP", "frozen_parameters",
         _seeded(_frozen_first)),
    Case("a Linear layer left out of the optimizer, digits CNN", "frozen_parameters",
         _seeded(_frozen_cnn)),
    Case("only the last layer in AdamW, synthetic MLP", "frozen_parameters",
         _seeded(_frozen_synth)),
    # update_ratio
    Case("one layer at 100× the learning rate, digits MLP, Adam", "update_ratio",
         _seeded(lambda s: (m := mlp(64, [64, 64]),
                            Setup(m, _one_layer_lr(m, "3.", torch.optim.Adam, 1e-3),
                                  digits_batches(s)))[1])),
    Case("one layer at 100× the learning rate, digits CNN, SGD momentum", "update_ratio",
         _seeded(lambda s: (m := digits_cnn(),
                            Setup(m, _one_layer_lr(m, "6.", lambda g, lr: torch.optim.SGD(
                                g, lr=lr, momentum=0.9), 5e-4), digits_batches(s)))[1])),
    Case("one layer at 100× the learning rate, synthetic MLP, AdamW", "update_ratio",
         _seeded(lambda s: (m := mlp(784, [64, 64]),
                            Setup(m, _one_layer_lr(m, "1.", torch.optim.AdamW, 1e-3),
                                  teacher_batches("mnist_mlp", s)))[1])),
    # missing_zero_grad
    Case("no zero_grad(), digits MLP, SGD", "missing_zero_grad",
         _seeded(lambda s: (m := mlp(64, [64, 64]),
                            Setup(m, _sgd(m, 0.01), digits_batches(s), zero_grad=False))[1])),
    Case("no zero_grad(), digits CNN, Adam", "missing_zero_grad",
         _seeded(lambda s: (m := digits_cnn(),
                            Setup(m, _adam(m), digits_batches(s), zero_grad=False))[1])),
    # noise_dominated
    Case("batch of 2, SGD lr 0.1 momentum, digits MLP", "noise_dominated",
         _seeded(lambda s: (m := mlp(64, [64, 64]),
                            Setup(m, _sgd(m, 0.1), digits_batches(s, batch_size=2)))[1])),
    Case("batch of 2, SGD lr 0.05 momentum, digits CNN", "noise_dominated",
         _seeded(lambda s: (m := digits_cnn(),
                            Setup(m, _sgd(m, 0.05), digits_batches(s, batch_size=2)))[1])),
    Case("batch of 4, Adam lr 1e-2, synthetic MLP", "noise_dominated",
         _seeded(lambda s: (m := mlp(784, [64, 64]),
                            Setup(m, _adam(m, 1e-2), teacher_batches("mnist_mlp", s,
                                                                     batch_size=4)))[1])),
]


def instruments() -> list[quantities.Quantity]:
    """Economy (DeadUnits included; GradientMismatch is recorded by Cockpit at every tracked
    step), tracked every step."""
    chosen = configuration("economy")
    if "DeadUnits" not in {q.name for q in chosen}:
        chosen.append(quantities.DeadUnits())
    return chosen


def train(case: Case, seed: int, steps: int | None = None) -> dict:
    """Train one run of ``case``; returns ``get_output()``."""
    import warnings

    setup = case.build(seed)
    model, opt = setup.model, setup.optimizer
    cockpit = Cockpit(model, instruments(), optimizer=opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps or case.steps):
            x, y = next(setup.batches)
            if setup.nan_at is not None and step >= setup.nan_at:
                x = x.clone()
                x.view(len(x), -1)[:, 0] = float("nan")
            if setup.zero_grad:
                opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()
    return cockpit.get_output()


def judge(case: Case, output: dict) -> tuple[bool, list[str]]:
    """(passed, codes raised as warning/error)."""
    raised = [f.code for f in diagnose(output) if f.is_problem]
    if case.expected is None:
        return not raised, raised
    return case.expected in raised, raised


def _run_one(job: tuple[int, int, int | None]) -> tuple[int, int, bool, list[str]]:
    index, seed, steps = job
    torch.set_num_threads(1)
    case = CASES[index]
    passed, raised = judge(case, train(case, seed, steps))
    return index, seed, passed, raised


def run_zoo(cases: list[Case], seeds: list[int], steps: int | None = None,
            progress: bool = True, jobs: int = 1) -> list[tuple[Case, int, bool, list[str]]]:
    """Train and judge every case × seed (in ``jobs`` worker processes)."""
    from tqdm.auto import tqdm

    work = [(CASES.index(c), s, steps) for c in cases for s in seeds]
    bar = tqdm(total=len(work), desc="bug zoo", unit="run", disable=not progress)
    done = []
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for result in pool.imap_unordered(_run_one, work):
                done.append(result)
                bar.update()
    else:
        for job in work:
            done.append(_run_one(job))
            bar.update()
    bar.close()
    done.sort(key=lambda r: (r[0], r[1]))
    return [(CASES[i], seed, passed, raised) for i, seed, passed, raised in done]


def table(results) -> str:
    rows: dict[str, list] = {}
    for case, _, passed, raised in results:
        key = case.expected or "healthy (no warning)"
        rows.setdefault(key, []).append((case, passed, raised))
    lines = ["| code | runs | named correctly | other warnings raised |", "|---|---|---|---|"]
    for key, entries in rows.items():
        ok = sum(p for _, p, _ in entries)
        others = sorted({c for _, _, r in entries for c in r if c != key})
        lines.append(f"| `{key}` | {len(entries)} | {ok}/{len(entries)} "
                     f"({100 * ok / len(entries):.0f} %) | {', '.join(others) or '–'} |")
    bugs = [p for c, _, p, _ in results if c.expected is not None]
    healthy = [p for c, _, p, _ in results if c.expected is None]
    if bugs:
        lines.append(f"| **all bug runs** | {len(bugs)} | {sum(bugs)}/{len(bugs)} "
                     f"({100 * sum(bugs) / len(bugs):.0f} %) | |")
    if healthy:
        lines.append(f"| **healthy runs without any warning** | {len(healthy)} | "
                     f"{sum(healthy)}/{len(healthy)} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2, help="seeds per case (default 2)")
    parser.add_argument("--steps", type=int, default=None, help=f"steps (default {STEPS})")
    parser.add_argument("--only", nargs="*", default=None,
                        help="codes to run ('healthy' for the healthy runs)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cases = [c for c in CASES if args.only is None
             or (c.expected or "healthy") in args.only]
    results = run_zoo(cases, list(range(args.seeds)), args.steps, jobs=args.jobs)
    if args.verbose:
        for case, seed, passed, raised in results:
            print(f"{'ok  ' if passed else 'MISS'} {case.name} (seed {seed}): {raised}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
