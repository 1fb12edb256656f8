"""Sums of millions of float32 products on a CPU (``cockpit.engine.float_sums``) against float64:
‖x‖² and ⟨a, b⟩ of an embedding-sized vector of equal-sized numbers (Adam's first update),
of Gaussian numbers, with a remainder beyond the rows, in every floating dtype; and Alpha on
AdamW's first steps of a layer that large stays on its predicted path (a float32 dot product
there drifted by 1e-3 and failed the check that the real update is the predicted one)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, quantities
from cockpit.engine import float_sums
from tests.models import Problem, train

N = 12_865_792 + 77  # GPT-2 small's token embedding (50257 × 256) and a remainder


def vectors(kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if kind == "equal":  # ±lr everywhere: Adam's first update
        a = torch.sign(torch.randn(N, generator=gen)) * 1e-4
        b = a * (1 + 1e-3 * torch.randn(N, generator=gen))
    else:
        a, b = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", ["equal", "gaussian"])
def test_norms_and_dots_keep_their_digits(kind, dtype):
    a, b = vectors(kind, dtype)
    exact_sq = float((a.double() ** 2).sum())
    exact_dot = float((a.double() * b.double()).sum())
    got_sq = float_sums.sq_norm(a)
    got_dot = float_sums.dot(a, b)
    assert got_sq.dtype == got_dot.dtype == torch.float64 and got_sq.dim() == 0  # (by rows)
    assert abs(float(got_sq) / exact_sq - 1) <= 1e-6  # (torch.dot of float32: 1e-2)
    # (Gaussian: the terms cancel, so the error is relative to Σ|a_i b_i|)
    scale = float((a.double() * b.double()).abs().sum())
    assert abs(float(got_dot) - exact_dot) <= 1e-5 * scale


def test_short_integer_and_strided_vectors():
    x = torch.arange(-5, 6)
    assert float(float_sums.sq_norm(x)) == 110.0
    wide = torch.randn(3, 2**17)[:, ::2]  # not contiguous
    expected = float((wide.double() ** 2).sum())
    assert float(float_sums.sq_norm(wide)) == pytest.approx(expected, rel=1e-7)
    assert float(float_sums.dot(wide, wide)) == pytest.approx(expected, rel=1e-5)


def test_alpha_on_adamws_first_step_of_a_large_layer_is_predicted():
    """A Linear layer of 12.8 M numbers whose gradient has no zero: Adam's first update is
    ±lr in every element, whose float32 dot products drifted by 1e-3."""
    torch.manual_seed(0)
    model = nn.Linear(3200, 4000)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cockpit = Cockpit(model, [quantities.Alpha()], optimizer=opt)
    problem = Problem("linear", model, torch.randn(6, 3200), torch.randint(0, 4000, (6,)),
                      lambda out, y: F.cross_entropy(out, y, reduction="none"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(problem, cockpit, 3, opt)
        cockpit.close()
    assert not [w for w in caught if "does not match the prediction" in str(w.message)]
    output, notes = cockpit.get_output(), cockpit.get_notes()
    assert all(output[step]["Alpha"] is not None for step in range(2)), notes
