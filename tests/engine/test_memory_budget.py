"""Cockpit(..., memory_budget=...): a layer whose |B| individual gradients exceed the budget
is processed in sample chunks. Every per-sample statistic equals the unchunked one (float64)
and torch.func's, on Linear over sequences, an embedding tied to the output layer, Conv2d and
a layer without a rule (torch.func fallback); the largest tensor formed while the backward
pass is processed stays within the budget; bad budgets are refused."""

from __future__ import annotations

import collections
import contextlib

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cockpit import Cockpit
from cockpit.engine.histograms.exact import BinSpec
from cockpit.quantities import Quantity
from tests.reference import individual_gradients

STATISTICS = ("sq_norms", "gram_mean", "sum_sq", "var_sum", "hist1d", "hist2d", "l1_norms")


class AllStatistics(Quantity):
    """Every registered per-sample statistic of every parameter (test only)."""

    needs = frozenset(STATISTICS)

    def compute(self, data):
        return {"AllStatistics": {
            f"{stat}/{name}": value.double().cpu().numpy()
            for stat in STATISTICS for name, value in data.stats[stat].items()}}


class Scale(nn.Module):
    """y = x ⊙ w: no rule, so the torch.func fallback forms its individual gradients."""

    def __init__(self, shape):
        super().__init__()
        self.w = nn.Parameter(1 + 0.1 * torch.randn(shape))

    def forward(self, x):
        return x * self.w


class TiedNet(nn.Module):
    """tokens → embedding → Linear (sequence) → Conv2d → Scale → logits by the embedding's
    own weight (tied)."""

    def __init__(self, vocab=30, dim=6, length=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lin = nn.Linear(dim, dim)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.scale = Scale((length, dim))
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        h = torch.tanh(self.lin(self.emb(tokens)))
        h = self.conv(h.unsqueeze(1)).sum(1)
        return self.out(self.scale(h))


def token_losses(logits, tokens):
    """ℓ_n: the mean next-token cross-entropy of sample n."""
    per_token = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                            tokens[:, 1:].reshape(-1), reduction="none")
    return per_token.view(tokens.shape[0], -1).mean(1)


def run(budget, steps=1, seed=0):
    torch.manual_seed(seed)
    model = TiedNet().double()
    tokens = torch.randint(0, 30, (7, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [AllStatistics()], optimizer=opt, strict=True,
                      hist_bins=BinSpec(-0.5, 0.5, 16), memory_budget=budget)
    for step in range(steps):
        opt.zero_grad()
        losses = token_losses(model(tokens), tokens)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    return cockpit, model, tokens


@pytest.mark.parametrize("budget", [1, 500, 3 * 2 * 30 * 6 * 8])
def test_chunked_statistics_equal_unchunked_ones(budget):
    """1 byte: one sample per chunk everywhere; 500 bytes: chunks of 2 samples for the
    fallback layer, of 3 for the convolution; 3 samples' worth of the tied embedding's
    summed individual gradients (and the running sum): chunks of 3, 3, 1 for it alone."""
    whole, _, _ = run(None)
    chunked, _, _ = run(budget)
    expected = whole.get_output()[0]["AllStatistics"]
    recorded = chunked.get_output()[0]["AllStatistics"]
    assert set(recorded) == set(expected)
    assert {key.split("/", 1)[1] for key in expected} == {
        "emb.weight", "lin.weight", "lin.bias", "conv.weight", "conv.bias", "scale.w"}
    for key, value in expected.items():
        np.testing.assert_allclose(recorded[key], value, rtol=1e-10, atol=1e-12, err_msg=key)
    assert "Cockpit" not in whole.get_notes().get(0, {})


def test_chunked_statistics_match_torch_func():
    cockpit, _, tokens = run(1)
    recorded = cockpit.get_output()[0]["AllStatistics"]
    torch.manual_seed(0)
    model = TiedNet().double()
    grads = individual_gradients(model, token_losses, tokens, tokens)
    for name, g in grads.items():
        rows = g.reshape(g.shape[0], -1)
        mean = rows.mean(0)
        np.testing.assert_allclose(recorded[f"sq_norms/{name}"], rows.pow(2).sum(1), rtol=1e-10)
        np.testing.assert_allclose(recorded[f"gram_mean/{name}"], rows @ mean, rtol=1e-10,
                                   atol=1e-14)
        np.testing.assert_allclose(recorded[f"var_sum/{name}"].reshape(-1),
                                   (rows - mean).pow(2).sum(0), rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(recorded[f"l1_norms/{name}"], rows.abs().sum(1), rtol=1e-10)


def test_the_notes_say_once_which_layers_were_chunked():
    cockpit, _, _ = run(1, steps=2)
    notes = cockpit.get_notes()
    note = notes[0]["Cockpit"]
    assert "memory_budget=1 bytes" in note and "emb.weight (7 chunks)" in note
    assert "Cockpit" not in notes.get(1, {})


class LargestTensor(TorchDispatchMode):
    """The largest tensor (bytes) any operation returns inside the block."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, tuple | list) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


class WideEmbedding(nn.Module):
    """An embedding whose individual gradients (8 × 4000 × 16 float64 = 4 MB) dwarf the
    model's own tensors (a few kB)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4000, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


def largest_tensor_of_backward(budget) -> int:
    torch.manual_seed(1)
    model = WideEmbedding().double()
    tokens, y = torch.randint(0, 4000, (8, 4)), torch.randint(0, 3, (8,))
    cockpit = Cockpit(model, [AllStatistics()], strict=True, memory_budget=budget)
    losses = nn.functional.cross_entropy(model(tokens), y, reduction="none")
    mode = LargestTensor()
    with cockpit(0, losses=losses), mode:
        losses.mean().backward()
    cockpit.close()
    return mode.largest


def test_the_largest_scratch_tensor_stays_within_the_budget():
    per_sample = 4000 * 16 * 8
    assert largest_tensor_of_backward(None) >= 8 * per_sample  # materialized at once
    budget = 2 * per_sample + 100
    assert largest_tensor_of_backward(budget) <= budget


@pytest.mark.parametrize("bad", [0, -5, 0.5, "1GB", True, [1]])
def test_a_bad_budget_is_refused(bad):
    with pytest.raises(ValueError, match="memory_budget must be a positive number of bytes"):
        Cockpit(nn.Linear(2, 2), memory_budget=bad)


def test_the_automatic_budget_on_a_cpu_is_512_mib():
    assert Cockpit(nn.Linear(2, 2)).tracker.memory_budget == 2**29
    assert Cockpit(nn.Linear(2, 2), memory_budget=None).tracker.memory_budget is None


def outputs_of(budget, configuration, micro_batches):
    torch.manual_seed(0)
    model = TiedNet().double()
    tokens = torch.randint(0, 30, (7, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, configuration, optimizer=opt, memory_budget=budget,
                      grad_accumulation=micro_batches > 1)
    for step in range(3):
        opt.zero_grad()
        for part in tokens.tensor_split(micro_batches):
            losses = token_losses(model(part), part)
            with cockpit(step, losses=losses):
                (losses.sum() / len(tokens)).backward()
        opt.step()
    cockpit.close()
    return cockpit.get_output()


def leaves(value, prefix=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{prefix}/{key}")
    else:
        yield prefix, value


@pytest.mark.parametrize(("configuration", "micro_batches"),
                         [("economy", 1), ("economy", 2), ("full", 2)])
def test_every_instrument_is_unchanged_by_chunking(configuration, micro_batches):
    """Over three steps (Alpha's projections, the gradient tests, histograms, and with two
    micro-batches the merged statistics and the kept calls)."""
    expected = outputs_of(None, configuration, micro_batches)
    recorded = outputs_of(1, configuration, micro_batches)
    for step in expected:
        assert sum(v is not None for _, v in leaves(expected[step])) > 20
    assert_same_outputs(expected, recorded)


def representations() -> dict:
    """One of each selectable representation, float64, |B| = 7."""
    from cockpit.engine.rules.conv import ConvSampleGrads, _explicit_padding
    from cockpit.engine.rules.embedding import EmbeddingSampleGrads
    from cockpit.engine.rules.sample_chunks import CallSum
    from cockpit.engine.rules.sample_grads import (
        DenseSampleGrads,
        OuterSampleGrads,
        SequenceOuterSampleGrads,
    )
    torch.manual_seed(3)
    n = 7
    conv = nn.Conv2d(2, 3, 3, padding=1, stride=2).double()
    x = torch.randn(n, 2, 6, 5, dtype=torch.float64)
    delta_conv = torch.randn_like(conv(x))

    def embedding():
        return EmbeddingSampleGrads(torch.randint(0, 6, (n, 5)),
                                    torch.randn(n, 5, 4, dtype=torch.float64), 6, None)

    def sequence():
        return SequenceOuterSampleGrads(torch.randn(n, 5, 6, dtype=torch.float64),
                                        torch.randn(n, 5, 4, dtype=torch.float64))

    return {
        "dense": DenseSampleGrads(torch.randn(n, 3, 4, dtype=torch.float64)),
        "outer": OuterSampleGrads(torch.randn(n, 3, dtype=torch.float64),
                                  torch.randn(n, 4, dtype=torch.float64)),
        "sequence": sequence(),
        "embedding": embedding(),
        "conv": ConvSampleGrads(conv, _explicit_padding(conv, x), delta_conv, scale=0.5),
        "tied": CallSum([sequence(), embedding()]),
    }


@pytest.mark.parametrize("kind", ["dense", "outer", "sequence", "embedding", "conv", "tied"])
def test_sample_chunks_answer_like_the_whole_batch(kind):
    from cockpit.engine.rules.sample_chunks import SampleChunks
    from cockpit.engine.rules.sample_grads import DenseSampleGrads
    sg = representations()[kind]
    whole = DenseSampleGrads(sg.materialize_owned().clone())
    assert sg.selectable
    for start, stop in ((0, 7), (2, 5), (6, 7)):
        torch.testing.assert_close(sg.select(start, stop).materialize(),
                                   whole.grads[start:stop], rtol=1e-12, atol=1e-14)
    chunked = SampleChunks(sg.num_samples, sg.shape, sg.dtype, sg.select, size=3)
    assert chunked.num_chunks == 3
    us = [torch.randn(sg.shape, dtype=torch.float64) for _ in range(2)]
    spec = BinSpec(-1.0, 1.0, 9)
    theta = torch.randn(sg.shape, dtype=torch.float64)
    for question in (lambda g: g.sq_norms(), lambda g: g.batch_mean(),
                     lambda g: g.gram_mean(), lambda g: g.dots(us[0]),
                     lambda g: g.dots_many(us), lambda g: g.sum_sq(),
                     lambda g: g.centered_sum_sq(), lambda g: g.histogram(spec),
                     lambda g: g.histogram2d(theta, spec, BinSpec(-2.0, 2.0, 5)),
                     lambda g: g.materialize()):
        expected = question(whole)
        torch.testing.assert_close(question(chunked).to(expected.dtype).reshape(expected.shape),
                                   expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["dense", "tied"])
def test_chunks_stack_the_directions_once(kind):
    """Several directions' dot products by sample chunks: the directions' rows are stacked
    by the first chunk and read by the others (a stack per chunk copied K·D numbers each
    time: GPT-2 124M's tied embedding in chunks of one sample), the values as by the whole."""
    from cockpit.engine.rules.sample_chunks import SampleChunks
    from tests.engine.test_host_syncs import Count
    sg = representations()[kind]
    us = [torch.randn(sg.shape, dtype=torch.float64) for _ in range(3)]
    expected = sg.dots_many(us)
    chunked = SampleChunks(sg.num_samples, sg.shape, sg.dtype, sg.select, size=2)
    assert chunked.num_chunks == 4
    with Count() as counted:
        got = chunked.dots_many(us)
    assert counted.ops["stack"] == 1
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_a_tied_output_layer_under_autocast_waits_at_its_own_width(monkeypatch):
    """Under bfloat16 autocast the tied output layer's individual gradients wait for the
    embedding's in sample chunks: its output gradient is held in bfloat16 (the width the
    layer computed in, half the memory of the float32 it is read in) and widened per chunk
    when read. Every statistic equals the one formed from the output gradient widened when
    it arrived (widening is exact), bit for bit."""
    from cockpit.engine import processing
    from cockpit.engine.rules.linear import linear_rule
    from cockpit.engine.rules.sample_chunks import CallSum
    from cockpit.engine.rules.sample_grads import SequenceOuterSampleGrads

    def autocast_run(narrow: bool):
        monkeypatch.setattr(linear_rule, "widens_when_read", narrow)
        held = []
        accumulate = processing.accumulate

        def spy(accumulated, name, sg, budget=None):
            accumulate(accumulated, name, sg, budget)
            for value in accumulated.values():
                if isinstance(value, CallSum):
                    held.extend((part._factors[0].dtype, part._read[0] is None)
                                for part in value.calls
                                if isinstance(part, SequenceOuterSampleGrads))

        monkeypatch.setattr(processing, "accumulate", spy)
        torch.manual_seed(0)
        model = TiedNet()
        tokens = torch.randint(0, 30, (7, 5))
        cockpit = Cockpit(model, [AllStatistics()], strict=True,
                          hist_bins=BinSpec(-0.5, 0.5, 16), memory_budget=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
        losses = token_losses(logits.float(), tokens)
        with cockpit(0, losses=losses):
            losses.mean().backward()
        cockpit.close()
        monkeypatch.undo()
        return cockpit.get_output()[0]["AllStatistics"], held

    narrow, held = autocast_run(True)
    wide, held_wide = autocast_run(False)
    assert held and all(item == (torch.bfloat16, True) for item in held)
    assert held_wide and all(dtype == torch.float32 for dtype, _ in held_wide)
    assert set(narrow) == set(wide) and any("emb.weight" in k for k in narrow)
    for key, value in wide.items():
        np.testing.assert_array_equal(narrow[key], value, err_msg=key)

def every_other_step_run(model, x, y, loss_fn, budget, representation):
    """Economy every 2nd step, four steps (SGD with momentum 0.9): the output, and the steps
    at which ``representation.select`` formed a sample range."""
    from cockpit import configuration
    from cockpit.schedules import every
    from tests.models import Problem, train
    selected: list[int] = []
    steps = iter(range(4))
    current = [0]

    def losses(output, target):  # (once per step)
        current[0] = next(steps)
        return loss_fn(output, target)

    original = representation.select
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cockpit = Cockpit(model, configuration("economy", every(2)), optimizer=opt,
                      memory_budget=budget)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(representation, "select", lambda self, start, stop: (
            selected.append(current[0]), original(self, start, stop))[1])
        train(Problem("every other step", model, x, y, losses), cockpit, 4, opt)
    cockpit.close()
    return cockpit.get_output(), selected


def assert_same_outputs(expected: dict, recorded: dict, rtol: float = 1e-9,
                        atol: float = 1e-12, counts_within: int | None = None) -> int:
    """Every value of every step equal (float64 rounding, or ``rtol``/``atol``), None where
    the other's is; with ``counts_within``, histogram counts (keys with "counts") apart by at
    most that many in all. Returns the number of values compared by tolerance."""
    assert expected.keys() == recorded.keys()
    compared = 0
    for step in expected:
        want, got = dict(leaves(expected[step])), dict(leaves(recorded[step]))
        assert want.keys() == got.keys()
        for key, value in want.items():
            if value is None:
                assert got[key] is None, key
            elif counts_within is not None and "counts" in key:
                difference = np.abs(np.asarray(got[key]) - np.asarray(value)).sum()
                assert difference <= counts_within, key
            else:
                np.testing.assert_allclose(np.asarray(got[key], dtype=float),
                                           np.asarray(value, dtype=float), rtol=rtol,
                                           atol=atol, equal_nan=True, err_msg=key)
                compared += 1
    return compared


def conv_run(budget):
    """A convolution whose projections go by convolution (D = C_in·k² = 72 > 4 positions)."""
    from cockpit.engine.rules.conv import ConvSampleGrads
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(16, 3)).double()
    x, y = torch.randn(8, 8, 4, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    return every_other_step_run(
        model, x, y, lambda out, target: nn.functional.cross_entropy(out, target, reduction="none"),
        budget, ConvSampleGrads)


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_projections_of_a_chunked_convolution_are_formed_whole_where_they_fit(path):
    """The convolution's 8 × 288 individual gradients (18 KiB) exceed a 4 KiB budget (one
    sample a chunk): at the tracked steps each sample is formed once, its statistics and its
    dot products (with ḡ, and with the update's directions once the gradient arrived) from
    the same chunk; at the steps after them, where Alpha only projects on s_t (by one
    convolution, 1 KiB), the whole batch is projected at once, no chunk formed. Every value
    equals the unchunked run's, on the CPU's path and on the accelerators' (histograms by
    lanes, norms read from a histogram's chunks)."""
    from cockpit.engine.histograms.device import forced
    with forced() if path == "accelerator" else contextlib.nullcontext():
        expected, whole_steps = conv_run(None)
        recorded, chunked_steps = conv_run(4096)
    assert whole_steps == []
    assert collections.Counter(chunked_steps) == {0: 8, 2: 8}  # the tracked steps, once
    assert recorded[0]["Alpha"] is not None and recorded[2]["Alpha"] is not None
    assert_same_outputs(expected, recorded)


def test_sample_chunks_project_the_whole_batch_where_its_dots_fit_the_budget():
    """A convolution projecting by convolution holds K times δ's size, not its individual
    gradients: within the budget the whole batch answers, no chunk is formed; above it, or
    where the projections materialize (two directions), the chunks answer, equally."""
    from cockpit.engine.rules.sample_chunks import SampleChunks
    from cockpit.engine.rules.sample_grads import DenseSampleGrads
    torch.manual_seed(4)
    conv = nn.Conv2d(8, 4, 3).double()
    x = torch.randn(6, 8, 4, 4, dtype=torch.float64)
    delta = torch.randn(6, 4, 2, 2, dtype=torch.float64)
    whole = DenseSampleGrads(conv_rule_weight(conv, x, delta).materialize_owned().clone())
    sg = conv_rule_weight(conv, x, delta)  # (not materialized)
    us = [torch.randn(sg.shape, dtype=torch.float64) for _ in range(2)]
    one = sg.dots_scratch_bytes(1)
    assert one == 6 * 4 * 2 * 2 * 8 < sg.scratch_bytes() == sg.dots_scratch_bytes(2)
    for budget, directions, formed in ((one, us[:1], False), (one - 1, us[:1], True),
                                       (one, us, True)):
        parts: list[int] = []

        def part(start, stop, parts=parts):
            parts.append(start)
            return sg.select(start, stop)

        chunked = SampleChunks(6, sg.shape, sg.dtype, part, size=4, whole=sg, budget=budget)
        torch.testing.assert_close(chunked.dots_many(directions),
                                   whole.dots_many(directions), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(chunked.dots(directions[0]), whole.dots(directions[0]),
                                   rtol=1e-12, atol=1e-12)
        assert bool(parts) == formed


def conv_rule_weight(conv, x, delta):
    from cockpit.engine.rules.conv import conv_rule
    return conv_rule(conv, (x,), {}, conv(x), delta)["weight"]


def tied_run(budget):
    from cockpit.engine.rules.sample_chunks import CallSum
    torch.manual_seed(0)
    tokens = torch.randint(0, 30, (7, 5))
    return every_other_step_run(TiedNet().double(), tokens, tokens, token_losses, budget,
                                CallSum)


def test_a_tied_weight_is_projected_call_by_call_on_one_direction():
    """The tied embedding's individual gradients (7 × 30 × 6 float64, 10 KiB) exceed half a
    4 KiB budget: its calls are kept apart and summed per sample chunk (one sample each) for
    the statistics, each sample once per tracked step (g_nᵀḡ from the weight's gradient,
    which is this backward's own: its dot products come from the same chunks). Where Alpha
    only projects on s_t, each call projects on its own (the output layer's δ U and the
    embedding's rows, each within the budget): no sample range is summed, and every value
    equals the unchunked run's."""
    expected, _ = tied_run(None)
    recorded, chunked_steps = tied_run(4096)
    assert collections.Counter(chunked_steps) == {0: 7, 2: 7}
    assert recorded[0]["Alpha"] is not None and recorded[2]["Alpha"] is not None
    assert_same_outputs(expected, recorded)


def test_a_call_sum_projects_one_direction_call_by_call():
    """g_nᵀu = Σ_c g_n^{(c)ᵀ}u: one direction from each call's own projection, without
    summing the calls' individual gradients; several from the sum, equally."""
    from cockpit.engine.rules.sample_chunks import CallSum
    sg = representations()["tied"]
    assert isinstance(sg, CallSum)
    whole = sg.materialize().reshape(sg.num_samples, -1)
    us = [torch.randn(sg.shape, dtype=torch.float64) for _ in range(2)]
    expected = torch.stack([whole @ u.reshape(-1) for u in us])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CallSum, "select", lambda *args: pytest.fail("summed the calls"))
        torch.testing.assert_close(sg.dots_many(us[:1]), expected[:1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sg.dots(us[1]), expected[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sg.dots_many(us), expected, rtol=1e-12, atol=1e-12)
    assert sg.dots_scratch_bytes(1) < sg.scratch_bytes() == sg.dots_scratch_bytes(2)


def test_a_call_sum_adds_an_embeddings_rows_into_another_calls_gradients():
    """A tied embedding's sum over its calls starts from the output layer's materialized
    individual gradients, whichever call came first, and adds the embedding's rows at
    their (sample, token) places: no dense zeros of the embedding's own; the sum equals the
    sum of both calls' materializations, bit for bit."""
    from cockpit.engine.rules.embedding import EmbeddingSampleGrads
    from cockpit.engine.rules.sample_chunks import CallSum
    tied = representations()["tied"]
    sequence, embedding = tied.calls
    expected = sequence.materialize() + embedding.materialize()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EmbeddingSampleGrads, "materialize",
                      lambda self: pytest.fail("materialized the embedding's calls densely"))
        for calls in ([embedding, sequence], [sequence, embedding]):
            got = CallSum(list(calls)).select(2, 6).materialize()
            assert torch.equal(got, expected[2:6])
