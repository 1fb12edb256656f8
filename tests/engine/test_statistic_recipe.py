"""A per-sample statistic added as one file of cockpit.engine.statistics (``l1_norms``,
‖g_n‖₁ per parameter) reaches an instrument that names it in ``needs``: exact against
torch.func individual gradients (float64) in one backward pass, merged over micro-batches
and gathered over two processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cockpit import Cockpit
from cockpit.engine.statistics import REGISTRY, BackwardStatistics, Combine, Merge, register
from cockpit.quantities import Quantity
from tests.models import make_problem
from tests.reference import individual_gradients


class L1Norms(Quantity):
    """‖g_n‖₁ of every sample, per parameter (test only)."""

    needs = frozenset({"l1_norms"})

    def compute(self, data):
        return {"L1Norms": {name: value.double().cpu().numpy()
                            for name, value in data.stats["l1_norms"].items()}}


def l1_instruments() -> list:
    return [L1Norms()]


def reference_l1(problem, x, y) -> dict[str, np.ndarray]:
    """Σ_j |g_{n,j}| from torch.func's individual gradients, float64."""
    grads = individual_gradients(problem.model, problem.loss_fn, x, y)
    return {name: g.reshape(g.shape[0], -1).abs().sum(1).numpy() for name, g in grads.items()}


def assert_matches(recorded: dict, expected: dict) -> None:
    assert set(recorded) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(recorded[name], value, rtol=1e-12, atol=1e-14)


def test_the_statistic_is_registered_with_its_rules():
    statistic = REGISTRY["l1_norms"]
    assert (statistic.merge, statistic.combine) == (Merge.CONCAT, Combine.GATHER)
    with pytest.raises(KeyError, match="not a registered per-sample statistic"):
        BackwardStatistics(3)["l1_norm"]
    # registered outside the package, the engine would never form it for the instruments
    with pytest.raises(RuntimeError, match="add its module to the cockpit"):
        register(type(statistic)())


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_one_backward_pass_gives_every_samples_l1_norm(name):
    """cnn: Conv2d (materialized) and Linear (‖δ_n‖₁‖a_n‖₁); transformer: Linear layers on
    sequences, embeddings and norms (materialized chunks shared with other statistics)."""
    problem = make_problem(name, 11)
    model = problem.model
    expected = reference_l1(problem, problem.x, problem.y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [L1Norms()], optimizer=opt, strict=True)
    losses = problem.loss_fn(model(problem.x), problem.y)
    with cockpit(0, losses=losses):
        losses.mean().backward()
    opt.step()
    cockpit.close()
    assert_matches(cockpit.get_output()[0]["L1Norms"], expected)


def test_micro_batches_concatenate_their_samples():
    """Two micro-batches of unequal size (gradient accumulation) give the whole batch's
    per-sample values in batch order."""
    problem = make_problem("cnn", 12)
    model = problem.model
    expected = reference_l1(problem, problem.x, problem.y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [L1Norms()], optimizer=opt, strict=True, grad_accumulation=True)
    for part in (slice(0, 5), slice(5, 12)):
        losses = problem.loss_fn(model(problem.x[part]), problem.y[part])
        with cockpit(0, losses=losses):
            (losses.sum() / 12).backward()
    opt.step()
    cockpit.close()
    assert_matches(cockpit.get_output()[0]["L1Norms"], expected)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_two_processes_gather_every_samples_l1_norm(tmp_path):
    """DistributedDataParallel on 2 processes, uneven shards, 2 micro-batches each: every
    rank reports the global batch's values in rank order."""
    from tests.engine.test_distributed import _two_processes, sgd

    problem = make_problem("cnn", 48)
    x, y = problem.x[:12], problem.y[:12]
    expected = reference_l1(problem, x, y)
    config = {"problem": "cnn", "batches": [(x, y)], "shard_sizes": [5, 7],
              "micro_batches": 2, "make_optimizer": sgd, "instruments": l1_instruments}
    for result in _two_processes(tmp_path, config):
        recorded = result["output"][0]["L1Norms"]
        assert_matches({k.removeprefix("module."): v for k, v in recorded.items()}, expected)
