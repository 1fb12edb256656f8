"""A quick bug zoo (benchmarks/diagnosis.py, a few small runs): the right code is named as a
warning or error on each broken run, and healthy runs raise no warning."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ZOO_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnosis.py"


@pytest.fixture(scope="module")
def zoo():
    spec = importlib.util.spec_from_file_location("bug_zoo", ZOO_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


QUICK = [
    "healthy: digits MLP, SGD momentum",
    "healthy: digits MLP, Adam",
    "NaN pixel in the data from step 30",
    "SGD lr 2.0 (no momentum), digits MLP",
    "SGD lr 1e-5, digits MLP",
    "raw digits pixels 0…16, MLP, SGD lr 1e-3",
    "deep sigmoid MLP (8 layers), digits, SGD",
    "70 % of a ReLU layer's units dead (bias −100), digits",
    "first layer left out of the optimizer, digits MLP",
    "no zero_grad(), digits MLP, SGD",
    "batch of 2, SGD lr 0.1 momentum, digits MLP",
]


@pytest.mark.parametrize("name", QUICK)
def test_quick_zoo_names_the_bug(zoo, name):
    (case,) = [c for c in zoo.CASES if c.name == name]
    output = zoo.train(case, seed=0, steps=40)
    passed, raised = zoo.judge(case, output)
    if case.expected is None:
        assert raised == [], f"healthy run raised {raised}"
    else:
        assert case.expected in raised, f"{name}: expected {case.expected}, got {raised}"
    assert passed
