"""What Cockpit holds at a tracked economy step's peak of allocated memory, per kind, on a
GPT-2-shaped model (the shape of ``memory_budget.py``), and the peak against the untracked
step's.

Allocated bytes are counted exactly from the CPU allocator's events (``torch.profiler`` with
``profile_memory``: every allocation and free with its address and size), the equivalent
of ``torch.cuda.max_memory_allocated`` on the CPU, unlike the resident set size, which
counts freed pages the allocator keeps. One step is profiled after ``--warmup`` steps:

* held before the step (allocated in earlier steps): every tensor storage reachable from
  the Cockpit object and the scratch workspaces, named by the path it was found by
  (``_run.initial``: θ₀ for Distance, …), minus the model's parameters, their gradients and
  the optimizer's state;
* allocated within the step and live at its peak: grouped by the innermost Cockpit
  function on the allocating call's Python stack (``with_stack``), or "training" where no
  Cockpit function is on it.

    python benchmarks/memory_held.py                        # n_layer 2, n_embd 256
    python benchmarks/memory_held.py --n-embd 768 --autocast
    python benchmarks/memory_held.py --path accelerator     # as on a GPU (stacked layers)

``--path accelerator`` forces the accelerators' paths on the CPU (histograms, small
parameters side by side, layers of one shape stacked), ``accelerator-unstacked`` the same
with every layer formed alone: what the stacks hold beyond one layer at a time.
"""

from __future__ import annotations

import argparse

from _common import add_gpt2_shape_arguments, run_worker

WORKER = r"""
import collections, gc, json, re, sys, types
import torch, torch.nn.functional as F
import transformers
from torch.profiler import ProfilerActivity, profile
from cockpit import Cockpit
from cockpit.engine import workspace as ws_module

mode, budget = sys.argv[1], int(sys.argv[2])
n_layer, n_embd, batch, length = map(int, sys.argv[3:7])
warmup, autocast, path = int(sys.argv[7]), sys.argv[8] == "1", sys.argv[9]
if path != "cpu":
    from cockpit.engine.histograms import device as histogram_device
    histogram_device._forced = True
if path == "accelerator-unstacked":
    from cockpit.engine import stacked
    stacked.capacity = lambda sg, budget: 0
    stacked.norm_capacity = lambda x, delta, budget: 0
torch.set_num_threads(2)
torch.manual_seed(0)
config = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64),
                                 n_positions=max(length, 1024), resid_pdrop=0.0,
                                 embd_pdrop=0.0, attn_pdrop=0.0)
model = transformers.GPT2LMHeadModel._from_config(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
tokens = torch.randint(0, config.vocab_size, (batch, length))
cockpit = (None if mode == "untracked"
           else Cockpit(model, "economy", optimizer=opt, memory_budget=budget))
phase = torch.profiler.record_function

def step(i):
    opt.zero_grad(set_to_none=True)
    with phase("phase: forward"), torch.autocast(device_type="cpu", dtype=torch.bfloat16,
                                                 enabled=autocast):
        logits = model(tokens).logits
        per_token = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                    tokens[:, 1:].reshape(-1), reduction="none")
        losses = per_token.view(batch, -1).mean(1)
    if cockpit is None:
        with phase("phase: backward"):
            losses.mean().backward()
    else:
        with phase("phase: block exit"), cockpit(i, losses=losses), phase("phase: backward"):
            losses.mean().backward()
    with phase("phase: optimizer step"):
        opt.step()

def storage_key(t):
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())

def user_storages():
    keys = set()
    for p in model.parameters():
        keys.add(storage_key(p))
        if p.grad is not None:
            keys.add(storage_key(p.grad))
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                keys.add(storage_key(v))
    for b in model.buffers():
        keys.add(storage_key(b))
    keys.add(storage_key(tokens))
    return keys

def name_of(key):
    if isinstance(key, tuple) and key:  # e.g. a workspace's (purpose, dtype, device)
        key = key[0]
    return repr(key) if isinstance(key, str | int) else "."

def held(root, skip):
    # breadth first from root: the first path that reaches each storage names it
    found, seen = {}, set()
    queue = collections.deque([(root, "cockpit")])
    stop = (torch.nn.Module, torch.optim.Optimizer, types.ModuleType, type)
    while queue:
        obj, path = queue.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta" or obj.is_sparse:
                continue
            try:
                key = storage_key(obj)
            except Exception:
                continue
            if key not in skip and key[1] > 0 and key not in found:
                found[key] = path
            continue
        if isinstance(obj, stop) and path != "cockpit":
            continue
        if isinstance(obj, dict):
            items = [(f"{path}[{name_of(k)}]", v) for k, v in obj.items()]
        elif isinstance(obj, list | tuple | set | frozenset | collections.deque):
            items = [(f"{path}[]", v) for v in obj]
        elif isinstance(obj, types.FunctionType):
            items = []
            for c in obj.__closure__ or ():
                try:
                    items.append((f"{path}.<{obj.__name__}>", c.cell_contents))
                except ValueError:
                    pass
        elif isinstance(obj, types.MethodType):
            items = [(path, obj.__self__), (path, obj.__func__)]
        else:
            items = []
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict):
                items += [(f"{path}.{k}", v) for k, v in d.items()]
            for slot in getattr(type(obj), "__slots__", ()) or ():
                if isinstance(slot, str) and hasattr(obj, slot):
                    items.append((f"{path}.{slot}", getattr(obj, slot)))
            if not items and not isinstance(obj, str | bytes | int | float | bool):
                items = [(f"{path}.?", r) for r in gc.get_referents(obj)]
        for child_path, child in items:
            if child is None or isinstance(child, str | bytes | int | float | bool):
                continue
            queue.append((child, child_path))
    return found

for i in range(warmup):
    step(i)
skip = user_storages()
workspaces = list(ws_module._ALL)
before = held([cockpit, workspaces], skip) if cockpit is not None else {}
live_before = {}
for obj in gc.get_objects():
    if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_sparse:
        try:
            key = storage_key(obj)
        except Exception:
            continue
        live_before[key[0]] = key[1]
gc.collect()
with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
             with_stack=True) as prof:
    step(warmup)
if cockpit is not None:
    cockpit.close()

def cockpit_frame(node):
    # the innermost frame in the package ("cockpit/engine/update_prediction.py(231):
    # _adam_step") and the phase the allocation was made in
    time, inner = node.start_time_ns, None
    while node is not None and inner is None:
        if re.search(r"(^|/)cockpit/[^(]*\.py\(", node.name):
            inner = node.name
        node = node.parent
    where = max(((start, name) for start, end, name in phases if start <= time <= end),
                default=(0, "?"))[1]  # the innermost
    if inner is None:
        return f"{where}: training"
    file = re.sub(r"^.*?(cockpit/)", r"\1", inner.split("(")[0])
    return f"{where}: {file}:{inner.split(': ')[-1]}"

events, phases = [], []
def walk(nodes):
    for n in nodes:
        f = n.extra_fields
        if type(f).__name__ == "_ExtraFields_Allocation":
            events.append((n.start_time_ns, f.ptr, f.alloc_size, n))
        elif n.name.startswith("phase: "):
            phases.append((n.start_time_ns, n.end_time_ns, n.name[len("phase: "):]))
        walk(n.children)
walk(prof.profiler.kineto_results.experimental_event_tree())
events.sort(key=lambda e: e[0])
base = sum(live_before.values())
current, peak, peak_index = base, base, -1
for index, (_, ptr, size, _) in enumerate(events):
    current += size
    if current > peak:
        peak, peak_index = current, index
# at the peak: what was held before and still is, and what the step allocated and still holds
live, freed_before = {}, set()
for _, ptr, size, node in events[:peak_index + 1]:
    if size > 0:
        live[ptr] = (size, node)
    elif ptr in live:
        del live[ptr]
    else:
        freed_before.add(ptr)
kinds = collections.Counter()
for (ptr, nbytes), path in before.items():
    if ptr not in freed_before:
        kinds["held: " + re.sub(r"\['[^']*\.[^']*'\]", "[θ]", path)] += nbytes
for size, node in live.values():
    kinds["step: " + cockpit_frame(node)] += size
at = cockpit_frame(events[peak_index][3]) if peak_index >= 0 else "?"
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak_mib": peak / 2**20, "base_mib": base / 2**20,
                  "params_mib": params / 2**20, "peak_at": at,
                  "held_before_mib": sum(k[1] for k in before) / 2**20,
                  "kinds": {k: v / 2**20 for k, v in kinds.most_common()}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gpt2_shape_arguments(parser)
    parser.add_argument("--min-mib", type=float, default=1.0, help="smallest kind listed")
    parser.add_argument("--path", choices=["cpu", "accelerator", "accelerator-unstacked"],
                        default="cpu", help="the paths a step takes (see above)")
    args = parser.parse_args()
    results = {}
    for mode in ("untracked", "economy"):
        results[mode] = run_worker(WORKER, mode, str(args.budget), str(args.n_layer),
                                   str(args.n_embd), str(args.batch), str(args.length),
                                   str(args.warmup), "1" if args.autocast else "0",
                                   args.path)
    untracked, economy = results["untracked"], results["economy"]
    print(f"GPT-2 shape n_layer={args.n_layer} n_embd={args.n_embd} |B|={args.batch} "
          f"T={args.length}, AdamW, {'bf16 autocast' if args.autocast else 'float32'}, "
          f"budget {args.budget / 2**20:.0f} MiB, {args.path} path; parameters "
          f"{economy['params_mib']:.0f} MiB")
    print(f"peak allocated: untracked {untracked['peak_mib']:.0f} MiB, economy "
          f"{economy['peak_mib']:.0f} MiB ({economy['peak_mib'] / untracked['peak_mib']:.2f}×)")
    print(f"untracked peak in {untracked['peak_at']}, economy's in {economy['peak_at']}")
    print("| live at the peak | untracked [MiB] | economy [MiB] | economy × parameters |")
    print("|---|---|---|---|")
    kinds = {**untracked["kinds"], **economy["kinds"]}
    for kind in sorted(kinds, key=lambda k: -max(untracked["kinds"].get(k, 0),
                                                  economy["kinds"].get(k, 0))):
        a, b = untracked["kinds"].get(kind, 0.0), economy["kinds"].get(kind, 0.0)
        if max(a, b) >= args.min_mib:
            print(f"| {kind} | {a:.0f} | {b:.0f} | {b / economy['params_mib']:.2f} |")
    print(f"| before the step (parameters, gradients, optimizer state, …) | "
          f"{untracked['base_mib']:.0f} | {economy['base_mib'] - economy['held_before_mib']:.0f}"
          " | |")


if __name__ == "__main__":
    main()
