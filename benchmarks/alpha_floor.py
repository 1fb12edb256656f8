"""The least work Alpha must add to a step tracked every step, as a ratio to that step.

Alpha at step t needs s_tᵀg_n(θ_t) and, for α_{t−1}, s_{t−1}ᵀg_n(θ_t) for every sample n:
projections of the individual gradients on two directions (for momentum SGD the update basis
is {g_t, b_old} and s_{t−1} ∥ b_old, so two; for Adam {s_{t−1}, ŝ_t}). Per layer, the
cheapest exact way to project on two directions is measured here on the real layer inputs
and output gradients of one step:

* convolution: the faster of (a) materializing the |B| individual gradients (one batched
  product, the layer's weight-gradient FLOPs) and reading them twice, and (b) two
  convolutions of the input with the directions (forward-pass FLOPs each);
* Linear: one GEMM δ·U per direction (the gradient's row is the Gram closed form);
* after the step: snapshot θ_t, form θ_{t+1} − θ_t and verify the predicted span (the SGD
  basis fit), the least that checks the prediction against the real update.

The sum is a lower bound for any implementation of this design on this machine: it leaves
out Python, hooks, the loss statistics and the copies the basis needs.

    python benchmarks/alpha_floor.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from _common import timed
from cockpit.benchmark.problems.paper_models import BUILDERS, synthetic_batches
from cockpit.engine.rules.conv import ConvSampleGrads, _explicit_padding
from cockpit.engine.rules.sample_grads import OuterSampleGrads
from cockpit.engine.update_fit import fit_basis_coefficients


def best_of(fn, repeats: int = 7) -> float:
    return timed(fn, repeats)[1]


def measure(problem: str) -> None:
    torch.manual_seed(0)
    model = BUILDERS[problem]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    batches = synthetic_batches(problem, 128)
    recorded: dict[nn.Module, list] = {}

    def forward_hook(module, args, output):
        recorded[module] = [args[0].detach(), None]
        output.register_hook(lambda g: recorded[module].__setitem__(1, g.detach() * 128))

    def step(record: bool = False) -> None:
        handles = [m.register_forward_hook(forward_hook) for m in model.modules()
                   if record and isinstance(m, nn.Conv2d | nn.Linear)]
        x, y = next(batches)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        for h in handles:
            h.remove()

    for _ in range(4):
        step()
    untracked = timed(step, 9)[0]  # median
    step(record=True)

    rows = []
    for module, (a, delta) in recorded.items():
        if isinstance(module, nn.Conv2d):
            x = _explicit_padding(module, a)
            us = [torch.randn_like(module.weight) for _ in range(2)]

            def materialize(module=module, x=x, delta=delta, us=us):
                grads = ConvSampleGrads(module, x, delta)
                grads.materialize()
                return grads.dots_many(us)  # on the materialized gradients

            def convolve(module=module, x=x, delta=delta, us=us):
                grads = ConvSampleGrads(module, x, delta)
                grads._materialize_for_projections = lambda k: False
                return grads.dots_many(us)

            cost = min(best_of(materialize), best_of(convolve))
            rows.append((f"conv {tuple(module.weight.shape)}", cost))
        else:
            u = [torch.randn_like(module.weight)]
            sg = OuterSampleGrads(delta, a)
            cost = best_of(lambda sg=sg, u=u: (sg.dots_many(u), sg.gram_mean()))
            rows.append((f"linear {tuple(module.weight.shape)}", cost))

    params = list(model.parameters())
    basis = [torch.randn(2, *p.shape) for p in params]

    def after_step():
        snapshot = [p.detach().clone() for p in params]
        updates = [torch.sub(p.detach(), s, out=s) for p, s in zip(params, snapshot, strict=True)]
        for b, s in zip(basis, updates, strict=True):
            fit_basis_coefficients(b, s)

    rows.append(("snapshot, update, basis fit", best_of(after_step)))
    total = sum(cost for _, cost in rows)
    print(f"\n{problem}: untracked step {untracked * 1e3:.0f} ms")
    for name, cost in rows:
        print(f"  {name:>32}: {cost * 1e3:6.1f} ms")
    print(f"  {'floor':>32}: {total * 1e3:6.1f} ms → Alpha ≥ {1 + total / untracked:.2f}× "
          "the untracked step")


if __name__ == "__main__":
    torch.set_num_threads(2)
    for name in ("cifar10_3c3d", "fmnist_2c2d"):
        measure(name)
