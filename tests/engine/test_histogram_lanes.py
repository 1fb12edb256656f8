"""The accelerator path's lane counts summed for every parameter at once, when the backward
pass ends (:class:`~cockpit.engine.histograms.device.LaneCounts`,
:func:`~cockpit.engine.histograms.device.sum_lanes`): each parameter's counts are exactly
those of its own values, with one block or many (a parameter beyond 2^24 values per counter:
blocks made small), over sample chunks of a memory budget and over micro-batches; adding lane counts
is the union of their values; and the lanes of all parameters cost the same few ops however
many parameters there are (they cost two per parameter when each parameter summed its own).

The model of the end-to-end tests computes exactly in float64 (dyadic inputs, weights and
targets, ReLU, a squared error summed per sample), so every path and every split of the
batch forms the same individual gradients as torch.func, bit for bit, and the counts are
compared with exact rational binning of those."""

from __future__ import annotations

import collections
import contextlib
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cockpit import Cockpit
from cockpit.engine import stacked
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.histograms import exact as hmod
from cockpit.engine.histograms.device import LaneCounts, sum_lanes
from cockpit.engine.histograms.exact import BinSpec, symmetric_fast_spec
from cockpit.quantities import GradHist1d, GradHist2d
from tests.engine.test_histogram_device import pair_counts, small_blocks
from tests.engine.test_histogram_exact import exact_counts
from tests.reference import individual_gradients

DEVICE_PY = str(Path(histogram_device.__file__).resolve())


class OpsByFunction(TorchDispatchMode):
    """aten ops, by the function of histograms/device.py that issued them."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename == DEVICE_PY]
        self.ops[frames[-1].name if frames else None] += 1
        return func(*args, **(kwargs or {}))


def second_step_ops(model: nn.Module, cockpit: Cockpit, x: torch.Tensor, y: torch.Tensor
                    ) -> OpsByFunction:
    """Two tracked steps of cross-entropy on (x, y); the second one's ops, the ``with``
    block's end included (it sums the lanes); the first forms the cached edges and lane
    offsets. Closes ``cockpit``."""
    counter = OpsByFunction()
    for step in range(2):
        model.zero_grad()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        with counter if step == 1 else contextlib.nullcontext(), cockpit(step, losses=losses):
            losses.mean().backward()
    cockpit.close()
    return counter


def lane_counts(x: torch.Tensor, spec: BinSpec) -> LaneCounts:
    counts = hmod.histogram_dense_lanes([x], spec)
    assert isinstance(counts, LaneCounts)
    return counts


def dyadic(shape, generator, scale=4) -> torch.Tensor:
    """Multiples of 1/scale in [−1, 1] (float64): every sum and product below is exact."""
    return torch.randint(-scale, scale + 1, shape, generator=generator).double() / scale


@pytest.fixture
def forced():
    with histogram_device.forced():
        yield


PADDED = {"padded": histogram_device._PAD_BYTES, "per_size": 0}


@pytest.mark.parametrize("pad_bytes", PADDED.values(), ids=PADDED.keys())
def test_sum_lanes_gives_every_value_its_own_exact_counts(pad_bytes, forced, monkeypatch):
    """Values with 1, 2, 3 and 9 tallies (blocks of 40), of two bin layouts, and a ready
    count tensor, summed with zero tallies padded or per number of tallies: every value's
    counts equal the exact counts of its own elements (int64); the non-finite elements are
    left out."""
    small_blocks(monkeypatch, (5, 8))
    monkeypatch.setattr(histogram_device, "_PAD_BYTES", pad_bytes)
    gen = torch.Generator().manual_seed(0)
    spec_a, spec_b = BinSpec(-1.0, 1.0, 8), BinSpec(-2.0, 2.0, 5)
    xs = {"one": dyadic((30,), gen), "two": dyadic((2, 40), gen),
          "three": dyadic((100,), gen), "nine": 3 * dyadic((350,), gen),
          "other": dyadic((90,), gen), "other2": dyadic((3, 5), gen)}
    xs["three"][5] = float("nan")
    xs["nine"][:3] = torch.tensor([float("inf"), -float("inf"), 1e300])
    specs = {name: spec_b if name.startswith("other") else spec_a for name in xs}
    values: dict[str, torch.Tensor | LaneCounts] = {
        name: lane_counts(x, specs[name]) for name, x in xs.items()}
    assert [len(values[n].tallies) for n in ("one", "two", "three", "nine")] == [1, 2, 3, 9]
    ready = torch.tensor([4, 0, 1, 2, 0, 0, 7, 1])
    values["ready"] = ready
    out = sum_lanes(values)
    assert list(out) == list(values) and out["ready"] is ready
    for name, x in xs.items():
        finite = x[torch.isfinite(x)]
        assert out[name].dtype == torch.int64, name
        assert torch.equal(out[name], exact_counts(finite, specs[name])), name
        assert torch.equal(values[name].counts(), out[name]), name


def test_adding_lane_counts_counts_the_union(forced):
    gen = torch.Generator().manual_seed(1)
    spec = BinSpec(-1.0, 1.0, 8)
    a, b, c = dyadic((40,), gen), dyadic((3, 9), gen), dyadic((13,), gen)
    union = exact_counts(torch.cat([a, b.reshape(-1), c]), spec)
    la, lb, lc = lane_counts(a, spec), lane_counts(b, spec), lane_counts(c, spec)
    total = la + lb + lc
    assert isinstance(total, LaneCounts) and len(total.tallies) == 3
    assert torch.equal(total.counts(), union)
    assert torch.equal(sum([la, lb, lc]).counts(), union)  # as SampleChunks sums its parts
    # with counts already summed: a tensor
    assert torch.equal(la + lb + exact_counts(c, spec), union)
    assert torch.equal(exact_counts(c, spec) + (la + lb), union)
    other = BinSpec(-2.0, 2.0, 8)  # counts add bin by bin, as tensors of counts do
    assert torch.equal((la + lane_counts(c, other)).counts(),
                       exact_counts(a, spec) + exact_counts(c, other))


@pytest.mark.parametrize("pad_bytes", PADDED.values(), ids=PADDED.keys())
@pytest.mark.parametrize("tallies", [[1], [1, 5], [1, 2, 5]])
def test_the_lane_sum_of_many_values_costs_the_ops_of_few(tallies, pad_bytes, forced,
                                                          monkeypatch):
    """3 values or 30 with the same numbers of tallies: the same ops (one stack, one strided
    sum — per number of tallies unless padded —, one cat where there are several, one
    unbind)."""
    small_blocks(monkeypatch, (5, 2))  # blocks of 10
    monkeypatch.setattr(histogram_device, "_PAD_BYTES", pad_bytes)
    spec = BinSpec(-1.0, 1.0, 8)
    gen = torch.Generator().manual_seed(2)

    def ops(copies: int) -> collections.Counter:
        values = {f"{k}/{i}": lane_counts(dyadic((10 * k,), gen), spec)
                  for i in range(copies) for k in tallies}
        with OpsByFunction() as counter:
            sum_lanes(values)
        return counter.ops

    ops(3)  # (the zero tally is made once)
    few, many = ops(3), ops(30)
    assert few == many
    groups = 1 if pad_bytes else len(tallies)
    assert sum(few.values()) == 2 + 2 * groups + (groups > 1)


class ExactNet(nn.Module):
    """Conv2d → ReLU → Linear → ReLU → Linear with dyadic weights (float64)."""

    def __init__(self, generator):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.fc1 = nn.Linear(27, 6)
        self.fc2 = nn.Linear(6, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(dyadic(p.shape, generator))
        self.double()

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(h)))


def squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out - target).pow(2).sum(1)


SPEC = BinSpec(-4.0, 4.0, 32)
SPECS_2D = (BinSpec(-4.0, 4.0, 16), BinSpec(-1.0, 1.0, 8))


def grad_hist_counts(accelerator: bool, micro_batches: int, budget: int | None,
                     monkeypatch) -> tuple[dict, dict]:
    """GradHist1d and GradHist2d per parameter of one step, and the exact counts of
    torch.func's individual gradients (and of their pairs with θ)."""
    monkeypatch.setattr(histogram_device, "_forced", accelerator)
    gen = torch.Generator().manual_seed(3)
    model = ExactNet(gen)
    x, target = dyadic((12, 2, 5, 5), gen, scale=2), dyadic((12, 4), gen)
    cockpit = Cockpit(model, [GradHist1d(), GradHist2d()], hist_bins=SPEC,
                      hist2d_bins=SPECS_2D, strict=True, memory_budget=budget,
                      grad_accumulation=micro_batches > 1)
    for xs, ts in zip(x.tensor_split(micro_batches), target.tensor_split(micro_batches),
                      strict=True):
        losses = squared_error(model(xs), ts)
        with cockpit(0, losses=losses):
            losses.sum().backward()
    cockpit.close()
    record = cockpit.get_output()[0]
    got, expected = {}, {}
    grads = individual_gradients(model, squared_error, x, target)
    for name, theta in model.named_parameters():
        got[name] = record[f"GradHist1d/{name}"]["counts"]
        expected[name] = exact_counts(grads[name], SPEC).numpy()
        got[name, "2d"] = record[f"GradHist2d/{name}"]["counts"]
        expected[name, "2d"] = pair_counts(grads[name].reshape(12, -1),
                                           theta.detach().reshape(-1), *SPECS_2D).numpy()
    return got, expected


@pytest.mark.parametrize(("micro_batches", "blocks", "budget"), [
    (1, None, None), (3, None, None), (1, (37, 1), None), (3, (37, 1), None),
    (1, (2, 16), None), (1, None, 4000), (3, (37, 1), 4000), (1, None, 900)])
def test_grad_hist_counts_are_exact_however_the_batch_and_the_values_are_split(
        micro_batches, blocks, budget, monkeypatch, one_thread):
    """One batch of 12 or 3 micro-batches of 4; one block per parameter or blocks of 37 or
    32 values (every parameter several, of different numbers: the stand-in for parameters
    beyond 2^24 individual-gradient elements per counter); whole layers or sample chunks
    and blocks of a 4000- or 900-byte memory budget: every parameter's counts (GradHist1d,
    GradHist2d) equal the exact ones."""
    small_blocks(monkeypatch, blocks)
    got, expected = grad_hist_counts(True, micro_batches, budget, monkeypatch)
    for name, counts in expected.items():
        assert got[name].dtype == counts.dtype and (got[name] == counts).all(), name
        assert int(counts.sum()) > 0 and int(counts.max()) < int(counts.sum())


def test_the_cpu_path_gives_the_same_exact_counts(monkeypatch, one_thread):
    got, expected = grad_hist_counts(False, 3, None, monkeypatch)
    for name, counts in expected.items():
        assert (got[name] == counts).all(), name


def test_a_steps_lane_sum_ops_do_not_grow_with_the_parameters(forced, monkeypatch,
                                                              one_thread):
    """GradHist1d and GradHist2d of MLPs with 2 and 8 Linear layers: the ops that sum lanes
    into counts (strided sums of the tallies) are the same few in a tracked step, not two
    per parameter and histogram (the weights one by one: stacked, their GradHist1d counts
    are summed when counted, :mod:`cockpit.engine.stacked`)."""
    monkeypatch.setattr(stacked, "capacity", lambda sg, budget: 0)

    def lane_sum_ops(depth: int) -> int:
        torch.manual_seed(0)
        layers = [nn.Linear(8, 8) for _ in range(depth)]
        model = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())])
        cockpit = Cockpit(model, [GradHist1d(), GradHist2d()],
                          hist_bins=BinSpec(-1.0, 1.0, 16), strict=True)
        x, y = torch.randn(16, 8), torch.randint(0, 8, (16,))
        counter = second_step_ops(model, cockpit, x, y)
        assert cockpit.get_output()[1]["GradHist1d"]["counts"].sum() == 16 * depth * 72
        # GradHist1d's (add, histc) per weight; the biases' side by side (one histc)
        assert counter.ops["tally"] == 2 * depth
        return counter.ops["sum_lanes"] + counter.ops["finite_counts"]

    assert lane_sum_ops(2) == lane_sum_ops(8) <= 2 * 4



@pytest.mark.parametrize(("budget", "blocks"), [(None, 1), (2**27, 2)])
def test_a_linear_layer_beyond_2_24_products_in_the_blocks_its_budget_allows(
        budget, blocks, monkeypatch, one_thread):
    """GradHist1d of a Linear layer whose |B| = 128 individual gradients have 128·512·288
    (> 2^24) float32 elements: without a memory limit in one block (the views of δ and a,
    one mul, search, add and histc), within 128 MiB in two blocks of rows of every sample
    (one split of δ's view, none of a's), their lanes summed in three ops (four: the
    blocks' tallies stacked); the bias side by side (one search, one histc:
    :mod:`cockpit.engine.side_by_side`); the counts equal the CPU path's."""

    def run(accelerator: bool) -> tuple[dict, collections.Counter]:
        monkeypatch.setattr(histogram_device, "_forced", accelerator)
        torch.manual_seed(0)
        model = nn.Linear(288, 512)
        x, y = torch.randn(128, 288), torch.randint(0, 512, (128,))
        cockpit = Cockpit(model, [GradHist1d()], hist_bins=symmetric_fast_spec(0.01),
                          strict=True, memory_budget=budget)
        counter = second_step_ops(model, cockpit, x, y)
        return cockpit.get_output()[1]["GradHist1d"], counter.ops

    accelerator, ops = run(True)
    expected, _ = run(False)
    assert torch.equal(torch.as_tensor(accelerator["counts"]),
                       torch.as_tensor(expected["counts"]))
    assert int(torch.as_tensor(expected["counts"]).sum()) > 2**23
    products = {"_sample_blocks": 2, "_products": 1} if blocks == 1 else {"_products": 5}
    searched = blocks + 1
    assert {k: v for k, v in ops.items() if k is not None} == {
        **products, "bin_index": searched, "tally": 2 * blocks,
        "sum_lanes": 3 if blocks == 1 else 4}  # (two blocks' tallies are stacked first)


def test_grad_hists_counts_of_rows_of_one_matrix_are_the_matrix():
    """GradHist1d/2d read the counts of every parameter as one tensor: the lane sums' matrix
    itself where the counts are its rows in order (no op), else their stack."""
    from cockpit.quantities.grad_hist import _counts

    matrix = torch.arange(12).reshape(4, 3).clone()
    rows = dict(zip("abcd", matrix.unbind(0), strict=True))
    with OpsByFunction() as counter:
        assert _counts(rows) is matrix
    assert not counter.ops
    shuffled = {k: rows[k] for k in "bacd"}
    assert torch.equal(_counts(shuffled), matrix[[1, 0, 2, 3]])
    assert torch.equal(_counts(dict(list(rows.items())[:3])), matrix[:3])
    separate = {k: v.clone() for k, v in rows.items()}
    assert torch.equal(_counts(separate), matrix)


def test_a_failed_lane_sum_is_recorded_and_training_goes_on(forced, monkeypatch):
    """Summing the lanes fails at the end of the backward pass (say, out of memory): the
    histogram is reported as not computed, with the reason, and the gradient is the
    plain backward pass' own."""
    from cockpit.engine.statistics.hist1d import Hist1d

    def fail(self, values):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(Hist1d, "finish", fail)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    nn.functional.cross_entropy(model(x), y).backward()
    plain = model.weight.grad.clone()
    model.zero_grad()
    cockpit = Cockpit(model, [GradHist1d()], hist_bins=SPEC)
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with pytest.warns(RuntimeWarning, match="GradHist1d not computed"):
        with cockpit(0, losses=losses):
            losses.mean().backward()
        cockpit.close()
    assert cockpit.get_output()[0]["GradHist1d"] is None
    assert "out of memory" in cockpit.get_notes()[0]["GradHist1d"]
    assert torch.equal(model.weight.grad, plain)
