"""Cost of the loop checks (cockpit/loop_checks/) per tracked step, as ratios to one
untracked forward-backward pass of the same model in the same process: GradientMismatch at
the optimizer step, the gradients-held check at the first block (p.grad zero tensors, as
after ``zero_grad(set_to_none=False)``; with the default ``set_to_none=True`` it only reads
attributes), arming and disarming the outside-backward hooks.

    python benchmarks/loop_checks.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from cockpit.benchmark.problems.paper_models import cifar10_3c3d, mnist_mlp
from cockpit.loop_checks import (
    OutsideBackwardWatch,
    gradient_mismatch,
    parameters_holding_gradient,
)


def best(fn, repeats: int = 9) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    for name, model, shape in [("mnist_mlp", mnist_mlp(), (128, 784)),
                               ("cifar10_3c3d", cifar10_3c3d(), (128, 3, 32, 32))]:
        x, y = torch.randn(*shape), torch.randint(0, 10, (shape[0],))
        params = dict(model.named_parameters())

        def forward_backward(model=model, x=x, y=y):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()

        forward_backward()
        mean = {k: p.grad / 3 for k, p in params.items()}
        watch = OutsideBackwardWatch(params, lambda: False)
        base = best(forward_backward)
        mismatch = best(lambda params=params, mean=mean: gradient_mismatch(params, mean, [1.0]))
        model.zero_grad(set_to_none=False)
        held = best(lambda params=params: parameters_holding_gradient(params))
        arm = best(lambda watch=watch, params=params: (watch.arm(True, list(params)),
                                                       watch.disarm()))
        print(f"{name}: forward-backward {base * 1e3:.1f} ms; GradientMismatch "
              f"{mismatch / base:.3f}×, held check {held / base:.3f}×, hooks "
              f"{arm / base:.4f}×")


if __name__ == "__main__":
    main()
