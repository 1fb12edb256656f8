"""Checks of the gradient the optimizer steps on against the backward passes Cockpit's
hooks saw.

* **GradientMismatch** (a recorded value, never a warning): 1 − cos∠(p.grad, ḡ) over all
  parameters at ``optimizer.step()``, where p.grad is the gradient the optimizer steps on
  and ḡ = (1/N) Σ_n g_n the step's batch gradient from the backward passes inside
  ``with cockpit(step, ...)``. When every backward pass of the step weighted its samples
  alike (w = ∂L/∂ℓ_n), p.grad = w·N·ḡ in exact arithmetic, so the value is 0 up to
  rounding (below 1e-10 in float32), also after a global rescaling (clip_grad_norm_, a
  GradScaler). Editing gradients between backward and step (clip_grad_value_, per-parameter
  clipping, gradient noise, SAM, manual weight decay, a penalty outside ``losses``) makes it
  positive legitimately, so it is only recorded; a run-level reading of it belongs to the
  diagnosis.
* **Definite misuse** (a warning): a parameter already holds a non-zero gradient when the
  first block of a tracked step opens (gradients not zeroed, or a backward pass before the
  block); a backward pass accumulated into p.grad outside the blocks of an open tracked step,
  onto the very gradient the blocks left (a micro-batch outside the block), or in a step
  whose blocks saw no gradient at all (backward after the block). A gradient that was reset
  or edited in between (SAM's second pass after ``zero_grad``) is no evidence and gives no
  warning.
"""

from __future__ import annotations

import functools
import math
import operator
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from cockpit._listing import listed
from cockpit.engine import tensor_sums
from cockpit.engine.capture.removed_hooks import forget_removed_hooks
from cockpit.engine.dtypes import in_dtype
from cockpit.engine.readout import Later, Noted
from cockpit.engine.sharded import is_sharded, shard_like
from cockpit.engine.tensor_block import TensorBlock
from cockpit.engine.workspace import PARAMETER_SIZED, workspace
from cockpit.quantities.base import (
    FormedNorms,
    fused,
    norms,
    norms_of_differences,
    sq_norm_tensor,
)

ADDED = "added"  # a backward outside the blocks added to the gradient the blocks left
ONLY_OUTSIDE = "only_outside"  # the blocks saw no gradient; a backward outside them did
WATCHED = 4  # parameters watched for backward passes outside the blocks


def gradient_mismatch(params: dict[str, Tensor], mean: dict[str, Tensor],
                      weights: list[float | None], mean_norms: list[FormedNorms] | None = None
                      ) -> Later | None:
    """1 − cos∠(p.grad, ḡ) = ½ Σ_params ‖p.grad/‖p.grad‖ − sign(w)·ḡ/‖ḡ‖‖² over the
    parameters the step's backward passes reached (the keys of ``mean``), as one vector
    (the half squared distance of unit vectors: no cancellation near 0).

    ``mean``: ḡ per parameter name; ``weights``: the loss weight w of each backward pass of
    the step. None where it cannot be checked: weights unknown or unequal (then p.grad is
    not a multiple of ḡ), a parameter without a dense p.grad. Formed on the device; the
    value ({"GradientMismatch": ...}) comes when the step's numbers are read: None for a
    zero or non-finite ḡ, 1 for a zero p.grad against a non-zero ḡ.

    ``mean_norms``: a list that receives ‖ḡ‖ per parameter of ``mean`` where they were
    formed on the way (GradNorm reads the same numbers:
    :meth:`cockpit.quantities.base.StepData.reuse_grad_norms`).
    """
    if not mean or not weights or any(w is None for w in weights):
        return None
    known = [float(w) for w in weights if w is not None]
    if max(known) - min(known) > 1e-6 * max(abs(w) for w in known) or known[0] == 0.0:
        return None
    sign = 1.0 if known[0] > 0 else -1.0
    grads, means = [], []
    with torch.no_grad():  # (no detach per tensor: nothing here joins a graph)
        for name, g in mean.items():
            p = params.get(name)
            if p is None or p.grad is None or p.grad.layout != torch.strided:
                return None
            grads.append(p.grad)
            means.append(in_dtype(g, p.grad.dtype))
            if is_sharded(p.grad):  # fully_shard: ḡ sliced like this rank's shard of p.grad
                means[-1] = shard_like(means[-1], p.grad)
        # many tensors on an accelerator: both lists read once by one kernel on CUDA
        # (:mod:`~cockpit.engine.tensor_sums`), else in one block each (a few ops whatever
        # their number; :class:`~cockpit.engine.tensor_block.TensorBlock`)
        many = fused(grads)
        sizes = tensor_sums.checked(grads, means) if many else None
        sums = None if sizes is None else tensor_sums.pair_sums(grads, means, sizes)
        blocks = TensorBlock.pair(grads, means) if sums is None and many else None
        # [‖p.grad‖, ‖ḡ‖] over all parameters, from one pass over both lists
        both = (torch.cat([sums[0], sums[1]]).sqrt_() if sums is not None
                else norms(grads + means) if blocks is None
                else torch.cat([blocks[0].sq_norms(), blocks[1].sq_norms()]).sqrt_())
        if mean_norms is not None and all(map(operator.is_, means, mean.values())):
            mean_norms.append(FormedNorms.of(both[len(grads):], list(mean.values())))
        totals = torch.linalg.vector_norm(both.view(2, -1), dim=1)
        grad_norm, mean_norm = totals.unbind()
        # ½‖a/‖a‖ − b/‖b‖‖² = ½‖a − c·b‖²/‖a‖², c = ‖a‖/‖b‖
        c = grad_norm / mean_norm
        c = in_dtype(c if sign > 0 else -c, grads[0].dtype)
        halves_sq = (tensor_sums.sq_norms_of_differences(grads, means, c, sizes)
                     if sums is not None else None)
        if halves_sq is None and blocks is not None:
            halves_sq = blocks[0].subtract(blocks[1], c).sq_norms()
        if halves_sq is not None:  # (the differences' squared norms, summed on the host)
            return Later(_mismatch, totals, halves_sq, name="GradientMismatch")
        if many:  # the differences' norms squared and summed on the host
            halves = norms_of_differences(grads, means, c)
            return Later(lambda t, h: _mismatch(t, h * h), totals, halves,
                         name="GradientMismatch")
        # one fused pass per parameter into scratch memory (fresh temporaries cost page
        # faults on a CPU)
        parts: list[Tensor] = []
        for a, b in zip(grads, means, strict=True):
            if is_sharded(a):  # (scratch memory is not a DTensor)
                parts.append(sq_norm_tensor(a - b * float(c)))
                continue
            diff, _ = workspace().take(PARAMETER_SIZED, a.shape, a.dtype, a.device)
            parts.append(sq_norm_tensor(torch.addcmul(a, b, c, value=-1, out=diff)))
    return Later(_mismatch, totals, torch.stack(parts), name="GradientMismatch")


def _mismatch(totals, halves) -> dict[str, float | None]:
    """From [‖p.grad‖, ‖ḡ‖] and the per-parameter ‖a − c·b‖² (host arrays)."""
    grad_sq, mean_sq = float(totals[0]) ** 2, float(totals[1]) ** 2
    half_sq = float(halves.sum())
    if not (math.isfinite(grad_sq) and math.isfinite(mean_sq)) or mean_sq == 0.0:
        return {"GradientMismatch": None}
    if grad_sq == 0.0:
        return {"GradientMismatch": 1.0}
    return {"GradientMismatch": min(0.5 * half_sq / grad_sq, 2.0)}


def parameters_holding_gradient(params: dict[str, Tensor]) -> tuple[list[str], Tensor | None]:
    """The names of the parameters with a p.grad and, on the device, whether each p.grad is
    non-zero (one fused norm over the dense gradients; None without any p.grad)."""
    named = [(n, p.grad.detach()) for n, p in params.items() if p.grad is not None]
    dense = [(n, g) for n, g in named if g.layout == torch.strided]
    sparse = [(n, g.coalesce()) for n, g in named if g.layout == torch.sparse_coo]
    flags = []
    if dense:
        flags.append(torch.stack(torch._foreach_norm([g for _, g in dense])) != 0)
    flags += [g.values().any().reshape(1) for _, g in sparse]
    names = [n for n, _ in dense] + [n for n, _ in sparse]
    return names, (torch.cat(flags) if flags else None)


class HeldGradients:
    """Definite misuse: the parameters the optimizer steps on hold a gradient before the
    step's first backward pass (recorded as GradientHeld, 1.0 or 0.0, and warned about once;
    decided when the step's numbers are read).

    Looked at when the step's first block opens (whether each p.grad is non-zero, on the
    device) and when it closes (:meth:`later`): ``optimizer.zero_grad()`` inside the block
    sets p.grad to None, so that the backward pass makes a new one, or zeroes it in place;
    held is only a p.grad that is still the same tensor, written at most once since (the
    backward pass's accumulation into it: each in-place write advances its version). The
    block's start keeps no reference to the gradients (a weak one only: zero_grad frees
    their memory as without Cockpit).
    """

    def __init__(self, step: int, stepped: dict[str, Tensor]):
        self.step = step
        self.names, self.nonzero = parameters_holding_gradient(stepped)
        grads = [stepped[n].grad for n in self.names]  # (each set: names are those held)
        self._grads = [(weakref.ref(g), g._version) for g in grads if g is not None]

    def later(self, stepped: dict[str, Tensor]) -> Later:
        """The check as the block leaves it (``stepped``: the parameters, as above)."""
        step, names, nonzero = self.step, self.names, self.nonzero
        if nonzero is None:
            return Later(lambda: {"GradientHeld": 0.0})
        kept = [_unchanged_but_accumulated(stepped.get(n), ref, version)
                for n, (ref, version) in zip(names, self._grads, strict=True)]

        def verdict(flags) -> Noted:
            held = [n for n, flag, same in zip(names, flags, kept, strict=True)
                    if flag and same]
            if not held:
                return Noted({"GradientHeld": 0.0})
            return Noted({"GradientHeld": 1.0}, warnings=((
                f"step {step}: {listed(held)} already hold a gradient when the first "
                f"`with cockpit({step}, ...)` block opens: zero the gradients before each "
                "step (optimizer.zero_grad()) and call backward inside `with cockpit(step, "
                "...)`; the optimizer steps on more than the backward passes Cockpit sees",
                "gradients-not-zeroed"),))

        return Later(verdict, nonzero)


def _unchanged_but_accumulated(param: Tensor | None, ref: weakref.ref, version: int) -> bool:
    """Whether ``param.grad`` is the tensor ``ref`` names, written at most once since its
    ``version`` was read."""
    grad = None if param is None else param.grad
    if grad is None:
        return False
    written = grad._version - version
    return ref() is grad and written <= 1


class OutsideBackwardWatch:
    """Hooks on the parameters, armed only while a tracked step is open and no block is:
    they see a backward pass that accumulates into p.grad outside ``with cockpit(step)``.

    A pre-hook sees p.grad before the accumulation (whether it is still the gradient the
    blocks left, unchanged), the post-accumulate hook confirms that p.grad was written (a
    ``torch.autograd.grad`` call fires only the first). A backward pass of the model reaches
    all its parameters, so a few watched parameters suffice (:data:`WATCHED`): registering
    and removing a hook costs ~25 µs, per parameter that would be milliseconds per tracked
    step on a large model.
    """

    def __init__(self, params: dict[str, Tensor], busy: Callable[[], bool]):
        self.params = params
        self.busy = busy  # True while Cockpit runs backward passes of its own
        self.evidence: str | None = None
        self._handles: list = []
        self._left: dict[str, tuple[weakref.ref | None, int]] = {}
        self._onto_left: dict[str, bool] = {}
        self._blocks_saw_gradient = True

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self, blocks_saw_gradient: bool, candidates: list[str]) -> None:
        """Start watching the first and last :data:`WATCHED` / 2 of ``candidates`` (the
        parameters the blocks' backward passes reached, else any); p.grad as it is now is
        what the blocks left."""
        self.disarm()
        self._blocks_saw_gradient = blocks_saw_gradient
        half = WATCHED // 2
        names = [n for n in candidates if n in self.params] or list(self.params)
        for name in dict.fromkeys(names[:half] + names[-half:]):
            p = self.params[name]
            g = p.grad
            self._left[name] = (None, 0) if g is None else (weakref.ref(g), g._version)
            self._handles.append(p.register_hook(functools.partial(self._before, name)))
            self._handles.append(p.register_post_accumulate_grad_hook(
                functools.partial(self._after, name)))

    def disarm(self) -> None:
        if not self._handles:  # (nothing armed: nothing noted either)
            return
        for handle in self._handles:
            handle.remove()
        forget_removed_hooks(self.params[name] for name in self._left)
        self._handles = []
        self._left = {}
        self._onto_left = {}

    def reset(self) -> None:
        self.disarm()
        self.evidence = None

    def _before(self, name: str, grad: Tensor) -> None:
        if self.busy():
            return
        ref, version = self._left.get(name, (None, 0))
        current = self.params[name].grad
        self._onto_left[name] = (ref is not None and current is not None
                                 and ref() is current
                                 and current._version == version)  # type: ignore[union-attr]

    def _after(self, name: str, param: Tensor) -> None:
        if self.busy() or name not in self._onto_left:
            return
        onto_left = self._onto_left.pop(name)
        if not self._blocks_saw_gradient:
            self.evidence = ONLY_OUTSIDE
        elif onto_left and self.evidence is None:
            self.evidence = ADDED


def report_backward_outside(step: int, evidence: str | None, no_gradient: bool,
                            warn: Callable[..., None]) -> str | None:
    """Warn about a backward pass outside the blocks of ``step`` (``evidence`` of the
    :class:`OutsideBackwardWatch`); the note for the gradient instruments if the blocks saw
    no gradient at all (else None)."""
    if no_gradient:
        outside = (" (a backward pass outside the block did)" if evidence == ONLY_OUTSIDE
                   else "")
        message = (f"no backward pass reached the parameters inside `with cockpit({step}, "
                   f"...)`{outside}: call backward inside `with cockpit(step, ...)`")
        warn(f"step {step}: {message}; the step's gradient instruments are not recorded",
             key="backward-outside")
        return message
    if evidence is not None:
        warn(f"step {step}: a backward pass outside `with cockpit({step}, ...)` added to the "
             "gradient of the backward passes inside it: call every backward pass of a step "
             "(every micro-batch) inside `with cockpit(step, ...)`; the step's values "
             "describe only the backward passes inside the block", key="backward-outside")
    return None


