"""Models compiled with torch.compile: untracked steps run the compiled graph, tracked steps
the eager module, and every value equals that of a run of the uncompiled model."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from cockpit import Cockpit, configuration
from cockpit.schedules import every


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Each test compiles its own model: dynamo's caches keyed on the shared forward code
    would otherwise fill up across tests (and fall back to eager at their limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class CountingBackend:
    """A torch.compile backend (AOTAutograd, graphs run by the FX interpreter, i.e. the same
    aten ops as eager) that counts compilations and runs of the compiled forward and
    backward graphs."""

    def __init__(self):
        self.compiles = self.forwards = self.backwards = 0
        self.backend = aot_autograd(fw_compiler=self._forward, bw_compiler=self._backward)

    def _forward(self, graph, example_inputs):
        self.compiles += 1
        return self._counted(graph, "forwards")

    def _backward(self, graph, example_inputs):
        return self._counted(graph, "backwards")

    def _counted(self, graph, counter: str):
        def run(args):
            setattr(self, counter, getattr(self, counter) + 1)
            return torch.fx.Interpreter(graph).boxed_run(args)

        run._boxed_call = True
        return run


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.fc1, self.fc2 = nn.Linear(4 * 4 * 4, 12), nn.Linear(12, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.sigmoid(self.conv(x)).flatten(1))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net().double()


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 2, 6, 6, dtype=torch.float64, generator=generator),
             torch.randint(0, 3, (6,), generator=generator)) for _ in range(steps)]


def _train(model: nn.Module, called: nn.Module, batches, schedule,
           name: str = "economy") -> tuple[dict, dict]:
    """A plain loop with Cockpit attached to ``called`` (the module the loop calls)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cockpit = Cockpit(called, configuration(name, schedule), optimizer=opt, strict=True)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        losses = nn.functional.cross_entropy(called(x), y, reduction="none")
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    return cockpit.get_output(), cockpit.get_notes()


def _compile(model: nn.Module, how: str, backend) -> nn.Module:
    if how == "wrapper":
        return torch.compile(model, backend=backend)
    model.compile(backend=backend)
    return model


def _assert_same(expected: dict, actual: dict) -> None:
    assert actual.keys() == expected.keys()
    for step, values in expected.items():
        assert actual[step].keys() == values.keys(), step
        for name, value in values.items():
            got = actual[step][name]
            if isinstance(value, dict):  # histograms: counts and edges
                assert got.keys() == value.keys()
                for key in value:
                    np.testing.assert_allclose(np.asarray(got[key]), np.asarray(value[key]),
                                               rtol=1e-10, atol=1e-12, err_msg=f"{step} {name}")
            elif value is None:
                assert got is None, (step, name)
            else:
                np.testing.assert_allclose(got, value, rtol=1e-10, atol=1e-12,
                                           err_msg=f"{step} {name}")


@pytest.mark.parametrize("how", ["wrapper", "in_place"])
def test_compiled_model_values_equal_the_eager_run_and_untracked_steps_run_compiled(how):
    steps, schedule = 11, every(4)
    batches = _batches(steps)
    eager = _model()
    expected, expected_notes = _train(eager, eager, batches, schedule)

    counting = CountingBackend()
    counters.clear()
    model = _model()
    called = _compile(model, how, counting.backend)
    actual, notes = _train(model, called, batches, schedule)

    _assert_same(expected, actual)
    assert notes == expected_notes
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):  # the same training
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # the forward of step s is recorded (eager) when s is tracked; step 0's always is
    quantities = configuration("economy", schedule)
    untracked = [s for s in range(1, steps) if not any(q.should_track(s) for q in quantities)]
    assert len(untracked) >= 4
    assert counting.forwards == counting.backwards == len(untracked)
    assert counting.compiles == 1  # compiled once, not again at each switch
    assert not counters["recompiles"]


def test_curvature_instruments_of_a_compiled_model_equal_the_eager_run():
    """business: HessTrace and TICDiag re-differentiate the recorded (eager) forward."""
    batches = _batches(5)
    eager = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the curvature method chosen is warned)
        expected, expected_notes = _train(eager, eager, batches, every(3), "business")
        model = _model()
        actual, notes = _train(model, torch.compile(model, backend=CountingBackend().backend),
                               batches, every(3), "business")
    assert expected[3]["HessTrace"] is not None and expected[3]["TICDiag"] is not None
    _assert_same(expected, actual)
    assert notes == expected_notes


def test_compiled_graph_traces_cockpits_hooks_to_nothing():
    """At untracked steps the compiled graph holds the model's operations only."""
    counting = CountingBackend()
    counters.clear()
    model = _model()
    _train(model, torch.compile(model, backend=counting.backend), _batches(4), every(3))
    assert counting.forwards == 1
    assert counters["stats"]["calls_captured"] == 6  # conv, sigmoid, flatten, linear, relu, linear


def test_forward_failing_at_a_tracked_step_leaves_the_compiler_as_it_was():
    counting = CountingBackend()
    model = _model()
    compiled = torch.compile(model, backend=counting.backend)
    cockpit = Cockpit(compiled, configuration("economy", every(2)))
    with pytest.raises(RuntimeError):  # step 0 is recorded: eager; wrong input shape
        compiled(torch.randn(6, 3, 6, 6, dtype=torch.float64))
    cockpit.tracker.capturing = False  # as at an untracked step
    compiled(torch.randn(6, 2, 6, 6, dtype=torch.float64))
    assert counting.forwards == 1  # the stance went back: the compiled graph ran
    cockpit.close()


def test_run_log_names_the_compiled_models_class(tmp_path):
    from cockpit.store import read_meta

    model = _model()
    Cockpit(torch.compile(model, backend="eager"), configuration("economy"),
            logdir=str(tmp_path)).close()
    assert read_meta(tmp_path)["model_class"] == "_Net"


def test_close_restores_a_model_compiled_in_place():
    counting = CountingBackend()
    model = _model()
    model.compile(backend=counting.backend)
    compiled_call = model._compiled_call_impl
    cockpit = Cockpit(model, configuration("economy"))
    assert model._compiled_call_impl is not compiled_call
    cockpit.close()
    assert model._compiled_call_impl is compiled_call
    model(torch.randn(6, 2, 6, 6, dtype=torch.float64))
    assert counting.forwards == 1


def test_evaluation_without_gradients_runs_compiled_while_recording_is_armed():
    """An evaluation pass under no_grad records nothing, so it needs no eager forward."""
    counting = CountingBackend()
    model = _model()
    compiled = torch.compile(model, backend=counting.backend)
    cockpit = Cockpit(compiled, configuration("economy"))
    assert cockpit.tracker.capturing
    with torch.no_grad():
        compiled(torch.randn(6, 2, 6, 6, dtype=torch.float64))
    assert counting.forwards == 1
    cockpit.close()


def test_compiled_with_inductor_matches_the_eager_run():
    """The default backend (generated kernels) at untracked steps; tracked steps eager."""
    pytest.importorskip("torch._inductor")
    steps, schedule = 6, every(3)
    batches = _batches(steps)
    eager = _model()
    expected, _ = _train(eager, eager, batches, schedule)
    model = _model()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual, _ = _train(model, torch.compile(model), batches, schedule)
    assert not counters["recompiles"]
    assert counters["stats"]["unique_graphs"] == 1
    for step, values in expected.items():
        for name in ("Loss", "GradNorm", "NormTest", "InnerTest", "OrthoTest", "Alpha",
                     "Distance", "UpdateSize"):
            if values.get(name) is not None:  # fused kernels round differently: 1e-9
                np.testing.assert_allclose(actual[step][name], values[name], rtol=1e-9,
                                           err_msg=f"{step} {name}")


def test_torch_without_set_stance_refuses_a_compiled_model_and_leaves_no_hooks(monkeypatch):
    model = _model()
    compiled = torch.compile(model, backend="eager")
    monkeypatch.delattr(torch.compiler, "set_stance")
    with pytest.raises(NotImplementedError, match=r"torch >= 2\.6"):
        Cockpit(compiled, configuration("economy"))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in compiled.modules())
    Cockpit(model, configuration("economy")).close()  # the uncompiled model is fine


def test_micro_batches_of_untracked_steps_run_compiled_and_equal_the_eager_run():
    """Gradient accumulation: the second micro-batch of an untracked step is not warned
    about as a repeated step number, and its forward runs compiled unless the next step is
    tracked (Cockpit cannot tell it from that step's first forward then)."""
    steps, schedule, batches = 8, every(4), _batches(16)

    def train(model, called):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        cockpit = Cockpit(called, configuration("economy", schedule), optimizer=opt,
                          strict=True, grad_accumulation=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                opt.zero_grad()
                for x, y in batches[2 * step:2 * step + 2]:
                    losses = nn.functional.cross_entropy(called(x), y, reduction="none")
                    with cockpit(step, losses=losses):
                        (losses.mean() / 2).backward()
                opt.step()
            cockpit.close()
        assert not [str(w.message) for w in caught]
        return cockpit.get_output(), cockpit.get_notes()

    eager = _model()
    expected, expected_notes = train(eager, eager)
    counting = CountingBackend()
    model = _model()
    actual, notes = train(model, torch.compile(model, backend=counting.backend))
    _assert_same(expected, actual)
    assert notes == expected_notes
    quantities = configuration("economy", schedule)
    untracked = [s for s in range(1, steps) if not any(q.should_track(s) for q in quantities)]
    tracked = [s for s in range(steps + 1) if s not in untracked]
    assert counting.forwards == sum(1 if s + 1 in tracked else 2 for s in untracked) >= 5
    assert counting.compiles == 1
