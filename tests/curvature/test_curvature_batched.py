"""Batched vector backpropagations (one vmap'd backward pass for many GGN factor columns)
give the diagonal curvature of dense float64 references, as the one-by-one loop does, also
when a small memory budget splits them into chunks; Hutchinson's batched Hessian-vector
products equal the loop's draw for draw; ``curvature="auto"`` picks the Monte-Carlo GGN for
many classes and says so."""

from __future__ import annotations

import collections
import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from curvature_reference import single_thread  # noqa: F401  (autouse fixture)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cockpit import Cockpit, quantities
from cockpit.benchmark.problems.small_nets import TFSamePool
from cockpit.curvature import batched as batched_module
from cockpit.curvature.batched_grad import batched_grad
from cockpit.curvature.diagonal import diagonal_curvature, diagonal_replicates
from cockpit.curvature.hutchinson import (
    hutchinson_diagonal,
    hutchinson_replicates,
    rademacher_blocks,
    rademacher_like,
)
from cockpit.curvature.hvp import HessianVectorProduct
from cockpit.engine.histograms import device as histogram_device
from tests.curvature.test_curvature_instruments import (
    dense_ggn_diagonal,
    dense_hessian,
    math_attention,
)
from tests.models import Problem, cross_entropy, make_problem
from tests.reference import rel_close


def cnn_problem(batch_size: int = 5) -> Problem:
    """Convolutions (one grouped and strided), max-pooling, ReLU, GroupNorm, cross-entropy."""
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, stride=2, groups=2), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4),
    ).double()
    x = torch.randn(batch_size, 2, 8, 8, dtype=torch.float64)
    return Problem("cnn_plain", model, x, torch.randint(0, 4, (batch_size,)), cross_entropy)


def pool_problem(batch_size: int = 5) -> Problem:
    """Convolutions with and without padding, "same"-padded max-pooling (an explicit pad),
    plain max-pooling, ReLU, cross-entropy over 5 classes."""
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), TFSamePool(3, 2),
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4, 5),
    ).double()
    x = torch.randn(batch_size, 2, 8, 8, dtype=torch.float64)
    return Problem("pool", model, x, torch.randint(0, 5, (batch_size,)), cross_entropy)


class CountOps(TorchDispatchMode):
    """The aten ops run inside the context, by name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def problem_of(name: str) -> Problem:
    return cnn_problem() if name == "cnn_plain" else make_problem(name, 5)


class _Probe(quantities.Quantity):
    """Calls the curvature primitives inside a tracked step; the one-by-one loop raises, so
    a value can only come from the batched passes."""

    needs_activations = True  # the diagonal curvature reads the recorded activations

    def __init__(self, fn, forbid_loop: bool = True):
        super().__init__()
        self.fn, self.forbid_loop, self.result = fn, forbid_loop, None

    def prepare(self, step, tracker, optimizer, losses):
        if self.forbid_loop:
            def loop(*args, **kwargs):
                raise AssertionError("the one-by-one loop ran")

            tracker.sum_sq_of_backprops = loop
        self.result = self.fn(tracker, losses)


def run_probe(problem: Problem, fn, forbid_loop: bool = True):
    problem.model.zero_grad(set_to_none=True)
    probe = _Probe(fn, forbid_loop)
    cockpit = Cockpit(problem.model, [probe], strict=True)
    losses = problem.losses()
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    return probe.result


def summed_side_by_side(monkeypatch) -> list[list[str]]:
    """The names of the small parameters each side-by-side sum of squares covered."""
    groups: list[list[str]] = []
    original = batched_module._add_side_by_side

    def spy(small):
        if small:
            groups.append([name for _, name, _ in small])
        original(small)

    monkeypatch.setattr(batched_module, "_add_side_by_side", spy)
    return groups


@pytest.mark.parametrize("accelerator", [pytest.param(False, marks=pytest.mark.cpu_path), True])
@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("name", ["mlp_relu", "mlp_sigmoid", "cnn_plain", "residual"])
def test_batched_exact_ggn_equals_dense_reference(name, budget, accelerator, monkeypatch):
    """On the accelerator path the small parameters' sums of squares are formed side by
    side (the biases, and cnn_plain's GroupNorm weight and bias): the same values."""
    monkeypatch.setattr(batched_module, "DEFAULT_BUDGET_BYTES", budget)
    side = summed_side_by_side(monkeypatch)
    problem = problem_of(name)
    expected = dense_ggn_diagonal(problem)
    with histogram_device.forced() if accelerator else contextlib.nullcontext():
        got = run_probe(problem, lambda tracker, losses: diagonal_curvature(
            "diag_ggn_exact", tracker, losses, tracker.params, batched=True))
    assert set(got) == set(expected)
    for k, d in expected.items():
        assert torch.allclose(got[k], d, rtol=1e-9, atol=1e-13), k
    biases = {k for k in expected if k.endswith("bias")}
    covered = {name for group in side for name in group}
    if accelerator and budget is None:  # (one chunk: every vector's samples at once)
        assert len(side) == 1 and biases <= covered
        if name == "cnn_plain":
            assert {"4.weight", "4.bias"} <= covered  # (the GroupNorm's)
    elif not accelerator:
        assert not side


def test_batched_grad_equals_one_backward_pass_per_vector():
    """Every vector's vector-Jacobian product through padding, max-pooling and convolution
    is the plain backward pass's; an input the outputs do not reach gives None."""
    problem = pool_problem()
    model = problem.model
    hidden = model[:3](problem.x)
    output = model[3:](hidden)
    unused = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    vectors = torch.randn(4, *output.shape, dtype=torch.float64)
    inputs = [hidden, model[0].weight, unused]
    got = batched_grad([output], inputs, [vectors])
    assert got[2] is None
    for k, v in enumerate(vectors):
        want = torch.autograd.grad(output, inputs[:2], v, retain_graph=True)
        for g, w in zip(got[:2], want, strict=True):
            assert torch.allclose(g[k], w, rtol=1e-12, atol=1e-15)


def test_batched_backprops_run_each_backward_kernel_once(monkeypatch):
    """The exact GGN's C = 5 vectors pass padding and max-pooling in one call each (no
    loop over the vectors), with the loop's and the dense reference's values."""
    problem = pool_problem()
    expected = dense_ggn_diagonal(problem)
    counter = CountOps()

    def counted(*args):
        with counter:
            return batched_grad(*args)

    monkeypatch.setattr(batched_module, "batched_grad", counted)
    got = run_probe(problem, lambda tracker, losses: diagonal_curvature(
        "diag_ggn_exact", tracker, losses, tracker.params, batched=True))
    looped = run_probe(problem, lambda tracker, losses: diagonal_curvature(
        "diag_ggn_exact", tracker, losses, tracker.params, batched=False), forbid_loop=False)
    assert counter.ops["max_pool2d_with_indices_backward"] == 2
    assert counter.ops["constant_pad_nd"] == 1
    assert counter.ops["convolution_backward"] == 1  # the second convolution's input
    assert set(got) == set(expected) == set(looped)
    for k, d in expected.items():
        assert torch.allclose(got[k], d, rtol=1e-9, atol=1e-13), k
        assert torch.allclose(got[k], looped[k], rtol=1e-12, atol=1e-15), k


@pytest.mark.parametrize("per_fold", [7, 12, 5 * 4])
def test_batched_folds_of_whole_vectors_and_of_single_samples(per_fold, monkeypatch):
    """A rule's scratch budget for 7 samples (k, n) folds them one by one (N = 5), for 12
    two vectors at a time (the input repeated twice), for 20 all C = 4 vectors at once:
    the dense reference's values each time."""
    monkeypatch.setattr(batched_module, "_sample_bytes", lambda call: 2**20 // per_fold)
    monkeypatch.setattr(batched_module, "DEFAULT_BUDGET_BYTES", 2**20)
    problem = cnn_problem()
    expected = dense_ggn_diagonal(problem)
    got = run_probe(problem, lambda tracker, losses: diagonal_curvature(
        "diag_ggn_exact", tracker, losses, tracker.params, batched=True))
    for k, d in expected.items():
        assert torch.allclose(got[k], d, rtol=1e-9, atol=1e-13), k


@pytest.mark.parametrize("name", ["mlp_sigmoid", "smooth"])
def test_batched_exact_hessian_diagonal(name):
    from tests.curvature.test_curvature_instruments import smooth_problem

    problem = smooth_problem() if name == "smooth" else make_problem(name, 5)
    H, names, shapes = dense_hessian(problem)
    diag = torch.diagonal(H).split([math.prod(s) for s in shapes])
    got = run_probe(problem, lambda tracker, losses: diagonal_curvature(
        "diag_hessian", tracker, losses, tracker.params, batched=True))
    for k, d, s in zip(names, diag, shapes, strict=True):
        assert torch.allclose(got[k], d.reshape(s), rtol=1e-9, atol=1e-12), k


def mc_replicates(batched: bool):
    """A probe's function: the MC GGN's four replicates (one sampled column each)."""
    def fn(tracker, losses):
        generator = torch.Generator().manual_seed(3)
        return diagonal_replicates("diag_ggn_mc", tracker, losses, tracker.params,
                                   num_samples=4, generator=generator, batched=batched)
    return fn


def assert_same_replicates(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want) == 4
    for g, w in zip(got, want, strict=True):
        for k in w:
            assert torch.allclose(g[k], w[k], rtol=1e-10, atol=1e-15), k


def unfolded_samples(monkeypatch) -> list[int]:
    """The number of samples of each input a convolution unfolds into patches."""
    from cockpit.engine.rules import conv as conv_module

    unfolded: list[int] = []
    original = conv_module._patches

    def spy(module, x, out_sizes, out=None):
        unfolded.append(x.shape[0])
        return original(module, x, out_sizes, out)

    monkeypatch.setattr(conv_module, "_patches", spy)
    return unfolded


@pytest.mark.parametrize("accelerator", [pytest.param(False, marks=pytest.mark.cpu_path), True])
def test_batched_mc_replicates_equal_the_loop(accelerator, monkeypatch):
    """The MC GGN's replicates (one sampled column each) are the loop's, one by one (on
    the accelerator path with each replicate's small parameters summed side by side)."""
    problem = cnn_problem()
    side = summed_side_by_side(monkeypatch)

    with histogram_device.forced() if accelerator else contextlib.nullcontext():
        got = run_probe(problem, mc_replicates(True))
    want = run_probe(problem, mc_replicates(False), forbid_loop=False)
    assert bool(side) == accelerator
    assert_same_replicates(got, want)
    assert not torch.allclose(got[0]["0.weight"], got[1]["0.weight"])  # independent draws


def test_unfoldable_layers_fall_back_to_the_loop():
    """ReLU(inplace=True) modifies a layer output after the call: the loop runs, exactly."""
    problem = make_problem("cnn", 5)
    expected = dense_ggn_diagonal(problem)
    got = run_probe(problem, lambda tracker, losses: diagonal_curvature(
        "diag_ggn_exact", tracker, losses, tracker.params, batched=True), forbid_loop=False)
    for k, d in expected.items():
        assert torch.allclose(got[k], d, rtol=1e-9, atol=1e-13), k
    with pytest.raises(AssertionError, match="loop ran"):
        run_probe(problem, lambda tracker, losses: diagonal_curvature(
            "diag_ggn_exact", tracker, losses, tracker.params, batched=True))


@pytest.mark.parametrize("name", ["mlp_sigmoid", "transformer"])
def test_batched_hutchinson_equals_the_loop(name):
    """Hutchinson with M Rademacher draws: the batched products equal one product per draw
    (same draws, same order of the generator)."""
    problem = make_problem(name, 4)
    params = [p for p in problem.model.parameters() if p.requires_grad]
    results = {}
    for batched in (False, True):
        with math_attention():
            loss = problem.losses().mean()
        hvp = HessianVectorProduct(loss, params)
        generator = torch.Generator().manual_seed(5)
        results[batched] = hutchinson_diagonal(hvp, params, 6, generator, batched=batched)
        assert hvp.num_calls == 6
        hvp.release()
    for a, b in zip(results[False], results[True], strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("fn", [hutchinson_diagonal, hutchinson_replicates])
def test_batched_hutchinson_issues_as_many_ops_for_any_number_of_draws(fn):
    """The draws, the products and v ⊙ H v take the same ops for 3 and for 6 draws (no
    loop over the draws: on an accelerator each op is a launch)."""
    problem = make_problem("cnn", 4)
    params = [p for p in problem.model.parameters() if p.requires_grad]
    hvp = HessianVectorProduct(problem.losses().mean(), params)
    counts = []
    for draws in (3, 6):
        with CountOps() as counter:
            fn(hvp, params, draws, torch.Generator().manual_seed(0), batched=True)
        counts.append(counter.ops)
    assert counts[0] == counts[1]
    assert counts[0]["randint"] == 1


def test_rademacher_blocks_are_the_draws_one_by_one():
    """From a CPU generator, M draws over P tensors (two dtypes) as [M, *shape] blocks are
    the numbers of M × P calls of rademacher_like in draw-then-parameter order."""
    params = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.float64), torch.zeros(2, 1, 2)]
    blocks = rademacher_blocks(params, 4, torch.Generator().manual_seed(7))
    generator = torch.Generator().manual_seed(7)
    for m in range(4):
        for block, p in zip(blocks, params, strict=True):
            want = rademacher_like(p, generator)
            assert block.shape == (4, *p.shape) and block.dtype == p.dtype
            assert torch.equal(block[m], want)
    assert set(torch.cat([b.reshape(-1).float() for b in blocks]).tolist()) == {-1.0, 1.0}


def wide_classifier(classes: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, classes)).double()
    return model, torch.randn(16, 6, dtype=torch.float64), torch.randint(0, classes, (16,))


@pytest.mark.parametrize("classes,method", [(32, "diag_hessian"), (33, "diag_ggn_mc"),
                                            (100, "diag_ggn_mc")])
def test_auto_picks_the_mc_ggn_for_many_classes(classes, method):
    model, x, y = wide_classifier(classes)
    trace, tic = quantities.HessTrace(), quantities.TICDiag()
    cockpit = Cockpit(model, [trace, tic], strict=True)
    losses = F.cross_entropy(model(x), y, reduction="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cockpit(0, losses=losses):
            losses.mean().backward()
    cockpit.close()
    assert trace.method_used == tic.method_used == method
    note = cockpit.get_notes()[0]["HessTrace"]
    if method == "diag_ggn_mc":
        assert "Monte-Carlo" in note and f"{classes} outputs" in note
        assert "mc_threshold=32" in note
        assert any("Monte-Carlo" in str(w.message) for w in caught)
    else:
        assert "Monte-Carlo" not in note
    # the choice is cost, not a failure: the MC GGN is unbiased for the exact value here
    model.zero_grad(set_to_none=True)
    exact = Cockpit(model, [quantities.HessTrace(curvature="diag_ggn_exact")], strict=True)
    losses = F.cross_entropy(model(x), y, reduction="none")
    with exact(0, losses=losses):
        losses.mean().backward()
    exact.close()
    value = cockpit.get_output()[0]["HessTrace"]
    reference = exact.get_output()[0]["HessTrace"]
    stderr = cockpit.get_output()[0].get("HessTrace.stderr")
    if method == "diag_ggn_mc":
        assert abs(value - reference) <= 5 * stderr
    else:
        assert rel_close(value, reference, 1e-9)


@pytest.mark.parametrize("conv", [
    nn.Conv1d(3, 4, 3, padding=1),
    nn.Conv2d(2, 5, 3, stride=2, padding=1, bias=False),
    nn.Conv2d(2, 3, (3, 2), dilation=(2, 1), padding="same", padding_mode="reflect"),
    nn.Conv3d(2, 2, 2, stride=(1, 2, 1)),
])
@pytest.mark.parametrize("vectors_per_fold", [1, 2, 5])
def test_folded_convolution_sums_equal_each_vectors_own(conv, vectors_per_fold):
    """Σ_k Σ_n g_{k,n} ⊙ g_{k,n} of a convolution's weight with the input's patches formed
    once for the K vectors (in folds of vectors within the budget) equals the sum of the
    brute-force individual gradients (torch.func) of each vector's backpropagation."""
    from cockpit.engine.rules.conv import folded_weight_sum_sq

    torch.manual_seed(0)
    conv = conv.double()
    n, k = 3, 5
    x = torch.randn(n, conv.in_channels, *[6] * (conv.weight.dim() - 2), dtype=torch.float64)
    out = conv(x)
    folded = torch.randn(k * n, *out.shape[1:], dtype=torch.float64)

    def sample_output(weight, x_n, v_n):  # ⟨conv(x_n; W), v_n⟩: its gradient is g_{k,n}
        params = {"weight": weight} | ({"bias": conv.bias} if conv.bias is not None else {})
        y = torch.func.functional_call(conv, params, (x_n.unsqueeze(0),))
        return (y[0] * v_n).sum()

    each = torch.func.vmap(torch.func.grad(sample_output), in_dims=(None, 0, 0))
    expected = sum(each(conv.weight.detach(), x, folded[i * n:(i + 1) * n]).pow(2).sum(0)
                   for i in range(k))
    positions = math.prod(out.shape[2:])
    patches = n * conv.weight.shape[1:].numel() * positions * 8
    per_vector = n * (conv.weight.numel() + conv.out_channels * positions) * 8
    budget = patches + vectors_per_fold * per_vector
    got = folded_weight_sum_sq(conv, x, folded, budget)
    assert got is not None and got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert folded_weight_sum_sq(conv, x, folded, patches + per_vector - 1) is None
    apart = folded_weight_sum_sq(conv, x, folded, budget, separate=True)
    assert apart is not None and apart.shape == (k, *conv.weight.shape)
    for i in range(k):  # each vector's own Σ_n
        own = each(conv.weight.detach(), x, folded[i * n:(i + 1) * n]).pow(2).sum(0)
        torch.testing.assert_close(apart[i], own, rtol=1e-12, atol=1e-14)


def test_batched_convolutions_unfold_each_input_once(monkeypatch):
    """The exact GGN's C = 5 vectors on the accelerator path: each convolution's patches
    are formed from its N recorded samples (not a repeated input of C·N), the dense
    reference's values."""
    problem = pool_problem()
    expected = dense_ggn_diagonal(problem)
    unfolded = unfolded_samples(monkeypatch)
    counter, add_folded = CountOps(), batched_module._add_folded

    def counted(*args, **kwargs):
        with counter:
            return add_folded(*args, **kwargs)

    monkeypatch.setattr(batched_module, "_add_folded", counted)
    with histogram_device.forced():
        got = run_probe(problem, lambda tracker, losses: diagonal_curvature(
            "diag_ggn_exact", tracker, losses, tracker.params, batched=True))
    for k, d in expected.items():
        assert torch.allclose(got[k], d, rtol=1e-9, atol=1e-13), k
    assert unfolded == [5, 5]  # (two convolutions, N = 5 samples each)
    assert counter.ops["repeat"] == 1  # (the Linear layer's input, repeated for its rule)


def test_an_instrument_without_needs_activations_is_told_to_declare_it():
    """An own instrument that backpropagates through the recorded calls but does not set
    needs_activations gets a message that says so, not autograd's complaint about the
    records the forward pass kept in place of the outputs."""

    class Undeclared(_Probe):
        needs_activations = False

    problem = pool_problem()
    probe = Undeclared(lambda tracker, losses: diagonal_curvature(
        "diag_ggn_exact", tracker, losses, tracker.params, batched=True))
    cockpit = Cockpit(problem.model, [probe], strict=True)
    losses = problem.losses()
    with pytest.raises(RuntimeError, match="needs_activations = True"), cockpit(
            0, losses=losses):
        losses.mean().backward()


def test_mc_replicates_unfold_each_convolutions_input_once(monkeypatch):
    """The MC GGN's replicates (one sampled column each, summed apart) on the accelerator
    path: each convolution's patches are formed once for all replicates, and every
    replicate equals the loop's."""
    problem = pool_problem()
    unfolded = unfolded_samples(monkeypatch)
    with histogram_device.forced():
        got = run_probe(problem, mc_replicates(True))
    assert unfolded == [5, 5]  # (two convolutions, once each for the four replicates)
    want = run_probe(problem, mc_replicates(False), forbid_loop=False)
    assert_same_replicates(got, want)


@pytest.mark.parametrize("budget", ["auto", 2**12])
def test_a_memory_budget_given_caps_the_batched_chunks(budget, monkeypatch):
    """``Cockpit(..., memory_budget=N)`` bounds the curvature's chunks as it bounds a
    layer's individual gradients: the exact GGN's C = 4 vectors, one chunk under the
    default budget, take one chunk per vector within 4 KiB (a vector's layer-output
    gradients count 26 KiB) and each layer's folded individual gradients go in folds
    within it; HessTrace equals the dense reference's either way."""
    problem = cnn_problem()
    chunks: list[int] = []
    folds = collections.Counter()
    batched, sample_grads = batched_module.batched_grad, batched_module._add_folded

    def counted(outputs, inputs, vectors):
        chunks.append(len(vectors[0]))
        return batched(outputs, inputs, vectors)

    def spied(engine, call, folded, n, totals, budget_bytes, small):
        folds[budget_bytes] += 1
        return sample_grads(engine, call, folded, n, totals, budget_bytes, small)

    monkeypatch.setattr(batched_module, "batched_grad", counted)
    monkeypatch.setattr(batched_module, "_add_folded", spied)
    model = problem.model
    cockpit = Cockpit(model, [quantities.HessTrace(curvature="diag_ggn_exact")],
                      strict=True, memory_budget=budget)
    assert cockpit.tracker.curvature_budget == (None if budget == "auto" else budget)
    with histogram_device.forced():  # (batched, as on an accelerator)
        losses = problem.losses()
        with cockpit(0, losses=losses):
            losses.mean().backward()
    cockpit.close()
    if budget == "auto":
        assert chunks == [4] and set(folds) == {batched_module.default_budget(problem.x.device)}
    else:
        assert chunks == [1, 1, 1, 1] and set(folds) == {budget}
    expected = dense_ggn_diagonal(problem)
    reference = sum(d.sum().item() for d in expected.values())
    assert rel_close(cockpit.get_output()[0]["HessTrace"], reference, 1e-9)
