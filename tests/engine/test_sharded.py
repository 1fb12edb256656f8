"""Sharded and replicated models in one process: ``fully_shard`` (FSDP2) on a process group of
one gives exactly the values of the unsharded model, and with a mixed precision policy draws
the full-precision θ in GradHist2d; FSDP1, a param_dtype that is no float, an inner
module of a sharded model and ``nn.DataParallel`` over several devices are refused with the
way out; ``nn.DataParallel`` on a CPU gives the plain model's values. (Two processes:
tests/engine/test_fsdp.py.)"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from cockpit import Cockpit, configuration, quantities
from cockpit.engine.histograms.exact import BinSpec
from cockpit.store.reader import read_meta
from tests.exit_worker import free_port
from tests.models import make_problem
from tests.split_reference import assert_same_values

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")



@pytest.fixture
def group_of_one():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def economy_run(model: nn.Module, problem, steps: int = 3, config: str = "economy",
                chosen: list | None = None) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    chosen = configuration(config) if chosen is None else chosen
    cockpit = Cockpit(model, chosen, optimizer=opt, strict=True)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        index = torch.randint(0, problem.x.shape[0], (16,), generator=generator)
        opt.zero_grad()
        losses = problem.loss_fn(model(problem.x[index]), problem.y[index])
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    return cockpit.get_output(), cockpit.get_notes()


@needs_gloo
@pytest.mark.parametrize("reshard", [True, False])
def test_fully_shard_in_one_process_equals_the_unsharded_model(group_of_one, reshard):
    from torch.distributed.fsdp import fully_shard

    problem = make_problem("mlp_relu", 48)
    expected, _ = economy_run(copy.deepcopy(problem.model), problem, chosen=every_curvature())
    model = problem.model
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    output, notes = economy_run(model, problem, chosen=every_curvature())
    assert assert_same_values(output, expected, range(3)) > 100
    for step in range(3):  # p.grad (sharded) against ḡ: one process only
        assert output[step]["GradientMismatch"] == pytest.approx(
            expected[step]["GradientMismatch"], abs=1e-12)
        # the Lanczos instruments (the whole batch's graph: one process), on the gathered
        # parameters with FSDP's hooks held: the same Hessian-vector products (HessTopEV and
        # HessDensity compared above)
        assert output[step]["HessMaxEV"] == pytest.approx(expected[step]["HessMaxEV"],
                                                          rel=1e-12)
        assert expected[step]["HessMaxEV"] > 0
        assert len(output[step]["HessTopEV"]["values"]) == 2
        assert all(output[step][k] is not None for k in ("HessTrace", "TICDiag", "TICTrace"))
        assert "computed from" in notes[step]["HessTrace"]


def every_curvature() -> list:
    """Every curvature instrument, beside the full configuration's."""
    return [*configuration("full"), quantities.TICTrace(), quantities.HessTopEV(k=2),
            quantities.HessDensity(probes=2, steps=8)]


@needs_gloo
def test_own_backward_passes_leave_fsdp_and_the_gradients_alone(group_of_one):
    """Backward passes with FSDP's hooks held, on the parameters gathered whole after
    ``reshard_after_forward=True`` freed them: repeatable (nothing resharded in between),
    the gradient of the unsharded parameters as without sharding, no ``.grad`` written;
    FSDP's state is restored also after an error, and the user's backward pass then fills
    p.grad with the gradient of the plain model."""
    from torch.distributed.fsdp import fully_shard

    from cockpit.engine import sharded

    plain = small_model()
    model = copy.deepcopy(plain)
    for layer in (model[0], model[2]):
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    plain(x).square().sum().backward()
    expected = {k: p.grad for k, p in plain.named_parameters()}

    loss = model(x).square().sum()
    params = dict(model.named_parameters())
    states = [(state, state._training_state) for state in sharded._fsdp_states(model)]
    whole = sharded.graph_parameters(model, params)
    for _ in range(2):
        with sharded.fsdp_backward_hooks_held(model):
            grads = torch.autograd.grad(loss, list(whole.values()), retain_graph=True)
        for (name, grad) in zip(whole, grads, strict=True):
            torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="inside"), sharded.fsdp_backward_hooks_held(model):
        torch.autograd.grad(loss, list(whole.values()), retain_graph=True)
        raise RuntimeError("inside")
    assert all(p.grad is None for p in params.values())
    for state, training_state in states:
        assert state._training_state == training_state
        for group in state._fsdp_param_groups:
            assert "pre_backward" not in vars(group) and "post_backward" not in vars(group)
    loss.backward()
    for name, p in params.items():
        torch.testing.assert_close(p.grad.full_tensor(), expected[name], rtol=1e-6, atol=1e-7)


@needs_gloo
def test_refused_sharded_models_name_the_way_out(group_of_one):
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard

    flat = FullyShardedDataParallel(small_model(), device_id=torch.device("cpu"))
    with pytest.raises(NotImplementedError, match=r"FSDP1.*fully_shard"):
        Cockpit(flat)
    mixed = small_model()
    fully_shard(mixed, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8))
    with pytest.raises(NotImplementedError, match=r"param_dtype torch.int8.*bfloat16"):
        Cockpit(mixed)
    model = small_model()
    fully_shard(model[0])
    fully_shard(model)
    Cockpit(model).close()
    with pytest.raises(NotImplementedError, match=r"not sharded by fully_shard.*root"):
        Cockpit(model[2])  # an inner module: its parameters belong to the root's FSDP group


def test_data_parallel_on_a_cpu_is_the_plain_model():
    problem = make_problem("mlp_relu", 48)
    expected, _ = economy_run(copy.deepcopy(problem.model), problem)
    output, _ = economy_run(nn.DataParallel(problem.model), problem)
    output = {step: {k.replace("/module.", "/"): v for k, v in values.items()}
              for step, values in output.items()}
    assert assert_same_values(output, expected, range(3)) > 100


def test_data_parallel_over_several_devices_is_refused():
    wrapped = nn.DataParallel(small_model())
    wrapped.device_ids = [0, 1]  # as over two GPUs (this machine need not have them)
    with pytest.raises(NotImplementedError, match="DistributedDataParallel"):
        Cockpit(wrapped)


@needs_gloo
def test_mixed_precision_draws_the_full_precision_parameters(group_of_one, tmp_path):
    """bfloat16 layers over float32 parameters: GradHist2d's pairs (g_n,j, θ_j) hold the θ
    the optimizer steps on (float32), not the copy rounded to bfloat16 the layers computed
    with; summed over the gradient bins (all of them: outliers are clamped) the counts are
    N times the histogram of θ. The θ bins are narrow enough that the rounded copy's
    histogram differs (checked), so the test tells the two apart."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    problem = make_problem("mlp_relu", 48, dtype=torch.float32)
    model = problem.model
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    spec_theta = BinSpec(-0.5, 0.5, 1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cockpit = Cockpit(model, [quantities.GradHist2d()], optimizer=opt, strict=True,
                      hist2d_bins=(BinSpec(-1.0, 1.0, 8), spec_theta), logdir=str(tmp_path))
    thetas, told_apart = [], 0
    for step in range(2):
        opt.zero_grad()
        losses = problem.loss_fn(model(problem.x[:16]), problem.y[:16])
        thetas.append({k: p.full_tensor().detach().clone() for k, p in model.named_parameters()})
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    output = cockpit.get_output()

    def counts(theta: torch.Tensor) -> np.ndarray:
        index = ((theta.double() - spec_theta.lo) * spec_theta.scale).floor().long()
        return 16 * np.bincount(index.clamp(0, spec_theta.bins - 1).reshape(-1).numpy(),
                                minlength=spec_theta.bins)

    for step, theta in enumerate(thetas):
        for name, value in theta.items():
            drawn = output[step][f"GradHist2d/{name}"]["counts"].sum(0)
            np.testing.assert_array_equal(drawn, counts(value), err_msg=f"{step} {name}")
            told_apart += not np.array_equal(counts(value), counts(value.bfloat16()))
    assert told_apart >= 4
    # the run log and the notes say what the values describe
    assert "param_dtype bfloat16" in read_meta(tmp_path)["mixed_precision"]
    assert "mixed precision" in cockpit.get_notes()[0]["GradHist2d"]


class AsComputed(nn.Module):
    """A layer as ``fully_shard`` with ``MixedPrecisionPolicy(bfloat16, output_dtype=float32)``
    runs it: input and θ rounded to bfloat16, the output cast to float32 after the layer."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = copy.deepcopy(layer).bfloat16()

    def forward(self, x):
        return self.layer(x.bfloat16()).float()


@needs_gloo
def test_mixed_precision_with_an_output_dtype_describes_the_layers_computation(group_of_one):
    """With ``output_dtype=float32`` Cockpit's hooks see float32 output gradients, but the
    layers backpropagate them rounded to bfloat16 (the cast's backward). The gradient tests
    equal those of individual gradients g_n = δ_n a_nᵀ/w formed in float64 from the bfloat16
    (a_n, δ_n) a plain model computing the same way hands its layers (hooks on it, no FSDP).
    Tolerance 2e-5: Cockpit sums over 16 samples and at most 42 coordinates in float32
    (relative error below 1e-6 each); unrounded δ_n are 1.6e-4 off."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tests.reference import flat, gradient_tests

    problem = make_problem("mlp_relu", 48, dtype=torch.float32)
    x, y = problem.x[:16], problem.y[:16]
    plain = nn.Sequential(*(AsComputed(m) if isinstance(m, nn.Linear) else m
                            for m in problem.model))
    recorded: dict[int, list] = {}

    def record(module, args, output):
        recorded[id(module)] = [args[0].detach()]
        output.register_hook(lambda grad: recorded[id(module)].append(grad))

    for m in plain.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(record)
    problem.loss_fn(plain(x), y).mean().backward()
    grads = {}
    for i in (0, 2, 4):
        a, delta = (t.double() for t in recorded[id(plain[i].layer)])
        delta = delta * len(x)  # δ_n = ∂ℓ_n/∂y_n (w = 1/N: exact)
        assert recorded[id(plain[i].layer)][1].dtype == torch.bfloat16
        grads[f"{i}.weight"] = torch.einsum("ni,nj->nij", delta, a)
        grads[f"{i}.bias"] = delta
    expected = gradient_tests(flat(grads))

    model = problem.model
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.InnerTest(),
                              quantities.OrthoTest()], strict=True)
    losses = problem.loss_fn(model(x), y)
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    output = cockpit.get_output()[0]
    for name, value in expected.items():
        assert output[name] == pytest.approx(value, rel=2e-5), name


@needs_gloo
def test_a_reduce_dtype_alone_leaves_the_values_exact(group_of_one):
    """``MixedPrecisionPolicy(reduce_dtype=bfloat16)``: the layers compute in the parameters'
    float32 and only FSDP's reduction of the gradient rounds, so the values of the first step
    are the unsharded model's, without a mixed precision note (except the update, made from
    the rounded gradient)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    problem = make_problem("mlp_relu", 48, dtype=torch.float32)
    expected, _ = economy_run(copy.deepcopy(problem.model), problem, steps=1)
    model = problem.model
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    output, notes = economy_run(model, problem, steps=1)
    # (the update is the optimizer's on the gradient rounded to bfloat16 by the reduction;
    # on the accelerator path the unsharded model's layers are stacked, the sharded ones
    # not: the same numbers summed in another order)
    from cockpit.engine.histograms import device

    rtol = 1e-6 if device._forced else 1e-12
    assert assert_same_values(output, expected, range(1), rtol=rtol,
                              skip={"UpdateSize", "UpdateRatio"}) > 30
    assert not any("mixed precision" in note for note in notes.get(0, {}).values())


@needs_gloo
def test_frozen_batchnorm_under_mixed_precision_says_why_it_is_refused(group_of_one):
    """batchnorm='frozen_statistics' needs the layers at their own precision: under a mixed
    precision policy of fully_shard the per-sample instruments are None with that reason
    (not one about gradient accumulation or processes, which this run has neither of)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8, track_running_stats=False),
                          nn.ReLU(), nn.Linear(8, 2))  # (bf16 running stats: torch refuses)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                      reduce_dtype=torch.float32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [quantities.NormTest()], optimizer=opt,
                      batchnorm="frozen_statistics")
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, losses=losses):
        losses.mean().backward()
    opt.step()
    cockpit.close()
    note = cockpit.get_notes()[0]["NormTest"]
    assert cockpit.get_output()[0]["NormTest"] is None
    assert "mixed precision policy" in note and "one backward pass per step" in note
