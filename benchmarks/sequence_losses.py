"""``sequence_losses`` (the individual losses of a language model) on GPT-2-size logits:
the tokens as rows of a [B·T, V] view (the implementation) against cross-entropy over the
class dimension of the transposed logits [B, V, T] (how it was written before), forward
and backward, and the largest difference of the losses.

    python benchmarks/sequence_losses.py                  # CUDA if present, B=8, T=256
    python benchmarks/sequence_losses.py --device cpu --batch 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from cockpit.integrations.transformers import IGNORE_INDEX, sequence_losses


def transposed(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The former layout: the shifted slice, classes as dimension 1."""
    logits, labels = logits[:, :-1], labels[:, 1:]
    tokens = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX,
                             reduction="none")
    return tokens.sum(1) / (labels != IGNORE_INDEX).sum(1).to(tokens.dtype)


def timed(fn, logits: torch.Tensor, labels: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        z = logits.detach().requires_grad_()
        if z.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(z, labels).mean().backward()
        if z.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, args.length, args.vocab, generator=gen).to(args.device)
    labels = torch.randint(0, args.vocab, (args.batch, args.length), generator=gen
                           ).to(args.device)
    rows = timed(lambda z, y: sequence_losses(z, y, shift=True), logits, labels, args.repeats)
    old = timed(transposed, logits, labels, args.repeats)
    difference = (sequence_losses(logits, labels, shift=True) - transposed(logits, labels)
                  ).abs().max().item()
    print(f"sequence_losses, B={args.batch} T={args.length} V={args.vocab} on {args.device}, "
          f"forward + backward (median of {args.repeats - 1}): rows {rows * 1e3:.2f} ms, "
          f"transposed {old * 1e3:.2f} ms ({old / rows:.2f}×); largest difference "
          f"{difference:.2e}")


if __name__ == "__main__":
    main()
