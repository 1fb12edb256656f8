"""Dot products g_{l,n}ᵀu_{l,k} of a stack of Linear layers' individual gradients with a few
directions per layer: [L, K, D] against [L, N, D], D up to millions, K and N small.

``torch.bmm(u, G.transpose(1, 2))`` reduces over the whole of D in one product with an
output of K × N per layer; cuBLAS's kernel for it took 20 ms a stack on an H200 at GPT-2
124M's shapes. This times the alternatives (CUDA events, median of ``--repeats``) and their
largest difference from a float64 reference, relative to the largest dot product; "kernel"
is the one Cockpit takes on CUDA (``cockpit.engine.row_dots``: one pass over G).

    python benchmarks/stacked_dots.py                     # CUDA: GPT-2 124M's stacks
    python benchmarks/stacked_dots.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from cockpit.engine import row_dots


def by_bmm(rows: Tensor, u: Tensor) -> Tensor:
    """[L, K, D] × [L, D, N] in one batched product (the reduction over all of D)."""
    return torch.bmm(u, rows.transpose(1, 2))


def by_bmm_transposed(rows: Tensor, u: Tensor) -> Tensor:
    """[L, N, D] × [L, D, K], transposed back."""
    return torch.bmm(rows, u.transpose(1, 2)).transpose(1, 2)


def by_products(rows: Tensor, u: Tensor) -> Tensor:
    """One elementwise product and sum over D per direction (a scratch of G's size)."""
    return torch.stack([(rows * u[:, k].unsqueeze(1)).sum(2) for k in range(u.shape[1])], 1)


def split(parts: int) -> Callable[[Tensor, Tensor], Tensor]:
    """D split into ``parts`` blocks that one batched product reduces side by side, then a
    sum over the blocks: [L·P, K, D/P] × [L·P, D/P, N] with G's blocks as strided views."""

    def dots(rows: Tensor, u: Tensor) -> Tensor:
        layers, n, d = rows.shape
        k = u.shape[1]
        q = d // parts
        head = d - d % parts
        # G_l's block p: rows[l, :, p·q:(p+1)·q]; one strided view per layer [P, q, N]
        g = torch.stack([rows[l, :, :head].reshape(n, parts, q).permute(1, 2, 0)
                         for l in range(layers)]) if layers > 1 else \
            rows[0, :, :head].reshape(n, parts, q).permute(1, 2, 0).unsqueeze(0)
        v = u[:, :, :head].reshape(layers, k, parts, q).transpose(1, 2)  # [L, P, K, q]
        out = torch.matmul(v, g).sum(1)  # [L, K, N]
        if head < d:
            out = out + torch.bmm(u[:, :, head:], rows[:, :, head:].transpose(1, 2))
        return out

    return dots


def split_by_layer(parts: int) -> Callable[[Tensor, Tensor], Tensor]:
    """As :func:`split`, one batched product per layer (G_l's blocks as one strided view:
    no copy of G)."""

    def dots(rows: Tensor, u: Tensor) -> Tensor:
        layers, n, d = rows.shape
        k = u.shape[1]
        q = d // parts
        head = d - d % parts
        out = []
        for layer in range(layers):
            g = rows[layer, :, :head].reshape(n, parts, q).permute(1, 2, 0)  # [P, q, N]
            v = u[layer, :, :head].reshape(k, parts, q).transpose(0, 1)  # [P, K, q]
            part = torch.bmm(v, g).sum(0)
            if head < d:
                part = part + u[layer, :, head:] @ rows[layer, :, head:].T
            out.append(part)
        return torch.stack(out)

    return dots


def by_layer(rows: Tensor, u: Tensor) -> Tensor:
    """One product per layer, u_l G_lᵀ."""
    return torch.stack([u[l] @ rows[l].T for l in range(rows.shape[0])])


def by_kernel(rows: Tensor, u: Tensor) -> Tensor:
    """Cockpit's Triton kernel (``cockpit.engine.row_dots``): one pass over G for all K."""
    return row_dots.row_dots(rows, u).transpose(1, 2)


FORMS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "bmm": by_bmm, "bmm transposed": by_bmm_transposed, "per layer": by_layer,
    "products": by_products, "split 256": split(256), "split 256 by layer": split_by_layer(256),
    "split 1024": split(1024), "kernel": by_kernel,
}


def timed(form: Callable[[Tensor, Tensor], Tensor], rows: Tensor, u: Tensor,
          repeats: int) -> float:
    """Median milliseconds of one call."""
    form(rows, u)
    times = []
    for _ in range(repeats):
        if rows.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            form(rows, u)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            form(rows, u)
            times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes (a dry run)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    # (layers, samples, D): GPT-2 124M's stacks at B = 8 within half the default budget, and
    # a sample chunk of its tied embedding (one layer: "per layer" is DenseSampleGrads' one
    # product U Gᵀ)
    cases = ([(3, 2, 3000), (2, 2, 1000)] if args.quick else
             [(4, 8, 2304 * 768), (3, 8, 3072 * 768), (12, 8, 768 * 768),
              (1, 3, 50257 * 768)])
    directions = [1, 3]
    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator(device=args.device).manual_seed(0)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"# {name}, torch {torch.__version__}, float32; ms per stack (× bmm's); "
          "largest difference from float64 / largest dot product")
    print("| L × N × D | K | " + " | ".join(FORMS) + " |")
    print("|---|---|" + "---|" * len(FORMS))
    for layers, n, d in cases:
        rows = torch.randn(layers, n, d, device=args.device, generator=generator)
        for k in directions:
            u = torch.randn(layers, k, d, device=args.device, generator=generator)
            exact = by_bmm(rows.double(), u.double())
            scale = float(exact.abs().max())
            cells, first = [], None
            for label, form in FORMS.items():
                if label == "kernel" and not row_dots.available(rows, k, threshold=False):
                    cells.append("–")  # (CUDA with Triton only)
                    continue
                error = float((form(rows, u).double() - exact).abs().max()) / scale
                ms = timed(form, rows, u, args.repeats)
                first = ms if first is None else first
                cells.append(f"{ms:.3f} ({ms / first:.2f}×, {error:.0e})")
            print(f"| {layers} × {n} × {d} | {k} | " + " | ".join(cells) + " |", flush=True)
        del rows


if __name__ == "__main__":
    main()
