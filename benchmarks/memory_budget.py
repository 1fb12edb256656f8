"""Peak memory and step time of economy on a GPT-2-shaped model with and without a memory
budget for the individual gradients.

The model is a ``transformers`` GPT-2 with the real vocabulary (50257 tokens, token embedding
tied to the output layer) and small blocks (default n_layer = 2, n_embd = 256, |B| = 8,
T = 256): the embedding's individual gradients are |B| × 50257 × n_embd numbers, summed
over its two uses (tied weights). Each mode runs in a fresh subprocess:

* ``untracked``: plain training steps;
* ``no budget``: economy tracked every step, ``memory_budget=None`` (every layer's |B|×D
  individual gradients at once, as before the budget existed);
* ``budget``: economy with ``memory_budget=--budget`` (layers above it in sample chunks).

Peak memory: on CPU the subprocess's peak resident set size, on CUDA
``torch.cuda.max_memory_allocated``; "extra" is the peak minus the untracked run's. Step time:
the median of the timed steps (after ``--warmup`` steps).

    python benchmarks/memory_budget.py                         # CPU
    python benchmarks/memory_budget.py --device cuda --n-layer 12 --n-embd 768 --autocast
"""

from __future__ import annotations

import argparse

from _common import add_gpt2_shape_arguments, run_worker

WORKER = r"""
import inspect, json, resource, statistics, sys, time
import torch, torch.nn.functional as F
import transformers
from cockpit import Cockpit

device, mode, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
n_layer, n_embd, batch, length = map(int, sys.argv[4:8])
warmup, steps, autocast = int(sys.argv[8]), int(sys.argv[9]), sys.argv[10] == "1"
if device == "cpu":
    torch.set_num_threads(2)
torch.manual_seed(0)
config = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64),
                                 n_positions=max(length, 1024), resid_pdrop=0.0,
                                 embd_pdrop=0.0, attn_pdrop=0.0)
model = transformers.GPT2LMHeadModel._from_config(config).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
tokens = torch.randint(0, config.vocab_size, (batch, length), device=device)
# (a Cockpit from before the budget existed has no such argument: it never chunks)
known = "memory_budget" in inspect.signature(Cockpit).parameters
limit = {"memory_budget": None if mode == "none" else budget} if known else {}
cockpit = (None if mode == "untracked" else
           Cockpit(model, "economy", optimizer=opt, **limit))

def sync():
    if device == "cuda":
        torch.cuda.synchronize()

def step(i):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens).logits
    per_token = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                tokens[:, 1:].reshape(-1), reduction="none")
    losses = per_token.view(batch, -1).mean(1)
    if cockpit is None:
        losses.mean().backward()
    else:
        with cockpit(i, losses=losses):
            losses.mean().backward()
    opt.step()

times = []
for i in range(warmup + steps):
    sync()
    start = time.perf_counter()
    step(i)
    sync()
    if i >= warmup:
        times.append(time.perf_counter() - start)
notes = {}
if cockpit is not None:
    cockpit.close()
    notes = {s: n["Cockpit"] for s, n in cockpit.get_notes().items() if "Cockpit" in n}
peak = (torch.cuda.max_memory_allocated() / 2**20 if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
print(json.dumps({"step_s": statistics.median(times), "peak_mib": peak,
                  "chunked": next(iter(notes.values()), "")}))
"""

MODES = (("untracked", "untracked"), ("none", "economy, no budget"),
         ("budget", "economy, budget"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_gpt2_shape_arguments(parser)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", default="untracked,none,budget",
                        help="which of untracked, none, budget to run")
    args = parser.parse_args()
    modes = [(m, label) for m, label in MODES if m in args.modes.split(",")]
    results = {}
    for mode, label in modes:
        results[mode] = run_worker(
            WORKER, args.device, mode, str(args.budget), str(args.n_layer), str(args.n_embd),
            str(args.batch), str(args.length), str(args.warmup), str(args.steps),
            "1" if args.autocast else "0")
        print(f"{label}: {results[mode]}", flush=True)
    base = results.get("untracked", {"step_s": float("nan"), "peak_mib": float("nan")})
    print(f"\nGPT-2 shape n_layer={args.n_layer} n_embd={args.n_embd} |B|={args.batch} "
          f"T={args.length} on {args.device}; budget {args.budget / 2**20:.0f} MiB")
    print("| mode | step [s] | × untracked | peak [MiB] | extra over untracked [MiB] |")
    print("|---|---|---|---|---|")
    for mode, label in modes:
        r = results[mode]
        print(f"| {label} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | "
              f"{r['peak_mib']:.0f} | {r['peak_mib'] - base['peak_mib']:.0f} |")
    if results.get("budget", {}).get("chunked"):
        print(f"\nnote: {results['budget']['chunked']}")


if __name__ == "__main__":
    main()
