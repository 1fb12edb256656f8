"""What is live at the peak of a tracked step on CUDA, by where it was allocated: GPT-2 124M
(from its config, bf16 autocast, B = 8, T = 256, AdamW), economy against the untracked step.

The model, its step and the peak are ``gpu_overhead.py``'s GPT-2 cell's (``Clock.built``:
building the model, its optimizer and Cockpit and three steps, above what was allocated
before: parameters, optimizer state and Cockpit's copies count). Then one more step runs under
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

from gpu_overhead import Clock, gpt2_problem, gpt2_trainer


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


def measure(clock: Clock, config, data: list[torch.Tensor], tracked: bool, top: int) -> None:
    made: list = []

    def factory():
        step, cockpit = gpt2_trainer(config, data, clock.device, tracked)
        made.append(cockpit)
        return step

    start = torch.cuda.memory_allocated() if clock.cuda else 0
    step, peak = clock.built(factory)
    record: dict = {"tracked": tracked}
    kinds: dict[str, int] = {}
    if clock.cuda:
        record["peak_MiB"] = round(peak or 0)
        record["persistent_MiB"] = round((torch.cuda.memory_allocated() - start) / 2**20)
        torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
        step(3)
        clock.sync()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        step_peak, kinds = live_at_peak(snapshot["device_traces"][0])
        record["step_peak_above_persistent_MiB"] = round(step_peak / 2**20)
    else:
        step(3)
    print(json.dumps(record), flush=True)
    for where, size in sorted(kinds.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   {size / 2**20:8.1f} MiB  {where}")
    if made[0] is not None:
        made[0].close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--top", type=int, default=12, help="allocation sites listed")
    args = parser.parse_args()
    clock = Clock(torch.device(args.device))
    config, data = gpt2_problem(clock.device, quick=not clock.cuda)  # (a CPU: a dry run)
    for tracked in (False, True):
        measure(clock, config, data, tracked, args.top)


if __name__ == "__main__":
    main()
