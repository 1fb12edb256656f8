"""DeadUnits' per-unit sums Σ_j |ḡ_i,j| on both paths: a norm per weight on the CPU, one copy
of all weights and a segmented sum on accelerators (forced here)."""

import pytest
import torch

from cockpit.engine.histograms import device as histogram_device
from cockpit.quantities.dead_units import unit_sums


def _weights(dtype):
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 5), (3, 2, 3, 3), (6, 1), (2, 7, 2)]
    weights = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    weights[0][1] = 0.0  # dead units
    weights[1][0] = 0.0
    weights[1][2, 1, 2, 0] = 0.0  # a zero element of a living unit
    weights[2][5] = 0.0
    weights[3][0, 3, 1] = 2.0**-140 if dtype != torch.bfloat16 else 2.0**-130  # tiny, alive
    weights[3][0, :3] = 0.0
    weights[3][0, 4:] = 0.0
    weights[3][0, 3, 0] = 0.0
    return weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_unit_sums_against_row_sums(dtype, path):
    weights = _weights(dtype)
    expected = torch.cat([w.double().abs().reshape(len(w), -1).sum(1) for w in weights])
    with histogram_device.forced() if path == "accelerator" else torch.no_grad():
        sums = unit_sums(weights)
    assert sums.shape == (sum(len(w) for w in weights),)
    assert torch.equal(sums == 0, expected == 0)  # exactly the dead units
    assert (sums == 0).sum() == 3
    torch.testing.assert_close(sums.double(), expected,
                               rtol={torch.bfloat16: 1e-2}.get(dtype, 1e-6), atol=0.0)


@pytest.mark.parametrize("odd", ["dtypes", "empty"])
def test_unit_sums_of_mixed_dtypes_or_empty_rows_on_the_accelerator_path(odd):
    """Weights of different dtypes (or one without inputs: its units are dead) cannot share
    one copy: a norm per weight instead."""
    weights = _weights(torch.float32)
    if odd == "dtypes":
        weights[2] = weights[2].double()
    else:
        weights.append(torch.zeros(4, 0))
    with histogram_device.forced():
        sums = unit_sums(weights)
    expected = torch.cat([w.double().abs().reshape(len(w), -1).sum(1) for w in weights])
    assert torch.equal(sums == 0, expected == 0)
    torch.testing.assert_close(sums.double(), expected)


def test_non_finite_units_are_alive():
    weights = [torch.tensor([[0.0, float("nan")], [0.0, 0.0], [float("inf"), 0.0]])]
    for forced in (False, True):
        with histogram_device.forced() if forced else torch.no_grad():
            sums = unit_sums(weights)
        assert (sums == 0).tolist() == [False, True, False]
