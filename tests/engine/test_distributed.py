"""torch.distributed: with DistributedDataParallel on 2 processes (gloo, 127.0.0.1) every
rank's instruments describe the global batch, exactly as one process on the whole batch
(tests/split_reference.py), also with uneven shards and with gradient accumulation."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cockpit import Cockpit, quantities
from tests.engine import ddp_worker
from tests.exit_worker import free_port
from tests.models import make_problem
from tests.split_reference import (
    MISUSE,
    adam,
    assert_same_eigenvalues,
    assert_same_values,
    dense_top_eigenvalues,
    instruments,
    sgd,
    whole_batch_run,
    with_top_eigenvalues,
)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

STEPS = 3


def strip(output: dict) -> dict:
    """DDP's parameter names carry the wrapper's "module." prefix."""
    return {step: {k.replace("/module.", "/"): v for k, v in values.items()}
            for step, values in output.items()}


def _two_processes(tmp_path, config: dict) -> list[dict]:
    mp.start_processes(ddp_worker.run, args=(2, free_port(), config, str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    ranks = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as file:
            ranks.append(pickle.load(file))
    return ranks


def _config(name: str, shard_sizes: list[int], seed: int = 5, **extra) -> dict:
    """A 2-process run of ``STEPS`` steps on batches drawn from the problem's data."""
    problem = make_problem(name, 48)
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(STEPS):
        index = torch.randint(0, 48, (sum(shard_sizes),), generator=generator)
        batches.append((problem.x[index], problem.y[index]))
    return {"problem": name, "batches": batches, "shard_sizes": shard_sizes,
            "micro_batches": 1, "make_optimizer": sgd, **extra}


def exact_hessian_diagonal() -> list:
    return instruments("diag_hessian")


@pytest.mark.parametrize(("name", "shard_sizes", "micro", "make_optimizer", "by_hand", "chosen"), [
    # DDP's gradient is (w·N/2)·ḡ: g_nᵀḡ from the dots with it, no pass over kept calls;
    # static_graph: the curvature's own backward passes at step 0 leave DDP's delayed
    # all-reduce to the user's (it ran in theirs, and the processes stepped apart); the
    # exact Hessian diagonal passes DDP's identity on the outputs
    ("mlp_relu", [12, 12], 1, sgd, "static_graph", exact_hessian_diagonal),
    # uneven shards: DDP's mean of shard means is not uniform; H_B v = Σ_r (N_r/N) H_r v
    # (HessTopEV and HessDensity too)
    ("cnn", [7, 13], 1, adam, None, with_top_eigenvalues),
    ("mlp_relu", [10, 14], 2, sgd, None, instruments),  # accumulation in each process (no_sync)
    # no DDP: gradients all-reduced by hand in the block
    ("cnn", [12, 12], 1, sgd, "inside", instruments),
])
def test_every_rank_reports_the_global_batch(tmp_path, name, shard_sizes, micro,
                                             make_optimizer, by_hand, chosen):
    static = by_hand == "static_graph"
    config = _config(name, shard_sizes, seed=3, micro_batches=micro,
                     make_optimizer=make_optimizer, allreduce_by_hand=None if static else by_hand,
                     instruments=chosen, ddp_kwargs={"static_graph": static})
    batches = config["batches"]
    ranks = _two_processes(tmp_path, config)
    uniform = len(set(shard_sizes)) == 1 and micro == 1
    expected, _ = whole_batch_run(
        make_problem(name, 48), batches, make_optimizer,
        gradients=None if uniform else ranks[0]["stepped"], chosen=chosen())
    dense = dense_top_eigenvalues(make_problem(name, 48), *batches[0], k=2)
    for result in ranks:
        assert not [m for m in result["warnings"] if MISUSE.search(m)], result["warnings"]
        output = strip(result["output"])
        assert assert_same_values(output, expected, range(STEPS)) > 30 * STEPS
        for step in range(STEPS):
            assert output[step]["BatchSize"] == sum(shard_sizes)
            assert_same_eigenvalues(output, result["notes"], expected, step,
                                    dense if step == 0 else None, micro)
        if chosen is with_top_eigenvalues:  # (HessDensity: compared with the others above)
            assert all(output[step]["HessDensity"] is not None for step in range(STEPS))
        # every rank ran the same iteration: the same value from the same products
        for step in range(STEPS):
            assert output[step]["HessMaxEV"] == ranks[0]["output"][step]["HessMaxEV"]
            assert result["notes"][step]["HessMaxEV"] == ranks[0]["notes"][step]["HessMaxEV"]
        assert all(output[step]["Alpha"] is not None for step in range(STEPS - 1))
        # the shortcut for g_nᵀḡ is taken exactly where the gradient seen is ∝ the global ḡ
        assert (result["union_projections"] == 0) == uniform


def gradient_tests_and_curvature() -> list:
    return [quantities.Loss(), quantities.GradNorm(), quantities.NormTest(),
            quantities.InnerTest(), quantities.Alpha(), quantities.HessMaxEV()]


def test_processes_splitting_their_batches_differently_and_an_empty_shard_go_on(tmp_path):
    """Rank 0 splits its shard in two micro-batches, rank 1 does not, with no
    grad_accumulation hint; at the last step rank 1's shard is empty. Every process learns
    the accumulation at once (their collectives stay the same: before, a gloo mismatch
    killed both), the step after equals one backward pass on the global batch, and the
    steps a process cannot describe are None on every process with the reason."""
    chosen = gradient_tests_and_curvature
    config = _config("mlp_relu", [6, 6], seed=3, micro_batches_per_rank=[2, 1],
                     grad_accumulation=False, instruments=chosen,
                     shard_sizes_per_step={2: [12, 0]})
    batches = config["batches"]
    ranks = _two_processes(tmp_path, config)
    expected, _ = whole_batch_run(make_problem("mlp_relu", 48), batches, sgd,
                                  gradients=ranks[0]["stepped"], chosen=chosen())
    for result in ranks:
        output, notes = strip(result["output"]), result["notes"]
        assert output[0]["InnerTest"] is None and "second backward pass" in notes[0]["InnerTest"]
        assert output[1]["NormTest"] == pytest.approx(expected[1]["NormTest"], rel=1e-6)
        assert output[1]["InnerTest"] == pytest.approx(expected[1]["InnerTest"], rel=1e-6)
        assert output[1]["HessMaxEV"] is None  # (micro-batches: no whole-batch graph)
        assert output[2]["NormTest"] is None and notes[2]["NormTest"]


def histograms() -> list:
    return [quantities.GradHist1d(), quantities.GradHist2d()]


def test_the_accelerator_paths_histograms_count_the_global_batch(tmp_path):
    """GradHist1d and GradHist2d on the accelerator path (each backward pass' lane counts
    summed when it ends, added over micro-batches, all-reduced over the ranks), uneven
    shards with 2 micro-batches each: every rank reports the whole batch's counts. Each
    process' samples take one head of two (DDP with ``find_unused_parameters``): the other
    head's individual gradients, 0, are counted as in one process whose samples pick their
    head per sample."""
    problem = make_problem("routed", 48)  # samples 0–23 take head a, 24–47 head b
    generator = torch.Generator().manual_seed(3)
    batches = [(problem.x[index], problem.y[index]) for index in (
        torch.cat([torch.randint(0, 24, (10,), generator=generator),
                   torch.randint(24, 48, (14,), generator=generator)]) for _ in range(STEPS))]
    config = _config("routed", [10, 14], micro_batches=2, instruments=histograms,
                     accelerator_path=True, batches=batches,
                     ddp_kwargs={"find_unused_parameters": True})
    ranks = _two_processes(tmp_path, config)
    expected, _ = whole_batch_run(make_problem("routed", 48), batches, sgd,
                                  gradients=ranks[0]["stepped"], chosen=histograms())
    parameters = len(list(problem.model.parameters()))
    for result in ranks:
        output = strip(result["output"])
        assert sum(key.startswith("GradHist") for step in range(STEPS)
                   for key in output[step]) == 2 * STEPS * (1 + parameters)
        assert assert_same_values(output, expected, range(STEPS)) >= 2 * STEPS * (
            1 + parameters)


@pytest.mark.parametrize("make_optimizer", [sgd, adam])
def test_a_branch_only_one_process_takes_gives_the_global_batch(tmp_path, make_optimizer):
    """DDP with ``find_unused_parameters``, each process's samples taking one head of two:
    every instrument equals one process on the whole batch. Alpha predicted the update of
    the head a process did not reach nowhere: with SGD the processes then took different
    paths at the next step (gloo aborted both), with Adam the writing process recorded a
    wrong α and the other a KeyError. The update of a parameter this process did not reach
    is predicted from the synchronized gradient, as on the other process."""
    problem = make_problem("routed", 48)  # samples 0–23 take head a, 24–47 head b
    generator = torch.Generator().manual_seed(5)
    batches = [(problem.x[index], problem.y[index]) for index in (
        torch.cat([torch.randint(0, 24, (12,), generator=generator),
                   torch.randint(24, 48, (12,), generator=generator)]) for _ in range(STEPS))]
    config = _config("routed", [12, 12], batches=batches, make_optimizer=make_optimizer,
                     ddp_kwargs={"find_unused_parameters": True})
    ranks = _two_processes(tmp_path, config)
    # (the reference steps on DDP's gradient: Adam turns the rounding of another summation
    # into different updates of the heads' near-zero entries)
    expected, _ = whole_batch_run(make_problem("routed", 48), batches, make_optimizer,
                                  gradients=ranks[0]["stepped"])
    for result in ranks:
        output = strip(result["output"])
        assert assert_same_values(output, expected, range(STEPS)) > 30 * STEPS
        assert all(output[step]["Alpha"] is not None for step in range(STEPS - 1))


def test_stacked_linear_weights_report_the_global_batch(tmp_path):
    """On the accelerator path the three hidden Linear weights of one shape are formed
    stacked (their statistics together, their dot products once their gradients arrived),
    and so are the three LayerNorms (one normalization of their inputs), uneven shards
    under Adam: every rank's values equal one process on the whole batch."""
    config = _config("mlp_deep", [10, 14], seed=3, make_optimizer=adam,
                     accelerator_path=True)
    ranks = _two_processes(tmp_path, config)
    expected, _ = whole_batch_run(make_problem("mlp_deep", 48), config["batches"], adam,
                                  gradients=ranks[0]["stepped"], chosen=instruments())
    for result in ranks:
        assert not [m for m in result["warnings"] if MISUSE.search(m)], result["warnings"]
        output = strip(result["output"])
        assert assert_same_values(output, expected, range(STEPS)) > 30 * STEPS
        assert all(output[step]["Alpha"] is not None for step in range(STEPS - 1))


def test_gradients_all_reduced_after_the_block_give_the_global_batch(tmp_path):
    """Against the advice, the gradients are averaged after the ``with`` block: at the
    optimizer step every process holds the global gradient, so the values are the global
    batch's. Alpha's update predicted inside the block (from the unsynchronized gradient)
    misses the real one at the first step: None there with the reason, then the general path,
    exact."""
    config = _config("mlp_relu", [12, 12], allreduce_by_hand="after")
    ranks = _two_processes(tmp_path, config)
    expected, _ = whole_batch_run(make_problem("mlp_relu", 48), config["batches"], sgd)
    for result in ranks:
        assert not [m for m in result["warnings"] if "different gradients" in m]
        output = result["output"]
        assert assert_same_values(output, expected, range(STEPS), skip={"Alpha"}) > 30 * STEPS
        assert output[0]["Alpha"] is None
        assert "all-reduced after it" in result["notes"][0]["Alpha"]
        assert assert_same_values(output, expected, range(1, STEPS)) > 30 * (STEPS - 1)


def test_processes_stepping_apart_get_no_global_values(tmp_path):
    """Each process trains its own copy on its own shards (a process group, but no
    synchronization): the combined statistics would describe a batch no optimizer steps on.
    The batch instruments are None with the reason and the way out; the process's own
    Distance and UpdateSize are recorded."""
    config = _config("mlp_relu", [12, 12], allreduce_by_hand="never")
    for result in _two_processes(tmp_path, config):
        said = [m for m in result["warnings"] if "different gradients" in m]
        assert len(said) == 1 and "distributed=False" in said[0]
        for step in range(STEPS):
            values, notes = result["output"][step], result["notes"][step]
            for name in ("Loss", "GradNorm", "NormTest", "InnerTest", "GradHist1d", "Alpha",
                         "HessTrace", "TICDiag", "HessMaxEV"):
                assert values[name] is None, (step, name)
                assert "different gradients" in notes[name]
            assert "BatchSize" not in values
            for name in ("Distance", "UpdateSize", "ParamNorm", "UpdateRatio"):  # its own
                assert values[name] is not None, (step, name)


def test_ddp_join_with_uneven_inputs_goes_on_without_global_values(tmp_path):
    """DistributedDataParallel's join() with 3 batches on rank 0 and 2 on rank 1: the rank
    that still trains would wait for ever (gloo: abort) in Cockpit's all-reduces, which the
    joined rank does not answer. While join() is active each process watches its own
    steps: the batch instruments are None with the reason and the way out (a process
    cannot tell whether the others still train, and its own values would be one shard's);
    the parameters' instruments are those of the update DDP made."""
    config = _config("mlp_relu", [12, 12], join=True, steps_per_rank=[3, 2])
    ranks = _two_processes(tmp_path, config)
    own = [quantities.Distance(), quantities.UpdateSize(), quantities.ParamNorm(),
           quantities.UpdateRatio()]
    for rank, result in enumerate(ranks):
        output, notes = strip(result["output"]), result["notes"]
        steps = [3, 2][rank]
        assert sorted(output) == list(range(steps))
        for step in range(steps):
            for name in ("Loss", "GradNorm", "NormTest", "InnerTest", "GradHist1d", "Alpha",
                         "HessTrace", "HessMaxEV", "GradientNoiseScale"):
                assert output[step][name] is None, (rank, step, name)
                assert "join()" in notes[step][name] and "drop_last=True" in notes[step][name]
            assert "BatchSize" not in output[step]
        expected, _ = whole_batch_run(make_problem("mlp_relu", 48), config["batches"][:steps],
                                      sgd, gradients=result["stepped"], chosen=own)
        assert assert_same_values(output, expected, range(steps),
                                  skip={"BatchSize", "GradientHeld"}) >= 4 * steps


def test_distributed_false_watches_each_process_alone(tmp_path):
    """Cockpit(..., distributed=False): every process's values are those of a single
    process training on its own shards (its own reference run), and every process writes."""
    shard_sizes = [10, 14]
    config = _config("mlp_relu", shard_sizes, allreduce_by_hand="never",
                     cockpit_kwargs={"distributed": False})
    ranks = _two_processes(tmp_path, config)
    for rank, result in enumerate(ranks):
        part = ddp_worker.shards(sum(shard_sizes), shard_sizes, rank)
        own = [(x[part], y[part]) for x, y in config["batches"]]
        expected, _ = whole_batch_run(make_problem("mlp_relu", 48), own, sgd)
        output = result["output"]
        assert not [m for m in result["warnings"] if "different gradients" in m]
        assert assert_same_values(output, expected, range(STEPS)) > 30 * STEPS
        assert all(output[step]["BatchSize"] == shard_sizes[rank] for step in range(STEPS))
    # the two processes' values differ (their shards do)
    assert ranks[0]["output"][0]["Loss"] != ranks[1]["output"][0]["Loss"]


def test_cockpit_on_rank_0_only_watches_its_own_batch_instead_of_hanging(tmp_path):
    """Cockpit created on rank 0 only (a common `if rank == 0:` habit): its all-reduces
    would never be answered and rank 0 would wait for ever. It waits a moment for the other
    processes' Cockpits, then describes its own batch, exactly, with one warning."""
    shard_sizes = [10, 14]
    config = _config("mlp_relu", shard_sizes, cockpit_ranks=[0], attach_timeout=2.0)
    ranks = _two_processes(tmp_path, config)  # returns: no process hung
    assert ranks[1]["output"] is None
    said = [m for m in ranks[0]["warnings"] if "only some of the 2 processes" in m]
    assert len(said) == 1
    part = ddp_worker.shards(sum(shard_sizes), shard_sizes, 0)
    own = [(x[part], y[part]) for x, y in config["batches"]]
    # DDP steps on the global gradient: the reference steps on what rank 0 stepped on
    expected, _ = whole_batch_run(make_problem("mlp_relu", 48), own, sgd,
                                  gradients=ranks[0]["stepped"])
    output = strip(ranks[0]["output"])
    # Alpha predicted rank 0's own SGD step; DDP stepped on the global gradient: None at the
    # first step with the reason, the general path (exact) from then on
    assert output[0]["Alpha"] is None and ranks[0]["notes"][0]["Alpha"]
    assert assert_same_values(output, expected, range(STEPS), skip={"Alpha"}) > 30 * STEPS
    assert assert_same_values(output, expected, range(1, STEPS)) > 30 * (STEPS - 1)
    assert all(output[step]["BatchSize"] == shard_sizes[0] for step in range(STEPS))


def test_distributed_takes_none_or_false():
    with pytest.raises(ValueError, match="distributed must be None"):
        Cockpit(torch.nn.Linear(2, 2), distributed=True)


def _statistics_with_gradient(gradient: dict, dots: dict, n: int = 4):
    from cockpit.engine.statistics import BackwardStatistics, GradientDots
    stats = BackwardStatistics(n)
    stats.gradient_dots = GradientDots(gradient, dots)
    return stats


def test_gram_from_the_synchronized_gradient_only_where_it_is_proportional():
    """g_nᵀḡ = g_nᵀG / c where G = c·ḡ to rounding; otherwise None (the caller projects)."""
    from cockpit.engine.reduction.step_reduction import gram_from_gradient
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


def test_layers_formed_in_sample_chunks_report_the_global_batch(tmp_path):
    """A memory budget so small that both convolutions form their individual gradients in
    chunks of 3 of a rank's 12 samples (statistics and dot products in one pass over the
    chunks): every rank's values equal those of one process on the whole batch."""
    config = _config("cnn", [12, 12], seed=3, cockpit_kwargs={"memory_budget": 2048})
    ranks = _two_processes(tmp_path, config)
    expected, _ = whole_batch_run(make_problem("cnn", 48), config["batches"], sgd,
                                  chosen=instruments())
    for result in ranks:
        assert not [m for m in result["warnings"] if MISUSE.search(m)], result["warnings"]
        assert "sample chunks" in str(result["notes"][0])
        output = strip(result["output"])
        assert assert_same_values(output, expected, range(STEPS)) > 30 * STEPS
        assert all(output[step]["Alpha"] is not None for step in range(STEPS - 1))
