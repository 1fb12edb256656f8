"""Linear weights of one shape stacked (``cockpit.engine.stacked``): the norms, dot products
and exact histogram counts of G = [G_1; …; G_L] against each layer's own individual
gradients formed by brute force, and tracked steps whose every instrument equals the
layer-at-a-time path (sequences, plain Linear layers, GPT-2's ``Conv1D``; with a memory
budget that splits the stacks; with micro-batches), at ops that do not grow with depth."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from cockpit import Cockpit, configuration, every
from cockpit.engine import stacked
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.histograms.exact import BinSpec, histogram_dense_counts
from cockpit.engine.processing import CallProcessor
from cockpit.engine.rules.sample_grads import OuterSampleGrads, SequenceOuterSampleGrads
from cockpit.engine.stacked import StackedGrads
from tests.engine.test_host_syncs import Count
from tests.engine.test_memory_budget import assert_same_outputs, leaves
from tests.engine.test_side_by_side import tracked_step_ops


def sequence_grads(layers: int, dtype: torch.dtype, n: int = 5, t: int = 3, i: int = 4,
                   j: int = 6, seed: int = 0) -> list[SequenceOuterSampleGrads]:
    gen = torch.Generator().manual_seed(seed)
    return [SequenceOuterSampleGrads(torch.randn(n, t, i, generator=gen).to(dtype),
                                     torch.randn(n, t, j, generator=gen).to(dtype))
            for _ in range(layers)]


def brute_force(sg) -> torch.Tensor:
    """g_n of one layer in float64 by an einsum over the factors."""
    if isinstance(sg, OuterSampleGrads):
        return torch.einsum("ni,nj->nij", sg.delta.double(), sg.a.double())
    delta, a = sg.factors
    return torch.einsum("nti,ntj->nij", delta.double(), a.double())


def three_layers(kind: str, dtype: torch.dtype, gen: torch.Generator, i: int = 4,
                 j: int = 6) -> list:
    """Three layers' factors of 5 samples, a weight of shape (i, j): over sequences, or
    plain outer products."""
    if kind == "sequence":
        return sequence_grads(3, dtype, i=i, j=j)
    return [OuterSampleGrads(torch.randn(5, i, generator=gen).to(dtype),
                             torch.randn(5, j, generator=gen).to(dtype)) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["sequence", "outer"])
def test_norms_and_dots_are_each_layers_own(dtype, kind):
    gen = torch.Generator().manual_seed(1)
    grads = three_layers(kind, dtype, gen)
    stack = StackedGrads(grads)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for norms, sg in zip(stack.norms(), grads, strict=True):
        torch.testing.assert_close(norms.double(), brute_force(sg).flatten(1).norm(dim=1), **tol)
    directions = [[torch.randn(4, 6, generator=gen, dtype=dtype),  # (θ's shape, or flat)
                   torch.randn(24, generator=gen, dtype=dtype)] for _ in grads]
    block = stack.dots(directions)
    assert block.shape == (2, 5, 3)
    for index, (sg, us) in enumerate(zip(grads, directions, strict=True)):
        flat = brute_force(sg).flatten(1)
        expected = torch.stack([flat @ u.double().reshape(-1) for u in us])
        torch.testing.assert_close(block[:, :, index].double(), expected, **tol)
        torch.testing.assert_close(stack.layer_dots(index, us).double(), expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize(("kind", "k"), [("sequence", 1), ("outer", 1), ("outer", 3)])
def test_dots_before_any_statistic_come_from_the_factors(dtype, wide, kind, k):
    """Where no statistic formed G (the step after a tracked one projects on s_t only), the
    dot products come from the factors, δ U a (``wide``: more outputs than inputs, a Uᵀ
    first), without an [L, N, D] tensor: each layer's own against brute force."""
    gen = torch.Generator().manual_seed(4)
    i, j = (4, 6) if wide else (6, 4)
    grads = three_layers(kind, dtype, gen, i, j)
    stack = StackedGrads(grads)
    directions = [[torch.randn(i, j, generator=gen, dtype=dtype) for _ in range(k)]
                  for _ in grads]
    block = stack.dots(directions)
    assert stack._rows is None and block.shape == (k, 5, 3)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for index, (sg, us) in enumerate(zip(grads, directions, strict=True)):
        flat = brute_force(sg).flatten(1)
        expected = torch.stack([flat @ u.double().reshape(-1) for u in us])
        torch.testing.assert_close(block[:, :, index].double(), expected, **tol)


def test_dots_form_g_where_the_factors_cost_more():
    """Two directions over sequences would take twice the FLOPs of forming G, and more
    positions than the wider factor has features more memory than G: G is formed."""
    grads = sequence_grads(3, torch.float64)  # T = 3 positions, I = 4, J = 6
    two = [[torch.randn(4, 6, dtype=torch.float64) for _ in range(2)] for _ in grads]
    stack = StackedGrads(grads)
    stack.dots(two)
    assert stack._rows is not None
    long = sequence_grads(3, torch.float64, t=7)
    stack = StackedGrads(long)
    stack.dots([[torch.randn(4, 6, dtype=torch.float64)] for _ in long])
    assert stack._rows is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["sequence", "outer"])
def test_sums_of_squares_are_each_layers_own(dtype, kind):
    """Σ_n g_n ⊙ g_n (TICDiag) of every layer of a stack: float64, θ's shape, equal to the
    brute-force sum and to the layer's own representation."""
    grads = three_layers(kind, dtype, torch.Generator().manual_seed(3))
    tol = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {}
    for sums, sg in zip(StackedGrads(grads).sum_sq(), grads, strict=True):
        assert sums.dtype == torch.float64 and sums.shape == (4, 6)
        torch.testing.assert_close(sums, brute_force(sg).pow(2).sum(0), **tol)
        torch.testing.assert_close(sums, sg.sum_sq(), **tol)


def edge_grads(layers: int, n: int, i: int, j: int, spec: BinSpec) -> list[OuterSampleGrads]:
    """Outer factors (a = 1) whose products are the spec's edges, their neighbours, zeros,
    values outside the range and non-finite ones."""
    gen = torch.Generator().manual_seed(2)
    edges = torch.linspace(spec.lo, spec.hi, spec.bins + 1)
    special = torch.cat([torch.tensor([5.0, -5.0, float("inf"), float("-inf"), float("nan"),
                                       0.0, -0.0]),
                         edges, torch.nextafter(edges, torch.tensor(-9.0)),
                         torch.nextafter(edges, torch.tensor(9.0))])
    out = []
    for _ in range(layers):
        values = torch.rand(n * i, generator=gen) * 2.4 - 1.2
        values[: min(len(special), len(values))] = special[: len(values)]
        values = values[torch.randperm(len(values), generator=gen)]
        out.append(OuterSampleGrads(values.view(n, i), torch.ones(n, j)))
    return out


@pytest.mark.parametrize(("n", "i", "j", "budget"), [
    (8, 16, 4, None),     # every layer's size a multiple of the lanes: one histc for all
    (4, 64, 8, 2**16),    # blocks of two layers within half the budget (4096 values)
    (3, 7, 5, None),      # an odd size: each layer's own tallies
])
def test_histograms_are_each_layers_exact_counts(n, i, j, budget):
    spec = BinSpec(-1.0, 1.0, 10)
    grads = edge_grads(5, n, i, j, spec)
    with histogram_device.forced():
        counts = StackedGrads(grads).histograms(spec, budget)
    for got, sg in zip(counts, grads, strict=True):  # (the CPU path's exact counts)
        got = got.counts() if isinstance(got, histogram_device.LaneCounts) else got
        expected = histogram_dense_counts([sg.materialize()], spec)
        assert got.dtype == torch.int64 and torch.equal(got, expected)
        assert 0 < int(expected.sum()) < n * i * j  # (non-finite and outside values left out)


# ---------------------------------------------------------------- tracked steps


class Tokens(nn.Module):
    """Four Linear layers of one shape on sequences [N, T, 6] (each followed by a LayerNorm
    where ``norms``), a head on their mean (or on every position, then the mean: a lone
    Linear layer on sequences, where ``head_on_positions``)."""

    def __init__(self, depth: int = 4, norms: bool = False, head_on_positions: bool = False):
        super().__init__()
        self.blocks = nn.Sequential(*[m for _ in range(depth) for m in (
            nn.Linear(6, 6), *([nn.LayerNorm(6)] if norms else []), nn.Tanh())])
        self.head = nn.Linear(6, 3)
        self.head_on_positions = head_on_positions

    def forward(self, x):
        if self.head_on_positions:
            return self.head(self.blocks(x)).mean(1)
        return self.head(self.blocks(x).mean(1))


def gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=20, n_embd=8, n_layer=3, n_head=2, n_positions=6, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager")


def problem(kind: str):
    """model, inputs, losses(model, inputs)."""
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (8,), generator=gen)
    if kind == "gpt2":
        ids = torch.randint(0, 20, (8, 6), generator=gen)

        def lm_losses(model, ids):
            logits = model(input_ids=ids).logits[:, :-1]
            return nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:],
                                               reduction="none").mean(1)

        return gpt2().double(), ids, lm_losses
    if kind in ("sequence", "layernorm"):
        x = torch.randn(8, 5, 6, generator=gen, dtype=torch.float64)
        return Tokens(norms=kind == "layernorm").double(), x, lambda m, x: (
            nn.functional.cross_entropy(m(x), y[: len(x)], reduction="none"))
    if kind == "groupnorm":  # three convolutions and GroupNorms of one shape
        x = torch.randn(8, 4, 5, 5, generator=gen, dtype=torch.float64)
        model = nn.Sequential(*[m for _ in range(3) for m in (
            nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU())],
            nn.Flatten(), nn.Linear(100, 3)).double()
        return model, x, lambda m, x: nn.functional.cross_entropy(m(x), y[: len(x)],
                                                                  reduction="none")
    x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(6, 6), nn.Tanh())],
                          nn.Linear(6, 3)).double()
    return model, x, lambda m, x: nn.functional.cross_entropy(m(x), y[: len(x)],
                                                              reduction="none")


def outputs(kind: str, config: str, stacks: bool, monkeypatch, micro_batches: int = 1,
            budget: int | None = 2**29, every_k: int = 1, steps: int = 3
            ) -> tuple[dict, list[int], list[int]]:
    """Every instrument's output over ``steps`` steps tracked every ``every_k``-th (AdamW,
    the accelerators' path), and the number of layers of every stack of Linear weights and
    of normalization layers formed."""
    sizes: list[int] = []
    norm_sizes: list[int] = []
    original_init, original_norms = StackedGrads.__init__, stacked.form_norm_stack

    def spy(self, grads):
        sizes.append(len(grads))
        original_init(self, grads)

    def norm_spy(stack):
        norm_sizes.append(len(stack.units))
        return original_norms(stack)

    with monkeypatch.context() as patch:
        patch.setattr(StackedGrads, "__init__", spy)
        patch.setattr(stacked, "form_norm_stack", norm_spy)
        if not stacks:
            patch.setattr(stacked, "capacity", lambda sg, budget: 0)
            patch.setattr(stacked, "norm_capacity", lambda x, delta, budget: 0)
        patch.setattr(histogram_device, "_forced", True)
        torch.manual_seed(0)
        model, x, losses_of = problem(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cockpit = Cockpit(model, configuration(config, every(every_k)), optimizer=opt,
                          strict=True, memory_budget=budget,
                          grad_accumulation=micro_batches > 1)
        for step in range(steps):
            opt.zero_grad()
            for part in x.tensor_split(micro_batches):
                losses = losses_of(model, part)
                with cockpit(step, losses=losses):
                    (losses.sum() / len(x)).backward()
            opt.step()
        cockpit.close()
    return cockpit.get_output(), sizes, norm_sizes


@pytest.mark.parametrize(("kind", "config", "micro_batches", "expected_sizes", "norm_sizes"), [
    ("sequence", "economy", 1, [4] * 3, []),
    ("sequence", "business", 2, [4] * 6, []),
    ("outer", "economy", 1, [4] * 3, []),
    ("outer", "business", 1, [4] * 3, []),
    # c_attn, attn.c_proj, c_fc, mlp.c_proj; ln_1, ln_2 of 3 blocks and ln_f; × 3 steps
    ("gpt2", "economy", 1, [3] * 4 * 3, [7] * 3),
    ("gpt2", "economy", 2, [3] * 4 * 6, [7] * 6),
    ("layernorm", "economy", 1, [4] * 3, [4] * 3),
    ("layernorm", "business", 2, [4] * 6, [4] * 6),
    ("groupnorm", "economy", 1, [], [3] * 3),
    ("groupnorm", "business", 1, [], [3] * 3),
])
def test_every_instrument_equals_one_layer_at_a_time(kind, config, micro_batches,
                                                     expected_sizes, norm_sizes, monkeypatch):
    """Over three steps: Alpha's projections on Adam's update, the gradient tests, the
    histograms (GradHist2d too in business), with micro-batches the merged statistics."""
    expected, none, no_norms = outputs(kind, config, False, monkeypatch, micro_batches)
    got, sizes, norms = outputs(kind, config, True, monkeypatch, micro_batches)
    assert none == no_norms == [] and sorted(sizes) == expected_sizes
    assert sorted(norms) == norm_sizes
    for step in expected:
        assert sum(v is not None for _, v in leaves(expected[step])) > 20
    assert_same_outputs(expected, got)


@pytest.mark.parametrize("kind", ["sequence", "outer", "gpt2"])
def test_the_step_after_a_tracked_one_projects_from_the_factors(kind, monkeypatch):
    """Tracked every other step, the steps after a tracked one project each stack's
    individual gradients on s_t from the factors (no G formed): Alpha equals the layer at
    a time path."""
    factor_calls = []
    original = StackedGrads._factor_dots

    def spy(self, stacked_directions, k):
        factor_calls.append(k)
        return original(self, stacked_directions, k)

    expected, _, _ = outputs(kind, "economy", False, monkeypatch, every_k=2, steps=5)
    monkeypatch.setattr(StackedGrads, "_factor_dots", spy)
    got, sizes, _ = outputs(kind, "economy", True, monkeypatch, every_k=2, steps=5)
    stacks_per_step = {"sequence": 1, "outer": 1, "gpt2": 4}[kind]
    assert factor_calls == [1] * (2 * stacks_per_step)  # (steps 1 and 3)
    assert len(sizes) == 5 * stacks_per_step
    alphas = [step for step in expected if expected[step].get("Alpha") is not None]
    assert alphas == [0, 2]
    assert_same_outputs(expected, got)


def test_the_memory_budget_splits_the_stacks(monkeypatch):
    """A budget whose half holds two layers' individual gradients (8 × 36 float64 numbers
    each): the four weights in two stacks of two, the same outputs."""
    budget = 2 * (2 * 8 * 36 * 8) + 10
    expected, _, _ = outputs("outer", "economy", False, monkeypatch, budget=budget)
    got, sizes, _ = outputs("outer", "economy", True, monkeypatch, budget=budget)
    assert sizes == [2, 2] * 3
    assert_same_outputs(expected, got)


def test_stacked_weights_cost_the_same_kernels_however_many(monkeypatch):
    """2 or 6 weights of one shape: one materialization, one norm, one histogram search and
    count, one prediction of Adam's update and the same dot products for all of them. The
    dot products take no batched matrix product: on a GPU cuBLAS reduced the millions of
    numbers of GPT-2's layers for the [K, N] outputs 20× slower than a product and a sum."""
    monkeypatch.setattr(histogram_device, "_forced", True)
    dots_ops: list[collections.Counter] = []
    real_dots = StackedGrads.dots

    def counted_dots(self, directions):
        with Count() as count:
            result = real_dots(self, directions)
        dots_ops.append(count.ops)
        return result

    monkeypatch.setattr(StackedGrads, "dots", counted_dots)
    few, many = tracked_step_ops(2), tracked_step_ops(6)  # (blocks of Linear(6, 6) and more)
    for op in ("bmm", "linalg_vector_norm", "bucketize", "histc", "_fused_adamw_"):
        assert many[op] == few[op], op
    assert len(dots_ops) == 6 and dots_ops[:3] == dots_ops[3:]  # (three steps each)
    assert dots_ops[2]["mul"] >= 1 and not any(c["bmm"] for c in dots_ops)


def test_a_shape_alone_in_the_last_backward_pass_no_longer_waits(monkeypatch):
    """The head's weight has no partner of its shape: at the first tracked step it waits
    for the end of the backward pass (and is formed alone), at the later ones it is formed
    in its hook; the four block weights are one stack every step."""
    formed: list[list[str]] = []
    real = CallProcessor.reduce_stack_guarded
    monkeypatch.setattr(CallProcessor, "reduce_stack_guarded",
                        lambda self, stack: formed.append(sorted(stack.names))
                        or real(self, stack))
    outputs("sequence", "economy", True, monkeypatch)
    blocks = [f"blocks.{i}.weight" for i in (0, 2, 4, 6)]
    assert sorted(formed) == sorted([["head.weight"], blocks, blocks, blocks])


@pytest.mark.parametrize("scaled", [0, 1])
@pytest.mark.parametrize("narrow", [False, True])
def test_a_scale_held_apart_is_multiplied_once_for_the_stack(scaled, narrow):
    """Layers over sequences hand their factors unscaled with the loss weight's 1/w held
    apart (``scale``, into factor ``scaled``): each layer read alone multiplies it in after
    the widening, the stack multiplies the concatenated factor once; both are c·g_n."""
    c = 1 / 0.3  # (not a power of two: each factor's rounding shows)
    gen = torch.Generator().manual_seed(4)
    grads = [SequenceOuterSampleGrads(
        torch.randn(5, 3, 4, generator=gen).to(torch.bfloat16 if narrow else torch.float32),
        torch.randn(5, 3, 6, generator=gen), torch.float32 if narrow else None, c, scaled)
        for _ in range(3)]
    with Count() as counted:
        stack = StackedGrads(grads)
        stack.rows  # noqa: B018  (G formed: the factors read)
    assert counted.ops["mul"] + counted.ops["mul_"] == 1
    for index, sg in enumerate(grads):
        expected = c * brute_force(sg)
        torch.testing.assert_close(stack.layer(index).double(), expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(stack.layer(index), sg.materialize(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sg.select(1, 4).materialize(), sg.materialize()[1:4],
                                   rtol=1e-6, atol=1e-6)
    assert stacked.key(grads[0]) != stacked.key(SequenceOuterSampleGrads(*grads[0].factors,
                                                                          grads[0].wide))
