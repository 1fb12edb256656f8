"""The basis fit of the update on the accelerators' path (every tensor's fit at once, in
blocks) against float64 least squares by NumPy and against the per-tensor fit of the CPU
path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cockpit.engine import update_fit
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.update_fit import BasisFits, fit_basis_coefficients_many
from tests.engine.test_host_syncs import Count

B = update_fit._BLOCK
# (shape, basis size k, dtype): one element (a scalar parameter and a [1] tensor), sizes
# below, at, just above and several blocks, k = 1, 2, 3, float32 and float64 in one call
CASES = [((), 1, torch.float64), ((1,), 1, torch.float32), ((7,), 2, torch.float64),
         ((B,), 3, torch.float32), ((B + 1,), 1, torch.float32), ((3, 10, 10), 2, torch.float32),
         ((2, B), 3, torch.float64), ((4, 3, 3, 3), 2, torch.float32),
         ((3 * B - 5,), 2, torch.float64)]


@pytest.fixture
def accelerator_path(monkeypatch):
    monkeypatch.setattr(histogram_device, "_forced", True)


def problems(cases=CASES, seed=0, zero_row=True):
    """Bases with a few degrees of freedom more than the basis (a residual to measure) or an
    exact fit (one element), targets = Vᵀc + noise; the third tensor's second basis vector
    is zero (a zero-initialised bias under weight decay)."""
    gen = torch.Generator().manual_seed(seed)
    bases, actuals = [], []
    for index, (shape, k, dtype) in enumerate(cases):
        basis = torch.randn(k, *shape, generator=gen, dtype=torch.float64)
        if zero_row and index == 2:
            basis[1] = 0.0
        c = torch.randn(k, generator=gen, dtype=torch.float64)
        noise = 1e-3 * torch.randn(shape, generator=gen, dtype=torch.float64)
        actual = torch.einsum("k,k...->...", c, basis) + noise
        bases.append(basis.to(dtype))
        actuals.append(actual.to(dtype))
    return bases, actuals


def reference(basis: torch.Tensor, actual: torch.Tensor) -> tuple[np.ndarray, float]:
    """Minimum-norm least squares of the exact values in float64, and its residual."""
    v = basis.reshape(len(basis), -1).double().numpy()
    a = actual.reshape(-1).double().numpy()
    c = np.linalg.lstsq(v.T, a, rcond=None)[0]
    return c, float(np.linalg.norm(a - v.T @ c))


@pytest.mark.parametrize("chunk_blocks", [update_fit._CHUNK_BLOCKS, 2])
def test_every_fit_at_once_equals_float64_least_squares(chunk_blocks, accelerator_path,
                                                        monkeypatch):
    """Coefficients to the float32 rounding of the normal equations (float64: 1e-10),
    residual norms measured directly (to the rounding of the residual, not of ‖a‖²), the
    zero basis vector's coefficient exactly 0, nothing that waits for the device (two
    segment sums per dtype and basis size: the Gram matrices and the squared residuals);
    and the same as the per-tensor fit. Also with groups of at most two blocks (each large
    tensor a group of its own, small ones together)."""
    monkeypatch.setattr(update_fit, "_CHUNK_BLOCKS", chunk_blocks)
    bases, actuals = problems()
    counter = Count()
    with counter:
        fits = BasisFits(bases, actuals)
    groups = len(update_fit._layout(update_fit._spec(fits.problems), torch.device("cpu")).groups)
    assert counter.ops["segment_reduce"] == 2 * groups
    # two blocks at most: float32 with k = 1 and float64 with k = 2 take two groups each
    assert groups == len({(k, d) for _, k, d in CASES}) + (2 if chunk_blocks == 2 else 0)
    waits = {"_local_scalar_dense", "_linalg_check_errors", "nonzero", "item"}
    assert not waits & set(counter.ops), counter.ops
    coefficients = fits.coefficients.split([k for _, k, _ in CASES])
    for index, (basis, actual) in enumerate(zip(bases, actuals, strict=True)):
        c, residual = reference(basis, actual)
        single = actual.dtype == torch.float32
        np.testing.assert_allclose(coefficients[index].numpy(), c,
                                   rtol=1e-4 if single else 1e-10, atol=1e-6 if single else 1e-12)
        scale = float(actual.double().norm())
        np.testing.assert_allclose(float(fits.residual_norms[index]), residual,
                                   rtol=1e-3 if single else 1e-8,
                                   atol=1e-6 * scale if single else 1e-14 * scale)
    assert float(coefficients[2][1]) == 0.0
    histogram_device._forced = False
    per_tensor = BasisFits(bases, actuals)
    torch.testing.assert_close(fits.coefficients, per_tensor.coefficients, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fits.residual_norms, per_tensor.residual_norms, rtol=1e-3,
                               atol=1e-7)


def test_a_failed_fit_in_a_batch_is_retried_on_the_host(accelerator_path):
    """Two parallel basis vectors: the batched solve fails that fit (singular), the float64
    retry on the host gives the minimum-norm coefficients; the other fits of the batch come
    from the device; a foreign update (outside the span) has no fit."""
    bases, actuals = problems(CASES[2:6], zero_row=False)
    v = torch.randn(B + 3, generator=torch.Generator().manual_seed(1))
    bases.insert(1, torch.stack([v, v]))
    actuals.insert(1, 3.0 * v)
    foreign = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    bases.append(foreign)
    actuals.append(torch.randn(50, generator=torch.Generator().manual_seed(3)))
    fits = BasisFits(bases, actuals)
    assert not float(fits.residual_norms[1]) <= 1e-3 * float(actuals[1].norm())
    sq = [float(a.double().square().sum()) for a in actuals]
    atols = [torch.finfo(a.dtype).eps * float(a.norm()) for a in actuals]
    results = fit_basis_coefficients_many(bases, actuals, 1e-2, atols, sq)
    torch.testing.assert_close(results[1], torch.tensor([1.5, 1.5], dtype=torch.float64))
    assert results[-1] is None
    for index in (0, 2, 3, 4):
        c, _ = reference(bases[index], actuals[index])
        np.testing.assert_allclose(results[index].numpy(), c, rtol=1e-4, atol=1e-6)


def test_the_segment_sums_do_not_check_their_lengths_on_the_device(accelerator_path,
                                                                  monkeypatch):
    """torch.segment_reduce checks ``lengths`` by reading the device (``.item()`` inside the
    kernel: a wait on a GPU, invisible to the op count) unless ``unsafe``; the layout's
    lengths are right by construction."""
    calls = []
    segment_reduce = torch.segment_reduce

    def spy(*args, **kwargs):
        calls.append(kwargs.get("unsafe", False))
        return segment_reduce(*args, **kwargs)

    monkeypatch.setattr(torch, "segment_reduce", spy)
    BasisFits(*problems())
    assert calls and all(calls), calls


def count_fit(n: int) -> int:
    bases, actuals = problems((CASES[5:8] * n)[:n])
    BasisFits(bases, actuals)  # the layout of these shapes, built once
    counter = Count()
    with counter:
        BasisFits(bases, actuals)
    return sum(counter.ops.values())


def test_the_fits_take_as_many_ops_for_three_tensors_as_for_thirty(accelerator_path):
    """A fixed number of ops per dtype and basis size (two float32 groups here: k = 2, 3),
    not a few per tensor."""
    three, thirty = count_fit(3), count_fit(30)
    assert three == thirty, (three, thirty)
    assert thirty <= 90


def test_an_empty_tensor_takes_the_fits_one_tensor_at_a_time(accelerator_path):
    """A parameter without elements (its rows cannot be concatenated): every fit of the call
    on the per-tensor path, the empty one exact (c = 0, residual 0)."""
    bases, actuals = problems(CASES[2:5], zero_row=False)
    bases.append(torch.zeros(2, 0))
    actuals.append(torch.zeros(0))
    counter = Count()
    with counter:
        fits = BasisFits(bases, actuals)
    assert "segment_reduce" not in counter.ops
    for index in range(3):
        c, _ = reference(bases[index], actuals[index])
        k = CASES[2 + index][1]
        start = sum(case[1] for case in CASES[2 : 2 + index])
        np.testing.assert_allclose(fits.coefficients[start : start + k].numpy(), c,
                                   rtol=1e-4, atol=1e-6)
    assert fits.coefficients[-2:].tolist() == [0.0, 0.0]
    assert float(fits.residual_norms[-1]) == 0.0


def test_packed_bases_give_the_same_fits_in_a_fixed_number_of_ops(accelerator_path):
    """Bases copied at once into the rows of the batched fit (as Alpha does at the end of
    the backward pass, from the rows as they are: one copy per basis row and group), then
    fitted from there (only the updates copied in): the same coefficients and residuals as
    from the stacked bases, the same ops for three tensors as for thirty, and a failed fit
    retried on the host from the packed rows."""
    bases, actuals = problems()
    counter = Count()
    with counter:
        packed = update_fit.PackedBases([list(b.unbind(0)) for b in bases], torch.device("cpu"))
    groups = len(packed.layout.groups)
    assert counter.ops["_chunk_cat"] == sum(g.k for g in packed.layout.groups)
    slots = packed.slots()
    bases[0].zero_()  # the originals may change now (the optimizer step)
    counter = Count()
    with counter:
        fits = BasisFits(slots, actuals)
    assert counter.ops["_chunk_cat"] == groups and counter.ops["segment_reduce"] == 2 * groups
    originals, _ = problems()
    stacked = BasisFits(originals, actuals)  # (VVᵀ and Va in one product there: rounding)
    torch.testing.assert_close(fits.coefficients, stacked.coefficients, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(fits.residual_norms, stacked.residual_norms, rtol=1e-5,
                               atol=1e-9)
    sq = [float(a.double().square().sum()) for a in actuals]
    retried = fits.accept([math.nan] * len(actuals), 1e-2, [0.0] * len(actuals), sq)
    for index, (basis, actual) in enumerate(zip(originals, actuals, strict=True)):
        np.testing.assert_allclose(retried[index].numpy(), reference(basis, actual)[0],
                                   rtol=1e-8, atol=1e-10)

    def count(n: int) -> int:
        bases, actuals = problems((CASES[5:8] * n)[:n])
        rows = [list(b.unbind(0)) for b in bases]
        BasisFits(update_fit.PackedBases(rows, torch.device("cpu")).slots(), actuals)
        counter = Count()
        with counter:
            BasisFits(update_fit.PackedBases(rows, torch.device("cpu")).slots(), actuals)
        return sum(counter.ops.values())

    assert count(3) == count(30)


@pytest.mark.cpu_path
def test_the_cpu_path_fits_one_tensor_at_a_time():
    """Without the accelerators' path, no rows of all tensors (F would be a copy of every
    basis): the per-tensor BLAS products and the workspace's residual."""
    bases, actuals = problems()
    counter = Count()
    with counter:
        BasisFits(bases, actuals)
    assert "segment_reduce" not in counter.ops and "bmm" not in counter.ops
