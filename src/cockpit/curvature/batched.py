"""Many vector backpropagations through the same forward pass as a few batched ones.

The exact diagonal GGN backpropagates C vectors v_k (the columns of a factor of the loss
Hessian, :mod:`cockpit.curvature.loss_factors`) from the model output f and reduces each
layer's individual "gradients" g_{n,k} = (∂f_n/∂θ)ᵀ v_{n,k} to Σ_k Σ_n g_{n,k} ⊙ g_{n,k}.
One backward pass per vector costs C launches of every backward kernel; on a GPU that is
launch-bound for small networks (CIFAR-100's C = 100). Here the vectors travel together:

* one backward pass vmap'd over the vectors (:func:`batched_grad`) gives every layer's
  output gradient δ_{k,n} for a chunk of K vectors;
* each layer's rule then runs once on the K·N "samples" (k, n), its recorded input repeated
  K times, so Σ_{k,n} g_{k,n} ⊙ g_{k,n} is one call of ``sum_sq`` — the same closed forms
  and kernels as for the user's own backward pass, on a K times larger batch;
* on accelerators a convolution with one group forms its input's patches once for all K
  vectors of a chunk, whose output gradients are K·C_out output channels of one product per sample
  (:func:`cockpit.engine.rules.conv.folded_weight_sum_sq`), instead of unfolding its
  input repeated K times;
* the small parameters' (biases, normalization weights) individual gradients of a chunk
  are summed side by side (:meth:`cockpit.engine.side_by_side.SideBySide.sum_sq`): one
  square and one sum for all of them instead of three kernels each.

Memory: a chunk of K vectors holds K times the backward pass's activation gradients, and a
rule's scratch grows with its batch; both are chunked to ``budget_bytes``.

Where the batched pass does not apply (a layer output modified in place, an output shared by
the batch, a parameter used by several calls, a layer without a closed-form rule or with an
unusual batch layout, an operator without a vmap rule) the caller's loop runs instead:
the result is the same, only slower.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn

from cockpit.curvature.batched_grad import batched_grad
from cockpit.engine import side_by_side
from cockpit.engine.capture.hooks import Call
from cockpit.engine.engine_view import EngineView
from cockpit.engine.histograms.device import device_path
from cockpit.engine.rules.conv import conv_rule, folded_weight_sum_sq
from cockpit.engine.rules.sample_grads import DenseSampleGrads, SampleGrads

# Small parameters' individual gradients waiting to be summed side by side: (the totals
# they add to, the parameter's name, its individual gradients).
_Waiting = list[tuple[dict[str, Tensor], str, DenseSampleGrads]]

# Layers whose rule reads one batched input ``args[0]`` (batch dimension first) and whose
# individual gradients depend on nothing else: repeating the input repeats their samples.
FOLDABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.LayerNorm, nn.GroupNorm,
            nn.RMSNorm, nn.Embedding)

DEFAULT_BUDGET_BYTES: int | None = None  # None: :func:`default_budget` of the device


def default_budget(device: torch.device) -> int:
    """Bytes a chunk of batched backpropagations (and, apart, a layer's rule) may take:
    1/16 of a CUDA device's memory, at most 8 GiB (an H200: 8 GiB, so that 3C3D's exact
    GGN at |B| = 128 — ten vectors, ~71 MB of layer-output gradients each by the estimate
    below — runs as one chunk); 1 GiB elsewhere."""
    if DEFAULT_BUDGET_BYTES is not None:
        return DEFAULT_BUDGET_BYTES
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return min(total // 16, 8 * 2**30)
    return 2**30


def chunk_budget(device: torch.device, cap: int | None) -> int:
    """Bytes a chunk may take: :func:`default_budget`, at most ``cap`` (a ``memory_budget``
    the user gave, which bounds the folded individual gradients here as it bounds a layer's
    in the statistics)."""
    budget = default_budget(device)
    return budget if cap is None else min(budget, cap)


def use_batched(device: torch.device, batched: bool | None) -> bool:
    """Whether to batch the backpropagations: ``batched`` if given, else on CUDA only (and
    on the CPU where it stands in for an accelerator: :func:`device_path`'s ``forced``).

    On a 2-core CPU the loop is faster (the work, not the launches, dominates, and the loop
    unfolds each convolution's input once for all vectors; ``benchmarks/curvature_batched.py``)
    and needs no extra memory."""
    if batched is not None:
        return batched
    return device.type == "cuda" or (device.type == "cpu" and device_path(device))


def _foldable_calls(engine: EngineView, n: int) -> list[Call] | None:
    """The calls Cockpit's backprops reach, or None if one of them cannot be folded."""
    calls = engine.probe_calls()
    for call in calls:
        unit = call.unit
        if (not isinstance(unit.module, FOLDABLE) or unit.rule is None or call.taps
                or len(call.outputs) != 1 or not call.outputs_unchanged()
                or call.args is None or len(call.args) != 1 or call.kwargs
                or any(engine.used_repeatedly(engine.unit_param_name(unit, a))
                       for a in unit.params)):
            return None
        x, y = call.args[0], call.outputs[0]
        if not (isinstance(x, Tensor) and x.dim() >= 1 and x.shape[0] == n
                and y.dim() >= 1 and y.shape[0] == n):
            return None
    return calls


def _sample_bytes(call) -> int:
    """A rough upper bound of one (k, n) sample's scratch in the layer's rule: its input
    (unfolded for a convolution), its output gradient and its materialized gradient."""
    x, y = call.args[0], call.outputs[0]
    module = call.unit.module
    kernel = math.prod(getattr(module, "kernel_size", (1,)))
    per_sample = (math.prod(x.shape[1:]) * kernel + math.prod(y.shape[1:])
                  + sum(p.numel() for p in call.unit.params.values()))
    return per_sample * max(y.element_size(), 4)


def batched_sum_sq_of_backprops(engine: EngineView, output: Tensor, grad_outputs: Tensor,
                                budget_bytes: int | None = None,
                                separate: bool = False
                                ) -> list[dict[str, Tensor]] | None:
    """Σ_k Σ_n g_{n,k} ⊙ g_{n,k} per parameter as :meth:`ModuleTracker.sum_sq_of_backprops`
    computes it one vector at a time (``grad_outputs``: [K, *output.shape]), as a list of
    one dict; with ``separate`` the K sums Σ_n g_{n,k} ⊙ g_{n,k} one by one (K dicts). None
    where the batched passes do not apply (module docstring). ``budget_bytes``: default
    :func:`chunk_budget` of the engine's ``curvature_budget``."""
    if budget_bytes is None:
        budget_bytes = chunk_budget(output.device, engine.curvature_budget)
    n = output.shape[0]
    calls = _foldable_calls(engine, n)
    if not calls:
        return None
    targets = [c.outputs[0] for c in calls]
    per_vector = 2 * sum(t.numel() * t.element_size() for t in targets)
    chunk = max(1, min(len(grad_outputs), budget_bytes // max(per_vector, 1)))
    totals: list[dict[str, Tensor]] = [{} for _ in range(len(grad_outputs) if separate else 1)]
    small: _Waiting = []
    with engine.suspended():
        for start in range(0, len(grad_outputs), chunk):
            vectors = (grad_outputs if chunk == len(grad_outputs)
                       else grad_outputs[start:start + chunk])
            try:
                deltas = batched_grad([output], targets, [vectors])
            except RuntimeError:  # an operator without a batching rule for its backward
                if start:
                    raise
                return None
            for call, delta in zip(calls, deltas, strict=True):
                if delta is None:
                    continue
                # (no create_graph: the output gradients are outside autograd already)
                folded = delta.reshape(-1, *delta.shape[2:])  # samples (k, n), k major
                if not separate:
                    _add_folded(engine, call, folded, n, totals[0], budget_bytes, small)
                    continue
                if _convolution_folds(engine, call, folded,
                                      totals[start:start + len(vectors)], budget_bytes, small):
                    continue  # (each vector's sums from patches formed once)
                for k in range(len(vectors)):
                    _add_folded(engine, call, folded[k * n:(k + 1) * n], n, totals[start + k],
                                budget_bytes, small)
                del delta, folded
            del deltas
            _add_side_by_side(small)
    return totals


def _add_folded(engine: EngineView, call, folded: Tensor, n: int,
                totals: dict[str, Tensor], budget_bytes: int,
                small: _Waiting) -> None:
    """Add Σ_{k,n} g_{k,n} ⊙ g_{k,n} of one layer, δ of the samples (k, n) as ``folded``
    [K·N, ...] (k major), in folds of samples whose scratch fits the budget: of whole
    vectors where one vector's samples fit (the recorded input repeated: one copy), else
    of single samples (an index each). The rule sees no output (no closed-form rule of
    :data:`FOLDABLE` reads it). A small parameter's individual gradients of one fold of
    all samples go to ``small`` instead, summed side by side with the others'."""
    if _convolution_folds(engine, call, folded, [totals], budget_bytes, small):
        return
    k, x = len(folded) // n, call.args[0]
    size = max(1, budget_bytes // _sample_bytes(call))
    if size >= n:
        size -= size % n
    for start in range(0, k * n, size):
        stop = min(start + size, k * n)
        with torch.no_grad():  # (copies of the input: no graph)
            if start == 0 and stop == n:  # one vector's samples: the recorded input itself
                inputs = x
            elif start % n == 0 and stop % n == 0:
                inputs = x.repeat((stop - start) // n, *[1] * (x.dim() - 1))
            else:
                inputs = x.index_select(0, torch.arange(start, stop, device=x.device) % n)
        part = dataclasses.replace(call, args=(inputs,), outputs=[])
        grads = folded if stop - start == k * n else folded[start:stop]
        for name, sg in engine.sample_grads(part, [grads]).items():
            if stop - start == k * n:  # (a fold of all samples: it may wait for others)
                _sum_or_wait(totals, name, sg, small)
            else:
                _add(totals, name, sg.sum_sq())


def _convolution_folds(engine: EngineView, call, folded: Tensor,
                       targets: list[dict[str, Tensor]], budget_bytes: int,
                       small: _Waiting) -> bool:
    """A convolution with one group on an accelerator whose input and output gradients share
    a dtype (no mixed-precision parameters): its weight's sums by the input's patches formed
    once for all vectors, its bias's from Σ_l δ_{k,n,:,l} (side by side), added to the one
    dict of ``targets`` (summed over the vectors) or to each vector's own. False where this
    does not apply or the patches exceed the budget (then the rule runs on the repeated
    input, or on each vector's output gradients)."""
    unit, x = call.unit, call.args[0]
    module = unit.module
    if (unit.rule is not conv_rule or module.groups != 1 or not module.weight.requires_grad
            or x.dtype != folded.dtype or engine.compute_dtypes
            or not device_path(folded.device)):
        return False  # (a CPU sums the rule's rows sample by sample in its cache: faster)
    separate = len(targets) > 1
    with torch.no_grad():
        weight = folded_weight_sum_sq(module, x, folded, budget_bytes, separate)
    if weight is None:
        return False
    name = engine.unit_param_name(unit, "weight")
    for totals, sums in zip(targets, weight.unbind(0) if separate else [weight], strict=True):
        _add(totals, name, sums)
    if module.bias is not None and module.bias.requires_grad:
        sums = folded.sum(tuple(range(2, folded.dim())))  # [K·N, C_out]
        name, n = engine.unit_param_name(unit, "bias"), len(folded) // len(targets)
        for index, totals in enumerate(targets):
            bias = DenseSampleGrads(sums[index * n:(index + 1) * n] if separate else sums)
            _sum_or_wait(totals, name, bias, small)
    return True


def _sum_or_wait(totals: dict[str, Tensor], name: str, sg: SampleGrads,
                 small: _Waiting) -> None:
    """Add the parameter's Σ g ⊙ g to its totals, or, if small
    (:func:`cockpit.engine.side_by_side.is_small`), leave it in ``small`` to be summed side
    by side with the others'."""
    if side_by_side.is_small(sg):
        small.append((totals, name, sg))  # type: ignore[arg-type]
    else:
        _add(totals, name, sg.sum_sq())


def _add_side_by_side(small: _Waiting) -> None:
    """Add the sums of squares of the small parameters waiting in ``small`` to their
    totals, those with the same samples, dtype and device side by side; empties ``small``."""
    shapes = [(sg.num_samples, sg.unscaled.dtype, sg.unscaled.device,
               sg.shape.numel()) for _, _, sg in small]
    for group in side_by_side.groups(shapes, bins=0):
        members = [small[i] for i in group]
        side = side_by_side.SideBySide([sg.unscaled for _, _, sg in members],
                                       [sg.scale for _, _, sg in members])
        for (totals, name, _), total in zip(members, side.sum_sq(), strict=True):
            _add(totals, name, total)
    small.clear()


def _add(totals: dict[str, Tensor], name: str, total: Tensor) -> None:
    totals[name] = totals[name] + total if name in totals else total
