"""A quick bug zoo (benchmarks/diagnosis.py, a few small runs): the right code is named as a
warning or error on each broken run, and healthy runs raise no warning."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ZOO_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "diagnosis.py"


@pytest.fixture(scope="module")
def zoo():
    spec = importlib.util.spec_from_file_location("bug_zoo", ZOO_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


# One run per family the zoo trains for real (the other codes are checked on built outputs
# in test_diagnose.py); 30 steps keep it small.
QUICK = [
    "healthy: digits MLP, SGD momentum",
    "healthy: digits MLP, Adam",
    "raw digits pixels 0…16, MLP, SGD lr 1e-3",
    "deep sigmoid MLP (8 layers), digits, SGD",
    "70 % of a ReLU layer's units dead (bias −100), digits",
    "no zero_grad(), digits MLP, SGD",
    "one layer at 100× the learning rate, digits CNN, SGD momentum",
]


@pytest.mark.parametrize("name", QUICK)
def test_quick_zoo_names_the_bug(zoo, name):
    (case,) = [c for c in zoo.CASES if c.name == name]
    output = zoo.train(case, seed=0, steps=30)
    passed, raised = zoo.judge(case, output)
    if case.expected is None:
        assert raised == [], f"healthy run raised {raised}"
    else:
        assert case.expected in raised, f"{name}: expected {case.expected}, got {raised}"
    assert passed
