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
(LBFGS and other closure-based ones included), subclasses that override ``step``, ``fused``,
``capturable`` and ``differentiable`` groups, complex parameters, sparse gradients, tensor
hyperparameters other than a one-element ``lr``, state that does not fit the group's options.
``foreach=True`` runs the same math with multi-tensor kernels (agreement to rounding).

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
  ``fit_basis_coefficients`` recovers the coefficients after the step, exactly. For Adam,
  RMSprop and Adagrad clipping is not a rescaling; the check fails and the caller falls back.
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from torch.optim import SGD, Adagrad, Adam, Optimizer, RMSprop

from cockpit.engine.histograms.device import device_path
from cockpit.engine.workspace import workspace

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
    FUSED = "fused=True is not supported"
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
    """The supported base class whose unmodified ``step`` ``optimizer`` uses, else None."""
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


def _group_reason(group: dict) -> str | None:
    if group.get("fused"):
        return UnsupportedOptimizer.FUSED
    if group.get("capturable"):
        return UnsupportedOptimizer.CAPTURABLE
    if group.get("differentiable"):
        return UnsupportedOptimizer.DIFFERENTIABLE
    for key in _RULE_KEYS:  # keys the rules read (schedulers add e.g. a tensor "initial_lr")
        value = group.get(key)
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, Tensor) for v in values):
            return UnsupportedOptimizer.TENSOR_HYPERPARAMETER
    lr = group.get("lr")
    if isinstance(lr, Tensor) and (lr.numel() != 1 or lr.requires_grad):
        return UnsupportedOptimizer.TENSOR_HYPERPARAMETER
    return None


def unsupported_reason(
    optimizer: Optimizer, param: Tensor | None = None, grad: Tensor | None = None
) -> str | None:
    """Why the updates (of ``param`` with ``grad``, if given) cannot be predicted, or None.

    ``UnsupportedOptimizer.INCONSISTENT_STATE`` is found only by ``predict_update`` itself.
    """
    reason = _optimizer_reason(optimizer)
    if reason is not None or param is None:
        return reason
    if _find_group(optimizer, param) is None:
        return UnsupportedOptimizer.PARAM_NOT_FOUND
    if torch.is_complex(param):
        return UnsupportedOptimizer.COMPLEX
    if grad is not None and grad.is_sparse:
        return UnsupportedOptimizer.SPARSE
    if grad is not None and grad.shape != param.shape:
        return UnsupportedOptimizer.SHAPE
    return None


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
        reason = _group_reason(group)
        if reason is not None:
            return reason
    return None


def supports(optimizer: Optimizer) -> bool:
    """Whether ``predict_update`` can predict this optimizer's updates."""
    return unsupported_reason(optimizer) is None


# Per optimizer: (shape of its param_groups, id(param) → (group, position)). Looked up once
# or more per parameter and tracked step; a scan of every group each time made a step cost
# O(parameters²) (a 302-tensor MLP: ~70 ms per step).
_GROUP_INDEX: weakref.WeakKeyDictionary[Optimizer, tuple[tuple, dict]] = (
    weakref.WeakKeyDictionary())


def _find_group(optimizer: Optimizer, param: Tensor) -> dict | None:
    """The param group holding ``param`` (None if none does), from an index rebuilt whenever
    the groups change shape or an entry no longer holds the same tensor."""
    groups = optimizer.param_groups
    shape = tuple((id(g), len(g["params"])) for g in groups)
    for attempt in range(2):
        cached = _GROUP_INDEX.get(optimizer)
        if attempt or cached is None or cached[0] != shape:
            index = {id(p): (g, i) for g in groups for i, p in enumerate(g["params"])}
            _GROUP_INDEX[optimizer] = cached = (shape, index)
        found = cached[1].get(id(param))
        if found is not None and found[0]["params"][found[1]] is param:
            return found[0]
    return None


def _scalar(value: float | Tensor) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def _next_step(state: dict) -> float:
    """``step_t += 1; step = step_t.item()`` in the state's own dtype."""
    step = state.get("step", 0.0)
    return (step + 1).item() if isinstance(step, Tensor) else float(step) + 1.0


def predict_update(optimizer: Optimizer, param: Tensor, grad: Tensor) -> Tensor | None:
    """The update ``θ_{t+1} − θ_t`` that ``optimizer.step()`` will apply to ``param``.

    ``grad`` is the gradient the step will see in ``param.grad``. Returns None when the update
    cannot be predicted (see ``unsupported_reason``); never modifies ``optimizer``'s state.
    """
    if unsupported_reason(optimizer, param, grad) is not None:
        return None
    group = _find_group(optimizer, param)
    state = optimizer.state.get(param) or {}  # .get: do not create an entry
    base = supported_base(optimizer)
    with torch.no_grad():
        param = param.detach()
        grad = grad.detach().to(param.dtype)
        if base is SGD:
            new_param = _sgd_step(param, grad, group, state)
        elif base is Adam:
            new_param = _adam_step(param, grad, group, state)
        elif base is RMSprop:
            new_param = _rmsprop_step(param, grad, group, state)
        else:
            new_param = _adagrad_step(param, grad, group, state, optimizer.defaults)
        return None if new_param is None else new_param - param


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
        needed = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        if any(key not in state for key in needed):
            return None
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        max_exp_avg_sq = state.get("max_exp_avg_sq")
    else:
        exp_avg = exp_avg_sq = max_exp_avg_sq = torch.zeros_like(param)
    step = _next_step(state)
    grad = _signed(grad, group)
    new_param = param
    if weight_decay != 0:
        if group.get("decoupled_weight_decay", False):
            new_param = param.mul(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg = exp_avg.lerp(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    step_size = lr / bias_correction1
    if amsgrad:
        exp_avg_sq = torch.maximum(max_exp_avg_sq, exp_avg_sq)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    return new_param.addcdiv(exp_avg, denom, value=-step_size)


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


def _dot(a: Tensor, b: Tensor) -> float:
    """⟨a, b⟩ by a BLAS dot product in the tensors' dtype (no temporary)."""
    return float(torch.dot(a.reshape(-1), b.reshape(-1).to(a.dtype)))


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
        actual_sq = sum(_dot(a, a) for a in actual)
    match = UpdateMatch(predicted, actual)  # type: ignore[arg-type]
    return match.kappa(_to_host(match.checks).numpy(), rtol, atol, actual_sq)


class UpdateMatch:
    """:func:`match_update` in two halves: ``checks`` = [⟨p, p⟩, ⟨p, a⟩, ‖a − κp‖ per tensor]
    with κ = ⟨p, a⟩/⟨p, p⟩ (float64 on the device; dot products by BLAS in the tensors'
    dtype) is formed without reading the device; :meth:`kappa` decides on its host copy."""

    def __init__(self, predicted: Sequence[Tensor], actual: Sequence[Tensor]):
        if not predicted:
            self.checks = torch.zeros(2, dtype=torch.float64)
            return
        pp = [torch.dot(p.reshape(-1), p.reshape(-1)) for p in predicted]
        pa = [torch.dot(p.reshape(-1), a.reshape(-1).to(p.dtype))
              for p, a in zip(predicted, actual, strict=True)]
        sums = torch.stack([torch.stack(pp).double().sum(), torch.stack(pa).double().sum()])
        kappa = sums[1] / sums[0]
        residuals = []
        for p, a in zip(predicted, actual, strict=True):
            # κ at least in float32 (rounded to bfloat16 it would miss by 0.4 %)
            dtype = torch.promote_types(a.dtype, torch.float32)
            residuals.append(a.to(dtype) - p.to(dtype) * kappa.to(dtype))
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
    s_{t−1} takes b_old's row (see :func:`previous_update_replaces_buffer`): a caller that
    projects on s_{t−1} anyway needs one direction less. Should the buffer have been edited
    since (other than by a scaling), the fit after the step finds the update outside the span
    and says so.
    """
    if supported_base(optimizer) is not SGD or unsupported_reason(optimizer, param, grad):
        return None
    group = _find_group(optimizer, param)
    rows = [grad]
    if group["weight_decay"] != 0:
        rows.append(param)
    if previous_update is not None and previous_update_replaces_buffer(optimizer, param):
        rows.append(previous_update)
    else:
        buffer = (optimizer.state.get(param) or {}).get("momentum_buffer")
        if group["momentum"] != 0 and buffer is not None:
            rows.append(buffer)
    with torch.no_grad():
        return torch.stack([r.to(param.dtype) for r in rows])  # one copy kernel for all


def previous_update_replaces_buffer(optimizer: Optimizer, param: Tensor) -> bool:
    """Whether :func:`sgd_update_basis` puts a given previous update in the momentum buffer's
    row: SGD with momentum, without Nesterov, after its first step (a buffer exists)."""
    if supported_base(optimizer) is not SGD:
        return False
    group = _find_group(optimizer, param)
    if group is None or group["momentum"] == 0 or group["nesterov"]:
        return False
    return (optimizer.state.get(param) or {}).get("momentum_buffer") is not None


def fit_basis_coefficients(
    basis: Tensor | Sequence[Tensor], actual: Tensor, rtol: float = 1e-4, atol: float = 0.0,
    actual_sq: float | None = None,
) -> Tensor | None:
    """Least-squares coefficients c with ``actual ≈ Σ_k c_k basis_k`` (float64, on the CPU).

    Accepted when ``‖actual − Σ c_k basis_k‖ ≤ rtol ‖actual‖ + atol``, else None; ``atol``
    covers the rounding in measuring ``actual`` (a difference of parameters); ``actual_sq``
    is ‖actual‖² if the caller has it already. Then
    ``s_tᵀ g_n = Σ_k c_k (basis_kᵀ g_n)`` for any vector g_n, also if the basis is degenerate.
    ``basis``: a stacked tensor ``[k, ...]`` (as from :func:`sgd_update_basis`) or a list.
    See :func:`fit_basis_coefficients_many`.
    """
    if actual_sq is None:
        target = actual.reshape(-1)
        actual_sq = _dot(target, target)
    return fit_basis_coefficients_many([basis], [actual], rtol, [atol], [actual_sq])[0]


def fit_basis_coefficients_many(
    bases: Sequence[Tensor | Sequence[Tensor]], actuals: Sequence[Tensor], rtol: float,
    atols: Sequence[float], actual_sqs: Sequence[float],
) -> list[Tensor | None]:
    """:func:`fit_basis_coefficients` of several tensors at once (``actual_sqs``: ‖actual‖²
    of each): every fit is solved and checked on the device (:class:`BasisFits`), then read
    once; only fits that fail there are read again (:meth:`BasisFits.accept`)."""
    fits = BasisFits(bases, actuals)
    host = _to_host(torch.cat([fits.coefficients, fits.residual_norms.to(
        fits.coefficients.device)])).numpy()
    answer = fits.accept(host[len(fits.coefficients):], rtol, atols, actual_sqs)
    results: list[Tensor | None] = []
    offset = 0
    for index, (vectors, _) in enumerate(fits.problems):
        k = len(vectors)
        results.append(answer[index] if index in answer
                       else torch.from_numpy(host[offset : offset + k].copy()))
        offset += k
    return results


class BasisFits:
    """Least-squares fits ``a ≈ Vᵀc`` of several tensors, formed on the device without
    reading it: ``coefficients`` (float64, every tensor's c in turn) solve each tensor's
    normal equations VVᵀc = Va (BLAS products in the tensors' dtype, solved in float64),
    ``residual_norms`` (float64) are ‖a − Vᵀc‖ of each, measured directly. On the host,
    :meth:`accept` decides by them and solves once more what failed.

    The k×k systems (k ≤ 3) are scaled to a unit diagonal (Jacobi) and solved by LU
    (``solve_ex``: no error check, which would read the device); a row of zeros (a zero
    basis vector: a zero-initialised bias with weight decay) gets coefficient 0. A singular
    system (two parallel basis vectors) or non-finite one leaves a non-finite residual,
    which fails the check.
    """

    def __init__(self, bases: Sequence[Tensor | Sequence[Tensor]], actuals: Sequence[Tensor]):
        self.problems = []  # (V, a) per tensor
        for basis, actual in zip(bases, actuals, strict=True):
            target = actual if actual.dim() == 1 else actual.reshape(-1)  # (a view: host work)
            k = len(basis)
            if k == 0:
                vectors = target[:0].view(0, -1)
            elif isinstance(basis, Tensor):
                vectors = (basis if basis.dim() == 2 else basis.reshape(k, -1)).to(target.dtype)
            else:
                vectors = torch.stack([b.reshape(-1).to(target.dtype) for b in basis])
            self.problems.append((vectors, target))
        device = actuals[0].device if actuals else torch.device("cpu")
        self.coefficients = _solve_on_device(
            [_normal_equations(v, t) for v, t in self.problems], device)
        self.residual_norms = _residual_norms(self.problems, self.coefficients, device)

    def accept(self, residual_norms: Sequence[float], rtol: float, atols: Sequence[float],
               actual_sqs: Sequence[float]) -> dict[int, Tensor | None]:
        """The fits ``coefficients`` does not give, by index: ``residual_norms`` is the host
        copy of ``residual_norms``; a fit is accepted when ``‖a − Vᵀc‖ ≤ rtol ‖a‖ + atol``.
        A tensor without a basis or with a non-finite ‖a‖² has no fit (None); one that
        failed is solved once more from normal equations accumulated in float64 (by LAPACK's
        SVD on the host, which reads the device): they square the condition number of V,
        and directions that are nearly parallel (the gradient and SGD's momentum buffer when
        consecutive gradients agree) leave float32 products too inaccurate for a fit that
        exists. What fails then has no fit (None)."""
        answer: dict[int, Tensor | None] = {}
        retry = []
        for index, ((vectors, target), residual, atol, target_sq) in enumerate(zip(
                self.problems, residual_norms, atols, actual_sqs, strict=True)):
            if not len(vectors) or not math.isfinite(target_sq):
                answer[index] = None
                continue
            tolerance = rtol * math.sqrt(target_sq) + atol + _TINY
            if not residual <= tolerance:  # (NaN: fails)
                answer[index] = None
                retry.append((index, vectors, target, tolerance))
        if retry:
            systems = [_normal_equations_float64(v, t) for _, v, t, _ in retry]
            host = _to_host(_flat_systems(systems, retry[0][2].device)).numpy()
            answer.update(_fit_on_host(retry, host))
        return answer


def _solve_on_device(systems: list[tuple[Tensor, Tensor]], device: torch.device) -> Tensor:
    """c of every system (VVᵀ, Va), float64 in turn on ``device`` (see :class:`BasisFits`);
    one batched solve per basis size."""
    by_size: dict[int, list[int]] = {}
    for index, (gram, _) in enumerate(systems):
        by_size.setdefault(len(gram), []).append(index)
    pieces: dict[int, Tensor] = {}
    for k, indices in by_size.items():
        if k == 0:
            continue
        grams = torch.stack([systems[i][0].to(device) for i in indices]).double()
        rhs = torch.stack([systems[i][1].to(device) for i in indices]).double()
        diagonal = grams.diagonal(dim1=1, dim2=2)
        live = diagonal > 0
        scale = torch.where(live, diagonal, 1.0).rsqrt_().mul_(live)
        scaled = grams.mul_(scale.unsqueeze(2) * scale.unsqueeze(1))
        scaled.diagonal(dim1=1, dim2=2).add_(~live)  # zero rows: c = 0
        solution = torch.linalg.solve_ex(scaled, (rhs * scale).unsqueeze(2)).result
        solved = solution.squeeze(2).mul_(scale)
        if len(by_size) == 1:
            return solved.reshape(-1)
        pieces.update(zip(indices, solved.unbind(0), strict=True))
    if not pieces:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.cat([pieces[i] for i in range(len(systems)) if i in pieces])


def _residual_norms(problems: list[tuple[Tensor, Tensor]], coefficients: Tensor,
                    device: torch.device) -> Tensor:
    """‖a − Vᵀc‖ of every problem, float64 on ``device`` (NaN-free inputs give finite
    norms); one cast and split of ``coefficients`` per dtype."""
    if not problems:
        return torch.zeros(0, dtype=torch.float64, device=device)
    sizes = [len(v) for v, _ in problems]
    fused = device_path(device) and all(  # (not for DTensors: their own norms)
        type(target) is Tensor and target.device == device for _, target in problems)
    by_dtype: dict[torch.dtype, tuple[Tensor, ...]] = {}
    norms, residuals_fused = [], []
    for i, (vectors, target) in enumerate(problems):
        if target.dtype not in by_dtype:
            by_dtype[target.dtype] = coefficients.to(target.dtype).split(sizes)
        c = by_dtype[target.dtype][i]
        if fused:  # fresh residuals, one multi-tensor norm for all (accelerators)
            residuals_fused.append(torch.addmv(target, vectors.T, c, alpha=-1))
            continue
        scratch, _ = workspace().take("fit residual", target.shape, target.dtype,
                                      target.device)
        residual = torch.addmv(target, vectors.T, c, alpha=-1, out=scratch)
        norms.append(torch.linalg.vector_norm(residual).to(device))
    if fused:
        norms = list(torch._foreach_norm(residuals_fused, dtype=torch.float64))
    return torch.stack(norms).to(torch.float64)


def _fit_on_host(pending: list, host: np.ndarray) -> dict[int, Tensor | None]:
    """Coefficients (or None) of the ``pending`` problems (index, V, a, tolerance) from
    ``host``, the host copy of their flat normal equations: solved by LAPACK's gelsd (SVD),
    accepted by their residual (one more read of the device)."""
    answer: dict[int, Tensor | None] = {index: None for index, *_ in pending}
    solved, offset = [], 0
    for index, vectors, target, tolerance in pending:
        k = len(vectors)
        system = host[offset : offset + k * k + k]
        offset += k * k + k
        if not np.isfinite(system).all():
            continue  # no fit exists: None
        coefficients = np.linalg.lstsq(system[: k * k].reshape(k, k), system[k * k :],
                                       rcond=None)[0]
        solved.append((index, vectors, target, tolerance, torch.from_numpy(coefficients)))
    if not solved:
        return answer
    device = solved[0][2].device
    on_device = to_device(torch.cat([c for *_, c in solved]), device)
    residuals = _to_host(_residual_norms([(v, t) for _, v, t, _, _ in solved], on_device,
                                         device)).tolist()
    for (index, _, _, tolerance, coefficients), residual in zip(solved, residuals,
                                                                strict=True):
        if residual <= tolerance:
            answer[index] = coefficients
    return answer


def _flat_systems(systems: list[tuple[Tensor, Tensor]], device: torch.device) -> Tensor:
    """[VVᵀ flat, Vᵀa] of every tensor in one float64 vector (concatenated in their dtypes,
    then cast once: the cast to float64 is exact either way)."""
    parts = [(part if part.dim() == 1 else part.reshape(-1)).to(device)
             for gram, rhs in systems for part in (gram, rhs)]
    if not parts:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.cat(parts).double()


def _to_host(x: Tensor) -> Tensor:
    """float64 copy on the CPU: the fit's read of the device."""
    return x.detach().to("cpu", torch.float64)


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on ``device`` without waiting (pinned, non-blocking copy)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _normal_equations(vectors: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """VVᵀ and Vᵀa in the tensors' dtype (two BLAS products) on their device."""
    return vectors @ vectors.T, vectors @ target


# Elements per block of the float64 normal equations: the float64 copies stay in cache.
_FLOAT64_BLOCK = 2**16


def _normal_equations_float64(vectors: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """VVᵀ and Vᵀa accumulated in float64, block by block (no float64 copy of V)."""
    k = vectors.shape[0]
    gram = torch.zeros(k, k, dtype=torch.float64, device=vectors.device)
    rhs = torch.zeros(k, dtype=torch.float64, device=vectors.device)
    for start in range(0, target.numel(), _FLOAT64_BLOCK):
        block = vectors[:, start : start + _FLOAT64_BLOCK].double()
        gram.addmm_(block, block.T)
        rhs.addmv_(block, target[start : start + _FLOAT64_BLOCK].double())
    return gram, rhs
