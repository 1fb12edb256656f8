"""DeepOBS test problems (Schneider, Balles & Hennig, ICLR 2019) for benchmarking optimizers
with Cockpit attached, plus small real problems on scikit-learn's digits.

    from cockpit.benchmark.problems import get_problem, list_problems
    problem = get_problem("cifar10_3c3d", data="real", data_dir="~/data")
    for x, y in problem.train_loader:
        losses = problem.losses(problem.model(x), y)          # [batch]
        loss = losses.mean() + problem.regularizer()

See :class:`~cockpit.benchmark.problems.base.TestProblem` for the interface and
:mod:`~cockpit.benchmark.problems.readers` for where the data files go.
"""

from cockpit.benchmark.problems.base import BatchLoader, SequenceLoader, Splits, TestProblem
from cockpit.benchmark.problems.readers import MissingDataError, data_root
from cockpit.benchmark.problems.registry import REGISTRY, ProblemSpec, get_problem, list_problems

__all__ = [
    "REGISTRY",
    "BatchLoader",
    "MissingDataError",
    "ProblemSpec",
    "SequenceLoader",
    "Splits",
    "TestProblem",
    "data_root",
    "get_problem",
    "list_problems",
]
