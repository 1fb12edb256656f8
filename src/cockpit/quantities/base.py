"""The interface every instrument implements, and the data it reads.

An instrument (a :class:`Quantity`) declares the statistics it needs (``needs``) and turns
them into numbers in :meth:`Quantity.compute`, called once the tracked backward pass is over.
Instruments that need the update s_t = θ_{t+1} − θ_t also implement
:meth:`Quantity.compute_after_update`, called after ``optimizer.step()``.

Values follow one contract: a float (NaN when the instrument saw non-finite numbers), None
(not computed; the reason goes to ``notes``), or a dict of numpy arrays/floats. Per-parameter
values use the name ``"<Instrument>/<parameter name>"``.

``compute`` returns the values, or — so that the step never waits for the device — a
:class:`~cockpit.engine.readout.Later`: the device tensors the values are made of and the
function that makes them from their host copies. Cockpit copies every Later's tensors of a
step to the host together and records the values at the next read (the next step's start,
``get_output()``, ``close()``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor

from cockpit.engine import float_sums, initial_parameters, sharded, tensor_sums
from cockpit.engine.engine_view import EngineView
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.histograms.auto_range import AutoRange
from cockpit.engine.histograms.exact import BinSpec
from cockpit.engine.readout import Later
from cockpit.engine.statistics import BackwardStatistics
from cockpit.engine.tensor_block import TensorBlock
from cockpit.schedules import Schedule, as_schedule

Value = float | None | dict[str, Any]
Values = dict[str, Value] | Later  # what compute() returns


T = TypeVar("T")

_VERSION = operator.attrgetter("_version")


class FormedNorms(NamedTuple):
    """‖x‖ of each of ``tensors`` (float64, on the device), formed while they had
    ``versions``: work one part of a step did that a later part may read."""

    norms: Tensor
    tensors: list[Tensor]
    versions: list[int]

    @classmethod
    def of(cls, norms: Tensor, tensors: list[Tensor]) -> FormedNorms:
        return cls(norms, tensors, list(map(_VERSION, tensors)))

    def hold_for(self, tensors: list[Tensor]) -> bool:
        """Whether these are the norms of ``tensors``: the same tensors in the same order,
        unchanged since."""
        return (len(tensors) == len(self.tensors)
                and all(map(operator.is_, tensors, self.tensors))
                and list(map(_VERSION, tensors)) == self.versions)


@dataclass
class StepData:
    """Everything the instruments may read at a tracked step t."""

    step: int
    losses: Tensor | None  # individual losses ℓ_n(θ_t), detached, shape [N]
    stats: BackwardStatistics | None  # per-sample statistics of this backward pass
    # g_B = (1/N) Σ_n g_n per parameter, read in ``compute`` (afterwards their memory holds
    # θ_t for the update, and the dict is empty)
    batch_grads: dict[str, Tensor]
    params: dict[str, Tensor]  # θ_t (live tensors: read before optimizer.step())
    initial_params: dict[str, Tensor] | None  # θ_0
    learning_rate: float | None
    hist_spec: BinSpec | AutoRange
    hist2d_specs: tuple[BinSpec, BinSpec]
    time: float
    notes: dict[str, str] = field(default_factory=dict)
    engine: EngineView | None = None  # what the instruments may ask of the engine
    # Σ_params g_nᵀu for every sample of the step, u known only after the optimizer step
    # (set when an instrument asked to keep the layer calls: request.keep_calls)
    project: Callable[[dict[str, Tensor]], Tensor] | None = None
    # why statistics that need the whole batch's gradient are missing (accumulation that
    # Cockpit learned only during this step), or None
    unmerged: str | None = None
    # the watched optimizer's steps before this one (θ_t: after that many updates)
    optimizer_steps: int = 0
    late: dict[int, dict[str, Value]] = field(default_factory=dict)  # values of earlier steps
    late_notes: dict[int, dict[str, str]] = field(default_factory=dict)
    late_values: dict[int, list[Later]] = field(default_factory=dict)  # ... still on the device
    warnings: list[str] = field(default_factory=list)
    # work several instruments share, formed once per step (:meth:`once`)
    _formed: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False)

    @property
    def num_samples(self) -> int:
        return 0 if self.losses is None else int(self.losses.numel())

    def once(self, key: Hashable, make: Callable[[], T]) -> T:
        """``make()``, formed at the first call with ``key`` in this step and kept."""
        if key not in self._formed:
            self._formed[key] = make()
        return self._formed[key]

    def formed(self, key: Hashable) -> Any:
        """What :meth:`once` formed for ``key`` in this step, or None."""
        return self._formed.get(key)

    def loss_mean_var(self) -> MeanVar:
        """:func:`batch_mean_var` of the step's losses, formed once per step (Loss reads
        the mean; α of step t − 1 ends and α of step t begins with both)."""
        losses = self.losses
        assert losses is not None
        return self.once("loss mean var", lambda: batch_mean_var(losses))

    def grad_norms(self) -> Tensor:
        """‖g_B‖ of every parameter tensor in the order of ``batch_grads``, float64 on the
        device (one fused kernel, formed once per step)."""
        return self.once("grad norms", lambda: norms(list(self.batch_grads.values())))

    def reuse_grad_norms(self, formed: FormedNorms) -> None:
        """Take norms formed earlier in the step (the gradient check's) as
        :meth:`grad_norms` where they are those of this step's batch gradients."""
        if formed.hold_for(list(self.batch_grads.values())):
            self._formed.setdefault("grad norms", formed.norms)

    def losses_finite(self) -> Tensor | None:
        """Whether every loss of the step is finite (:func:`all_finite`, formed once per
        step), None without losses."""
        losses = self.losses
        if losses is None:
            return None
        return self.once("losses finite", lambda: all_finite(losses))

    def grad_sq_norm(self, name: str) -> float:
        """‖g_B‖² of one parameter tensor as a float (reads the device: for instruments
        outside the configurations only)."""
        return float(self.grad_norms()[list(self.batch_grads).index(name)]) ** 2

    def update_norm_vector(self, update: dict[str, Tensor]) -> Tensor:
        """‖s_t‖ per parameter tensor of the update s_t = θ_{t+1} − θ_t, in the order of
        ``update``, float64 on the device (formed once per step: UpdateSize, UpdateRatio and
        Alpha read the same numbers)."""
        cached = self.__dict__.get("_update_norms")
        if cached is None or cached[0] is not update:
            cached = self.__dict__["_update_norms"] = (update, norms(list(update.values())))
        return cached[1]


class Quantity:
    """Base class of all instruments."""

    needs: frozenset[str] = frozenset()  # per-sample statistics (see engine.statistics)
    needs_losses: bool = True
    needs_update: bool = False
    handles_invalid_statistics: bool = False  # compute() also runs when a layer failed
    # needs the graph of each process's whole batch in one backward pass (None for micro-batches)
    whole_batch_graph: bool = False
    # differentiates the step's forward graph itself in prepare (curvature): under
    # fully_shard the engine gathers the parameters whole first, on every rank alike
    differentiates_graph: bool = False
    # keys of additive per-sample sums the instrument adds in prepare (engine.add_sample_sums)
    sample_sum_keys: tuple[str, ...] = ()
    # keys under which it may register directions to project on in prepare (request.
    # directions, request.direction_providers): the reduction over processes lays them out
    # on every rank alike
    projection_keys: tuple[str, ...] = ()
    # reads the smooth activations' inputs and outputs of the recorded forward pass (the
    # diagonal curvature's residual terms) and the layers' inputs at the width they were
    # given; held so only for steps that track such an instrument
    needs_activations: bool = False
    # the steps tracked relative to the schedule's: step s + k for each offset k and each
    # step s the schedule picks (Alpha: also the step after, where it observes θ_{t+1})
    schedule_offsets: tuple[int, ...] = (0,)

    def __init__(self, schedule: Schedule | int | None = None):
        self.schedule = as_schedule(schedule)

    @property
    def name(self) -> str:
        return type(self).__name__

    def should_track(self, step: int) -> bool:
        offsets = self.schedule_offsets
        if len(offsets) == 1:  # (no generator for the common case: asked often)
            return bool(self.schedule(step - offsets[0]))
        return any(self.schedule(step - k) for k in offsets)

    def needs_update_at(self, step: int) -> bool:
        """Whether :meth:`compute_after_update` has work at ``step``, a step it tracks
        (then Cockpit copies θ_t before the optimizer step for θ_{t+1} − θ_t)."""
        return self.needs_update

    def prepare(self, step: int, engine: EngineView, optimizer, losses: Tensor | None
                ) -> None:
        """Called before the user's backward pass of a tracked step (register directions
        in ``engine.request``, curvature work on the forward graph, ...)."""

    def compute(self, data: StepData) -> dict[str, Value]:
        return {}

    def compute_after_update(self, data: StepData, update: dict[str, Tensor]) -> dict[str, Value]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What the instrument carries from step to step (a moving average), for a run
        resumed from a checkpoint (:meth:`cockpit.Cockpit.state_dict`); empty for most."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s result."""

    def __repr__(self) -> str:
        return f"{self.name}(schedule={self.schedule!r})"


def sq_norm(x: Tensor) -> float:
    """‖x‖² without a temporary or a float64 copy (:func:`cockpit.engine.float_sums.sq_norm`:
    a CPU's float32 dot product of millions of numbers drifts by up to 1 %)."""
    return float(float_sums.sq_norm(x))


MeanVar = tuple[Tensor, Tensor]


def batch_mean_var(x: Tensor) -> MeanVar:
    """(mean, biased (1/|B|) variance), 0-dim float64 tensors on x's device (Appendix B.2;
    two scalars, not a stacked pair: the step's readout packs every scalar at once)."""
    x = x.double()
    if x.numel() > 1:
        var, mean = torch.var_mean(x, correction=0)
        return mean, var
    if x.numel() == 0:  # (no samples: both undefined, as the mean of nothing is)
        nan = torch.full((), math.nan, dtype=x.dtype, device=x.device)
        return nan, nan
    return x.reshape(()), torch.zeros((), dtype=x.dtype, device=x.device)


def norms(tensors: list[Tensor]) -> Tensor:
    """‖x‖ of every tensor as one float64 vector on their device (instruments square them on
    the host where their formula reads ‖x‖²: a square per vector is a kernel on the device,
    a multiplication on the host). On a CPU one BLAS dot product per tensor in its dtype (as
    fast as reading it once); elsewhere (and on the CPU under
    :func:`cockpit.engine.histograms.device.forced`) one fused norm kernel for all
    (``torch._foreach_norm``, accumulated in float64)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    if sharded.is_sharded(tensors[0]):
        return sharded.sq_norms(tensors).sqrt_()
    with torch.no_grad():
        if not histogram_device.device_path(tensors[0].device):
            return torch.stack([sq_norm_tensor(t) for t in tensors]).double().sqrt_()
        return fused_norms(tensors)


def fused_norms(tensors: list[Tensor]) -> Tensor:
    """‖x‖ of every tensor as one float64 vector by fused kernels on any device: where
    there are many, by one pass over them on CUDA (:mod:`cockpit.engine.tensor_sums`) or
    from one block of them all (a few ops and tensors made, whatever their number:
    :class:`~cockpit.engine.tensor_block.TensorBlock`), else one multi-tensor norm
    (``torch._foreach_norm``, accumulated in float64)."""
    with torch.no_grad():
        sq = tensor_sums.sq_norms(tensors)
        if sq is not None:
            return sq.sqrt_()
        block = TensorBlock.on_accelerator(tensors)
        if block is not None:
            return block.sq_norms().sqrt_()
        return stacked(torch._foreach_norm(tensors, dtype=torch.float64))


def fused(tensors: list[Tensor]) -> bool:
    """Whether per-tensor work over ``tensors`` takes fused multi-tensor kernels
    (``torch._foreach_*``): off the CPU (and on the CPU under
    :func:`cockpit.engine.histograms.device.forced`), not for DTensors. A GPU then runs a few
    kernels for all tensors instead of a few per tensor; the CPU keeps its per-tensor BLAS
    dot products into scratch memory (as fast as reading each tensor once)."""
    return (bool(tensors) and not sharded.is_sharded(tensors[0])
            and histogram_device.device_path(tensors[0].device))


# Elements of the temporaries one group of fused differences may hold.
_FUSED_ELEMENTS = 2**26


def norms_of_differences(xs: list[Tensor], ys: list[Tensor],
                         scale: Tensor | None = None, bring: bool = False) -> Tensor:
    """[‖x_k − c·y_k‖]_k as one float64 vector (c = ``scale``, a 0-dim tensor, or 1) by
    fused kernels (:func:`fused`) per group of tensors of at most 2^26 elements (the
    differences are temporaries): on CUDA one pass over both lists
    (:mod:`cockpit.engine.tensor_sums`), else the difference of two blocks and its norms
    (:class:`~cockpit.engine.tensor_block.TensorBlock`), or where blocks do not pay one
    multi-tensor difference and one multi-tensor norm. ``bring``: ``ys`` wait in the host's
    memory (:mod:`cockpit.engine.initial_parameters`), each group's copied to the device
    right before its differences."""
    if not bring:  # (no temporaries: the kernel takes all tensors at once)
        with torch.no_grad():
            sq = tensor_sums.sq_norms_of_differences(xs, ys, scale)
        if sq is not None:
            return sq.sqrt_()
    groups: list[list[int]] = [[]]
    size = 0
    for k, x in enumerate(xs):
        if groups[-1] and size + x.numel() > _FUSED_ELEMENTS:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += x.numel()
    parts: list[Tensor] = []
    with torch.no_grad():
        for group in groups:
            x, y = [xs[k] for k in group], [ys[k] for k in group]
            if bring:
                y = initial_parameters.brought(y, x[0].device)
            sq = tensor_sums.sq_norms_of_differences(x, y, scale)
            if sq is not None:
                parts.append(sq.sqrt_())
                continue
            blocks = TensorBlock.pair(x, y)
            if blocks is not None:
                parts.append(blocks[0].subtract(blocks[1], scale).sq_norms().sqrt_())
                continue
            if scale is not None:
                y = torch._foreach_mul(y, scale)
            parts.append(stacked(torch._foreach_norm(torch._foreach_sub(x, y),
                                                     dtype=torch.float64)))
    return parts[0] if len(parts) == 1 else _joined(parts)


def sq_norm_tensor(x: Tensor) -> Tensor:
    """‖x‖² as a 0-dim tensor on x's device, by one dot product in x's dtype (on a CPU, for
    long vectors, by rows, in float64: :func:`cockpit.engine.float_sums.sq_norm`)."""
    if sharded.is_sharded(x):
        return sharded.sq_norms([x])[0]
    return float_sums.sq_norm(x)


def all_finite(x: Tensor) -> Tensor:
    """Whether every element of ``x`` is finite, a 0-dim bool tensor on x's device, in three
    kernels (0·x is 0 for a finite x, NaN otherwise; ``isfinite(x).all()`` takes six)."""
    with torch.no_grad():
        return x.mul(0).sum().eq(0)


def finite_witness(x: Tensor) -> Tensor:
    """A 0-dim float64 tensor on x's device, finite exactly when every element of ``x`` is
    (read on the host): Σ x accumulated in float64 for narrower floats, one kernel (no sum
    of fewer than 10^269 float32 values overflows float64; ±∞ and NaN stay non-finite), and
    Σ 0·x for float64 (0, or NaN)."""
    with torch.no_grad():
        if x.dtype == torch.float64:
            return x.mul(0).sum()
        return x.sum(dtype=torch.float64)


def stacked(norms: list[Tensor]) -> Tensor:
    """The norms ‖x_k‖ (0-dim tensors) as one float64 vector on the first one's device
    (norms in float64 already need no cast)."""
    device = norms[0].device
    if len({n.device for n in norms}) > 1:  # a model spread over devices
        norms = [n.to(device, non_blocking=True) for n in norms]
    return torch.stack(norms).to(torch.float64)


def _joined(parts: list[Tensor]) -> Tensor:
    """Vectors of norms (float64) as one, on the first one's device."""
    device = parts[0].device
    return torch.cat([p.to(device, non_blocking=True) for p in parts])


def per_param_norms(name: str, names: list[str], norms: Tensor) -> Later:
    """The global norm √(Σ_k ‖x_k‖²) and one norm per parameter tensor (``name`` and
    ``name/<parameter>``) from the norms ``norms`` of the tensors ``names``."""

    def values(norms_host) -> dict[str, Value]:
        host = norms_host.tolist()
        total = math.sqrt(sum(map(operator.mul, host, host)))
        return global_and_per_param(name, dict(zip(names, host, strict=True)), total)

    return Later(values, norms, name=name)


def to_float(x: Tensor | float) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def global_and_per_param(
    name: str, per_param: dict[str, float], total: float
) -> dict[str, Value]:
    out: dict[str, Value] = {name: total}
    out.update(zip([f"{name}/{param}" for param in per_param], per_param.values(),
                   strict=True))
    return out
