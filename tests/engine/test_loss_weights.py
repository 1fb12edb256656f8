"""Checks of the losses: their backpropagated weights w_n = ∂L/∂ℓ_n and their finiteness."""

from __future__ import annotations

import math

import pytest
import torch

from cockpit.engine.processing import weights_problem
from cockpit.quantities.base import finite_witness


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_uniform_weights_give_their_value(dtype):
    w = torch.full((7,), 1 / 7, dtype=dtype)
    problem, value = weights_problem(w)
    assert problem is None and value == float(w[0])


@pytest.mark.parametrize("where", [0, 3, 6])
def test_one_different_weight_anywhere_is_found(where):
    w = torch.full((7,), 0.25)
    w[where] = 0.5
    problem, value = weights_problem(w.view(7, 1))
    assert problem is not None and "unequally" in problem
    assert value == float(w[0])


def test_a_nan_weight_is_not_uniform():
    w = torch.ones(5)
    w[2] = math.nan
    problem, _ = weights_problem(w)
    assert problem is not None and "unequally" in problem


def test_zero_weights_say_the_loss_does_not_depend_on_losses():
    problem, value = weights_problem(torch.zeros(4))
    assert value == 0.0 and "does not depend" in problem


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [None, math.inf, -math.inf, "both", math.nan])
def test_the_losses_finite_witness_is_finite_exactly_when_every_loss_is(dtype, bad):
    """Σ ℓ_n in float64 (float64 losses: Σ 0·ℓ_n): the largest finite values of the dtype
    do not overflow it, one ±∞ or NaN (or +∞ and −∞ together) makes it non-finite."""
    losses = torch.full((512,), torch.finfo(dtype).max, dtype=dtype)
    if bad == "both":
        losses[3], losses[7] = math.inf, -math.inf
    elif bad is not None:
        losses[5] = bad
    witness = finite_witness(losses)
    assert witness.dtype == torch.float64 and witness.dim() == 0
    assert math.isfinite(float(witness)) == (bad is None)
