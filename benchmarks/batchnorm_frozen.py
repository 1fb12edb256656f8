"""How far the frozen-statistics individual gradients of BatchNorm networks are from the batch
gradient, and what the extra backward pass costs.

With ``Cockpit(..., batchnorm="frozen_statistics")`` the individual gradients g_n are those of
ℓ_n with every BatchNorm layer's batch mean and variance held constant. Their mean
ḡ_f = (1/|B|) Σ_n g_n is the gradient of the mean loss through a network whose BatchNorm
layers normalize with constant statistics — formed here independently of Cockpit's engine,
by a copy in eval mode whose running statistics are set to the batch's — and the batch
gradient g = ∇L is that of the network in training mode. Reported per measurement:
cos(ḡ_f, g), ‖ḡ_f‖ / ‖g‖, and the same cosine for the parameters below the last BatchNorm
layer only. Measured at initialization and after some SGD steps (momentum 0.9) on the
problems' synthetic images (class patterns plus noise: learnable), for a ResNet-18 for CIFAR
(He et al. 2016, 11.2 M parameters) and the DeepOBS Wide ResNet 40-4 (``cifar100_wrn404``).

Cost: the extra backward pass (Σ_n ℓ_n to every layer's output, BatchNorm nodes hooked, no
weight gradients; the per-sample statistics it feeds are the instruments' own cost) as a
ratio to the user's forward + backward pass, minima over repeats, in the same process.

    python benchmarks/batchnorm_frozen.py [--device cuda] [--batch-size 128]
        [--train-steps 60] [--every 30] [--nets resnet18,wrn404] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from cockpit.benchmark.problems import get_problem
from cockpit.engine.rules.batchnorm_frozen import FrozenStatisticsBackward


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18(num_classes: int = 10) -> nn.Sequential:
    """ResNet-18 for 32×32 inputs: 3×3 stem, four stages of two basic blocks (64–512)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU()]
    c_in = 64
    for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)]
        c_in = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


def frozen_mean_gradient(model: nn.Module, x, y) -> list[torch.Tensor]:
    """(1/|B|) Σ_n ∇ℓ_n with the batch statistics as constants (eval-mode copy)."""
    frozen = copy.deepcopy(model)
    inputs: dict[nn.Module, torch.Tensor] = {}
    bns = [m for m in frozen.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    hooks = [m.register_forward_hook(lambda m, a, o: inputs.__setitem__(m, a[0].detach()))
             for m in bns]
    with torch.no_grad():
        frozen(x)
    for hook in hooks:
        hook.remove()
    for module, a in inputs.items():
        dims = [0, *range(2, a.dim())]
        module.running_mean.copy_(a.mean(dims))
        module.running_var.copy_(a.var(dims, unbiased=False))
    frozen.eval()
    F.cross_entropy(frozen(x), y).backward()
    return [p.grad.detach().clone() for p in frozen.parameters()]


def below_last_batch_norm(model: nn.Module) -> list[bool]:
    """Per parameter: whether it comes before the last BatchNorm layer (module order)."""
    order = list(model.modules())
    last = max(i for i, m in enumerate(order) if isinstance(m, nn.modules.batchnorm._BatchNorm))
    owner = {id(p): i for i, m in enumerate(order) for p in m.parameters(recurse=False)}
    return [owner[id(p)] < last for p in model.parameters()]


def cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    dot = sum(float((u.double() * v.double()).sum()) for u, v in zip(a, b, strict=True))
    na = math.sqrt(sum(float(u.double().pow(2).sum()) for u in a))
    nb = math.sqrt(sum(float(v.double().pow(2).sum()) for v in b))
    return dot / (na * nb)


def measure(model: nn.Module, x, y) -> dict:
    frozen = frozen_mean_gradient(model, x, y)
    true_model = copy.deepcopy(model)
    F.cross_entropy(true_model(x), y).backward()
    true = [p.grad.detach() for p in true_model.parameters()]
    below = below_last_batch_norm(model)
    pick = [i for i, b in enumerate(below) if b]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in frozen))
    true_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in true))
    return {"cos": cosine(frozen, true), "norm_ratio": norm / true_norm,
            "cos_below_last_bn": cosine([frozen[i] for i in pick], [true[i] for i in pick])}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def extra_pass_cost(model: nn.Module, x, y, repeats: int, device: str) -> dict:
    """Minimum times of the user's forward + backward and of the frozen backward pass."""
    hooked = FrozenStatisticsBackward()
    outputs: list[torch.Tensor] = []

    def record(module, args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            outputs.append(output)
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                hooked.attach(module, args[0], output)

    handles = [m.register_forward_hook(record) for m in model.modules()
               if isinstance(m, nn.Conv2d | nn.Linear | nn.modules.batchnorm._BatchNorm)]
    step, frozen = math.inf, math.inf
    for _ in range(repeats + 1):  # the first is a warm-up
        outputs.clear()
        model.zero_grad()
        sync(device)
        t0 = time.perf_counter()
        losses = F.cross_entropy(model(x), y, reduction="none")
        sync(device)
        t1 = time.perf_counter()
        hooked.active = True
        torch.autograd.grad(losses, outputs, torch.ones_like(losses), retain_graph=True)
        hooked.active = False
        sync(device)
        t2 = time.perf_counter()
        losses.mean().backward()
        sync(device)
        t3 = time.perf_counter()
        step, frozen = min(step, (t1 - t0) + (t3 - t2)), min(frozen, t2 - t1)
    for handle in handles:
        handle.remove()
    model.zero_grad()
    return {"step_s": step, "frozen_pass_s": frozen, "ratio": frozen / step}


def run(name: str, args) -> list[dict]:
    problem_name = "cifar10_3c3d" if name == "resnet18" else "cifar100_wrn404"
    problem = get_problem(problem_name, batch_size=args.batch_size, seed=0, device=args.device)
    torch.manual_seed(0)
    model = (resnet18(10) if name == "resnet18" else problem.model).to(args.device)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    batches = iter(problem.train_loader)
    rows = []
    for step in range(args.train_steps + 1):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(problem.train_loader)
            x, y = next(batches)
        x, y = x.to(args.device), y.to(args.device)
        if step % args.every == 0:
            row = {"net": name, "step": step, "batch": len(y), **measure(model, x, y)}
            if step == 0:
                row.update(extra_pass_cost(model, x, y, args.repeats, args.device))
            rows.append(row)
            print(json.dumps(row), flush=True)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step % args.every == 0:
            rows[-1]["loss"] = float(loss)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--nets", default="resnet18,wrn404")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [row for name in args.nets.split(",") for row in run(name, args)]
    print("| network | step | |B| | loss | cos(ḡ_f, g) | ‖ḡ_f‖/‖g‖ | cos below last BN |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['net']} | {r['step']} | {r['batch']} | {r.get('loss', math.nan):.3f} | "
              f"{r['cos']:.4f} | {r['norm_ratio']:.3f} | {r['cos_below_last_bn']:.4f} |")
    for r in rows:
        if "ratio" in r:
            print(f"{r['net']}: forward+backward {r['step_s'] * 1e3:.1f} ms, frozen pass "
                  f"{r['frozen_pass_s'] * 1e3:.1f} ms ({r['ratio']:.2f}×)")


if __name__ == "__main__":
    main()
