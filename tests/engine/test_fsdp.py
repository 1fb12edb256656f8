"""A model sharded by ``fully_shard`` (FSDP2) on 2 processes (gloo, 127.0.0.1): every rank's
instruments describe the global batch, exactly as one process on the whole batch
(tests/split_reference.py), with parameters resharded after the forward pass or not, with
gradient accumulation and with the torch.func fallback, the curvature instruments included
(their own backward passes on the gathered parameters, FSDP's hooks held); and the optimizer
steps on the gradients of a plain loop."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.engine import fsdp_worker
from tests.exit_worker import free_port
from tests.models import make_problem
from tests.split_reference import (
    MISUSE,
    adam,
    assert_same_eigenvalues,
    assert_same_values,
    dense_top_eigenvalues,
    sgd,
    whole_batch_run,
)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

STEPS = 3


def two_processes(tmp_path, config: dict, world: int = 2, worker=fsdp_worker.run) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    mp.start_processes(worker, args=(world, free_port(), config, str(tmp_path)),
                       nprocs=world, join=True, start_method="spawn")
    ranks = []
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as file:
            ranks.append(pickle.load(file))
    return ranks


def make_config(name: str, shard_sizes: list[int], **extra) -> dict:
    problem = make_problem(name, 48)
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(STEPS):
        index = torch.randint(0, 48, (sum(shard_sizes),), generator=generator)
        batches.append((problem.x[index], problem.y[index]))
    return {"problem": name, "batches": batches, "shard_sizes": shard_sizes,
            "make_optimizer": sgd, **extra}


def plain_gradients(name: str, config: dict) -> list[dict[str, torch.Tensor]]:
    """The gradients FSDP's optimizer must step on, from a plain loop in one process without
    Cockpit: the mean over ranks of each rank's mean gradient over its shard."""
    problem = make_problem(name, 48)
    model = problem.model
    opt = config["make_optimizer"](model)
    sizes = config["shard_sizes"]
    out = []
    for x, y in config["batches"]:
        opt.zero_grad()
        for rank in range(len(sizes)):
            part = fsdp_worker.shards(len(x), sizes, rank)
            losses = problem.loss_fn(model(x[part]), y[part])
            (losses.mean() / len(sizes)).backward()
        out.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
    return out


@pytest.mark.parametrize(("name", "shard_sizes", "micro", "make_optimizer", "reshard", "config"), [
    # the curvature instruments' own backward passes (the exact Hessian diagonal of "auto")
    # on the unsharded parameters, gathered again before the backward pass
    ("mlp_relu", [12, 12], 1, sgd, False, "business"),
    # Hessian-vector products (Hutchinson: every rank draws the whole-batch run's probes,
    # so v ⊙ H_B v = Σ_r (N_r/N) v ⊙ H_r v is exact; HessMaxEV: H_B v all-reduced per
    # product) on the parameters gathered again, uneven shards
    ("cnn", [10, 14], 1, sgd, True, "instruments:hutchinson"),
    # uneven shards (FSDP averages the shard means) with 2 micro-batches per step and the
    # parameters kept whole between forward and backward; GradHist2d reads all of θ
    ("cnn", [10, 14], 2, adam, False, "full"),
    # accumulation with the parameters gathered again for the backward pass: the layers are
    # processed inside it, GradHist2d on the unsharded parameters
    ("mlp_relu", [12, 12], 2, sgd, True, "full"),
    # attention: the torch.func fallback on the gathered parameters after the backward pass
    ("transformer", [12, 12], 1, sgd, True, "economy"),
])
def test_every_rank_reports_the_global_batch(tmp_path, name, shard_sizes, micro,
                                             make_optimizer, reshard, config):
    config = make_config(name, shard_sizes, micro_batches=micro, configuration=config,
                         make_optimizer=make_optimizer, reshard_after_forward=reshard)
    ranks = two_processes(tmp_path, config)
    plain = plain_gradients(name, config)
    uniform = len(set(shard_sizes)) == 1 and micro == 1
    expected, _ = whole_batch_run(make_problem(name, 48), config["batches"], make_optimizer,
                                  gradients=None if uniform else ranks[0]["stepped"],
                                  chosen=fsdp_worker.chosen_instruments(config["configuration"]))
    # a stochastic estimate's standard error comes from its replicates in one process only
    # (as under DistributedDataParallel; the note says so)
    expected = {step: {k: v for k, v in values.items() if not k.endswith(".stderr")}
                for step, values in expected.items()}
    # the key bias of attention has individual gradients that are zero up to rounding: their
    # signs, and so their histogram bins, depend on the order of summation
    skip = {"GradHist1d"} if name == "transformer" else set()
    dense = (dense_top_eigenvalues(make_problem(name, 48), *config["batches"][0], k=2)
             if micro == 1 and "HessMaxEV" in expected[0] else None)
    for result in ranks:
        assert not [m for m in result["warnings"] if MISUSE.search(m)], result["warnings"]
        output, notes = result["output"], result["notes"]
        assert assert_same_values(output, expected, range(STEPS), skip=skip) > 50 * STEPS
        for step in range(STEPS):
            assert output[step]["BatchSize"] == sum(shard_sizes)
            if config["configuration"] != "economy":  # compared above, and not left out
                for curvature in ("HessTrace", "TICDiag"):
                    assert output[step][curvature] is not None, (step, curvature, notes[step])
                    assert "computed from" in notes[step][curvature]
                    if "hutchinson" in config["configuration"]:
                        assert "no standard error across processes" in notes[step][curvature]
            if "HessMaxEV" in expected[step]:  # over the processes, one all-reduce per product
                assert_same_eigenvalues(output, notes, expected, step,
                                        dense if step == 0 else None, micro)
                assert notes[step]["HessMaxEV"] == ranks[0]["notes"][step]["HessMaxEV"]
                assert output[step]["HessMaxEV"] == ranks[0]["output"][step]["HessMaxEV"]
        assert all(output[step]["Alpha"] is not None for step in range(STEPS - 1))
        # the optimizer stepped on the gradients of the plain loop: Cockpit (the curvature
        # refused included) left them alone
        for step, grads in enumerate(result["stepped"]):
            for key, grad in grads.items():
                torch.testing.assert_close(grad, plain[step][key], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("name", "config", "param_dtype", "output_dtype", "loss_scale"), [
    ("mlp_relu", "economy", torch.bfloat16, None, None),
    # convolutions, GradHist2d, the curvature; float16, outputs cast to float32 after each
    # layer
    ("cnn", "full", torch.float16, torch.float32, None),
    # attention: the torch.func fallback (on the rounded values, in float32), embeddings
    ("transformer", "economy", torch.bfloat16, None, None),
    # float16 with a torch.amp.GradScaler (the loss scaled by 2^10, the gradients unscaled
    # by scaler.step): the curvature and the per-sample values do not see the scale, and
    # the loop steps as without Cockpit
    ("cnn", "business", torch.float16, None, 2.0 ** 10),
])
def test_mixed_precision_equals_one_process_on_the_whole_batch(tmp_path, name, config,
                                                               param_dtype, output_dtype,
                                                               loss_scale):
    """``MixedPrecisionPolicy(param_dtype=bfloat16 or float16, reduce_dtype=float32)`` on
    float32 parameters: the layers compute in param_dtype, and the instruments describe that
    computation (docs/conventions.md, "Mixed precision under fully_shard"). The reference
    is the same policy on one process over the whole batch, stepping on the gradients the
    2-process run stepped on (their half-precision rounding depends on the split; the
    optimizer's θ then agree exactly).

    Tolerance: each g_n is formed from the layer's own rounded (a_n, δ_n), the same numbers
    on both runs (a row of a matrix product does not depend on the other rows; the loss
    weights 1/12 per rank and 1/24 differ by a power of 2, so w·∂ℓ_n/∂y_n rounds alike —
    with other shard sizes δ_n differs by the rounding to param_dtype, which the values then
    inherit: it is part of the computation), and products of two half-precision numbers are
    exact in float32 (layers without a closed form are evaluated in float32 at the rounded
    values: no sample's result depends on the batch). Only sums over samples differ in
    order: ḡ is summed in float32 (relative error ≤ N·u·Σ|g_n|/|Σ g_n|, u = 2⁻²⁴, N = 24:
    1.4e-6 times that condition), everything after in float64; norms of θ and of the update
    are float32 sums over coordinates, local shards first. A relative 1e-4 leaves a factor
    70 for the condition of the sums. The instruments that subtract nearly equal quantities
    get an absolute bound from the magnitudes they subtract: GradientNoiseScale's
    |G|² = (B‖ḡ_B‖² − b‖ḡ_b‖²)/(B − b) estimate (B/b ≤ 24 times ‖ḡ‖²/|G|² larger),
    the gradient tests' variances (relative to the mean of the terms they average):
    1e-4 on the terms, i.e. 1e-4·(|value| + the terms' scale, here the value itself or 1).
    The diagonal curvature (cnn) backpropagates each sample's factor columns through the
    layers' half-precision computation alike on both runs and sums the squares in float32:
    the same bound."""
    policy = {"param_dtype": param_dtype, "reduce_dtype": torch.float32,
              "output_dtype": output_dtype}
    shard_sizes = [12, 12]
    run = make_config(name, shard_sizes, configuration=config, dtype=torch.float32,
                      mixed_precision=policy,
                      **({} if loss_scale is None else {"grad_scaler": loss_scale}))
    ranks = two_processes(tmp_path / "two", run)
    reference = two_processes(tmp_path / "one", dict(run, shard_sizes=[sum(shard_sizes)],
                                                     gradients=ranks[0]["stepped"]), world=1)
    expected = reference[0]["output"]
    skip = {"GradientNoiseScale", "GradientNoiseScaleEMA"}
    for result in ranks:
        assert not [m for m in result["warnings"] if MISUSE.search(m)], result["warnings"]
        output = result["output"]
        assert assert_same_values(output, expected, range(STEPS), rtol=1e-4, skip=skip) > 40
        for step in range(STEPS):
            for key, value in expected[step].items():
                if key.startswith("GradientNoiseScale") and value is not None:
                    got = output[step][key]
                    if math.isnan(value):
                        assert math.isnan(got), (step, key, got)
                        continue
                    scale = max(abs(value), 1.0)  # B/b·‖ḡ‖²/|G|² is the value's own scale
                    assert abs(got - value) <= 1e-4 * scale * 24, (step, key)
            # the values say what they describe
            if step < STEPS - 1:  # Alpha's general path: g_nᵀs from the kept bf16 calls
                assert output[step]["Alpha"] is not None
            if config != "economy":  # the curvature is computed (and compared above)
                for curvature in ("HessTrace", "TICDiag"):
                    assert output[step][curvature] is not None, (step, curvature)
                    assert expected[step][curvature] is not None, (step, curvature)
            note = result["notes"][step]["NormTest"]
            assert "mixed precision" in note and f"param_dtype {str(param_dtype)[6:]}" in note
    for result in ranks if loss_scale is not None else ():  # Cockpit changed nothing in training
        assert len(result["plain_stepped"]) == STEPS
        for grads, plain in zip(result["stepped"], result["plain_stepped"], strict=True):
            for key, grad in grads.items():
                torch.testing.assert_close(grad, plain[key], rtol=0, atol=0)
    # the optimizer stepped on FSDP's float32 reduction of the half-precision gradients:
    # the same on both ranks, and a multiple of Cockpit's ḡ up to that rounding only
    for step in range(STEPS):
        for key, grad in ranks[0]["stepped"][step].items():
            torch.testing.assert_close(grad, ranks[1]["stepped"][step][key], rtol=0, atol=0)
        mismatch = expected[step]["GradientMismatch"]  # (one process: p.grad against ḡ)
        half_eps = torch.finfo(param_dtype).eps
        assert 0.0 < mismatch <= half_eps ** 2, (step, mismatch)


def test_distance_continues_after_a_resume(tmp_path):
    """θ_0 is sharded like θ: each rank's ``cockpit.state_dict()`` holds its own slice. A run
    resumed from it (``resume=True``, the saved state loaded on each rank; or a whole θ_0,
    sliced on loading) continues Distance = ‖θ_t − θ_0‖ as measured from the whole tensors;
    another rank's state, which holds another slice, is refused instead of giving a plausible
    wrong distance. The state loads with ``weights_only=True`` (plain tensors)."""
    config = make_config("mlp_relu", [12, 12])
    config["batches"] = config["batches"] + make_config("mlp_relu", [12, 12])["batches"][:1]
    ranks = two_processes(tmp_path, config, worker=fsdp_worker.run_resumed)
    for rank, result in enumerate(ranks):
        assert result["refused"] is not None and "rank" in result["refused"], result["refused"]
        output = result["output"]
        assert sorted(output) == [0, 1, 2, 3]  # steps 0-1 read back from the run log
        for step, expected in enumerate(result["distances"]):
            assert expected["0.weight"] > 0 or step == 0
            for name, value in expected.items():
                assert output[step][f"Distance/{name}"] == pytest.approx(value, rel=1e-9,
                                                                         abs=1e-12), (rank, step)


def test_a_non_finite_batch_on_one_rank_stops_no_rank(tmp_path):
    """A non-finite batch on rank 1 alone at step 1, with the curvature instruments: the
    parameters are gathered for their backward passes by the engine, where every rank passes
    alike, so no rank waits for a collective another skips; the step's values are NaN with
    the reason on every rank (and stay so: the optimizer stepped on NaN)."""
    config = make_config("cnn", [12, 12], configuration="full", poisoned=(1, 1))
    ranks = two_processes(tmp_path, config)
    for result in ranks:
        output, notes = result["output"], result["notes"]
        assert output[0]["HessTrace"] == ranks[0]["output"][0]["HessTrace"] > 0
        # λ_max: the processes agree on the losses' finiteness before any product
        assert output[0]["HessMaxEV"] == ranks[0]["output"][0]["HessMaxEV"] > 0
        for step in (1, 2):
            for name in ("Loss", "HessTrace", "TICDiag", "HessMaxEV"):
                assert math.isnan(output[step][name]), (step, name)
            for name in ("HessTrace", "HessMaxEV"):
                assert "non-finite loss" in notes[step][name], (step, name)
