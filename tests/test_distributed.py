"""torch.distributed: with DistributedDataParallel on 2 processes (gloo, 127.0.0.1) every
rank's instruments describe the global batch, exactly as one process on the whole batch
(tests/split_reference.py), also with uneven shards and with gradient accumulation."""

from __future__ import annotations

import pickle
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cockpit import Cockpit
from tests import ddp_worker
from tests.models import make_problem
from tests.split_reference import MISUSE, assert_same_values, whole_batch_run

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def strip(output: dict) -> dict:
    """DDP's parameter names carry the wrapper's "module." prefix."""
    return {step: {k.replace("/module.", "/"): v for k, v in values.items()}
            for step, values in output.items()}


@pytest.mark.parametrize(("name", "shard_sizes", "micro", "make_optimizer", "manual"), [
    # DDP's gradient is (w·N/2)·ḡ: g_nᵀḡ from the dots with it, no pass over kept calls
    ("mlp_relu", [12, 12], 1, sgd, False),
    ("cnn", [7, 13], 1, adam, False),  # uneven shards: DDP's mean of shard means is not uniform
    ("mlp_relu", [10, 14], 2, sgd, False),  # accumulation inside each process (no_sync)
    ("cnn", [12, 12], 1, sgd, True),  # no DDP: gradients all-reduced by hand in the block
])
def test_every_rank_reports_the_global_batch(tmp_path, name, shard_sizes, micro,
                                             make_optimizer, manual):
    problem = make_problem(name, 48)
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(STEPS):
        index = torch.randint(0, 48, (sum(shard_sizes),), generator=generator)
        batches.append((problem.x[index], problem.y[index]))
    config = {"problem": name, "batches": batches, "shard_sizes": shard_sizes,
              "micro_batches": micro, "make_optimizer": make_optimizer,
              "manual_allreduce": manual}
    mp.start_processes(ddp_worker.run, args=(2, free_port(), config, str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    ranks = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as file:
            ranks.append(pickle.load(file))
    uniform = len(set(shard_sizes)) == 1 and micro == 1
    expected, _ = whole_batch_run(make_problem(name, 48), batches, make_optimizer,
                                  gradients=None if uniform else ranks[0]["stepped"])
    for result in ranks:
        assert not [m for m in result["warnings"] if MISUSE.search(m)], result["warnings"]
        output = strip(result["output"])
        assert assert_same_values(output, expected, range(STEPS)) > 30 * STEPS
        for step in range(STEPS):
            assert output[step]["BatchSize"] == sum(shard_sizes)
            assert output[step]["HessMaxEV"] is None
        assert all(output[step]["Alpha"] is not None for step in range(STEPS - 1))
        # the shortcut for g_nᵀḡ is taken exactly where the gradient seen is ∝ the global ḡ
        assert (result["union_projections"] == 0) == uniform


def test_sharded_models_are_refused_with_the_way_out():
    class FSDPLinear(torch.nn.Linear):  # the class name fully_shard gives a module
        pass

    with pytest.raises(NotImplementedError, match="DistributedDataParallel"):
        Cockpit(torch.nn.Sequential(FSDPLinear(2, 2)))


def _statistics_with_gradient(gradient: dict, dots: dict, n: int = 4):
    from cockpit.engine.statistics import BackwardStatistics, GradientDots
    stats = BackwardStatistics(n)
    stats.gradient_dots = GradientDots(gradient, dots)
    return stats


def test_gram_from_the_synchronized_gradient_only_where_it_is_proportional():
    """g_nᵀḡ = g_nᵀG / c where G = c·ḡ to rounding; otherwise None (the caller projects)."""
    from cockpit.engine.reduction import gram_from_gradient
    generator = torch.Generator().manual_seed(0)
    g = {name: torch.randn(4, *shape, generator=generator, dtype=torch.float64)
         for name, shape in (("w", (3, 5)), ("b", (3,)))}
    mean = {name: value.mean(0) for name, value in g.items()}
    c = 24 * 0.5 / 2  # DDP with loss weight w = 0.5 on N = 24 samples, R = 2 processes
    gradient = {name: c * value for name, value in mean.items()}
    dots = {name: g[name].flatten(1) @ gradient[name].flatten() for name in g}
    gram = gram_from_gradient(_statistics_with_gradient(gradient, dots), mean)
    assert gram is not None
    for name in g:
        torch.testing.assert_close(gram[name], g[name].flatten(1) @ mean[name].flatten(),
                                   rtol=1e-12, atol=0)
    # one parameter's gradient off the line through ḡ (e.g. unequal loss weights): refused
    bent = dict(gradient, b=gradient["b"] + 1e-6 * gradient["b"].norm() * torch.tensor(
        [1.0, -1.0, 0.0], dtype=torch.float64))
    assert gram_from_gradient(_statistics_with_gradient(bent, dots), mean) is None
    # a parameter without a recorded gradient, or ḡ = 0: refused
    assert gram_from_gradient(_statistics_with_gradient({"w": gradient["w"]}, dots),
                              mean) is None
    zero = {name: torch.zeros_like(value) for name, value in mean.items()}
    assert gram_from_gradient(_statistics_with_gradient(gradient, dots), zero) is None
