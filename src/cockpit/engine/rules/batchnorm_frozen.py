"""Individual gradients of BatchNorm networks in training mode, batch statistics held constant.

In training mode BatchNorm normalizes sample n with the batch's mean μ and variance σ²
(per channel, over the batch and the spatial dims):

    y_n = γ ⊙ x̂_n + β,    x̂_n = (x_n − μ) / √(σ² + ε).

Every loss ℓ_n then depends on every sample, and individual gradients do not exist. With
``Cockpit(..., batchnorm="frozen_statistics")`` Cockpit defines them by differentiating each
ℓ_n as if μ and σ² of every BatchNorm layer were constants (an approximation, labelled as
such wherever its numbers appear). Sample n's gradient then flows only through sample n:

    ∂ℓ_n/∂x_n = γ / √(σ² + ε) ⊙ ∂ℓ_n/∂y_n          (no centering terms)
    g_n(γ) = Σ_{spatial} ∂ℓ_n/∂y_n ⊙ x̂_n,    g_n(β) = Σ_{spatial} ∂ℓ_n/∂y_n.

The user's backward pass differentiates through μ and σ² (its gradient stays exact), so the
output gradients it brings to the layers *below* a BatchNorm layer are not those of the
frozen definition. Cockpit therefore runs one extra backward pass over the recorded graph
before the user's: a hook on each BatchNorm layer's autograd node replaces the node's
gradients by the frozen ones above (only during that pass), and the engine's layer hooks
form the individual gradients from it as usual. The pass stops at the first layer's output
and computes no parameter gradient; it costs about one backward pass without the weight
gradients at each tracked step.

The sum Σ_n g_n of these individual gradients is not the batch gradient; how far it is from
it is measured in ``benchmarks/batchnorm_frozen.py``.
"""

from __future__ import annotations

from torch import Tensor, nn

from cockpit.engine.rules.sample_grads import SampleGrads

FROZEN_STATISTICS = "frozen_statistics"
BATCHNORM_MODES = (None, FROZEN_STATISTICS)
APPROXIMATION = (
    "approximation: individual gradients with every BatchNorm layer's batch mean and "
    "variance held constant (batchnorm='frozen_statistics'); their sum is not the batch "
    "gradient"
)


def check_batchnorm_mode(mode: str | None) -> str | None:
    if mode not in BATCHNORM_MODES:
        raise ValueError(
            f"batchnorm must be None (individual gradients undefined with BatchNorm in training "
            f"mode: the per-sample instruments are None) or '{FROZEN_STATISTICS}' (an "
            f"approximation that holds the batch statistics constant), got {mode!r}")
    return mode


def is_training_batch_norm(module: nn.Module) -> bool:
    return (isinstance(module, nn.modules.batchnorm._BatchNorm)
            and (module.training or module.running_mean is None))


def batch_statistics(module: nn.modules.batchnorm._BatchNorm, x: Tensor
                     ) -> tuple[Tensor, Tensor, list[int]]:
    """The batch mean μ and 1/√(σ² + ε) per channel (biased σ², as BatchNorm normalizes),
    shaped to broadcast against ``x`` [N, C, *spatial]."""
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    mean = x.mean(dims)
    var = x.var(dims, unbiased=False)
    return mean.reshape(shape), (var + module.eps).rsqrt().reshape(shape), dims


def frozen_batch_norm_rule(module, args, kwargs, output, grad_output, scale: float = 1.0
                           ) -> dict[str, SampleGrads]:
    """g_n(γ) = Σ δ_n ⊙ x̂_n and g_n(β) = Σ δ_n with x̂ normalized by the batch statistics
    (δ = ``scale`` · ``grad_output``)."""
    from cockpit.engine.rules.norms import _affine_grads

    x = (args[0] if args else kwargs["input"]).detach()
    mean, inv_std, _ = batch_statistics(module, x)
    x_hat = (x - mean) * inv_std
    return _affine_grads(module, x_hat, grad_output, 1, 1, scale)


def frozen_rule(module: nn.Module):
    """The frozen-statistics rule of a BatchNorm layer in training mode. A SyncBatchNorm
    normalizes with the statistics of the batch over all processes, which one process's
    rule cannot hold constant (it sees its own samples only): refused there with the way
    out; in a single process it normalizes as a BatchNorm does."""
    if isinstance(module, nn.SyncBatchNorm):
        import torch.distributed as dist

        from cockpit.engine.rules.norms import SampleMixingError

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise SampleMixingError(
                "SyncBatchNorm normalizes with the batch statistics of all processes, which "
                "batchnorm='frozen_statistics' cannot hold constant from one process: use "
                "nn.BatchNorm (each process's own statistics; torch.nn.SyncBatchNorm is "
                "then not needed) or put the layer in eval mode")
    return frozen_batch_norm_rule


class FrozenStatisticsBackward:
    """Hooks on the autograd nodes of BatchNorm layers that, while :attr:`active`, replace
    the node's gradients (input, γ, β) by those with the batch statistics held constant."""

    def __init__(self) -> None:
        self.active = False

    def attach(self, module: nn.Module, x: Tensor, output: Tensor) -> None:
        """Hook the node that produced ``output`` = module(x) in this forward pass."""
        node = output.grad_fn
        if node is None:
            return
        node.register_hook(self._make_hook(module, x.detach()))

    def _make_hook(self, module: nn.Module, x: Tensor):
        def hook(grad_inputs, grad_outputs):
            if not self.active:
                return None
            delta = grad_outputs[0]
            if delta is None:
                return None
            mean, inv_std, dims = batch_statistics(module, x)
            weight = module.weight
            shape = [1, -1] + [1] * (x.dim() - 2)
            scale = inv_std if weight is None else inv_std * weight.detach().reshape(shape)
            new = list(grad_inputs)
            if new[0] is not None:
                new[0] = delta * scale
            if len(new) > 1 and new[1] is not None:
                new[1] = (delta * (x - mean) * inv_std).sum(dims)
            if len(new) > 2 and new[2] is not None:
                new[2] = delta.sum(dims)
            return tuple(new)

        return hook
