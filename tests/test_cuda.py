"""Cockpit on a CUDA device (marker ``cuda``; skipped without one): every instrument of
``configuration("full")`` equals the CPU's in float64; the diagonal curvature's batched
backpropagations (the default on CUDA) equal the CPU's one-by-one loop; float16 autocast
with a GradScaler and bfloat16 autocast agree with float32; DistributedDataParallel with NCCL
gives the whole batch's values where two GPUs are present."""

from __future__ import annotations

import math
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, configuration, quantities
from cockpit.benchmark.problems.paper_models import cifar10_3c3d
from tests.engine.test_layer_notes import MaskedMix
from tests.exit_worker import free_port
from tests.models import RoutedNet
from tests.quantities.test_alpha import predicted_steps

DEVICE = "cuda"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def batches(steps: int, n: int, classes: int = 10, seed: int = 1) -> list[tuple]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, 32, 32, generator=generator),
             torch.randint(0, classes, (n,), generator=generator)) for _ in range(steps)]


def train(device: str, dtype, qs, data, make_model=cifar10_3c3d, seed: int = 0,
          autocast=None, scaler=None, make_optimizer=None) -> tuple[dict, dict]:
    torch.manual_seed(seed)
    model = make_model().to(device, dtype)
    opt = (torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
           if make_optimizer is None else make_optimizer(model.parameters()))
    cockpit = Cockpit(model, qs, optimizer=opt, grad_scaler=scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, (x, y) in enumerate(data):
            x, y = x.to(device, dtype), y.to(device)
            opt.zero_grad()
            with torch.autocast(DEVICE, dtype=autocast or torch.float16,
                                enabled=autocast is not None):
                out = model(x)
            losses = F.cross_entropy(out.float() if autocast else out, y, reduction="none")
            with cockpit(step, losses=losses):
                loss = losses.mean()
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        cockpit.close()
    return cockpit.get_output(), cockpit.get_notes()


def compare(got: dict, want: dict, rtol: float, max_count_diff: int = 0) -> int:
    """Every value of ``want`` equals ``got``'s: floats to ``rtol`` (NaN and None alike),
    histogram counts up to ``max_count_diff`` elements that rounding may move across an
    edge. Returns the number of values compared."""
    compared = 0
    for step, values in want.items():
        for name, value in values.items():
            other = got[step].get(name, "missing")
            where = f"step {step} {name}"
            if value is None or other is None:
                assert value is None and other is None, (where, other, value)
            elif isinstance(value, dict):
                for key, array in value.items():
                    a, b = np.asarray(other[key], float), np.asarray(array, float)
                    if key == "counts":
                        assert a.sum() == b.sum(), where
                        assert np.abs(a - b).sum() <= max_count_diff, where
                    else:
                        np.testing.assert_allclose(a, b, rtol=rtol, err_msg=where)
            elif isinstance(value, float) and math.isnan(value):
                assert math.isnan(other), (where, other)
            else:
                # λ_max stops once its own error is below tol = 1e-3: rounding that moves the
                # stop by one Lanczos step moves the value within that accuracy
                rel = max(rtol, 2e-3) if name.startswith("HessMaxEV") else rtol
                assert other == pytest.approx(value, rel=rel, abs=1e-300), (where, other, value)
            compared += 1
    return compared


def test_full_configuration_on_cuda_equals_the_cpu_in_float64():
    data = batches(3, 16)
    cpu, _ = train("cpu", torch.float64, configuration("full"), data)
    cuda, _ = train(DEVICE, torch.float64, configuration("full"), data)
    names = {name.split("/")[0] for values in cpu.values() for name in values}
    assert {"Loss", "GradNorm", "Alpha", "GradHist1d", "NormTest", "InnerTest", "OrthoTest",
            "HessTrace", "TICDiag", "HessMaxEV", "GradHist2d", "Distance",
            "UpdateSize"} <= names
    assert compare(cuda, cpu, rtol=1e-9, max_count_diff=4) > 100


def test_distance_from_theta0_in_pinned_host_memory_equals_the_cpu(monkeypatch):
    """A θ_0 above ``HOST_ABOVE`` waits in the host's pinned memory (here: any size) and is
    copied to the device where Distance is formed, without a host sync: the economy values
    equal the CPU's in float64."""
    from cockpit.engine import initial_parameters

    monkeypatch.setattr(initial_parameters, "HOST_ABOVE", 0)
    torch.manual_seed(0)
    params = dict(cifar10_3c3d().to(DEVICE).named_parameters())
    held = initial_parameters.snapshot(params)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in held.values())
    data = batches(3, 16)
    cpu, _ = train("cpu", torch.float64, configuration("economy"), data)
    cuda, _ = train(DEVICE, torch.float64, configuration("economy"), data)
    # the copy and the differences wait for nothing
    model = cifar10_3c3d().to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    cockpit = Cockpit(model, [quantities.Distance()], optimizer=opt)
    x, y = data[0][0].to(DEVICE), data[0][1].to(DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            with cockpit(0, losses=losses):
                losses.mean().backward()
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cockpit.close()
    waits = [f"{w.filename}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)]
    assert not [w for w in waits if "initial_parameters" in w or "distance" in w], waits
    assert any(name.startswith("Distance/") for name in cuda[2])
    assert compare(cuda, cpu, rtol=1e-9, max_count_diff=4) > 50


@pytest.mark.parametrize("fused", [False, True])
def test_alpha_with_adamw_on_cuda_equals_the_cpu_on_the_predicted_path(fused, monkeypatch):
    """AdamW's update on CUDA is predicted by the fused kernel (a ``fused=True`` optimizer's
    own; the others' at a few units in the last place), with step counts made on the device:
    α equals the CPU's in float64, every step on the predicted path."""
    provided = predicted_steps(monkeypatch)

    def make_optimizer(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=fused)

    data = batches(4, 16)
    cpu, _ = train("cpu", torch.float64, [quantities.Alpha()], data,
                   make_optimizer=make_optimizer)
    provided.clear()
    cuda, _ = train(DEVICE, torch.float64, [quantities.Alpha()], data,
                    make_optimizer=make_optimizer)
    assert provided == [0, 1, 2, 3]
    assert all(cpu[s]["Alpha"] is not None for s in range(3))
    assert compare(cuda, cpu, rtol=1e-7) >= 3


def small_cnn(classes: int = 100) -> nn.Module:
    """Convolutions, max-pooling and a many-class head: batched exact GGN on CUDA."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4),
                         nn.Conv2d(8, 8, 3, stride=2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 3 * 3, classes))


@pytest.mark.parametrize("curvature", ["diag_ggn_exact", "diag_ggn_mc", "hutchinson"])
def test_batched_curvature_on_cuda_equals_the_cpu_loop(curvature):
    """On CUDA the C = 100 backpropagations (or M samples) run batched; on the CPU one by
    one. Same values in float64 (the random draws come from a CPU generator)."""
    def qs():
        return [quantities.HessTrace(curvature=curvature, mc_samples=4),
                quantities.TICDiag(curvature=curvature, mc_samples=4)]

    data = batches(2, 12, classes=100)
    cpu, _ = train("cpu", torch.float64, qs(), data, make_model=small_cnn)
    cuda, _ = train(DEVICE, torch.float64, qs(), data, make_model=small_cnn)
    assert compare(cuda, cpu, rtol=1e-9) >= 4


def test_auto_uses_the_mc_ggn_for_many_classes_on_cuda():
    cuda, notes = train(DEVICE, torch.float32, [quantities.HessTrace()], batches(1, 32, 100),
                        make_model=small_cnn)
    assert "Monte-Carlo" in notes[0]["HessTrace"]
    assert math.isfinite(cuda[0]["HessTrace"]) and cuda[0]["HessTrace.stderr"] > 0


@pytest.mark.parametrize("kernel", [False, True])
def test_stacked_linear_weights_on_cuda_equal_the_cpu(kernel, monkeypatch):
    """Six Linear weights of one shape on sequences, economy with AdamW: formed as one
    stack on CUDA (one at a time on the CPU), the same values in float64; with the one-pass
    kernel (its threshold lowered) the six stacked layers' histograms counted in one launch
    and the head's weight (side by side, alone) in another, at each step after the first
    (the first counts magnitudes for GradHist1d's automatic range)."""
    from cockpit.engine import stacked
    from cockpit.engine.histograms import fused
    from tests.engine.test_stacked import Tokens

    launches, stacks = [], []
    if kernel:
        if not fused.available(torch.zeros(1, device=DEVICE), fused.MIN_VALUES):
            pytest.skip("the one-pass kernel needs Triton")
        monkeypatch.setattr(fused, "MIN_VALUES", 1)
        real_rows = fused.tally_rows
        monkeypatch.setattr(fused, "tally_rows",
                            lambda *args: launches.append(args[0].shape) or real_rows(*args))
    real_init = stacked.StackedGrads.__init__
    monkeypatch.setattr(stacked.StackedGrads, "__init__",
                        lambda self, grads: stacks.append(len(grads)) or real_init(self, grads))
    generator = torch.Generator().manual_seed(2)
    data = [(torch.randn(16, 5, 6, generator=generator),
             torch.randint(0, 3, (16,), generator=generator)) for _ in range(4)]

    def run(device: str) -> dict:
        return train(device, torch.float64, configuration("economy"), data,
                     make_model=lambda: Tokens(6),
                     make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))[0]

    cpu = run("cpu")
    assert stacks == []
    cuda = run(DEVICE)
    assert stacks == [6] * 4
    if kernel:  # 16 samples: 6 layers of 6 × 6, the head of 3 × 6
        assert sorted(launches) == [torch.Size([1, 16 * 18])] * 3 + [torch.Size([6, 16 * 36])] * 3
    assert compare(cuda, cpu, rtol=1e-9, max_count_diff=4) > 40


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_products_equal_the_exact_products_summed(dtype, monkeypatch):
    """Half-precision factors' batched product with a float32 result (this torch's op): the
    products are exact and summed in float32, so it equals the float64 product of the same
    numbers to float32's rounding, the scale c as α too; a stack of Linear layers under
    bfloat16 autocast formed so equals the path that widens the factors first, tracked every
    step and every other (lone layers projecting through G at the step after)."""
    from cockpit.engine import narrow_products
    from cockpit.engine.rules import sample_grads
    from tests.engine.test_narrow_products import assert_close_outputs, autocast_outputs

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, 256, generator=generator).to(dtype).to(DEVICE)
    y = torch.randn(6, 256, 30, generator=generator).to(dtype).to(DEVICE)
    if not narrow_products.available(x, y, torch.float32):
        pytest.skip("this torch has no half-precision product with a float32 result")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    exact = torch.bmm(x.double(), y.double())
    for c in (1.0, 1 / 0.3):
        got = narrow_products.wide_products(x, y, c)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), c * exact, rtol=1e-5, atol=1e-5)
    narrow, sizes = autocast_outputs("economy", monkeypatch, DEVICE)
    # every other step, lone layers' dot products through G (the step after a tracked one)
    monkeypatch.setattr(sample_grads, "_G_ROUTE", 1)
    narrow_after, _ = autocast_outputs("economy", monkeypatch, DEVICE, every_k=2,
                                       head_on_positions=True)
    monkeypatch.setattr(narrow_products, "_runs", lambda device_type: (False, False))
    wide, _ = autocast_outputs("economy", monkeypatch, DEVICE)
    wide_after, _ = autocast_outputs("economy", monkeypatch, DEVICE, every_k=2,
                                     head_on_positions=True)
    assert sizes and all(size == 6 for size in sizes)
    assert_close_outputs(wide, narrow)
    assert_close_outputs(wide_after, narrow_after)


def test_the_stacks_dot_product_kernel_equals_the_products_and_sums(monkeypatch):
    """Six Linear layers of one shape under bfloat16 autocast (G in float32), economy with
    AdamW: the stack's dot products by one launch of the kernel at every step (its
    threshold lowered) give the values of the products and sums."""
    from cockpit.engine import row_dots
    from tests.engine.test_narrow_products import assert_close_outputs, autocast_outputs

    if not row_dots.available(torch.zeros(1, 1, row_dots.MIN_VALUES, device=DEVICE), 3):
        pytest.skip("the kernel needs Triton")
    launches: list = []
    real = row_dots.row_dots
    monkeypatch.setattr(row_dots, "row_dots",
                        lambda g, u: launches.append(u.shape) or real(g, u))
    monkeypatch.setattr(row_dots, "MIN_VALUES", 1)
    with_kernel, sizes = autocast_outputs("economy", monkeypatch, DEVICE)
    assert len(launches) == len(sizes) == 3 and row_dots.SWITCH.broken is None
    assert all(shape[0] == 6 for shape in launches)
    monkeypatch.setattr(row_dots, "MIN_VALUES", 2**62)
    without, _ = autocast_outputs("economy", monkeypatch, DEVICE)
    assert_close_outputs(without, with_kernel)


def test_chunks_dot_products_by_the_kernel_equal_the_products(monkeypatch):
    """Individual gradients materialized in chunks (a large embedding under the memory
    budget): their dot products with one direction and with several by the kernel, one
    launch per chunk; it and cuBLAS's products within float32's rounding of float64 sums."""
    from cockpit.engine import row_dots
    from cockpit.engine.rules.sample_grads import DenseSampleGrads

    generator = torch.Generator().manual_seed(4)
    sg = DenseSampleGrads(torch.randn(6, 400, 300, generator=generator).to(DEVICE))
    us = [torch.randn(400, 300, generator=generator).to(DEVICE) for _ in range(3)]
    if not row_dots.available(torch.zeros(1, 1, row_dots.MIN_VALUES, device=DEVICE), 3):
        pytest.skip("the kernel needs Triton")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    want_many, want_one = sg.dots_many(us), sg.dots(us[0])
    launches: list = []
    real = row_dots.row_dots
    monkeypatch.setattr(row_dots, "row_dots", lambda g, u: launches.append(1) or real(g, u))
    monkeypatch.setattr(row_dots, "MIN_VALUES", 1)
    got_many, got_one = sg.dots_many(us), sg.dots(us[0])
    assert len(launches) == 2 and row_dots.SWITCH.broken is None
    rows = sg.grads.double().reshape(6, -1)
    directions = torch.stack([u.double().reshape(-1) for u in us])
    exact, scale = directions @ rows.T, directions.abs() @ rows.abs().T  # [K, N]
    for got, want, k in ((got_many, want_many, 3), (got_one, want_one, 1)):
        assert got.shape == want.shape
        for value in (got, want):  # both within float32's rounding of the float64 sums
            error = (value.double().reshape(k, -1) - exact[:k]).abs()
            assert (error <= 1e-5 * scale[:k]).all()


def _many_tensors() -> nn.Module:
    """18 Linear layers: 36 parameter tensors (the kernel over many tensors takes them)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 64), nn.Tanh(),
                         *[m for _ in range(16) for m in (nn.Linear(64, 64), nn.Tanh())],
                         nn.Linear(64, 10))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_tensor_sums_kernel_equals_float64_and_the_blocks(dtype, monkeypatch):
    """The kernel's sums over many tensors against float64 sums of the same numbers; a
    tracked step whose norms, Distance, gradient check and update check take it (launches
    counted) equals one that takes the blocks."""
    from cockpit.engine import tensor_sums
    from tests.engine.test_memory_budget import assert_same_outputs

    generator = torch.Generator().manual_seed(0)
    sizes = [1, tensor_sums.CHUNK + 3, 3 * tensor_sums.CHUNK - 1] + [77] * 40
    xs = [torch.randn(n, generator=generator).to(dtype).to(DEVICE) for n in sizes]
    ys = [torch.randn(n, generator=generator).to(dtype).to(DEVICE) for n in sizes]
    if not tensor_sums.available(xs, ys):
        pytest.skip("the kernel needs Triton")
    x64, y64 = [x.double() for x in xs], [y.double() for y in ys]
    c = torch.tensor(0.7, dtype=dtype, device=DEVICE)
    want = torch.stack([(x - float(c) * y).square().sum() for x, y in zip(x64, y64, strict=True)])
    torch.testing.assert_close(tensor_sums.sq_norms_of_differences(xs, ys, c), want,
                               rtol=1e-6, atol=0)
    pairs = torch.stack([torch.stack([x.square().sum(), y.square().sum(), x.dot(y)])
                         for x, y in zip(x64, y64, strict=True)]).T
    torch.testing.assert_close(tensor_sums.pair_sums(xs, ys), pairs, rtol=1e-6, atol=1e-5)
    if dtype != torch.float32:
        return
    launches: list = []
    real = tensor_sums._sums
    monkeypatch.setattr(tensor_sums, "_sums",
                        lambda *args: launches.append(args[3]) or real(*args))
    data = batches(3, 32)

    def run(kernel: bool) -> dict:
        monkeypatch.setenv("COCKPIT_TENSOR_SUMS", "1" if kernel else "0")
        qs = [*configuration("economy"), quantities.ParamNorm()]
        return train(DEVICE, torch.float32, qs, data, _many_tensors,
                     make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))[0]

    with_kernel = run(kernel=True)
    assert len(set(launches)) == 3 and tensor_sums.SWITCH.broken is None
    without = run(kernel=False)
    assert assert_same_outputs(without, with_kernel, rtol=1e-5, atol=1e-9) > 50


ECONOMY_VALUES = ("Loss", "GradNorm", "NormTest", "InnerTest", "OrthoTest", "Alpha",
                  "Distance", "UpdateSize")


@pytest.mark.parametrize("precision", ["fp16_grad_scaler", "bf16"])
def test_mixed_precision_agrees_with_float32(precision):
    """float16 autocast with a GradScaler (loss scaled by 2^16, passed to Cockpit) and
    bfloat16 autocast give the float32 values to half-precision accuracy."""
    data = batches(4, 32)
    reference, _ = train(DEVICE, torch.float32, configuration("economy"), data)
    if precision == "bf16":
        got, notes = train(DEVICE, torch.float32, configuration("economy"), data,
                           autocast=torch.bfloat16)
    else:
        scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**16)
        got, notes = train(DEVICE, torch.float32, configuration("economy"), data,
                           autocast=torch.float16, scaler=scaler)
    compared = 0
    for step in range(3):
        for name in ECONOMY_VALUES:
            want, value = reference[step].get(name), got[step].get(name)
            if want is None:
                continue
            assert value is not None, (step, name, notes.get(step))
            # α is a ratio of differences of losses and slopes: half precision moves it
            # by a few hundredths (measured 0.03 with float16 on a CPU)
            tolerance = {"abs": 0.1} if name == "Alpha" else {"rel": 5e-2, "abs": 1e-6}
            assert value == pytest.approx(want, **tolerance), (step, name, value, want)
            compared += 1
    assert compared >= 20
    counts = np.asarray(got[0]["GradHist1d"]["counts"])
    assert counts.sum() == np.asarray(reference[0]["GradHist1d"]["counts"]).sum()



class UnitRows(nn.Module):
    """W = V / ‖V‖ row by row (plain operations: PyTorch's weight_norm has a wrong second
    derivative, which the curvature instruments refuse)."""

    def forward(self, v):
        return v / v.norm(dim=1, keepdim=True)


class ComputedAndShared(nn.Module):
    """A parametrized Linear (its weight computed from a parameter: the reparametrized
    rule's vmap'd products), a user's own attention layer whose causal mask [T, T] has
    T = |B| (the general rule tells it from batched inputs by running the layer on the
    device's random number generator) and two heads (:class:`~tests.models.RoutedNet`'s)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        nn.utils.parametrize.register_parametrization(self.inp, "weight", UnitRows())
        self.mix = MaskedMix(6)
        self.routed = RoutedNet(d_in=6)

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.mix(torch.tanh(self.inp(x)), mask).mean(1)
        return self.routed(torch.cat([x[:, :, :1].mean(1), h[:, 1:]], 1))


def computed_and_shared_run(device: str) -> tuple[dict, dict]:
    """Two steps of two micro-batches of 4 samples (T = 4) in float64, the first taking
    one head, the second the other."""
    torch.manual_seed(0)
    model = ComputedAndShared().to(device, torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    chosen = [quantities.GradNorm(), quantities.NormTest(), quantities.InnerTest(),
              quantities.GradientNoiseScale(), quantities.GradHist1d(),
              quantities.GradHist2d(), quantities.HessTrace(curvature="diag_ggn_exact"),
              quantities.Alpha()]
    cockpit = Cockpit(model, chosen, optimizer=opt, strict=True, grad_accumulation=True)
    generator = torch.Generator().manual_seed(2)
    for step in range(2):
        x = torch.randn(8, 4, 5, generator=generator, dtype=torch.float64)
        x[:, :, 0] = torch.where(torch.arange(8) < 4, 1.0, -1.0)[:, None] * x[:, :, 0].abs()
        y = torch.randint(0, 3, (8,), generator=generator)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        for part in (slice(0, 4), slice(4, 8)):
            losses = F.cross_entropy(model(x[part]), y[part], reduction="none")
            with cockpit(step, losses=losses):
                (losses.sum() / 8).backward()
        opt.step()
    cockpit.close()
    return cockpit.get_output(), cockpit.get_notes()


def test_computed_weights_shared_inputs_and_unreached_heads_on_cuda_equal_the_cpu():
    cpu, cpu_notes = computed_and_shared_run("cpu")
    cuda, cuda_notes = computed_and_shared_run(DEVICE)
    assert cuda_notes == cpu_notes
    assert sum(value is not None for values in cpu.values() for value in values.values()) > 150
    assert compare(cuda, cpu, rtol=1e-9, max_count_diff=4) > 150


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_ddp_with_nccl_gives_the_whole_batch(tmp_path):
    import torch.multiprocessing as mp

    from tests import cuda_ddp_worker
    from tests.models import make_problem
    from tests.split_reference import assert_same_values, whole_batch_run

    problem = make_problem("mlp_relu", 48)
    generator = torch.Generator().manual_seed(3)
    data = [(problem.x[i], problem.y[i])
            for i in (torch.randint(0, 48, (24,), generator=generator) for _ in range(3))]
    mp.start_processes(cuda_ddp_worker.run, args=(2, free_port(), data, str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    expected, _ = whole_batch_run(make_problem("mlp_relu", 48), data, cuda_ddp_worker.sgd)
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as file:
            result = pickle.load(file)
        output = {step: {k.replace("/module.", "/"): v for k, v in values.items()}
                  for step, values in result["output"].items()}
        assert assert_same_values(output, expected, range(3)) > 30
