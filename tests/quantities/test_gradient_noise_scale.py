"""GradientNoiseScale against brute force (individual gradients by torch.func, float64), and
in expectation against the two-batch-size estimator of McCandlish et al. (2018, App. A).
Exactness under accumulation and over processes: tests/engine/test_accumulation.py and
tests/engine/test_distributed.py (tests/split_reference.py lists the instrument)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cockpit import Cockpit, quantities
from tests.models import make_problem
from tests.reference import flat, individual_gradients, rel_close


def brute_force(G: torch.Tensor) -> tuple[float, float]:
    """(tr(Σ), ‖G‖²) from individual gradients [N, D]: the sample covariance's trace with
    N − 1, and ‖ḡ‖² minus the noise it carries."""
    n = G.shape[0]
    g = G.mean(0)
    trace = (G - g).pow(2).sum().item() / (n - 1)
    return trace, g.dot(g).item() - trace / n


@pytest.mark.parametrize("name", ["mlp_relu", "cnn", "transformer"])
def test_every_step_and_the_moving_average_match_brute_force(name):
    problem = make_problem(name, 9)
    model = problem.model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    beta = 0.6
    cockpit = Cockpit(model, [quantities.GradientNoiseScale(smoothing=beta)], optimizer=opt,
                      strict=True)
    generator = torch.Generator().manual_seed(3)
    averages: dict[str, list[float]] = {}
    for step in range(3):
        index = torch.randint(0, problem.x.shape[0], (7,), generator=generator)
        x, y = problem.x[index], problem.y[index]
        grads = individual_gradients(model, problem.loss_fn, x, y)
        opt.zero_grad()
        losses = problem.loss_fn(model(x), y)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
        out = cockpit.get_output()[step]
        for key, names in [("", list(grads)), *[(f"/{k}", [k]) for k in grads]]:
            trace, signal = brute_force(flat(grads, names))
            average = averages.get(key)
            average = ([trace, signal] if average is None else
                       [beta * average[0] + (1 - beta) * trace,
                        beta * average[1] + (1 - beta) * signal])
            averages[key] = average
            for value, (t, s) in [(out[f"GradientNoiseScale{key}"], (trace, signal)),
                                  (out[f"GradientNoiseScaleEMA{key}"], average)]:
                if s > 0:
                    assert rel_close(value, t / s, 1e-8), (step, key, value, t / s)
                else:
                    assert math.isnan(value), (step, key, value)
    cockpit.close()


def test_a_step_with_non_finite_gradients_has_no_average_and_is_left_out_of_it():
    """A NaN input at step 2: GradientNoiseScaleEMA is NaN there (before: the previous
    average, a healthy-looking flat line through steps whose gradients are NaN), and step 3
    continues the average of steps 0 and 1 (brute force)."""
    problem = make_problem("mlp_sigmoid", 64)  # (‖G‖² estimated positive at each step)
    model = problem.model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    beta = 0.5
    cockpit = Cockpit(model, [quantities.GradientNoiseScale(smoothing=beta)], optimizer=opt)
    average = None
    for step in range(4):
        x, y = problem.x[16 * step: 16 * step + 16].clone(), problem.y[16 * step: 16 * step + 16]
        if step == 2:
            x[0, 0] = math.nan
        else:
            trace, signal = brute_force(flat(individual_gradients(model, problem.loss_fn, x, y),
                                             [k for k, _ in model.named_parameters()]))
            average = ((trace, signal) if average is None else
                       (beta * average[0] + (1 - beta) * trace,
                        beta * average[1] + (1 - beta) * signal))
        opt.zero_grad()
        losses = problem.loss_fn(model(x), y)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        if step == 2:
            opt.zero_grad()  # (θ stays finite: SGD skips parameters without a gradient)
        opt.step()
        out = cockpit.get_output()[step]
        if step == 2:
            assert math.isnan(out["GradientNoiseScaleEMA"])
            assert "left out" in cockpit.get_notes()[2]["GradientNoiseScaleEMA"]
        elif average[1] > 0:
            assert rel_close(out["GradientNoiseScaleEMA"], average[0] / average[1], 1e-8)
        else:
            assert math.isnan(out["GradientNoiseScaleEMA"])
    assert average[1] > 0  # (step 3 compared)
    cockpit.close()


def test_a_batch_of_one_gives_none_and_noise_hiding_the_signal_gives_nan():
    problem = make_problem("mlp_relu", 1)
    cockpit = Cockpit(problem.model, [quantities.GradientNoiseScale()], strict=True)
    losses = problem.losses()
    with cockpit(0, losses=losses):
        losses.mean().backward()
    assert cockpit.get_output()[0]["GradientNoiseScale"] is None
    assert "one sample" in cockpit.get_notes()[0]["GradientNoiseScale"]

    # two samples with opposite gradients: ḡ = 0, so the estimate of ‖G‖² is −tr(Σ)/2 < 0
    model = nn.Linear(2, 1, bias=False)
    x = torch.tensor([[1.0, 2.0], [-1.0, -2.0]])
    cockpit = Cockpit(model, [quantities.GradientNoiseScale()], strict=True)
    losses = model(x).flatten()
    with cockpit(0, losses=losses):
        losses.mean().backward()
    out = cockpit.get_output()[0]
    assert math.isnan(out["GradientNoiseScale"]) and math.isnan(out["GradientNoiseScaleEMA"])
    assert "‖G‖²" in cockpit.get_notes()[0]["GradientNoiseScale"]


def test_smoothing_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="smoothing"):
        quantities.GradientNoiseScale(smoothing=1.0)


def test_agrees_in_expectation_with_the_two_batch_size_estimator():
    """A fixed model (learning rate 0) and batches of 2b drawn with replacement from a
    population: every draw is one 'process pair' of a data-parallel run, each half a
    per-rank batch of b (B_small) and the union the global batch (B_big = 2b). The
    two-batch-size estimator (McCandlish et al., App. A)

        ‖G‖² = (B_big ‖g_big‖² − B_small ‖g_small‖²) / (B_big − B_small),
        tr(Σ) = (‖g_small‖² − ‖g_big‖²) / (1/B_small − 1/B_big),

    and Cockpit's per-sample estimates are unbiased for the same two numbers, so the moving
    averages of both (the same weights) agree with each other and with the population's
    exact tr(Σ)/‖G‖² up to sampling noise."""
    torch.manual_seed(0)
    population, b, draws, beta = 256, 8, 400, 0.995
    x = torch.randn(population, 5, dtype=torch.float64)
    y = x @ torch.randn(5, 1, dtype=torch.float64) + 0.8 * torch.randn(population, 1,
                                                                       dtype=torch.float64)
    model = nn.Linear(5, 1).double()
    with torch.no_grad():
        model.weight.fill_(0.2)

    def loss_fn(out, target):
        return (out - target).pow(2).flatten()

    everything = flat(individual_gradients(model, loss_fn, x, y))
    mean = everything.mean(0)
    exact = (everything - mean).pow(2).sum().item() / population / mean.dot(mean).item()

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cockpit = Cockpit(model, [quantities.GradientNoiseScale(smoothing=beta)], optimizer=opt,
                      strict=True)
    generator = torch.Generator().manual_seed(1)
    two_batch = [0.0, 0.0]
    for step in range(draws):
        index = torch.randint(0, population, (2 * b,), generator=generator)
        small_sq = []
        for half in (index[:b], index[b:]):
            g = everything[half].mean(0)
            small_sq.append(g.dot(g).item())
        g_big = everything[index].mean(0)
        small, big = sum(small_sq) / 2, g_big.dot(g_big).item()
        trace = (small - big) / (1 / b - 1 / (2 * b))
        signal = (2 * b * big - b * small) / (2 * b - b)
        two_batch = [beta * two_batch[0] + (1 - beta) * trace,
                     beta * two_batch[1] + (1 - beta) * signal]
        opt.zero_grad()
        losses = loss_fn(model(x[index]), y[index])
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    ours = cockpit.get_output()[draws - 1]["GradientNoiseScaleEMA"]
    theirs = two_batch[0] / two_batch[1]
    assert 0.5 * b < exact < 20 * b  # a problem where the noise scale is of the batch's order
    assert rel_close(ours, exact, 0.05), (ours, exact)
    assert rel_close(theirs, exact, 0.05), (theirs, exact)
    # a single step's ratio is far noisier than the moving average
    singles = [cockpit.get_output()[s]["GradientNoiseScale"] for s in range(draws)]
    assert max(abs(v - exact) for v in singles if math.isfinite(v)) > 0.2 * exact


BETA_DDP, SHARD, DRAWS = 0.995, 24, 400


def _noise_scale_only() -> list:
    return [quantities.GradNorm(), quantities.GradientNoiseScale(smoothing=BETA_DDP)]


def _frozen(model):
    return torch.optim.SGD(model.parameters(), lr=0.0)


def test_on_two_processes_it_agrees_with_the_two_batch_size_estimator(tmp_path):
    """DistributedDataParallel on 2 processes (gloo), a fixed model: each step, each process
    holds a shard of B_small = 24 samples and the global batch is B_big = 48. The two-batch-
    size estimator from the per-process and global batch gradients (McCandlish et al.,
    App. A) and Cockpit's global GradientNoiseScale are unbiased for the same numbers: their
    moving averages agree, and match the population's tr(Σ)/‖G‖²."""
    from tests.engine.test_distributed import _two_processes

    problem = make_problem("residual", 48)
    everything = flat(individual_gradients(problem.model, problem.loss_fn, problem.x,
                                           problem.y))
    mean = everything.mean(0)
    exact = (everything - mean).pow(2).sum().item() / len(everything) / mean.dot(mean).item()
    generator = torch.Generator().manual_seed(2)
    indices = [torch.randint(0, 48, (2 * SHARD,), generator=generator) for _ in range(DRAWS)]
    config = {"problem": "residual", "shard_sizes": [SHARD, SHARD], "micro_batches": 1,
              "make_optimizer": _frozen, "instruments": _noise_scale_only,
              "batches": [(problem.x[i], problem.y[i]) for i in indices]}
    ranks = _two_processes(tmp_path, config)

    two_batch = [0.0, 0.0]
    for step, index in enumerate(indices):
        small = sum(everything[half].mean(0).pow(2).sum().item()
                    for half in (index[:SHARD], index[SHARD:])) / 2
        g_big = everything[index].mean(0)
        big = g_big.dot(g_big).item()
        assert ranks[0]["output"][step]["GradNorm"] ** 2 == pytest.approx(big, rel=1e-9)
        trace = (small - big) / (1 / SHARD - 1 / (2 * SHARD))
        signal = (2 * SHARD * big - SHARD * small) / SHARD
        two_batch = [BETA_DDP * two_batch[0] + (1 - BETA_DDP) * trace,
                     BETA_DDP * two_batch[1] + (1 - BETA_DDP) * signal]
    theirs = two_batch[0] / two_batch[1]
    for result in ranks:
        ours = result["output"][DRAWS - 1]["GradientNoiseScaleEMA"]
        assert rel_close(ours, theirs, 0.1), (ours, theirs, exact)
        assert rel_close(ours, exact, 0.1), (ours, theirs, exact)
