"""Reference runs for split batches (gradient accumulation, torch.distributed): the same
training on the whole batch in one backward pass per step, and a comparison of every
recorded value."""

from __future__ import annotations

import copy
import math
import re
import warnings

import numpy as np
import torch
from pytest import approx

from cockpit import Cockpit, quantities
from tests.models import Problem

# need the whole batch's graph: None with a note when split over micro-batches (over
# processes formed within their Lanczos tolerance, compared where they are)
NOT_SPLIT = {"HessMaxEV", "HessTopEV"}
# properties of the loop, not of the batch: wall time; what the optimizer stepped on against
# Cockpit's batch gradient (the reference run copies the split run's gradient into p.grad;
# not checked with several processes)
LOOP = {"Time", "GradientMismatch"}
# warnings of misuse of the loop (cockpit/loop_checks.py): a correct loop never gets them,
# also when it edits p.grad between backward and step (the reference run copies gradients)
MISUSE = re.compile(r"already hold a gradient|outside `with cockpit|no backward pass reached")


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def misuse_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if MISUSE.search(str(w.message))]


def instruments(curvature: str = "diag_ggn_exact") -> list:
    return [
        quantities.Loss(), quantities.GradNorm(), quantities.Distance(),
        quantities.UpdateSize(), quantities.NormTest(), quantities.InnerTest(),
        quantities.OrthoTest(), quantities.GradHist1d(), quantities.GradHist2d(),
        quantities.Alpha(), quantities.MeanGSNR(), quantities.CABS(),
        quantities.EarlyStopping(), quantities.HessTrace(curvature=curvature),
        quantities.TICDiag(curvature=curvature), quantities.TICTrace(curvature=curvature),
        quantities.HessMaxEV(), quantities.GradientNoiseScale(), quantities.ParamNorm(),
        quantities.UpdateRatio(),
    ]


def with_top_eigenvalues() -> list:
    """:func:`instruments`, HessTopEV of the two largest eigenvalues and a small HessDensity
    (a fixed number of Lanczos steps: the same nodes and weights to rounding)."""
    return [*instruments(), quantities.HessTopEV(k=2), quantities.HessDensity(probes=2, steps=4)]


def dense_top_eigenvalues(problem, x, y, k: int = 1) -> np.ndarray:
    """The ``k`` largest eigenvalues (descending) of the dense float64 Hessian of the mean
    loss of (x, y) at the problem's initial parameters."""
    from tests.full_reference import dense_hessian

    model = copy.deepcopy(problem.model).double()
    hessian = dense_hessian(model, lambda: problem.loss_fn(model(x), y).mean())
    return torch.linalg.eigvalsh(hessian).flip(0)[:k].numpy()


def assert_same_eigenvalues(output: dict, notes: dict, expected: dict, step: int, dense,
                            micro: int) -> None:
    """HessMaxEV (and HessTopEV where tracked) of a run split over processes: the whole-batch
    run's value within the instrument's tolerance 1e-3 (θ ≤ λ_max ≤ θ·(1 + 1e-3)), and at
    the first step the dense float64 Hessian's; None with the reason where the batch is split over
    micro-batches (their graphs are gone)."""
    if micro > 1:
        assert output[step]["HessMaxEV"] is None
        assert "micro-batches" in notes[step]["HessMaxEV"]
        return
    value = output[step]["HessMaxEV"]
    assert value == approx(expected[step]["HessMaxEV"], rel=1e-3), notes[step]
    assert "relative accuracy" in notes[step]["HessMaxEV"]
    if dense is not None:
        assert value <= dense[0] * (1 + 1e-9)
        assert value >= dense[0] * (1 - 1e-3)
    if "HessTopEV" in expected[step]:
        got, want = output[step]["HessTopEV"], expected[step]["HessTopEV"]
        values, upper = np.asarray(got["values"]), np.asarray(got["upper"])
        np.testing.assert_allclose(values, np.asarray(want["values"]), rtol=1e-3)
        if dense is not None:  # λ_i ∈ [values_i, upper_i]
            assert (values <= dense * (1 + 1e-9)).all() and (upper >= dense * (1 - 1e-9)).all()


def batches_of(problem, steps: int, size: int, seed: int = 1) -> list[tuple]:
    """``steps`` batches of ``size`` samples drawn from the problem's data (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        index = torch.randint(0, problem.x.shape[0], (size,), generator=generator)
        out.append((problem.x[index], problem.y[index]))
    return out

def whole_batch_run(problem: Problem, batches: list[tuple], make_optimizer,
                    gradients: list[dict[str, torch.Tensor]] | None = None,
                    curvature: str = "diag_ggn_exact",
                    chosen: list | None = None, **cockpit_kwargs) -> tuple[dict, dict]:
    """One ``with`` block per step on the whole batch (x, y). ``gradients``: the gradient
    the split run's optimizer stepped on, per step (used instead of the whole batch's mean
    when the split run weighted its micro-batches unequally); Alpha then measures the real
    update by its general path, which is exact for any update. ``chosen``: the instruments
    (default: :func:`instruments`); ``cockpit_kwargs``: further arguments of Cockpit."""
    model = copy.deepcopy(problem.model)
    opt = make_optimizer(model)
    chosen = instruments(curvature) if chosen is None else chosen
    if gradients is not None:
        for q in chosen:
            if isinstance(q, quantities.Alpha):
                q.predict = False
    cockpit = Cockpit(model, chosen, optimizer=opt, strict=True, **cockpit_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(batches):
            opt.zero_grad()
            losses = problem.loss_fn(model(x), y)
            with cockpit(step, losses=losses):
                losses.mean().backward()
            if gradients is not None:
                for name, p in model.named_parameters():
                    if p.requires_grad:
                        p.grad.copy_(gradients[step][name])
            opt.step()
        cockpit.close()
    assert not misuse_warnings(caught)
    return cockpit.get_output(), cockpit.get_notes()


def assert_same_values(actual: dict, expected: dict, steps, rtol: float = 1e-6,
                       skip: set[str] = frozenset()) -> int:
    """Every value of ``expected`` at ``steps`` equals ``actual``'s (floats to ``rtol``,
    histograms to two counts: elements on a bin edge may round either way). Returns the
    number of values compared."""
    compared = 0
    for step in steps:
        for name, value in expected[step].items():
            if name.split("/")[0].split(".")[0] in NOT_SPLIT | set(skip) or name in LOOP:
                continue
            got = actual[step].get(name, "missing")
            assert got is not None or value is None, f"step {step} {name}: None, want {value}"
            if isinstance(value, dict):
                assert isinstance(got, dict), f"step {step} {name}: {got!r}"
                for key, array in value.items():
                    a, b = np.asarray(got[key]), np.asarray(array)
                    if key == "counts":
                        assert a.sum() == b.sum(), f"step {step} {name}: total count"
                        assert np.abs(a - b).sum() <= 4, f"step {step} {name}: counts"
                    else:
                        np.testing.assert_allclose(a, b, rtol=1e-12)
            elif value is None:
                assert got is None, f"step {step} {name}: {got}, want None"
            elif math.isnan(value):
                assert math.isnan(got), f"step {step} {name}: {got}, want NaN"
            else:
                assert abs(got - value) <= rtol * abs(value) + 1e-10, (
                    f"step {step} {name}: {got} vs whole batch {value}")
            compared += 1
    return compared
