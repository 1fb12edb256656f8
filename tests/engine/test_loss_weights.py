"""The check of the backpropagated loss weights w_n = ∂L/∂ℓ_n (one read of the device)."""

from __future__ import annotations

import math

import pytest
import torch

from cockpit.engine.processing import weights_problem


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
