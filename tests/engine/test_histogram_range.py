"""GradHist1d's default range: set once from the first tracked step's elements, exact counts.

References: the individual gradients by torch.func and their bins by rational edges
(tests/reference.py), independent of Cockpit's kernels.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from cockpit import BinSpec, Cockpit, quantities
from cockpit.engine.histograms.auto_range import (
    AUTO_RANGE_OUTSIDE,
    choose_auto_spec,
    magnitude_counts,
    regroup,
)
from tests.models import make_problem
from tests.reference import OpNames, bin_indices, flat, individual_gradients, same_histogram


def _brute(values: torch.Tensor, spec: BinSpec) -> torch.Tensor:
    finite = values[torch.isfinite(values)]
    return torch.bincount(bin_indices(finite, spec.lo, spec.hi, spec.bins), minlength=spec.bins)


def _awkward_values(dtype: torch.dtype, width: float) -> torch.Tensor:
    """Gaussian values and every edge k·width, |k| ≤ 70, with its neighbouring floats;
    zeros of both signs, subnormals, huge and non-finite values."""
    torch.manual_seed(0)
    edges = torch.arange(-70, 71, dtype=dtype) * width
    up = edges.nextafter(torch.tensor(math.inf, dtype=dtype))
    down = edges.nextafter(torch.tensor(-math.inf, dtype=dtype))
    tiny = torch.finfo(dtype).smallest_normal
    special = torch.tensor([0.0, -0.0, tiny, -tiny, tiny / 8, -tiny / 8, 1e30, -1e30,
                            math.nan, math.inf, -math.inf], dtype=dtype)
    return torch.cat([torch.randn(30_000, dtype=dtype) * 20 * width, edges, up, down, special])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("exponent", [-14, -3, 4])
def test_regrouped_magnitude_counts_equal_brute_force_at_every_edge(dtype, exponent):
    width = math.ldexp(1.0, exponent)
    x = _awkward_values(dtype, width)
    counts = magnitude_counts(list(x.split(7_001)))  # chunks add up
    for q in (exponent - 3, exponent, exponent + 2):
        spec = BinSpec(-math.ldexp(50.0, q), math.ldexp(50.0, q), 100)
        assert torch.equal(regroup(counts, spec), _brute(x, spec)), spec
    chosen = choose_auto_spec(counts.numpy())
    assert torch.equal(regroup(counts, chosen), _brute(x, chosen))


def test_float16_and_bfloat16_are_counted_exactly():
    x = _awkward_values(torch.float32, 2.0**-6)
    for dtype in (torch.float16, torch.bfloat16):
        h = x.to(dtype)
        spec = BinSpec(-50 * 2.0**-6, 50 * 2.0**-6, 100)
        assert torch.equal(regroup(magnitude_counts([h]), spec), _brute(h.double(), spec))


def test_magnitude_counts_read_nothing_from_the_device():
    """The keys of the first tracked step: no op whose output size depends on the data
    (boolean indexing, bincount, nonzero: each a wait on a GPU); the non-finite values
    go to a slot that is dropped."""
    x = _awkward_values(torch.float32, 2.0**-6)
    with OpNames() as ops:
        counts = magnitude_counts(list(x.split(7_001)))
    assert not ops.names & {"nonzero", "masked_select", "bincount", "_local_scalar_dense",
                            "index", "unique", "_unique2"}, ops.names
    assert int(counts.sum()) == int(torch.isfinite(x).sum())


@pytest.mark.parametrize("scale", [1e-7, 3e-3, 0.5, 40.0])
def test_chosen_range_holds_all_but_a_tiny_share_and_is_not_twice_too_wide(scale):
    torch.manual_seed(1)
    x = torch.cat([torch.randn(200_000) * scale, torch.zeros(50_000)])
    spec = choose_auto_spec(magnitude_counts([x]).numpy())
    inner = spec.inner
    assert inner == spec.hi * 49 / 50 and math.log2(spec.hi / 50).is_integer()
    share_beyond = float((x.abs() >= inner).double().mean())
    assert share_beyond <= AUTO_RANGE_OUTSIDE
    # half the bin width would have left more than the allowed share outside
    assert float((x.abs() >= 0.45 * inner).double().mean()) > AUTO_RANGE_OUTSIDE
    assert spec.bins == 100


def test_all_zero_elements_give_the_papers_range():
    spec = choose_auto_spec(magnitude_counts([torch.zeros(10), -torch.zeros(3)]).numpy())
    assert (spec.lo, spec.hi, spec.bins) == (-2.0, 2.0, 100)


def _run(problem, steps, micro_batches=1, **kwargs):
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.1)
    cockpit = Cockpit(problem.model, [quantities.GradHist1d()], optimizer=opt, **kwargs)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        grads.append(flat(individual_gradients(problem.model, problem.loss_fn, problem.x,
                                               problem.y)))
        for x, y in zip(problem.x.chunk(micro_batches), problem.y.chunk(micro_batches),
                        strict=True):
            losses = problem.loss_fn(problem.model(x), y)
            with cockpit(step, losses=losses):
                (losses.sum() / problem.x.shape[0]).backward()
        opt.step()
    cockpit.close()
    return cockpit.get_output(), grads


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_default_range_is_set_at_the_first_step_and_kept(name):
    problem = make_problem(name, 8)
    output, grads = _run(problem, 3)
    first = output[0]["GradHist1d"]
    edges = first["edges"]
    spec = BinSpec(float(edges[0]), float(edges[-1]), len(edges) - 1)
    chosen = choose_auto_spec(magnitude_counts([grads[0]]).numpy())
    assert (spec.lo, spec.hi, spec.bins) == (chosen.lo, chosen.hi, chosen.bins)
    for step in range(3):
        value = output[step]["GradHist1d"]
        assert np.array_equal(value["edges"], edges) and value["range"] == first["range"]
        # the reference's float64 elements differ from Cockpit's by rounding: near 0 either sign
        assert same_histogram(value["counts"], grads[step], spec.lo, spec.hi, spec.bins)
        beyond = int((grads[step].abs() >= value["range"]).sum())  # exactly the edge bins
        assert value["counts"][0] + value["counts"][-1] == beyond
    assert int((torch.as_tensor(first["counts"]) > 0).sum()) >= 20


def test_micro_batches_choose_the_same_range_and_counts_as_one_batch():
    one, _ = _run(make_problem("mlp_relu", 8), 2)
    two, _ = _run(make_problem("mlp_relu", 8), 2, micro_batches=2, grad_accumulation=True)
    for step in range(2):
        for key in ("counts", "edges"):
            assert np.array_equal(one[step]["GradHist1d"][key], two[step]["GradHist1d"][key])


def test_a_bin_spec_keeps_the_papers_fixed_range():
    output, grads = _run(make_problem("cnn", 8), 2, hist_bins=BinSpec(-2.0, 2.0, 100))
    for step in range(2):
        value = output[step]["GradHist1d"]
        assert value["edges"][0] == -2.0 and value["edges"][-1] == 2.0 and "range" not in value
        assert same_histogram(value["counts"], grads[step])


def test_range_narrows_by_nested_powers_of_two_when_the_elements_shrink():
    """The loss scaled down 200× after two steps: the range narrows by 4 per step until
    the elements fill it again; every step's counts equal brute force in its recorded
    bins, whose widths are powers of two apart (the bins nest)."""
    problem = make_problem("mlp_relu", 16)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.0)
    cockpit = Cockpit(problem.model, [quantities.GradHist1d()], optimizer=opt)
    grads = []
    for step in range(7):
        scale = 1.0 if step < 2 else 1 / 200
        loss_fn = lambda out, y, s=scale: problem.loss_fn(out, y) * s  # noqa: E731
        grads.append(flat(individual_gradients(problem.model, loss_fn, problem.x, problem.y)))
        opt.zero_grad()
        losses = loss_fn(problem.model(problem.x), problem.y)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    output = cockpit.get_output()
    widths = []
    for step in range(7):
        value = output[step]["GradHist1d"]
        edges = value["edges"]
        assert same_histogram(value["counts"], grads[step], edges[0], edges[-1], 100)
        widths.append(float(edges[1] - edges[0]))
    assert widths[0] == widths[1] == widths[2]  # the step that shrank is binned as before
    assert widths[3] == widths[2] / 4 and widths[4] == widths[3] / 4
    assert widths[-1] < widths[0] / 100
    for a, b in itertools.pairwise(widths):
        assert math.log2(a / b) in (0, 2)
    last = output[6]["GradHist1d"]
    assert int((last["counts"] > 0).sum()) >= 20
