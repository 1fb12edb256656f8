"""Fast paths of the per-sample gradient representations against torch.func in float64.

The convolution's lazy projections (one convolution with the direction as weight), its
cached materialization, the stacked projections ``dots_many`` of every representation and
the float64-accumulated sums of squares must equal the brute-force individual gradients.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.histograms.exact import BinSpec
from cockpit.engine.rules import conv as conv_module
from cockpit.engine.rules.conv import ConvSampleGrads, conv_rule, reuse_unfolded_inputs
from cockpit.engine.rules.linear import linear_rule
from cockpit.engine.rules.sample_grads import (
    DenseSampleGrads,
    OuterSampleGrads,
    SampleGrads,
    SequenceOuterSampleGrads,
)
from tests.reference import OpNames

CONVS = {
    "conv1d_stride_dilation": (nn.Conv1d(4, 6, 3, stride=2, dilation=2, padding=1), (4, 17)),
    "conv2d_groups_same": (nn.Conv2d(4, 6, 3, groups=2, padding="same"), (4, 7, 6)),
    "conv2d_reflect": (nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=1,
                                 padding_mode="reflect"), (3, 8, 7)),
    "conv2d_depthwise": (nn.Conv2d(4, 8, 3, groups=4, dilation=(1, 2)), (4, 9, 9)),
    "conv3d": (nn.Conv3d(2, 3, 2, stride=(1, 2, 1), padding=(1, 0, 1)), (2, 4, 5, 3)),
}


def individual_grads(module: nn.Module, x: Tensor, v: Tensor) -> dict[str, Tensor]:
    """g_n = ∇_θ ⟨v_n, m(x_n; θ)⟩ for every sample by vmap over torch.func.grad."""
    params = {k: p.detach() for k, p in module.named_parameters()}

    def loss(p, xn, vn):
        return (functional_call(module, p, (xn.unsqueeze(0),)).squeeze(0) * vn).sum()

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, v)



def check_all(sg: SampleGrads, g: Tensor, tag: str) -> None:
    n = g.shape[0]
    flat = g.reshape(n, -1)
    gen = torch.Generator().manual_seed(1)
    us = [torch.randn(sg.shape, generator=gen, dtype=g.dtype) for _ in range(3)]
    expected_dots = torch.stack([flat @ u.reshape(-1) for u in us])
    torch.testing.assert_close(sg.dots(us[0]), expected_dots[0], msg=tag)
    torch.testing.assert_close(sg.dots_many(us), expected_dots, msg=tag)
    # one direction alone (taken as it is, without stacking)
    torch.testing.assert_close(sg.dots_many(us[1:2]), expected_dots[1:2], msg=tag)
    torch.testing.assert_close(sg.sq_norms(), flat.pow(2).sum(1), msg=tag)
    torch.testing.assert_close(sg.norms(), flat.norm(dim=1), msg=tag)
    mean = flat.mean(0)
    torch.testing.assert_close(sg.gram_mean(), flat @ mean, msg=tag)
    torch.testing.assert_close(sg.sum_sq(), g.pow(2).sum(0), msg=tag)
    torch.testing.assert_close(sg.centered_sum_sq(), (g - g.mean(0)).pow(2).sum(0), msg=tag)
    torch.testing.assert_close(sg.materialize(), g, msg=tag)
    torch.testing.assert_close(sg.materialize_owned(), g, msg=tag)
    # histograms count in the representation's own row order: the pairs (g_{n,j}, θ_j)
    # must still match up
    reference = DenseSampleGrads(g)
    spec_g, spec_theta = BinSpec(-2.0, 2.0, 13), BinSpec(-1.0, 1.0, 7)
    theta = torch.randn(sg.shape, generator=gen, dtype=g.dtype)
    for got, expected in ((sg.histogram(spec_g), reference.histogram(spec_g)),
                          (sg.histogram2d(theta, spec_g, spec_theta),
                           reference.histogram2d(theta, spec_g, spec_theta))):
        assert expected.sum() == g.numel()
        torch.testing.assert_close(got, expected, msg=tag)
    # after materialization the projections come from the cached tensor: same numbers
    torch.testing.assert_close(sg.dots_many(us), expected_dots, msg=tag)
    torch.testing.assert_close(sg.dots_many(us[2:]), expected_dots[2:], msg=tag)


@pytest.mark.parametrize("method", ["unfold", "grouped", "channels_last"])
@pytest.mark.parametrize("materialize", [False, True])
@pytest.mark.parametrize("name", list(CONVS))
def test_conv_sample_grads_match_torch_func(name, materialize, method, monkeypatch):
    """Both projection paths: by convolution (lazy) and from the materialized gradients,
    which are formed by unfolding or by a grouped convolution."""
    monkeypatch.setattr(ConvSampleGrads, "_materialize_for_projections",
                        lambda self, num_directions: materialize)
    monkeypatch.setattr(ConvSampleGrads, "_method", lambda self: method)
    torch.manual_seed(0)
    module, shape = CONVS[name]
    module = module.double()
    x = torch.randn(5, *shape, dtype=torch.float64)
    out = module(x)
    delta = torch.randn_like(out)
    reference = individual_grads(module, x, delta)
    grads = conv_rule(module, (x,), {}, out, delta * 4, scale=0.25)  # the tracker's 1/w
    assert isinstance(grads["weight"], ConvSampleGrads)
    if method not in grads["weight"]._methods():
        pytest.skip(f"{method} does not apply to {name}")
    check_all(grads["weight"], reference["weight"], f"{name}.weight")
    check_all(grads["bias"], reference["bias"], f"{name}.bias")


@pytest.mark.parametrize("method", ["unfold", "grouped", "channels_last"])
@pytest.mark.parametrize("padding", [0, 1])
def test_conv_sample_grads_of_a_channels_last_input(method, padding, monkeypatch):
    """A channels-last input (torch.channels_last; with padding 0 the channels-last unfold
    uses it without a copy) gives the same individual gradients."""
    monkeypatch.setattr(ConvSampleGrads, "_method", lambda self: method)
    torch.manual_seed(5)
    module = nn.Conv2d(3, 4, 3, padding=padding).double()
    x = torch.randn(5, 3, 7, 6, dtype=torch.float64).to(memory_format=torch.channels_last)
    out = module(x)
    delta = torch.randn_like(out)
    reference = individual_grads(module, x, delta)
    grads = conv_rule(module, (x,), {}, out, delta)
    check_all(grads["weight"], reference["weight"], f"channels_last {method}")


@pytest.mark.parametrize("method", ["unfold", "channels_last"])
def test_conv_unfold_cache_serves_repeated_backprops(method, monkeypatch):
    """Within reuse_unfolded_inputs (diagonal curvature: several vectors backpropagated
    through one forward pass) each way unfolds the input once and every backprop's sums of
    squares still equal the brute force."""
    monkeypatch.setattr(ConvSampleGrads, "_method", lambda self: method)
    torch.manual_seed(4)
    module = nn.Conv2d(3, 4, 3, padding=1).double()
    x = torch.randn(5, 3, 6, 6, dtype=torch.float64)
    out = module(x)
    unfolds = []
    for name in ("_patches", "_patches_channels_last"):
        original = getattr(conv_module, name)

        def counted(*args, original=original, **kwargs):
            unfolds.append(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(conv_module, name, counted)
    with reuse_unfolded_inputs():
        for seed in range(3):
            delta = torch.randn(out.shape, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(seed))
            reference = individual_grads(module, x, delta)["weight"]
            sg = conv_rule(module, (x,), {}, out, delta)["weight"]
            torch.testing.assert_close(sg.sum_sq(), reference.pow(2).sum(0))
    assert len(unfolds) == 1


@pytest.mark.parametrize(("channels", "accelerator", "lazy"),
                         [(8, False, True), (1, False, False), (8, True, True), (1, True, True)])
def test_conv_projection_path_by_size(channels, accelerator, lazy, monkeypatch):
    """On a CPU one direction is projected by convolution when D > C_out·L (the
    materialized gradients would be larger than δ), else the gradients are materialized
    once; on accelerators always by convolution (the same FLOPs in two or three kernels
    instead of the unfolding's five or more and the product); two directions and the
    norms always materialize. Both ways give the brute-force dot products."""
    monkeypatch.setattr(histogram_device, "_forced", accelerator)
    torch.manual_seed(3)
    module = nn.Conv2d(channels, 4, 3).double()  # L = 36, (C_in/G)·K = 9·channels
    x = torch.randn(6, channels, 8, 8, dtype=torch.float64)
    out = module(x)
    delta = torch.randn_like(out)
    u = torch.randn(module.weight.shape, dtype=torch.float64)
    reference = individual_grads(module, x, delta)["weight"].flatten(1) @ u.flatten()
    sg = conv_rule(module, (x,), {}, out, delta)["weight"]
    torch.testing.assert_close(sg.dots_many([u])[0], reference)
    assert (sg._rows is None) == lazy
    # the gradient output's scale (a mean's 1/N undone) carried into the dot products
    scaled = conv_rule(module, (x,), {}, out, delta, scale=2.5)["weight"]
    torch.testing.assert_close(scaled.dots_many([u])[0], 2.5 * reference)
    twice = conv_rule(module, (x,), {}, out, delta)["weight"]
    twice.dots_many([u, 2 * u])
    assert twice._rows is not None
    sg.sq_norms()
    assert sg._rows is not None


@pytest.mark.parametrize(("padding", "mode", "copied"), [
    (1, "zeros", False), ("same", "zeros", False), (1, "reflect", True)])
def test_conv_projections_pad_by_the_convolution(padding, mode, copied):
    """Projected by convolution, a zero-padded layer's input is padded by the convolution
    itself (no padded copy: the step after a tracked one projects on s_t only); other
    padding modes copy it padded once, as materializing does; the brute force's values."""
    torch.manual_seed(3)
    module = nn.Conv2d(8, 4, 3, padding=padding, padding_mode=mode).double()
    x = torch.randn(6, 8, 5, 5, dtype=torch.float64)
    out = module(x)
    delta = torch.randn_like(out)
    sg = conv_rule(module, (x,), {}, out, delta)["weight"]
    u = torch.randn(sg.shape, dtype=torch.float64)
    dots = sg.dots_many([u])
    assert sg._rows is None and (sg._padded is not None) == copied
    expected = individual_grads(module, x, delta)["weight"].flatten(1) @ u.reshape(-1)
    torch.testing.assert_close(dots[0], expected)
    half = sg.select(0, 3)
    torch.testing.assert_close(half.dots_many([u])[0], expected[:3])
    torch.testing.assert_close(half.sq_norms(),
                               individual_grads(module, x, delta)["weight"][:3]
                               .flatten(1).pow(2).sum(1))


def test_float32_sums_of_squares_accumulate_in_float64():
    gen = torch.Generator().manual_seed(2)
    g = (torch.randn(64, 30, 20, generator=gen) * 1e3).float()
    sg = DenseSampleGrads(g)
    g64 = g.double()
    assert sg.sum_sq().dtype == torch.float64
    torch.testing.assert_close(sg.sum_sq(), g64.pow(2).sum(0), rtol=1e-6, atol=0)
    torch.testing.assert_close(
        sg.centered_sum_sq(), (g64 - g64.mean(0)).pow(2).sum(0), rtol=1e-9, atol=0
    )


@pytest.mark.parametrize("accelerator", [False, True])
@pytest.mark.parametrize("seq", [False, True])
def test_linear_dots_many_match_torch_func(seq, accelerator):
    """Both paths: the directions one by one (CPU) and side by side in one matmul (the
    accelerators' path, forced here)."""
    with histogram_device.forced() if accelerator else contextlib.nullcontext():
        _check_linear(seq)


def _check_linear(seq: bool) -> None:
    torch.manual_seed(3)
    module = nn.Linear(7, 5).double()
    x = torch.randn(6, 4, 7, dtype=torch.float64) if seq else torch.randn(6, 7).double()
    out = module(x)
    delta = torch.randn_like(out)
    reference = individual_grads(module, x, delta)
    grads = linear_rule(module, (x,), {}, out, delta)
    kind = SequenceOuterSampleGrads if seq else OuterSampleGrads
    assert isinstance(grads["weight"], kind)
    check_all(grads["weight"], reference["weight"], "weight")
    check_all(grads["bias"], reference["bias"], "bias")
    if not seq:  # the bias's ‖g_n‖ = ‖δ_n‖ is the factor of the weight's ‖δ_n‖‖a_n‖
        assert grads["bias"].norms() is grads["weight"].delta_norms()


def test_sequence_norms_by_gram_matrices_are_exact_and_zero_for_a_zero_gradient():
    """A Linear layer on short sequences forms ‖g_n‖ from per-sample Gram matrices (T(I+J) <
    IJ); a sample whose output gradient is zero has ‖g_n‖ = 0, not the NaN of the square root
    of a sum of products rounded below zero."""
    torch.manual_seed(4)
    module = nn.Linear(20, 30)
    x = torch.randn(5, 2, 20)
    out = module(x)
    delta = torch.randn_like(out)
    delta[2] = 0.0
    reference = individual_grads(module, x, delta)["weight"].reshape(5, -1)
    sg = linear_rule(module, (x,), {}, out, delta)["weight"]
    assert isinstance(sg, SequenceOuterSampleGrads) and sg._by_grams()
    norms = sg.norms()
    assert norms[2].item() == 0.0
    torch.testing.assert_close(norms, reference.norm(dim=1))
    torch.testing.assert_close(sg.sq_norms(), reference.pow(2).sum(1))


@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_large_float32_sums_of_squares_are_accurate(offset):
    """The row-wise float32 paths for large tensors (sum of squares, centered sum of squares
    by shifted sums, mean by a matrix-vector product) against float64, also when the mean
    is 10⁵ times the spread (the centered sum must not cancel)."""
    torch.manual_seed(0)
    g64 = offset + 1e-2 * torch.randn(9, 2**15, dtype=torch.float64)
    g32 = g64.float()
    sg = DenseSampleGrads(g32)
    exact = g32.double()
    torch.testing.assert_close(sg.sum_sq(), exact.pow(2).sum(0), rtol=1e-6, atol=0)
    scale = exact.abs().max().item()  # a float32 mean is accurate relative to the data
    torch.testing.assert_close(sg.batch_mean().double(), exact.mean(0), rtol=0,
                               atol=1e-6 * scale)
    centered = (exact - exact.mean(0)).pow(2).sum(0)
    torch.testing.assert_close(sg.centered_sum_sq(), centered, rtol=1e-3, atol=0)


@pytest.mark.parametrize("method", ["unfold", "channels_last"])
def test_conv_projections_of_flat_and_shaped_directions_agree(method, monkeypatch):
    """The materialized projections stack the K directions once (permuted to the row order of
    the channels-last way): flat directions [D] in θ's order give the brute-force dots too."""
    monkeypatch.setattr(ConvSampleGrads, "_method", lambda self: method)
    monkeypatch.setattr(ConvSampleGrads, "_materialize_for_projections",
                        lambda self, num_directions: True)
    torch.manual_seed(6)
    module = nn.Conv2d(3, 4, (3, 2), padding=1).double()
    x = torch.randn(5, 3, 6, 7, dtype=torch.float64)
    out = module(x)
    delta = torch.randn_like(out)
    g = individual_grads(module, x, delta)["weight"].reshape(5, -1)
    sg = conv_rule(module, (x,), {}, out, delta)["weight"]
    us = [torch.randn(module.weight.shape, dtype=torch.float64) for _ in range(2)]
    expected = torch.stack([g @ u.reshape(-1) for u in us])
    torch.testing.assert_close(sg.dots_many([u.reshape(-1) for u in us]), expected)
    torch.testing.assert_close(sg.dots_many(us), expected)
    torch.testing.assert_close(sg.dots_many([us[1].reshape(-1)]), expected[1:])


@pytest.mark.parametrize("method", ["unfold", "channels_last"])
def test_conv_projections_cast_directions_to_the_gradients_dtype(method, monkeypatch):
    """float64 directions against float32 individual gradients: the stacked directions are
    cast on the way into the scratch rows, as ``u.to(float32)`` would."""
    monkeypatch.setattr(ConvSampleGrads, "_method", lambda self: method)
    monkeypatch.setattr(ConvSampleGrads, "_materialize_for_projections",
                        lambda self, num_directions: True)
    torch.manual_seed(8)
    module = nn.Conv2d(2, 3, 3)
    x = torch.randn(4, 2, 5, 5)
    out = module(x)
    delta = torch.randn_like(out)
    g = individual_grads(module, x, delta)["weight"].reshape(4, -1)
    sg = conv_rule(module, (x,), {}, out, delta)["weight"]
    us = [torch.randn(module.weight.shape, dtype=torch.float64) for _ in range(3)]
    got = sg.dots_many(us)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.stack([g @ u.float().reshape(-1) for u in us]))
    one = sg.dots_many(us[:1])  # (one direction: cast, not stacked)
    assert one.dtype == torch.float32
    torch.testing.assert_close(one, got[:1])


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("seq", [False, True])
def test_transformers_conv1d_rule_matches_torch_func(seq, scale):
    """GPT-2's ``Conv1D`` (y = x W + b, W [in, out]) takes the Linear rule's factors in
    swapped roles, found by the class's name, not the vmap fallback."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    from cockpit.engine.rules.linear import transposed_linear_rule
    from cockpit.engine.rules.registry import find_rule

    torch.manual_seed(5)
    module = Conv1D(5, 7).double()
    assert find_rule(module) is transposed_linear_rule
    x = torch.randn(6, 3, 7, dtype=torch.float64) if seq else torch.randn(6, 7).double()
    out = module(x)
    delta = torch.randn_like(out)
    reference = individual_grads(module, x, delta * scale)
    grads = transposed_linear_rule(module, (x,), {}, out, delta, scale=scale)
    kind = SequenceOuterSampleGrads if seq else OuterSampleGrads
    assert isinstance(grads["weight"], kind) and grads["weight"].shape == (7, 5)
    check_all(grads["weight"], reference["weight"], "weight")
    check_all(grads["bias"], reference["bias"], "bias")


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_rule_matches_torch_func_without_reading_the_device(padding_idx):
    """Repeated tokens within a sample share one row (summed), padding contributes nothing,
    and forming the representation issues no op whose output size depends on the data (a
    wait on a GPU: ``unique``, ``nonzero``, reads of a value)."""
    from cockpit.engine.rules.embedding import embedding_rule

    torch.manual_seed(6)
    module = nn.Embedding(7, 3, padding_idx=padding_idx).double()
    tokens = torch.tensor([[1, 1, 2, 6], [0, 3, 3, 3], [2, 2, 2, 2], [6, 5, 1, 0]])
    out = module(tokens)
    delta = torch.randn_like(out)
    reference = individual_grads(module, tokens, delta)["weight"]
    with OpNames() as ops:
        sg = embedding_rule(module, (tokens,), {}, out, delta)["weight"]
    # projections are linear in g_n: read from the positions' rows, no grouping (sort)
    direction = torch.randn(7, 3, dtype=torch.float64)
    with OpNames() as projecting:
        torch.testing.assert_close(sg.dots(direction),
                                   reference.reshape(4, -1) @ direction.reshape(-1))
    with OpNames() as grouping:  # (the slots, formed once a norm asks)
        sg.sq_norms()
    assert "sort" not in projecting.names and "sort" in grouping.names
    for names in (ops.names, grouping.names):
        assert not names & {"unique", "_unique2", "unique_consecutive", "nonzero",
                            "_local_scalar_dense", "masked_select"}, names
    check_all(sg, reference, "embedding")
    for start, stop in ((0, 1), (1, 3), (3, 4)):
        no_reads = mock.patch.object(torch.Tensor, "tolist", side_effect=AssertionError)
        with OpNames() as ops, no_reads:
            part = sg.select(start, stop)
            dense = part.materialize()
        torch.testing.assert_close(dense, reference[start:stop])
        assert not ops.names & {"nonzero", "_local_scalar_dense", "masked_select"}, ops.names
        check_all(part, reference[start:stop], "embedding chunk")
    # a non-finite gradient of another sample stays out of a chunk
    delta[0, 0] = math.nan
    sg = embedding_rule(module, (tokens,), {}, out, delta)["weight"]
    torch.testing.assert_close(sg.select(1, 4).materialize(), reference[1:4])
