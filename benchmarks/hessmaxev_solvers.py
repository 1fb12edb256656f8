"""HessMaxEV solvers on DeepOBS cifar10_3c3d: power iteration (original) vs Lanczos.

At every step of a short SGD run on synthetic CIFAR-10-shaped data, λ_max of the
mini-batch Hessian (eq. 26) is computed twice from Hessian-vector products on the same
forward graph:

* power iteration as in the original package (cold random start, at most 100
  iterations, stop when the estimate changes by < 1e-6 + 1e-3·|λ|);
* Lanczos as HessMaxEV runs it (random start, stopping rule on λ_max's own error: relative
  accuracy ``tol`` except with probability 1e-3), for each ``--tols``.

Optionally (``--reference``) 80 Lanczos steps from a random start (no stopping rule) give
the reference value to measure both solvers' actual errors. Run:

    PYTHONPATH=src python benchmarks/hessmaxev_solvers.py --batch-size 32 --steps 10
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from cockpit.benchmark.problems.paper_models import cifar10_3c3d
from cockpit.curvature import HessianVectorProduct, lanczos_max_eigenvalue, power_iteration


def relative_error(value: float, reference: float | None) -> str:
    return "" if reference is None else f" {abs(value - reference) / abs(reference):>7.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--tols", type=float, nargs="+", default=[1e-3, 1e-2])
    parser.add_argument("--reference", action="store_true", help="tight Lanczos reference")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = cifar10_3c3d()
    params = [p for p in model.parameters() if p.requires_grad]
    num_params = sum(p.numel() for p in params)
    optimizer = torch.optim.SGD(params, lr=args.lr)
    data_gen = torch.Generator().manual_seed(args.seed)
    solver_gen = torch.Generator().manual_seed(args.seed + 1)
    print(
        f"cifar10_3c3d: {num_params:,} parameters, batch {args.batch_size}, "
        f"{torch.get_num_threads()} threads; err = |λ − ref| / ref"
    )
    err_head = f" {'err':>7}" if args.reference else ""
    header = f"{'step':>4} {'loss':>6} | {'power':>8} {'#HVP':>4}{err_head}"
    for tol in args.tols:
        header += f" | {f'Lcz {tol:.0e}':>9} {'#HVP':>4}{err_head}"
    if args.reference:
        header += f" | {'ref λ':>8}"
    print(header + f" | {'s/HVP':>5}")

    names = ["power", *[f"lanczos tol={tol:g}" for tol in args.tols]]
    totals = dict.fromkeys(names, 0)
    errors: dict[str, list[float]] = {name: [] for name in names}
    seconds, hvps = 0.0, 0
    for step in range(args.steps):
        x = torch.randn(args.batch_size, 3, 32, 32, generator=data_gen)
        y = torch.randint(0, 10, (args.batch_size,), generator=data_gen)
        optimizer.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        loss = losses.mean()

        start = time.perf_counter()
        with HessianVectorProduct(loss, params) as hvp:
            results = [power_iteration(hvp.matvec, num_params, generator=solver_gen)]
            for tol in args.tols:
                res = lanczos_max_eigenvalue(hvp.matvec, num_params, tol=tol,
                                             generator=solver_gen)
                results.append(res)
            seconds += time.perf_counter() - start
            hvps += hvp.num_calls
            ref = None
            if args.reference:
                ref = lanczos_max_eigenvalue(hvp.matvec, num_params, tol=1e-12, max_iter=80,
                                             generator=solver_gen).value
        row = f"{step:>4} {loss.item():>6.3f}"
        for name, res in zip(names, results, strict=True):
            totals[name] += res.num_matvecs
            if ref is not None:
                errors[name].append(abs(res.value - ref) / abs(ref))
            flag = "" if res.converged else "*"
            row += (
                f" | {res.value:>8.3f} {res.num_matvecs:>3}{flag:1}{relative_error(res.value, ref)}"
            )
        if ref is not None:
            row += f" | {ref:>8.3f}"
        print(row + f" | {seconds / hvps:>5.2f}", flush=True)

        loss.backward()  # the user's backward still works after the HVPs
        optimizer.step()

    print("(* = not converged; s/HVP is the running mean, reference HVPs excluded)")
    for name in names:
        ratio = totals["power"] / max(totals[name], 1)
        summary = f"{name:>20}: {totals[name]:>4} HVPs ({ratio:.1f}x fewer than power)"
        if errors[name]:
            summary += f", max err {max(errors[name]):.1e}"
        print(summary)
    print(f"{seconds / hvps:.3f} s per HVP (batch {args.batch_size})")


if __name__ == "__main__":
    main()
