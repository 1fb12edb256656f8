r"""Predict the update ``s = θ_{t+1} − θ_t`` that ``optimizer.step()`` will apply, and verify it.

Alpha needs ``s_tᵀ g_n`` for every sample, but ``s_t`` exists only after ``optimizer.step()``.
Inside the backward hook we know a layer's batch gradient ``g``; together with the parameter,
its param group's hyperparameters and the optimizer state this determines ``s`` for the
standard optimizers. ``predict_update`` replays torch 2.13's single-tensor update rule on copies
(same operations in the same order, so the prediction equals the real update bit for bit when
nothing changes in between) and never touches the optimizer's state. Rules, with ``g ← −g``
under ``maximize`` and ``λ`` = weight_decay:

* SGD: ``d = g + λθ``; with momentum μ: ``b = d`` on the first step, else
  ``b = μ b + (1 − dampening) d``; ``d = d + μ b`` (Nesterov) or ``d = b``; ``s = −lr d``.
* Adam / AdamW (k = step + 1): L2 decay ``g = g + λθ``, or decoupled ``θ ← θ(1 − lr λ)``;
  ``m = β₁m + (1−β₁)g``, ``v = β₂v + (1−β₂)g²``, amsgrad ``v̂ = max(v̂, v)``;
  ``θ ← θ − lr/(1−β₁ᵏ) · m / (√v / √(1−β₂ᵏ) + ε)``.
* RMSprop: ``g = g + λθ``; ``v = αv + (1−α)g²``; centered: ``ḡ = αḡ + (1−α)g``,
  ``a = √(v − ḡ²) + ε`` else ``a = √v + ε``; momentum: ``b = μb + g/a``, ``s = −lr b``;
  else ``s = −lr g/a``.
* Adagrad (k = step + 1): ``g = g + λθ``; ``clr = lr / (1 + (k−1)·lr_decay)``;
  ``S = S + g²`` (S starts at initial_accumulator_value); ``s = −clr · g/(√S + ε)``.

Not predicted (``None``, reasons in ``UnsupportedOptimizer``): other optimizer classes
(LBFGS and other closure-based ones included), subclasses that override ``step``, ``fused``
groups of SGD, RMSprop and Adagrad, ``capturable`` and ``differentiable`` groups, complex
parameters, sparse gradients, tensor hyperparameters other than a one-element ``lr``, state
that does not fit the group's options. ``foreach=True`` runs the same math with multi-tensor
kernels (agreement to rounding); Adam and AdamW with ``fused=True`` are replayed by their
own fused kernel on copies (equal bit for bit). On accelerators, where a parameter's nine
single-tensor launches cost host time the GPU waits for, the other Adam variants in float32
and float64 are predicted by that kernel too (three launches; it rounds intermediate values
differently, a few units in the last place of the update, far inside the check below).

Verification after the real step (``match_update``): the caller compares predictions with the
measured updates and accepts a global rescaling ``actual ≈ κ·predicted``:

* A learning-rate change between backward and step (a scheduler, the same factor for every
  group) is an exact global rescaling for every supported optimizer: each update is linear in
  lr with lr-independent state, also AdamW's decoupled decay (``−lr λθ − lr/(1−β₁ᵏ) m/…``) and
  Adagrad's ``lr / (1 + (k−1) lr_decay)``. κ = lr_new / lr_old, up to float rounding.
* Gradient clipping (``g ← c g``) is a global rescaling of the UPDATE only for SGD without
  momentum and weight decay (and on the first momentum step without weight decay). For
  momentum SGD the buffer mixes old and new gradients, so it is not; there
  ``sgd_update_basis`` gives tensors spanning the update for every gradient scale c,
  ``cockpit.engine.update_fit`` recovers the coefficients after the step, exactly. For Adam,
  RMSprop and Adagrad clipping is not a rescaling; the check fails and the caller falls back.
"""

from __future__ import annotations

import functools
import inspect
import math
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from torch.optim import SGD, Adagrad, Adam, Optimizer, RMSprop

from cockpit.engine import float_sums, tensor_sums
from cockpit.engine.chunk_cat import flat_cat
from cockpit.engine.dtypes import in_dtype, promote
from cockpit.engine.histograms.device import device_path
from cockpit.engine.tensor_block import TensorBlock
from cockpit.engine.update_fit import to_host

SUPPORTED_CLASSES: tuple[type[Optimizer], ...] = (SGD, Adam, RMSprop, Adagrad)
"""Base classes whose ``step`` is predicted (AdamW is a subclass of Adam with its ``step``)."""

_TINY = 1e-300
_RULE_KEYS = (
    "momentum", "dampening", "weight_decay", "betas", "eps", "alpha", "lr_decay",
    "initial_accumulator_value",
)  # fmt: skip


class UnsupportedOptimizer:
    """Reasons why an update cannot be predicted (``unsupported_reason`` returns one)."""

    UNKNOWN_CLASS = "optimizer class not supported (supported: SGD, Adam, AdamW, RMSprop, Adagrad)"
    STEP_OVERRIDDEN = "optimizer subclass overrides step(); its update rule is unknown"
    FUSED = "fused=True is supported for Adam and AdamW only"
    CAPTURABLE = "capturable=True is not supported"
    DIFFERENTIABLE = "differentiable=True is not supported"
    GRAD_SCALER = "optimizer carries grad_scale/found_inf (AMP GradScaler) and is not predicted"
    TENSOR_HYPERPARAMETER = "tensor-valued hyperparameter other than a one-element lr"
    PARAM_NOT_FOUND = "parameter is not in any param group of the optimizer"
    COMPLEX = "complex parameters are not supported"
    SPARSE = "sparse gradients are not supported"
    SHAPE = "gradient shape differs from the parameter's"
    INCONSISTENT_STATE = "optimizer state does not match the group's options"


def _raw_function(function: object) -> object:
    """Strip decorators (profiling hooks, lr-scheduler counters) that use functools.wraps."""
    function = getattr(function, "__func__", function)
    return inspect.unwrap(function)  # type: ignore[arg-type]


def supported_base(optimizer: Optimizer) -> type[Optimizer] | None:
    """The supported base class whose unmodified ``step`` ``optimizer`` uses, else None
    (asked per parameter and step: the answer is kept while the optimizer's class, the
    class's ``step`` and the optimizer's own ``step`` attribute stay the same objects)."""
    key = (type(optimizer), type(optimizer).step, optimizer.__dict__.get("step"))
    cached = _BASES.get(optimizer)
    if (cached is not None and cached[0][0] is key[0] and cached[0][1] is key[1]
            and cached[0][2] is key[2]):
        return cached[1]
    base = _supported_base(optimizer)
    _BASES[optimizer] = (key, base)
    return base


_BASES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _supported_base(optimizer: Optimizer) -> type[Optimizer] | None:
    for base in SUPPORTED_CLASSES:
        if isinstance(optimizer, base):
            expected = _raw_function(base.step)
            if _raw_function(type(optimizer).step) is not expected:
                return None
            patched = optimizer.__dict__.get("step")  # e.g. the lr scheduler's counter
            if patched is not None and _raw_function(patched) is not expected:
                return None
            return base
    return None


def _group_reason(group: dict, base: type[Optimizer]) -> str | None:
    if group.get("fused") and base is not Adam:
        return UnsupportedOptimizer.FUSED
    if group.get("capturable"):
        return UnsupportedOptimizer.CAPTURABLE
    if group.get("differentiable"):
        return UnsupportedOptimizer.DIFFERENTIABLE
    for key in _RULE_KEYS:  # keys the rules read (schedulers add e.g. a tensor "initial_lr")
        value = group.get(key)
        if isinstance(value, Tensor) or (isinstance(value, tuple)
                                         and any(isinstance(v, Tensor) for v in value)):
            return UnsupportedOptimizer.TENSOR_HYPERPARAMETER
    lr = group.get("lr")
    if isinstance(lr, Tensor) and (lr.numel() != 1 or lr.requires_grad):
        return UnsupportedOptimizer.TENSOR_HYPERPARAMETER
    return None


def unsupported_reason(
    optimizer: Optimizer, param: Tensor | None = None, grad: Tensor | None = None, *,
    optimizer_checked: bool = False,
) -> str | None:
    """Why the updates (of ``param`` with ``grad``, if given) cannot be predicted, or None.

    ``UnsupportedOptimizer.INCONSISTENT_STATE`` is found only by ``predict_update`` itself.
    ``optimizer_checked``: the caller knows that :func:`supports` holds (its param groups
    unchanged since it asked, e.g. within one backward pass): only the parameter's own
    checks run (the optimizer's cost a walk over every group's options, per parameter).
    """
    reason = None if optimizer_checked else _optimizer_reason(optimizer)
    if reason is not None or param is None:
        return reason
    if _find_group(optimizer, param) is None:
        return UnsupportedOptimizer.PARAM_NOT_FOUND
    return _parameter_reason(param, grad)


def _parameter_reason(param: Tensor, grad: Tensor | None) -> str | None:
    if torch.is_complex(param):
        return UnsupportedOptimizer.COMPLEX
    if grad is not None and grad.is_sparse:
        return UnsupportedOptimizer.SPARSE
    if grad is not None and grad.shape != param.shape:
        return UnsupportedOptimizer.SHAPE
    return None


def _predictable_group(optimizer: Optimizer, param: Tensor, grad: Tensor,
                       optimizer_checked: bool, shape: list | None = None) -> dict | None:
    """The param group of ``param`` where its update can be predicted (as far as
    :func:`unsupported_reason` knows), else None: one look-up of the group for the
    prediction and its checks (``shape``: see :func:`_find_group`)."""
    if not optimizer_checked and _optimizer_reason(optimizer) is not None:
        return None
    group = _find_group(optimizer, param, shape)
    return None if group is None or _parameter_reason(param, grad) is not None else group


def _optimizer_reason(optimizer: Optimizer) -> str | None:
    base = supported_base(optimizer)
    if base is None:
        if isinstance(optimizer, SUPPORTED_CLASSES):
            return UnsupportedOptimizer.STEP_OVERRIDDEN
        return UnsupportedOptimizer.UNKNOWN_CLASS
    if getattr(optimizer, "grad_scale", None) is not None:
        return UnsupportedOptimizer.GRAD_SCALER
    if getattr(optimizer, "found_inf", None) is not None:
        return UnsupportedOptimizer.GRAD_SCALER
    for group in optimizer.param_groups:
        reason = _group_reason(group, base)
        if reason is not None:
            return reason
    return None


def supports(optimizer: Optimizer) -> bool:
    """Whether ``predict_update`` can predict this optimizer's updates."""
    return unsupported_reason(optimizer) is None


# Per optimizer: (shape of its param_groups, id(param) → (group, position)). Looked up once
# or more per parameter and tracked step; a scan of every group each time made a step cost
# O(parameters²) (a 302-tensor MLP: ~70 ms per step).
_GROUP_INDEX: weakref.WeakKeyDictionary[Optimizer, tuple[list, dict]] = (
    weakref.WeakKeyDictionary())


def _find_group(optimizer: Optimizer, param: Tensor, shape: list | None = None
                ) -> dict | None:
    """The param group holding ``param`` (None if none does), from an index rebuilt whenever
    the groups change shape or an entry no longer holds the same tensor (``shape``: the
    groups' :func:`_groups_shape`, read once by a caller that looks up many parameters)."""
    groups = optimizer.param_groups
    if shape is None:
        shape = _groups_shape(groups)
    for attempt in range(2):
        cached = _GROUP_INDEX.get(optimizer)
        if attempt or cached is None or cached[0] != shape:
            index = {id(p): (g, i) for g in groups for i, p in enumerate(g["params"])}
            _GROUP_INDEX[optimizer] = cached = (shape, index)
        found = cached[1].get(id(param))
        if found is not None and found[0]["params"][found[1]] is param:
            return found[0]
    return None


def _groups_shape(groups: list[dict]) -> list[tuple[int, int]]:
    return [(id(g), len(g["params"])) for g in groups]


def _scalar(value: float | Tensor) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def _next_step(state: dict) -> float:
    """``step_t += 1; step = step_t.item()`` in the state's own dtype (on the host where that
    dtype holds step + 1 exactly: below 2^24 for float32)."""
    step = state.get("step", 0.0)
    if not isinstance(step, Tensor):
        return float(step) + 1.0
    value = step.item()
    if not step.is_floating_point() or value + 1.0 <= 2.0 / torch.finfo(step.dtype).eps:
        return float(value) + 1.0
    return (step + 1).item()


def predict_update(optimizer: Optimizer, param: Tensor, grad: Tensor, *,
                   optimizer_checked: bool = False) -> Tensor | None:
    """The update ``θ_{t+1} − θ_t`` that ``optimizer.step()`` will apply to ``param``.

    ``grad`` is the gradient the step will see in ``param.grad``. Returns None when the update
    cannot be predicted (see ``unsupported_reason``, also for ``optimizer_checked``); never
    modifies ``optimizer``'s state.
    """
    group = _predictable_group(optimizer, param, grad, optimizer_checked)
    if group is None:
        return None
    state = optimizer.state.get(param) or {}  # .get: do not create an entry
    base = supported_base(optimizer)
    with torch.no_grad():  # (no detach needed: nothing here joins a graph)
        grad = in_dtype(grad, param.dtype)
        if base is Adam and _replays_fused(group, param):  # type: ignore[arg-type]
            return _fused_adam_steps([param], [grad], group, [state])[0]
        if base is SGD:
            new_param = _sgd_step(param, grad, group, state)
        elif base is Adam:
            new_param = _adam_step(param, grad, group, state)
        elif base is RMSprop:
            new_param = _rmsprop_step(param, grad, group, state)
        else:
            new_param = _adagrad_step(param, grad, group, state, optimizer.defaults)
        # (each rule's new_param is a fresh tensor: the difference is taken in its memory)
        return None if new_param is None else new_param.sub_(param)


def predict_updates(optimizer: Optimizer, params: Sequence[Tensor], grads: Sequence[Tensor],
                    *, optimizer_checked: bool = False) -> list[Tensor | None]:
    """:func:`predict_update` of several parameters at once (None where one cannot be
    predicted): Adam and AdamW by multi-tensor kernels, one launch per operation and param
    group instead of one per operation and parameter (the same operations in the same order,
    so the same values); the other optimizers one parameter at a time. Holds the moments of
    all ``params`` at once: meant for many small tensors (biases, normalization weights)."""
    if not optimizer_checked and _optimizer_reason(optimizer) is not None:
        return [None] * len(params)
    if supported_base(optimizer) is not Adam:
        return [predict_update(optimizer, p, g, optimizer_checked=True)
                for p, g in zip(params, grads, strict=True)]
    updates: list[Tensor | None] = [None] * len(params)
    # per param group, and within it per kernel (a group may mix dtypes: bfloat16 replays
    # the single-tensor operations, float32 the fused kernel on accelerators)
    groups: dict[tuple[int, bool], tuple[dict, list[int]]] = {}
    shape = _groups_shape(optimizer.param_groups)  # (read once for all the parameters)
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        group = _predictable_group(optimizer, param, grad, optimizer_checked=True, shape=shape)
        if group is not None:
            key = (id(group), _replays_fused(group, param))
            groups.setdefault(key, (group, []))[1].append(i)
    with torch.no_grad():
        for (_, fused), (group, indices) in groups.items():
            members = [params[i] for i in indices]
            replay = _fused_adam_steps if fused else _adam_steps
            steps = replay(members, [in_dtype(grads[i], params[i].dtype) for i in indices],
                           group, [optimizer.state.get(p) or {} for p in members])
            for i, update in zip(indices, steps, strict=True):
                updates[i] = update
    return updates


def _signed(grad: Tensor, group: dict) -> Tensor:
    return -grad if group["maximize"] else grad


def _sgd_step(param: Tensor, grad: Tensor, group: dict, state: dict) -> Tensor | None:
    lr, momentum = _scalar(group["lr"]), group["momentum"]
    weight_decay = group["weight_decay"]
    direction = _signed(grad, group)
    if weight_decay != 0:
        direction = direction.add(param, alpha=weight_decay)
    if momentum != 0:
        buffer = state.get("momentum_buffer")
        if buffer is None:
            buffer = direction.clone()
        else:
            buffer = buffer.mul(momentum).add_(direction, alpha=1 - group["dampening"])
        direction = direction.add(buffer, alpha=momentum) if group["nesterov"] else buffer
    return param.add(direction, alpha=-lr)


def _adam_step(param: Tensor, grad: Tensor, group: dict, state: dict) -> Tensor | None:
    lr, (beta1, beta2) = _scalar(group["lr"]), group["betas"]
    weight_decay, eps, amsgrad = group["weight_decay"], group["eps"], group["amsgrad"]
    if state:
        if not state.keys() >= _ADAM_STATE[amsgrad]:
            return None
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        max_exp_avg_sq = state.get("max_exp_avg_sq")
    else:
        exp_avg = exp_avg_sq = max_exp_avg_sq = torch.zeros_like(param)
    step = _next_step(state)
    grad = _signed(grad, group)
    decoupled = weight_decay != 0 and group.get("decoupled_weight_decay", False)
    if weight_decay != 0 and not decoupled:
        grad = grad.add(param, alpha=weight_decay)
    # the new moments are fresh tensors, so the denominator is formed in the memory of the
    # second and θ̂ in its own (the same operations as Adam's): three parameter-sized
    # temporaries at most instead of five (GPT-2's token embedding: 154 MB each)
    exp_avg = exp_avg.lerp(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
    del grad  # (L2 decay's g + λθ: freed before θ̂ is formed)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    step_size = lr / bias_correction1
    if amsgrad:
        exp_avg_sq = torch.maximum(max_exp_avg_sq, exp_avg_sq)
    denom = exp_avg_sq.sqrt_().div_(bias_correction2_sqrt).add_(eps)
    if decoupled:
        return param.mul(1 - lr * weight_decay).addcdiv_(exp_avg, denom, value=-step_size)
    return param.addcdiv(exp_avg, denom, value=-step_size)


_ADAM_STATE = {amsgrad: frozenset({"step", "exp_avg", "exp_avg_sq"}
                                  | ({"max_exp_avg_sq"} if amsgrad else set()))
               for amsgrad in (False, True)}
"""The state Adam keeps per parameter, without and with ``amsgrad``."""


def _adam_steps(params: list[Tensor], grads: list[Tensor], group: dict, states: list[dict]
                ) -> list[Tensor | None]:
    """:func:`_adam_step` of the parameters of one group as multi-tensor operations, and
    the update θ̂ − θ of each (None where the state does not fit the group's options)."""
    lr, (beta1, beta2) = _scalar(group["lr"]), group["betas"]
    weight_decay, eps, amsgrad = group["weight_decay"], group["eps"], group["amsgrad"]
    needed = _ADAM_STATE[amsgrad]
    kept, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], []
    for i, (param, state) in enumerate(zip(params, states, strict=True)):
        if state and not state.keys() >= needed:
            continue
        zeros = None if state else torch.zeros_like(param)
        exp_avgs.append(state["exp_avg"] if state else zeros)
        exp_avg_sqs.append(state["exp_avg_sq"] if state else zeros)
        max_exp_avg_sqs.append(state.get("max_exp_avg_sq") if state else zeros)
        steps.append(_next_step(state))
        kept.append(i)
    out: list[Tensor | None] = [None] * len(params)
    if not kept:
        return out
    thetas, grads = [params[i] for i in kept], [grads[i] for i in kept]
    if group["maximize"]:
        grads = torch._foreach_neg(grads)
    decoupled = weight_decay != 0 and group.get("decoupled_weight_decay", False)
    if weight_decay != 0 and not decoupled:
        grads = torch._foreach_add(grads, thetas, alpha=weight_decay)
    exp_avg = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
    exp_avg_sq = torch._foreach_mul(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
    del grads
    if amsgrad:
        exp_avg_sq = torch._foreach_maximum(max_exp_avg_sqs, exp_avg_sq)
    torch._foreach_sqrt_(exp_avg_sq)
    torch._foreach_div_(exp_avg_sq, [(1 - beta2**k) ** 0.5 for k in steps])
    torch._foreach_add_(exp_avg_sq, eps)
    values = [-(lr / (1 - beta1**k)) for k in steps]  # −step_size per parameter
    if decoupled:
        new = torch._foreach_mul(thetas, 1 - lr * weight_decay)
        torch._foreach_addcdiv_(new, exp_avg, exp_avg_sq, values)
    else:
        new = torch._foreach_addcdiv(thetas, exp_avg, exp_avg_sq, values)
    torch._foreach_sub_(new, thetas)
    for i, update in zip(kept, new, strict=True):
        out[i] = update
    return out


def _replays_fused(group: dict, param: Tensor) -> bool:
    """Whether Adam's update of ``param`` is predicted by the fused kernel: always for a
    ``fused=True`` group (its own kernel); on accelerators also for the other Adam variants
    in float32 and float64 (three launches instead of nine, whose host time a GPU waits
    for; the kernel rounds its intermediate values differently, by a few units of the last
    place, far inside the update check's rtol), where this torch has the kernel."""
    if group.get("fused"):
        return True
    return (device_path(param.device) and param.dtype in (torch.float32, torch.float64)
            and _fused_kernel_runs(param.device.type))


@functools.cache
def _fused_kernel_runs(device_type: str) -> bool:
    """Whether ``torch._fused_adam_`` runs on this device type (probed once on a number)."""
    try:
        one = torch.ones(1, device=device_type)
        torch._fused_adam_([one.clone()], [one], [one.clone()], [one.clone()], [],
                           [torch.ones((), device=device_type)], amsgrad=False, lr=0.1,
                           beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8,
                           maximize=False)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


@functools.lru_cache(maxsize=8)
def _step_count(value: float, device: torch.device) -> Tensor:
    """A step count k as the fused kernel reads it (float32 on θ's device), made once per
    step and device for the states that keep their count on the host."""
    return torch.full((), value, dtype=torch.float32, device=device)


def _fused_adam_steps(params: list[Tensor], grads: list[Tensor], group: dict,
                      states: list[dict]) -> list[Tensor | None]:
    """Adam and AdamW by the fused kernel (``torch._fused_adam_`` / ``_fused_adamw_``, the
    ``fused=True`` optimizer's own: the same values bit for bit there) on copies of θ, the
    moments and the step counts; the update θ̂ − θ of each parameter (None where the state
    does not fit the group's options). Four launches per device and dtype however many
    parameters: the copies (x·1 is exact), the counts, the kernel, the differences."""
    amsgrad = group["amsgrad"]
    needed = _ADAM_STATE[amsgrad]
    by_kind: dict[tuple, list[int]] = {}
    for i, (param, state) in enumerate(zip(params, states, strict=True)):
        if not state or state.keys() >= needed:
            by_kind.setdefault((param.device, param.dtype), []).append(i)
    out: list[Tensor | None] = [None] * len(params)
    beta1, beta2 = group["betas"]
    replay = (torch._fused_adamw_ if group.get("decoupled_weight_decay", False)
              else torch._fused_adam_)
    for (device, _), members in by_kind.items():
        thetas = [params[i] for i in members]
        held, steps, counts = [], [], []  # counts: the steps that hold k already
        for i in members:
            state = states[i]
            if state:  # (copied below, with θ)
                held += [state["exp_avg"], state["exp_avg_sq"]]
                held += [state["max_exp_avg_sq"]] if amsgrad else []
            else:  # the optimizer's lazy initialisation: zeros
                zeros = torch.zeros_like(params[i], memory_format=torch.preserve_format)
                held += [zeros] * (3 if amsgrad else 2)
            step = state.get("step")
            if (isinstance(step, Tensor) and step.device == device
                    and step.dtype == torch.float32):
                steps.append(step)  # (a fused optimizer's count: k − 1, on θ's device)
            else:  # the count k the kernel reads, made on θ's device
                counts.append(len(steps))
                steps.append(_step_count(_next_step(state), device))
        copies = torch._foreach_mul([*thetas, *held], 1.0)
        new, moments = copies[:len(thetas)], copies[len(thetas):]
        width = 3 if amsgrad else 2
        lr = group["lr"]  # as the fused optimizer passes it; the others read a number
        if not group.get("fused"):
            lr = _scalar(lr)
        elif isinstance(lr, Tensor) and lr.device != device and lr.device.type != "cpu":
            lr = lr.to(device)
        replay(new, [grads[i] for i in members], moments[0::width], moments[1::width],
               moments[2::width] if amsgrad else [], _counts_after(steps, counts),
               amsgrad=amsgrad, lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=group["weight_decay"], eps=group["eps"],
               maximize=group["maximize"], grad_scale=None, found_inf=None)
        torch._foreach_sub_(new, thetas)
        for i, update in zip(members, new, strict=True):
            out[i] = update
    return out


def _counts_after(steps: list[Tensor], ready: list[int]) -> list[Tensor]:
    """The step counts k = t + 1 the kernel reads: the optimizer's own counts t plus one
    (new tensors: its state keeps t), those at the indices ``ready`` (k already) as they
    are."""
    skip = set(ready)
    todo = [i for i in range(len(steps)) if i not in skip]
    out = list(steps)
    if todo:
        for i, count in zip(todo, torch._foreach_add([steps[i] for i in todo], 1),
                            strict=True):
            out[i] = count
    return out


def _rmsprop_step(param: Tensor, grad: Tensor, group: dict, state: dict) -> Tensor | None:
    lr, alpha, eps = _scalar(group["lr"]), group["alpha"], group["eps"]
    momentum, centered, weight_decay = group["momentum"], group["centered"], group["weight_decay"]
    if state:
        needed = ("square_avg",)
        needed += ("momentum_buffer",) if momentum > 0 else ()
        needed += ("grad_avg",) if centered else ()
        if any(key not in state for key in needed):
            return None
        square_avg = state["square_avg"]
        buffer, grad_avg = state.get("momentum_buffer"), state.get("grad_avg")
    else:
        square_avg = buffer = grad_avg = torch.zeros_like(param)
    grad = _signed(grad, group)
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    square_avg = square_avg.mul(alpha).addcmul_(grad, grad, value=1 - alpha)
    if centered:
        grad_avg = grad_avg.lerp(grad, 1 - alpha)
        avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
    else:
        avg = square_avg.sqrt()
    avg = avg.add_(eps)
    if momentum > 0:
        buffer = buffer.mul(momentum).addcdiv_(grad, avg)
        return param.add(buffer, alpha=-lr)
    return param.addcdiv(grad, avg, value=-lr)


def _adagrad_step(
    param: Tensor, grad: Tensor, group: dict, state: dict, defaults: dict
) -> Tensor | None:
    lr, lr_decay = _scalar(group["lr"]), group["lr_decay"]
    weight_decay, eps = group["weight_decay"], group["eps"]
    if state:
        if "sum" not in state or "step" not in state:
            return None
        state_sum = state["sum"]
    else:  # lazy initialisation in Adagrad._init_group uses the optimizer's defaults
        state_sum = torch.full_like(param, defaults["initial_accumulator_value"])
    step = _next_step(state)
    grad = _signed(grad, group)
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    clr = lr / (1 + (step - 1) * lr_decay)
    state_sum = state_sum.addcmul(grad, grad, value=1)
    std = state_sum.sqrt().add_(eps)
    return param.addcdiv(grad, std, value=-clr)


def _as_double(tensors: Sequence[Tensor | None]) -> list[Tensor]:
    return [t.detach().double() for t in tensors]  # type: ignore[union-attr]


def match_update(
    predicted: Sequence[Tensor | None], actual: Sequence[Tensor], rtol: float = 1e-4,
    atol: float = 0.0, actual_sq: float | None = None,
) -> float | None:
    """Global scale κ with ``actual ≈ κ · predicted`` over all tensors, or None.

    κ = ⟨p, a⟩ / ⟨p, p⟩ (least squares), accepted when ``‖a − κ p‖ ≤ rtol ‖a‖ + atol``
    (``atol``: the rounding in measuring ``a`` as a difference of parameters; ``actual_sq``:
    ‖a‖² if the caller has it already). κ = lr_new / lr_old after an lr change for every
    group; κ = clip coefficient for clipped plain SGD (module docstring). A zero prediction
    matches only a zero update (κ = 1). None for a length mismatch, a missing prediction or
    non-finite values. See :class:`UpdateMatch`.
    """
    if len(predicted) != len(actual) or any(p is None for p in predicted):
        return None
    if actual_sq is None:
        actual_sq = sum(float(float_sums.sq_norm(a)) for a in actual)
    match = UpdateMatch(predicted, actual)  # type: ignore[arg-type]
    return match.kappa(to_host(match.checks).numpy(), rtol, atol, actual_sq)


class UpdateMatch:
    """:func:`match_update` in two halves: ``checks`` = [⟨p, p⟩, ⟨p, a⟩, ‖a − κp‖ per tensor
    (grouped by dtype: only their sum of squares is read)]
    with κ = ⟨p, a⟩/⟨p, p⟩ (float64 on the device; dot products by BLAS in the tensors'
    dtype) is formed without reading the device; :meth:`kappa` decides on its host copy."""

    def __init__(self, predicted: Sequence[Tensor], actual: Sequence[Tensor]):
        if not predicted:
            self.checks = torch.zeros(2, dtype=torch.float64)
            return
        checks = _kernel_checks(predicted, actual)
        if checks is not None:
            self.checks = checks
            return
        blocks = _blocks(predicted, actual)
        if blocks is not None:
            self.checks = _block_checks(*blocks)
            return
        flat = [p if p.dim() == 1 else p.reshape(-1) for p in predicted]
        pp = torch.stack(torch._foreach_norm(flat, dtype=torch.float64)).square().sum()
        pa = _total_dot(flat, actual)
        sums = torch.stack([pp.to(pa.device), pa])
        kappa = sums[1] / sums[0]
        # κp − a by dtype (κ at least in float32: rounded to bfloat16 it would miss by
        # 0.4 %), two multi-tensor kernels for the tensors of each dtype
        by_dtype: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
        for p, a in zip(predicted, actual, strict=True):
            dtype = promote(a.dtype, torch.float32)
            ps, as_ = by_dtype.setdefault(dtype, ([], []))
            ps.append(p if p.dtype == dtype else p.to(dtype))
            as_.append(a if a.dtype == dtype else a.to(dtype))
        residuals: list[Tensor] = []
        for dtype, (ps, as_) in by_dtype.items():
            scaled = torch._foreach_mul(ps, kappa.to(dtype))
            torch._foreach_sub_(scaled, as_)
            residuals += scaled
        norms = torch.stack(torch._foreach_norm(residuals)).double()
        self.checks = torch.cat([sums, norms.to(sums.device)])

    @staticmethod
    def kappa(checks: np.ndarray, rtol: float, atol: float, actual_sq: float) -> float | None:
        """κ, or None where ``actual`` is no multiple of ``predicted`` (``checks``: the host
        copy of ``checks``; ``actual_sq``: ‖actual‖²)."""
        pp, pa = float(checks[0]), float(checks[1])
        if not all(math.isfinite(x) for x in (pp, pa, actual_sq)):
            return None
        if pp == 0.0:
            return 1.0 if actual_sq == 0.0 else None
        residual_sq = sum(float(r) ** 2 for r in checks[2:])
        if math.sqrt(residual_sq) <= rtol * math.sqrt(actual_sq) + atol + _TINY:
            return pa / pp
        return None


def _blocks(predicted: Sequence[Tensor], actual: Sequence[Tensor]
            ) -> tuple[TensorBlock, TensorBlock] | None:
    """Both lists in one block each where that pays (many tensors on an accelerator,
    :class:`~cockpit.engine.tensor_block.TensorBlock`), of one floating dtype of at least
    float32 (κ is applied in it)."""
    blocks = TensorBlock.pair(predicted, actual)
    if blocks is None or blocks[0].values.dtype not in (torch.float32, torch.float64):
        return None
    return blocks


def _kernel_checks(predicted: Sequence[Tensor], actual: Sequence[Tensor]) -> Tensor | None:
    """:class:`UpdateMatch`'s checks by two passes of one kernel over both lists on CUDA
    (:mod:`cockpit.engine.tensor_sums`; sums in float32 per chunk of a tensor, then in
    float64): ⟨p, p⟩ and ⟨p, a⟩, then ‖a − κp‖² per tensor (only their sum is read, as a
    norm). None where the kernel does not take the lists."""
    sizes = tensor_sums.checked(predicted, actual)
    sums = None if sizes is None else tensor_sums.pair_sums(predicted, actual, sizes)
    if sums is None:
        return None
    totals = sums[0::2].sum(1)  # [⟨p, p⟩, ⟨p, a⟩]
    residual_sq = tensor_sums.sq_norms_of_differences(actual, predicted, totals[1] / totals[0],
                                                      sizes)  # (checked: the same lists)
    if residual_sq is None:
        return None
    return torch.cat([totals, residual_sq.sum().sqrt().reshape(1)])


def _block_checks(p: TensorBlock, a: TensorBlock) -> Tensor:
    """:class:`UpdateMatch`'s checks from the blocks of p and a: ⟨p, p⟩ and ⟨p, a⟩ summed
    per column of the blocks (ROWS numbers each) and then in float64, and ‖κp − a‖ over all
    tensors at once (only the sum of squares is read)."""
    pp = p.sq_total()
    pa = torch.linalg.vecdot(p.values, a.values, dim=0).sum(dtype=torch.float64)
    sums = torch.stack([pp, pa])
    kappa = (sums[1] / sums[0]).to(p.values.dtype)
    # (in the block's dtype: a float64 norm would widen the whole block first, and the
    # residual is only compared with rtol·‖a‖)
    residual = torch.linalg.vector_norm(p.values.mul_(kappa).sub_(a.values)).double()
    return torch.cat([sums, residual.reshape(1)])


# Tensors of at most this many elements (biases, normalization weights) enter
# :func:`_total_dot` together: one copy of them all instead of a product per tensor.
_SMALL_NUMEL = 2**16


def _total_dot(flat: Sequence[Tensor], actual: Sequence[Tensor]) -> Tensor:
    """Σ_k ⟨p_k, a_k⟩ in float64 (``flat``: the p_k as flat vectors; a_k in p_k's dtype):
    a dot product per large tensor (on a CPU by rows, :func:`cockpit.engine.float_sums.dot`:
    a float32 BLAS dot of an embedding's Adam step drifts by 1e-3, more than Alpha's check
    allows), one product of the small ones of each dtype side by side (a few kernels
    however many biases a model has)."""
    parts: list[Tensor] = []
    small: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
    for p, a in zip(flat, actual, strict=True):
        a = in_dtype(a, p.dtype)
        if p.numel() <= _SMALL_NUMEL:
            ps, as_ = small.setdefault(p.dtype, ([], []))
            ps.append(p)
            as_.append(a)
        else:
            parts.append(float_sums.dot(p, a))
    for ps, as_ in small.values():
        if len(ps) == 1:
            a = as_[0]
            parts.append(torch.dot(ps[0], a if a.dim() == 1 else a.reshape(-1)))
        else:
            parts.append(torch.mul(flat_cat(ps), flat_cat(as_)).sum())
    return torch.stack(parts).double().sum() if len(parts) > 1 else parts[0].double()


def sgd_update_basis(
    optimizer: Optimizer, param: Tensor, grad: Tensor, previous_update: Tensor | None = None
) -> Tensor | None:
    """Snapshot tensors whose span contains ``param``'s SGD update for any gradient scale c.

    With ``grad ← c·grad`` (e.g. clipping) and lr possibly changed, the update is
    ``s = a₁ g + a₂ θ + a₃ b_old`` (θ only with weight decay, the old momentum buffer only when
    it exists), for every option of SGD. Returned as copies stacked into one tensor
    ``[k, *param.shape]`` (rows g, θ, b_old; the step changes θ and b in place), so that the
    fit after the step reads them in one matrix product. None when the optimizer is not a
    supported plain SGD.

    ``previous_update``: the last update s_{t−1} of ``param``, if known and non-zero. Without
    Nesterov, SGD's last update was s_{t−1} = −lr·b_old (the buffer it left behind), so
    s_{t−1} takes b_old's row (see :func:`_replaces_buffer`): a caller that
    projects on s_{t−1} anyway needs one direction less. Should the buffer have been edited
    since (other than by a scaling), the fit after the step finds the update outside the span
    and says so.
    """
    rows = sgd_update_rows(optimizer, param, grad, previous_update)
    return None if rows is None else stack_rows(rows, param.dtype)


def stack_rows(rows: list[Tensor], dtype: torch.dtype) -> Tensor:
    """Copies of ``rows`` stacked into one tensor [k, *shape] of ``dtype``."""
    with torch.no_grad():
        return torch.stack([r.to(dtype) for r in rows])  # one copy kernel for all


def sgd_update_rows(
    optimizer: Optimizer, param: Tensor, grad: Tensor, previous_update: Tensor | None = None,
    *, optimizer_checked: bool = False,
) -> list[Tensor] | None:
    """The rows of :func:`sgd_update_basis` (g, θ, b_old or s_{t−1}) as they are now, not
    copied: whoever keeps them copies g, θ and b before they change (the step changes θ
    and b in place, the user may edit the gradient after the backward pass); s_{t−1}, when
    given, is the last row where it replaces b_old's (:func:`_replaces_buffer`;
    the caller tells by identity) (``optimizer_checked`` as for :func:`unsupported_reason`)."""
    if supported_base(optimizer) is not SGD:
        return None
    group = _predictable_group(optimizer, param, grad, optimizer_checked)
    if group is None:
        return None
    rows = [grad]
    if group["weight_decay"] != 0:
        rows.append(param.detach())
    buffer = (optimizer.state.get(param) or {}).get("momentum_buffer")
    if previous_update is not None and _replaces_buffer(group, buffer):
        rows.append(previous_update)
    elif group["momentum"] != 0 and buffer is not None:
        rows.append(buffer)
    return rows


def _replaces_buffer(group: dict, buffer: Tensor | None) -> bool:
    """Whether :func:`sgd_update_basis` puts a given previous update in the momentum buffer's
    row, for a parameter of SGD's ``group`` with momentum buffer ``buffer``: with momentum,
    without Nesterov, after its first step (a buffer exists)."""
    return group["momentum"] != 0 and not group["nesterov"] and buffer is not None
