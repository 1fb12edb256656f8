"""What is live at the peak of a tracked step on CUDA, by where it was allocated: GPT-2 124M
(from its config, bf16 autocast, B = 8, T = 256, AdamW), economy against the untracked step.

The peak is measured as ``gpu_overhead.py``'s GPT-2 cell does (building the model, its
optimizer and Cockpit and three steps, above what was allocated before: parameters,
optimizer state and Cockpit's copies count). Then one more step runs under
``torch.cuda.memory`` history with Python stacks; replaying its allocations finds the step's
peak, and each block live there is named by the innermost Cockpit frame that allocated it,
else the innermost ``transformers``/``torch.optim`` frame (the training's own tensors).
Blocks allocated before that step (parameters, optimizer state, θ_0 where it stays on the
device, s_{t−1}) are the ``persistent`` number.

    python benchmarks/gpu_memory_peak.py                  # CUDA, about 40 s on an H200
    python benchmarks/gpu_memory_peak.py --device cpu     # dry run: a 2-layer model
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from cockpit import Cockpit, configuration
from cockpit.integrations.transformers import sequence_losses


def build(config: GPT2Config, data: list[torch.Tensor], device: str, tracked: bool):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cockpit = Cockpit(model, configuration("economy"), optimizer=opt) if tracked else None

    def step(i: int) -> None:
        ids = data[i % len(data)]
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(ids).logits
        losses = sequence_losses(logits.float(), ids, shift=True)
        if cockpit is None:
            losses.mean().backward()
        else:
            with cockpit(i, losses=losses):
                losses.mean().backward()
        opt.step()

    return step, cockpit


def allocated_where(frames: list[dict]) -> str:
    """The innermost Cockpit frame of an allocation, else the training's own frame."""
    for frame in frames:
        if "/cockpit/" in frame["filename"]:
            return "cockpit " + frame["filename"].split("/cockpit/")[-1] + ":" + frame["name"]
    for frame in frames:
        if "transformers" in frame["filename"] or "torch/optim" in frame["filename"]:
            return frame["filename"].split("/")[-1] + ":" + frame["name"]
    return frames[0]["filename"].split("/")[-1] + ":" + frames[0]["name"] if frames else "?"


def live_at_peak(trace: list[dict]) -> tuple[int, dict[str, int]]:
    """The peak of a device trace's allocations (bytes above its start) and the bytes live
    there by :func:`allocated_where`."""
    current, peak, peak_index = 0, 0, -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            current += event["size"]
        elif event["action"] == "free_completed":
            current -= event["size"]
        if current > peak:
            peak, peak_index = current, index
    live: dict[int, dict] = {}
    for event in trace[:peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    kinds: collections.Counter = collections.Counter()
    for event in live.values():
        kinds[allocated_where(event.get("frames", []))] += event["size"]
    return peak, dict(kinds)


def measure(config: GPT2Config, data: list[torch.Tensor], device: str, tracked: bool,
            top: int) -> None:
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    step, cockpit = build(config, data, device, tracked)
    for i in range(3):
        step(i)
    record: dict = {"tracked": tracked}
    if cuda:
        torch.cuda.synchronize()
        record["peak_MiB"] = round((torch.cuda.max_memory_allocated() - start) / 2**20)
        record["persistent_MiB"] = round((torch.cuda.memory_allocated() - start) / 2**20)
        torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
        step(3)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, kinds = live_at_peak(snapshot["device_traces"][0])
        record["step_peak_above_persistent_MiB"] = round(peak / 2**20)
    else:
        step(3)
        kinds = {}
    print(json.dumps(record), flush=True)
    for where, size in sorted(kinds.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   {size / 2**20:8.1f} MiB  {where}")
    if cockpit is not None:
        cockpit.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--top", type=int, default=12, help="allocation sites listed")
    args = parser.parse_args()
    if args.device == "cuda":
        config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)
        batch, length = 8, 256
    else:  # a dry run
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000)
        batch, length = 2, 32
    generator = torch.Generator().manual_seed(0)
    data = [torch.randint(0, config.vocab_size, (batch, length), generator=generator)
            .to(args.device) for _ in range(4)]
    for tracked in (False, True):
        measure(config, data, args.device, tracked, args.top)


if __name__ == "__main__":
    main()
