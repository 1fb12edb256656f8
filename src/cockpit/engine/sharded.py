"""Parameters sharded over processes by torch's ``fully_shard`` (FSDP2).

Under ``fully_shard`` every parameter outside the forward and backward passes is a
``DTensor``: the full shape, of which each rank holds a slice (its *local shard*); so are
``p.grad`` (this rank's slice of the gradient averaged over ranks) and the optimizer state.
Inside a layer's backward hook the layer's parameters are whole again (FSDP all-gathered
them), so the individual gradients g_n of a rank's own samples are formed as without
sharding, and the ranks' statistics combine as under DistributedDataParallel
(:mod:`cockpit.engine.reduction.ranks`).

What needs a parameter-space tensor u besides g_n (a per-sample projection g_nᵀu on the
gradient G = p.grad or on the update s = θ_{t+1} − θ_t) needs all of u on every rank, for
the rank forms g_nᵀu for its own samples over all coordinates: :func:`whole` gathers it
(one all-gather per parameter, at points every rank passes in the same order). Norms and
inner products of parameter-space tensors alone (‖θ‖, ‖s‖, ‖G‖) are sums over coordinates:
:func:`sq_norms` forms them from the local shards and sums them over the ranks.

A mixed precision policy (``MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...)``) has
the layers compute on copies of θ rounded to ``param_dtype`` (:func:`compute_dtypes`), with
inputs and output gradients in that dtype; the optimizer steps on the full-precision θ with
the gradient reduced in ``reduce_dtype``. Cockpit then describes that computation: each g_n
is formed from the layer's own rounded (a_n, δ_n) (exact in float32), ḡ = (1/N) Σ_n g_n is
summed from them in full precision rather than read from the rounded gradient autograd
produced (which would depend on how the batch is split over processes), and θ means the
full-precision parameters (GradHist2d, the norms of θ and of the update).

The curvature instruments differentiate the forward graph themselves before the user's
backward pass (vector backpropagations from the output, Hessian-vector products). The
graph's leaves are the unsharded parameters, so they differentiate with respect to those
(:func:`graph_parameters`, which first gathers them whole again where
``reshard_after_forward=True`` freed them: the public ``FSDPModule.unshard``), with FSDP's
backward hooks held (:func:`fsdp_backward_hooks_held`: no all-gather, no resharding between
passes, no reduce-scatter into ``.grad``). Each rank then forms its own samples' share, and
the ranks combine as under DDP. Chosen over the alternatives: the gathered parameters
are kept until the user's backward pass, which then does not gather them again (one
all-gather per sharded module and tracked step instead of two: counted on 2 processes with
5 sharded layers, 10 all-gathers per step with the curvature instruments as without them;
the cost is holding all of θ on each rank from the start of the ``with`` block until each
layer's backward);
``torch.func.functional_call`` on gathered parameters would run the forward pass a second
time, on inputs Cockpit does not hold in general; keeping the parameters alive by
``reshard_after_forward=False`` would change the user's setting.

Three things have no public accessor in torch 2.13 and are read from ``fully_shard``'s
state: the unsharded parameter of each sharded one (:func:`unsharded_parameters`), the
mixed precision policy, and the backward hooks' methods (:func:`fsdp_backward_hooks_held`);
:func:`check_sharding` refuses a torch whose ``fully_shard`` lacks them.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
from torch import Tensor, nn

from cockpit.engine import float_sums

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


# ``DTensor`` is looked up where torch's distributed tensors are imported; no tensor is one
# before (``fully_shard`` imports them). Not imported here: that takes longer (~0.6 s) than the
# rest of Cockpit's import. (Inline in the two checks below: they run per parameter.)
_DISTRIBUTED_TENSORS = "torch.distributed.tensor"


def is_sharded(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a ``DTensor`` (a slice of it per process)."""
    dtensor = getattr(sys.modules.get(_DISTRIBUTED_TENSORS), "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def whole(tensor: Tensor) -> Tensor:
    """The full tensor of a ``DTensor`` (an all-gather: every rank must call it, in the same
    order), else ``tensor`` itself."""
    if is_sharded(tensor):
        return tensor.full_tensor()
    return tensor


def has_sharded(tensors: Iterable[Tensor]) -> bool:
    """Whether any of ``tensors`` is a ``DTensor`` (e.g. the parameters of a model sharded
    by ``fully_shard``)."""
    dtensor = getattr(sys.modules.get(_DISTRIBUTED_TENSORS), "DTensor", None)
    if dtensor is None:
        return False
    return any(map(isinstance, tensors, itertools.repeat(dtensor)))  # (no frame per tensor)


def local(tensor: Tensor) -> Tensor:
    """This rank's slice of a ``DTensor``, else ``tensor`` itself."""
    if is_sharded(tensor):
        return tensor.to_local()
    return tensor


def sq_norms(tensors: list[Tensor]) -> Tensor:
    """‖x_k‖² = Σ_r ‖x_k,r‖² of every sharded tensor from the local shards x_k,r, summed
    over the ranks in one all-reduce (float64, on the shards' device)."""
    from cockpit.engine.reduction.ranks import all_reduce_sum

    shards = [local(t).detach().reshape(-1) for t in tensors]
    summed = torch.stack([float_sums.sq_norm(s) for s in shards]).double()
    all_reduce_sum(summed)
    return summed.clone()  # the buffer itself stays with all_reduce_sum


def unsharded_parameters(model: nn.Module, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The unsharded parameter that ``fully_shard`` puts on the module for the forward and
    backward passes, per name of ``params`` (the sharded parameters): the backward pass
    computes the layer's gradient for it (this rank's samples, all coordinates), never for
    the sharded one, which FSDP fills afterwards by a reduce-scatter. FSDP creates each one
    at its first all-gather and reuses it from then on; before, a name is missing."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return {}
    names = {id(p): name for name, p in params.items()}
    out = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group  # no public accessor
        for fsdp_param in group.fsdp_params if group is not None else ():
            name = names.get(id(fsdp_param.sharded_param))
            twin = getattr(fsdp_param, "_unsharded_param", None)
            if name is not None and twin is not None:
                out[name] = twin
    return out


def _fsdp_states(model: nn.Module) -> list:
    """The ``fully_shard`` state of every sharded module of ``model``, in module order."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [module._get_fsdp_state() for module in model.modules()  # no public accessor
            if isinstance(module, FSDPModule)]


def graph_parameters(model: nn.Module, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The parameters the forward graph of ``model`` holds, per name of ``params``, with
    their values in place: under ``fully_shard`` the unsharded parameters
    (:func:`unsharded_parameters`), all-gathered again by ``FSDPModule.unshard`` where FSDP
    freed them after the forward pass (``reshard_after_forward=True``): one all-gather per
    sharded module, which every rank must reach at the same point. They stay whole until
    the user's backward pass, whose own all-gather then has nothing to do and which frees
    them as usual; the cost is one parameter-sized tensor per rank held from here to there.
    Without ``fully_shard``, ``params`` itself."""
    if not has_sharded(params.values()):
        return dict(params)
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # the same order on every rank
        if isinstance(module, FSDPModule):
            module.unshard()  # (nothing to do where the parameters are whole)
    twins = unsharded_parameters(model, params)
    missing = [name for name in params if name not in twins]
    if missing:
        raise RuntimeError(f"fully_shard has no unsharded parameter for {', '.join(missing)} "
                           "(not used in the forward pass?)")
    return {name: twins[name] for name in params}


@contextlib.contextmanager
def fsdp_backward_hooks_held(model: nn.Module) -> Iterator[None]:
    """Cockpit's own backward passes through the graph of a ``fully_shard`` model
    (curvature: Hessian-vector products, backpropagations of vectors from the output)
    without FSDP's backward hooks: the pre-backward hooks on the sharded modules' outputs
    would all-gather, and the post-backward function on their inputs would reshard the
    unsharded parameters (freeing what the next pass needs) and reduce-scatter their
    ``.grad`` into the sharded parameters' gradients; neither may happen outside the user's
    backward pass. Inside the context they do nothing (the parameters are already whole:
    :func:`graph_parameters`), and FSDP's state is as before afterwards. The hooks are
    registered on the graph during the forward pass and cannot be removed; they are held by
    replacing, on each instance, the methods they call (no public way in torch 2.13)."""
    states = _fsdp_states(model)
    if not states:
        yield
        return

    def nothing(*args, **kwargs) -> None:
        return None

    saved = [(state, state._training_state, state._states_to_backward_prefetch)
             for state in states]
    groups = [group for state in states for group in state._fsdp_param_groups]
    group_states = [group._training_state for group in groups]
    try:
        for state in states:
            state._register_root_post_backward_final_callback = nothing
            state._states_to_backward_prefetch = []
        for group in groups:
            group.pre_backward = nothing
            group.post_backward = nothing
        yield
    finally:
        for state, training_state, prefetch in saved:
            state.__dict__.pop("_register_root_post_backward_final_callback", None)
            state._states_to_backward_prefetch = prefetch
            state._training_state = training_state
        for group, training_state in zip(groups, group_states, strict=True):
            group.__dict__.pop("pre_backward", None)
            group.__dict__.pop("post_backward", None)
            group._training_state = training_state


def compute_dtypes(model: nn.Module, params: Mapping[str, Tensor]) -> dict[str, torch.dtype]:
    """Per name of ``params``: the dtype the layers compute in under a ``fully_shard`` mixed
    precision policy, where it differs from the parameter's own (``param_dtype`` of the
    innermost ``fully_shard`` module that owns the parameter; FSDP leaves parameters of
    other dtypes, and non-floating ones, alone). Empty without such a policy."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return {}
    owner_dtype: dict[int, torch.dtype | None] = {}
    for module in model.modules():  # parents first: an inner fully_shard overrides
        if isinstance(module, FSDPModule):
            policy = module._get_fsdp_state()._mp_policy  # no public accessor
            for p in cast(nn.Module, module).parameters():
                owner_dtype[id(p)] = policy.param_dtype
    out = {}
    for name, p in params.items():
        dtype = owner_dtype.get(id(p))
        if dtype is not None and p.is_floating_point() and dtype != p.dtype:
            out[name] = dtype
    return out


def precision_note(dtypes: Mapping[str, torch.dtype]) -> str | None:
    """What the per-sample values describe under a mixed precision policy (the step's note
    and the run's metadata); None without one."""
    if not dtypes:
        return None
    names = ", ".join(sorted({str(d).removeprefix("torch.") for d in dtypes.values()}))
    return (f"mixed precision (fully_shard mp_policy, param_dtype {names}): the individual "
            f"gradients are those of the layers' computation in {names} (θ, inputs and output "
            "gradients rounded as the layers used them), summed in float32 or wider; θ, the update "
            "and p.grad are the full-precision parameters the optimizer steps on and their "
            "gradient")


_WAY_OUT = (
    "shard the model with torch.distributed.fsdp.fully_shard (FSDP2) on a 1-D device mesh "
    "of all processes, or use DistributedDataParallel"
)


def check_sharding(model: nn.Module) -> None:
    """Refuse the sharded models Cockpit cannot describe exactly, with the way out:
    FSDP1 (``FullyShardedDataParallel``: flat parameters, whose individual gradients have
    no layer shape), parameters sharded otherwise than by ``fully_shard`` on a 1-D mesh of
    the whole process group (tensor parallelism, HSDP's 2-D mesh: the sums over ranks
    would count replicas twice or miss the other mesh dimension), and a mixed precision
    ``param_dtype`` narrower than 16 bits."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        from torch.distributed.tensor import Shard
    except ImportError:  # torch without distributed
        return
    owned: set[int] = set()  # the parameters fully_shard shards on this model
    for name, module in model.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            raise NotImplementedError(
                f"Cockpit does not support FullyShardedDataParallel (FSDP1) models "
                f"({name or 'the model'}): {_WAY_OUT}")
        if isinstance(module, FSDPModule):
            try:
                state = module._get_fsdp_state()
                policy, group = state._mp_policy, state._fsdp_param_group
                owned.update(id(fp.sharded_param) for fp in (group.fsdp_params if group else ()))
                # what fsdp_backward_hooks_held replaces and restores
                _ = (state._training_state, state._states_to_backward_prefetch,
                     state._register_root_post_backward_final_callback,
                     [(g._training_state, g.pre_backward, g.post_backward)
                      for g in state._fsdp_param_groups])
            except AttributeError as error:
                raise NotImplementedError(
                    f"Cockpit does not support fully_shard of torch {torch.__version__}: its "
                    f"internal state differs from torch 2.13's ({error}); use "
                    "DistributedDataParallel") from None
            compute = policy.param_dtype
            if compute is not None and not (compute.is_floating_point
                                            and torch.finfo(compute).bits >= 16):
                raise NotImplementedError(
                    f"Cockpit does not support fully_shard with param_dtype {compute} "
                    f"({name or 'the model'}): use bfloat16, float16 or float32")
    world = _world_size()
    for name, param in model.named_parameters():
        if not is_sharded(param):
            continue
        mesh = param.device_mesh
        if mesh.ndim != 1 or mesh.size() != world or not isinstance(param.placements[0], Shard):
            raise NotImplementedError(
                f"Cockpit does not support parameter {name} sharded as {param.placements} on "
                f"a device mesh of shape {tuple(mesh.shape)} ({world} processes): {_WAY_OUT}")
        if id(param) not in owned:
            raise NotImplementedError(
                f"Cockpit does not support parameter {name}: a DTensor not sharded by "
                f"fully_shard on this model (tensor parallelism, or an inner module of a "
                f"sharded model: attach Cockpit to the root module fully_shard was applied "
                f"to last): {_WAY_OUT}")


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def shard_like(full: Tensor, like: DTensor) -> Tensor:
    """``full`` (a whole tensor, the same on every rank) as a ``DTensor`` sharded like
    ``like``: each rank keeps its own slice, without communication."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.detach(), like.device_mesh, like.placements,
                             src_data_rank=None)


def saved_slices(tensors: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, int] | None]:
    """``tensors`` for a checkpoint, on the CPU: each sharded one as this rank's slice (a
    plain tensor), with ``{"rank", "world"}`` saying whose slice it is (None where nothing
    is sharded). Gathering them instead would be a collective, which a checkpoint written
    by rank 0 alone would never finish."""
    out = {k: local(v).detach().cpu().clone() for k, v in tensors.items()}
    if not has_sharded(tensors.values()):
        return out, None
    from cockpit.engine.reduction.ranks import rank

    return out, {"rank": rank(), "world": _world_size()}


def restored_slices(saved: Mapping[str, Tensor], holder: Mapping[str, int] | None,
                    own: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The saved ``tensors`` of :func:`saved_slices` in place of ``own`` (same names, on
    their devices and dtypes): a sharded one from this rank's saved slice, or from a whole
    tensor (sliced here, without communication). Another rank's slice, or a slice saved on
    another number of processes, is refused (it would give plausible wrong values)."""
    from cockpit.engine.reduction.ranks import rank

    out = {}
    for name, mine in own.items():
        value = saved[name]
        if is_sharded(value):
            value = value.to_local()  # (a state saved with DTensors: whose slice is unknown)
            holder = holder or {"rank": -1, "world": -1}
        if not is_sharded(mine) or tuple(value.shape) == tuple(mine.shape):
            if tuple(value.shape) != tuple(mine.shape) and holder is not None:
                raise ValueError(
                    f"the saved {name} is {_whose(holder)} (saved under fully_shard), and "
                    f"this model's {name} is not sharded: load a whole θ_0 here, or each "
                    "rank's own state on the same number of processes under fully_shard")
            if tuple(value.shape) != tuple(mine.shape):
                raise ValueError(f"the saved {name} has shape {tuple(value.shape)}, the model's "
                                 f"{tuple(mine.shape)}: it was saved for another model")
            whole_value = value.to(device=mine.device, dtype=mine.dtype)
            out[name] = shard_like(whole_value, mine) if is_sharded(mine) else whole_value
            continue
        me, world = rank(), _world_size()
        if holder is None or (holder["rank"], holder["world"]) != (me, world):
            raise ValueError(
                f"the saved {name} is {_whose(holder)}, and this is rank {me} of {world}: under "
                "fully_shard each rank holds its own slice of the parameters, so save "
                "cockpit.state_dict() on every rank and load each rank's own, on the same "
                "number of processes (or pass whole tensors)")
        restored = mine.detach().clone()
        local(restored).copy_(value.reshape(local(mine).shape))
        out[name] = restored
    return out


def _whose(holder: Mapping[str, int] | None) -> str:
    """Whose slice a saved tensor is, in words."""
    if holder is None or holder["rank"] < 0:
        return "a slice of unknown origin"
    return f"rank {holder['rank']}'s slice of {holder['world']} processes"
