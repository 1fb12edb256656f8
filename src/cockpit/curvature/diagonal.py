"""Diagonal curvature of the mini-batch loss L_B = (1/|B|) Σ_n ℓ_n, per parameter tensor.

Methods (``curvature=`` of HessTrace and TICDiag):

* ``"diag_ggn_exact"``: diag G with G = (1/|B|) Σ_n J_nᵀ (∂²ℓ_n/∂f_n²) J_n, the generalized
  Gauss-Newton matrix (J_n = ∂f_n/∂θ, f_n the model output). With a symmetric factor
  ∂²ℓ_n/∂f_n² = Σ_k s_{n,k} s_{n,k}ᵀ (C columns for C outputs),
  diag G = (1/|B|) Σ_k Σ_n (J_nᵀ s_{n,k})^{⊙2}: one vector backpropagation per column k,
  each reduced per layer by the engine's rules (individual "gradients" J_nᵀ s_{n,k}).
* ``"diag_ggn_mc"``: the same with a Monte-Carlo factor (targets sampled from the model's
  predictive distribution; ``num_samples`` columns): unbiased for diag G.
* ``"hutchinson"``: diag H ≈ (1/M) Σ_m v_m ⊙ H v_m with Rademacher v_m, for any model and
  loss; unbiased for the Hessian's diagonal itself.
* ``"diag_hessian"``: the exact Hessian diagonal, the GGN plus the residual terms of
  activation modules that are not piecewise linear (sigmoid, tanh, GELU also with
  approximate="tanh", SiLU, softplus, ELU) and of LayerNorm and RMSNorm, for networks whose
  structure :mod:`cockpit.curvature.diag_hessian` covers (checked on the autograd graph; two
  vector backpropagations per activation unit).
* ``"auto"`` (default): the exact Hessian diagonal where available and affordable — for
  networks whose nonlinearities are all piecewise linear (ReLU, max-pooling) the GGN *is*
  the Hessian, and for small networks with smooth activations and normalization layers
  ``"diag_hessian"`` fits in the budget of ``max_backprops`` (512) vector backpropagations.
  The exact diagonal costs one vector backpropagation per model output C; for more than
  ``mc_threshold`` = 32 outputs (CIFAR-100's C = 100, where the paper, too, uses the
  Monte-Carlo approximation) ``"auto"`` takes the Monte-Carlo GGN with ``mc_samples`` = 8
  backpropagations for piecewise-linear networks (unbiased for the Hessian's diagonal there,
  with its standard error recorded): at C ≤ 32 the exact value costs at most 4× the
  estimate (C = 10: 1.25×) and is worth it, beyond that the estimate's cost stays put while
  the exact one grows with C (All-CNN-C's business step on an H200: 1.42 s exact, 190 ms
  with one MC sample). Otherwise each
  instrument falls back (with a warning, once) to an estimator of its own kind: HessTrace
  and TICTrace, which read only the trace, to ``"hutchinson"`` (unbiased for the Hessian,
  ``mc_samples`` = 8 products, standard error recorded); TICDiag, which divides by the
  diagonal elementwise, to the exact GGN diagonal (or its Monte-Carlo estimate for more
  than ``mc_threshold`` = 32 outputs), labelled as the GGN's.

The method used is recorded at every step: in the notes (``Cockpit.get_notes()``, the run
log) and, for HessTrace computed from a GGN, as ``"HessTrace.ggn" = 1.0`` beside the value
(the view labels the panel "Tr(GGN)"). Stochastic values carry their standard error as
``"<Instrument>.stderr"`` (from the spread of the ``mc_samples`` independent replicates; the
delta method for the TIC ratios).

The GGN methods need the per-sample loss to be cross-entropy on the model's logits
(``F.cross_entropy(out, y, reduction="none")``) or a squared error
(``F.mse_loss(out, y, reduction="none")`` averaged or summed over the output dimensions);
Cockpit recognizes both from the autograd graph of ``losses``, or takes ``loss=`` explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from cockpit.curvature.batched import batched_sum_sq_of_backprops, use_batched
from cockpit.curvature.diag_hessian import (
    check_graph,
    check_single_use,
    num_backprops,
    residual_diagonal,
)
from cockpit.curvature.hutchinson import hutchinson_diagonal, hutchinson_replicates
from cockpit.curvature.hvp import HessianVectorProduct
from cockpit.curvature.loss_factors import exact_sqrt_factor, mc_sqrt_factor
from cockpit.engine.capture.hooks import reachable_nodes
from cockpit.engine.dtypes import promote
from cockpit.engine.engine_view import EngineView

METHODS = ("auto", "diag_ggn_exact", "diag_ggn_mc", "hutchinson", "diag_hessian")


class CurvatureError(ValueError):
    """The requested curvature cannot be computed for this model or loss."""


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown curvature {method!r}; choose one of {', '.join(METHODS)}")


# Autograd nodes that pass a tensor on unchanged up to its dtype: a dtype cast (``out.float()``,
# autocast's own cast to float32 before a loss, accelerate's cast of a bf16 model's outputs to
# float32) and DistributedDataParallel's identity on its outputs (with
# find_unused_parameters). They do not change the loss's Hessian with respect to the output.
PASS_THROUGH = ("ToCopyBackward0", "_DDPSinkBackward")


def _origin(node, index: int = 0) -> tuple:
    """(node, output index) that produced the tensor of edge (``node``, ``index``), past
    :data:`PASS_THROUGH` nodes (output k of DDP's identity is its input k)."""
    while node is not None and type(node).__name__ in PASS_THROUGH:
        node, index = node.next_functions[index if len(node.next_functions) > 1 else 0]
    return node, index


def _is_output(edge: tuple, output: Tensor) -> bool:
    """Whether the autograd edge (node, index) carries the model output (up to casts)."""
    got = _origin(*edge)
    want = _origin(output.grad_fn, output.output_nr)
    return got[0] is want[0] and got[1] == want[1]


def detect_loss(losses: Tensor, output: Tensor | None
                ) -> tuple[str, str, Tensor | float | None]:
    """(kind, mse_reduction, scale) of the per-sample losses, read from their autograd
    graph. ``scale`` multiplies each sample's loss Hessian ∂²ℓ_n/∂f_n² of the plain kind
    (:func:`scaled`): for cross-entropy w_{y_n} with class weights and 0 where y_n is the
    ignored index (ℓ_n = 0); for squared errors reduced over the output's entries by any
    mix of sums and means, the product of 1/(entries averaged) with ``mse_reduction`` "sum"
    (``.sum(2).mean(1)`` of [N, 2, 3]: ℓ_n = ½ Σ (f − y)², c = 1)."""
    way_out = (
        "Pass loss='cross_entropy' or loss='mse' to the instrument if that is what you use, "
        "or choose curvature='hutchinson', which works for any loss."
    )
    node = losses.grad_fn
    averaged = 1  # entries averaged over by the reductions to ℓ_n
    while node is not None and type(node).__name__ in (
        "MeanBackward1", "SumBackward1", "ViewBackward0", "ReshapeAliasBackward0",
        "UnsafeViewBackward0",
    ):
        if type(node).__name__ == "MeanBackward1":
            sizes = node._saved_self_sym_sizes
            averaged *= math.prod(sizes[d % len(sizes)] for d in node._saved_dim)
        node = node.next_functions[0][0]
    kind = type(node).__name__ if node is not None else None
    if kind == "NllLossBackward0" and output is not None:
        log_softmax = node.next_functions[0][0]
        if (type(log_softmax).__name__ == "LogSoftmaxBackward0"
                and _is_output(log_softmax.next_functions[0], output)):
            return "cross_entropy", "mean", _cross_entropy_scale(node)
    if (kind == "MseLossBackward0" and output is not None
            and _is_output(node.next_functions[0], output)):
        return "mse", "sum", 1.0 / averaged
    raise CurvatureError(
        "the GGN needs per-sample losses that are cross-entropy of the model's output "
        "(F.cross_entropy(model(x), y, reduction='none')) or squared errors "
        "(F.mse_loss(model(x), y, reduction='none').mean(1)); these losses are not "
        f"recognized. {way_out}"
    )


def _cross_entropy_scale(nll) -> Tensor:
    """w_{y_n} (1 without class weights), 0 where y_n is the ignored index, from the saved
    state of ``F.cross_entropy(..., reduction='none')``'s NLL node (on the device: no read)."""
    target = nll._saved_target
    ignore = int(nll._saved_ignore_index)
    if ignore >= 2**63:  # (saved as an unsigned 64-bit number)
        ignore -= 2**64
    kept = target != ignore
    weight = nll._saved_weight
    if weight is None:
        return kept
    return weight[target.masked_fill(~kept, 0)] * kept


def scaled(factor: Tensor, scale: Tensor | float | None) -> Tensor:
    """The factor [K, N, …] of ∂²ℓ_n/∂f_n² times ``scale`` (per sample [N], or one number):
    each sample's columns times √scale."""
    if scale is None or (isinstance(scale, float) and scale == 1.0):
        return factor
    if isinstance(scale, float):
        return factor * math.sqrt(scale)
    root = scale.to(factor.dtype).sqrt()
    return factor * root.view(1, -1, *([1] * (factor.dim() - 2)))


DESCRIPTIONS = {
    "diag_hessian": "the exact Hessian diagonal",
    "diag_ggn_exact": "the exact GGN diagonal (generalized Gauss-Newton: the Hessian without "
                      "the second-derivative terms of the network, not the Hessian's)",
    "diag_ggn_mc": "a Monte-Carlo estimate of the GGN diagonal (generalized Gauss-Newton, "
                   "not the Hessian's)",
    "hutchinson": "a Hutchinson estimate of the Hessian diagonal (unbiased)",
}
STOCHASTIC = ("diag_ggn_mc", "hutchinson")
GGN = ("diag_ggn_exact", "diag_ggn_mc")


def resolve_method(method: str, engine: EngineView, mc_threshold: int, max_backprops: int,
                   fallback: str = "ggn", losses: Tensor | None = None
                   ) -> tuple[str, str | None]:
    """(method, why the exact Hessian diagonal is not used or None) for this step.

    ``"auto"``: the exact Hessian diagonal where the graph is covered and the residual terms
    fit in ``max_backprops``; otherwise ``fallback``: ``"hutchinson"`` (unbiased for the
    Hessian, for instruments that read only the trace) or ``"ggn"`` (the exact GGN
    diagonal, or its Monte-Carlo estimate for more than ``mc_threshold`` outputs).
    ``losses`` (where the loss's kind is to be read from them): a loss whose Hessian
    Cockpit cannot factor (label smoothing, a custom loss) takes the fallback too."""
    check_method(method)
    if method != "auto":
        return method, None
    output = engine.model_output
    if output is None:
        return "hutchinson", "Cockpit did not see the model's output"
    outputs_per_sample = math.prod(output.shape[1:])
    try:
        check_graph(output, engine.activation_calls)
        check_single_use(engine)
        if losses is not None:
            detect_loss(losses, output)
        units = num_backprops(engine.activation_calls)
        if outputs_per_sample > mc_threshold:
            reason = many_outputs(outputs_per_sample, mc_threshold)
            if units == 0:
                return "diag_ggn_mc", (f"{reason}; the network is piecewise linear, so its GGN "
                                       "is its Hessian and the estimate is unbiased for it")
        elif units <= max_backprops:
            return "diag_hessian", None
        else:
            reason = (f"its residual terms need {units} vector backpropagations, more than "
                      f"max_backprops={max_backprops}")
    except ValueError as error:
        reason = str(error)
    if fallback == "hutchinson":
        return "hutchinson", reason
    return ("diag_ggn_mc" if outputs_per_sample > mc_threshold else "diag_ggn_exact"), reason


def many_outputs(outputs: int, mc_threshold: int) -> str:
    """Why ``"auto"`` estimates instead of computing the exact diagonal of a model with many
    outputs (the cost, not a limitation)."""
    return (f"the model has {outputs} outputs per sample, and the exact diagonal needs one "
            f"vector backpropagation per output, more than mc_threshold={mc_threshold}; a "
            "Monte-Carlo estimate needs mc_samples of them")


def diagonal_replicates(
    method: str,
    engine: EngineView,
    losses: Tensor,
    params: Mapping[str, Tensor],
    *,
    loss: str | None = None,
    mse_reduction: str = "mean",
    num_samples: int = 1,
    generator=None,
    max_backprops: int = 512,
    batched: bool | None = None,
) -> list[dict[str, Tensor]]:
    """Estimates of the diagonal curvature of the mean loss, per parameter: one exact value
    for the exact methods, ``num_samples`` independent unbiased replicates for the stochastic
    ones (Hutchinson: v_m ⊙ H v_m; MC GGN: one sampled factor column each). Their mean is
    the estimate; their spread gives its standard error."""
    n = losses.shape[0]
    if method == "hutchinson":
        if num_samples < 1:
            raise ValueError("num_samples must be at least 1.")
        hvp = hessian_vector_product(engine, losses, params)
        with engine.suspended():
            return [dict(zip(params, replicate, strict=True))
                    for replicate in hutchinson_replicates(hvp, list(params.values()),
                                                           num_samples, generator, batched)]
    if method == "diag_ggn_mc":
        output = _model_output(engine)
        kind, mse_reduction, scale = _loss_kind(losses, output, loss, mse_reduction)
        f = output.detach()
        factor = scaled(mc_sqrt_factor(f, kind, num_samples=num_samples, generator=generator,
                                       mse_reduction=mse_reduction) * math.sqrt(num_samples),
                        scale)
        per_column = sum_sq_of_backprops(engine, output, factor, batched, separate=True)
        reached = [(m, k) for m, sums in enumerate(per_column) for k in params if k in sums]
        means = dict(zip(reached, torch._foreach_div(  # (one kernel for all of them)
            [per_column[m][k].to(_wider(per_column[m][k], params[k])) for m, k in reached],
            float(n)), strict=True))
        return [{k: means[m, k] if (m, k) in means else p.new_zeros(p.shape)
                 for k, p in params.items()} for m in range(len(per_column))]
    return [diagonal_curvature(method, engine, losses, params, loss=loss,
                               mse_reduction=mse_reduction, num_samples=num_samples,
                               generator=generator, max_backprops=max_backprops,
                               batched=batched)]


def _wider(value: Tensor, param: Tensor):
    """The dtype of a parameter's diagonal: the parameter's, or ``value``'s where wider (a
    layer computing in half precision under a mixed precision policy sums its squared
    backpropagations in float32: kept so)."""
    return promote(value.dtype, param.dtype)


def sum_sq_of_backprops(engine: EngineView, output: Tensor, vectors: Tensor, batched: bool | None,
                        separate: bool = False) -> list[dict[str, Tensor]]:
    """Σ_k Σ_n g_{n,k} ⊙ g_{n,k} (g_{n,k} the backpropagation of ``vectors[k]`` from
    ``output``), as one dict, or with ``separate`` one dict per vector. Batched on CUDA
    (:mod:`cockpit.curvature.batched`) where it applies, else one backward pass per vector;
    ``batched`` forces either way."""
    if use_batched(output.device, batched):
        result = batched_sum_sq_of_backprops(engine, output, vectors, separate=separate)
        if result is not None:
            return result
    if separate:
        return [engine.sum_sq_of_backprops(output, v.unsqueeze(0)) for v in vectors]
    return [engine.sum_sq_of_backprops(output, vectors)]


def _model_output(engine: EngineView) -> Tensor:
    output = engine.model_output
    if output is None:
        raise CurvatureError(
            "the GGN needs the model's output of this step's forward pass, which Cockpit "
            "did not see; call the model on the batch after the previous cockpit(...) "
            "context, or use curvature='hutchinson'"
        )
    return output


def _loss_kind(losses: Tensor, output: Tensor, loss: str | None,
               mse_reduction: str) -> tuple[str, str, Tensor | float | None]:
    if loss is None:
        return detect_loss(losses, output)
    return loss, mse_reduction, None


def diagonal_curvature(
    method: str,
    engine: EngineView,
    losses: Tensor,
    params: Mapping[str, Tensor],
    *,
    loss: str | None = None,
    mse_reduction: str = "mean",
    num_samples: int = 1,
    generator=None,
    max_backprops: int = 512,
    batched: bool | None = None,
) -> dict[str, Tensor]:
    """The diagonal of the mini-batch loss's curvature (module docstring) per parameter."""
    n = losses.shape[0]
    if method == "diag_hessian":
        output = engine.model_output
        if output is None:
            raise CurvatureError("curvature='diag_hessian' needs the model's output")
        try:
            check_graph(output, engine.activation_calls)
            check_single_use(engine)
        except ValueError as error:
            raise CurvatureError(
                f"curvature='diag_hessian' cannot apply to this model: {error}. Use "
                "'diag_ggn_exact' (the Hessian's diagonal without second-derivative terms of "
                "the network) or 'hutchinson' (unbiased for the Hessian's diagonal)."
            ) from error
        ggn = diagonal_curvature("diag_ggn_exact", engine, losses, params, loss=loss,
                                 mse_reduction=mse_reduction, batched=batched)
        try:
            residual = residual_diagonal(engine, losses, max_backprops,
                                         lambda z, probes: sum_sq_of_backprops(
                                             engine, z, probes, batched)[0])
        except ValueError as error:
            raise CurvatureError(
                f"curvature='diag_hessian': {error}; raise max_backprops or use "
                "'diag_ggn_exact' or 'hutchinson'"
            ) from error
        return {k: ggn[k] + residual[k].to(ggn[k].dtype) if k in residual else ggn[k]
                for k in ggn}
    if method in ("diag_ggn_exact", "diag_ggn_mc"):
        output = _model_output(engine)
        kind, mse_reduction, scale = _loss_kind(losses, output, loss, mse_reduction)
        f = output.detach()
        if method == "diag_ggn_exact":
            factor = exact_sqrt_factor(f, kind, mse_reduction=mse_reduction)
        else:
            factor = mc_sqrt_factor(f, kind, num_samples=num_samples, generator=generator,
                                    mse_reduction=mse_reduction)
        factor = scaled(factor, scale)
        sums = sum_sq_of_backprops(engine, output, factor, batched)[0]
        reached = [k for k in params if k in sums]
        means = dict(zip(reached, torch._foreach_div(  # (one kernel for all parameters)
            [sums[k].to(_wider(sums[k], params[k])) for k in reached], float(n)), strict=True))
        return {k: means[k] if k in means else p.new_zeros(p.shape) for k, p in params.items()}
    if method == "hutchinson":
        hvp = hessian_vector_product(engine, losses, params)
        with engine.suspended():
            estimate = hutchinson_diagonal(hvp, list(params.values()), num_samples, generator,
                                           batched=batched)
        return dict(zip(params, estimate, strict=True))
    raise CurvatureError(f"curvature {method!r} cannot be computed here")


# Autograd nodes whose double backward PyTorch computes wrongly, so that Hessian-vector
# products through them are not H v (the "Hessian" they give is not even symmetric): what
# the node is, and how to avoid it.
WRONG_SECOND_DERIVATIVE = {
    # treats the norm ‖v‖ as a constant: the second derivatives through it are missing
    "WeightNormInterfaceBackward0": (
        "torch._weight_norm (the weight_norm of torch.nn.utils.parametrizations and "
        "torch.nn.utils)", "its double backward treats the weight's norm as a constant",
        "write the weight normalization with plain operations (a parametrization returning "
        "g * v / v.norm(dim=1, keepdim=True))"),
    # scale_grad_by_freq: the gradient D·g (rows scaled by 1/count) gets D·H instead of H·D
    "EmbeddingBackward0": (
        "an embedding with scale_grad_by_freq=True", "its double backward scales the "
        "Hessian's rows where the gradient's are scaled", "set scale_grad_by_freq=False"),
}


def _wrong_second_derivative(node) -> tuple[str, str, str] | None:
    known = WRONG_SECOND_DERIVATIVE.get(type(node).__name__)
    if known is not None and type(node).__name__ == "EmbeddingBackward0":
        return known if getattr(node, "_saved_scale_grad_by_freq", False) else None
    return known


def check_second_derivatives(losses: Tensor) -> None:
    """Raise :class:`CurvatureError` where the losses' graph holds a node whose second
    derivative PyTorch gets wrong (:data:`WRONG_SECOND_DERIVATIVE`)."""
    for node in reachable_nodes(losses):
        wrong = _wrong_second_derivative(node)
        if wrong is not None:
            what, why, instead = wrong
            raise CurvatureError(
                f"the loss's graph contains {what}, whose second derivative PyTorch computes "
                f"incorrectly ({why}), so Hessian-vector products through it are not H·v; "
                f"{instead} to use the curvature instruments")


def hessian_vector_product(engine: EngineView, losses: Tensor, params: Mapping[str, Tensor]):
    """The step's Hessian-vector product of L_B on the user's graph, shared by instruments
    (raises :class:`CurvatureError` where PyTorch's second derivatives are wrong)."""
    key = ("hvp", tuple(params))
    if key not in engine.step_cache:
        check_second_derivatives(losses)
        with engine.suspended():
            engine.step_cache[key] = HessianVectorProduct(losses.mean(), list(params.values()))
    return engine.step_cache[key]
