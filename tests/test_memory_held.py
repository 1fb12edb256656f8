"""The parameter-sized copies a tracked economy step holds (AdamW, Alpha's predicted path),
counted exactly: the distinct tensor storages reachable from the Cockpit whose size is one
of the parameters', apart from the parameters, their gradients and the optimizer's state,
in units of all parameters' bytes.

What each stage needs (AdamW, tracked every step):

* the start of the backward pass: θ₀ (Distance) and s_{t−1} (α_{t−1}'s projections);
* the optimizer step: θ₀, the predicted update ŝ_t (checked against s_t after the step) and
  θ_t (for s_t = θ_{t+1} − θ_t); ḡ has been read and s_{t−1} is no longer needed;
* between steps: θ₀ and s_t.
"""

from __future__ import annotations

import gc
import itertools
import types

import pytest
import torch
from torch import Tensor, nn

import cockpit.quantities as q
from cockpit import Cockpit
from cockpit.engine.workspace import workspace

# layer widths whose parameters' sizes no statistic of a batch of 16 shares
_WIDTHS = (37, 53, 41, 7)


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(_WIDTHS):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _storage(t: Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _reachable_storages(root: object) -> set[tuple[int, int]]:
    """The storages of the tensors reachable from ``root`` through containers, attributes
    and closures (not through modules, optimizers, classes or a function's globals)."""
    seen, found, stack = set(), set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            if obj.layout == torch.strided and obj.device.type != "meta":
                found.add(_storage(obj))
            continue
        if isinstance(obj, nn.Module | torch.optim.Optimizer | types.ModuleType | type):
            continue
        if isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or ()
                         if c.cell_contents is not None)
            continue
        stack.extend(gc.get_referents(obj))
    return found


def copies_held(root: object, model: nn.Module, opt: torch.optim.Optimizer) -> float:
    """Bytes of the parameter-sized storages reachable from ``root`` that are not the
    model's or the optimizer's, over the parameters' bytes."""
    params = list(model.parameters())
    own = {_storage(p) for p in params}
    own |= {_storage(p.grad) for p in params if p.grad is not None}
    own |= {_storage(v) for state in opt.state.values() for v in state.values()
            if isinstance(v, Tensor)}
    sizes = {p.numel() * p.element_size() for p in params}
    total = sum(p.numel() * p.element_size() for p in params)
    held = [nbytes for key in _reachable_storages(root) - own
            if (nbytes := key[1]) in sizes]
    return sum(held) / total


@pytest.fixture
def tracked_loop():
    """An AdamW loop with economy tracked at every step, and what was held at its stages."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    cockpit = Cockpit(model, "economy", optimizer=opt)
    held: dict[str, list[float]] = {"backward": [], "optimizer step": [], "between": []}
    # (registered after Cockpit's: runs after Cockpit finished the step's instruments)
    opt.register_step_pre_hook(
        lambda *_: held["optimizer step"].append(copies_held(cockpit, model, opt)))
    x, y = torch.randn(16, _WIDTHS[0]), torch.randn(16, _WIDTHS[-1])
    for step in range(4):
        opt.zero_grad()
        losses = ((model(x) - y) ** 2).mean(1)
        losses.register_hook(
            lambda g: held["backward"].append(copies_held(cockpit, model, opt)))
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
        held["between"].append(copies_held(cockpit, model, opt))
    values = cockpit.get_output()
    cockpit.close()
    return held, values


def test_parameter_sized_copies_at_each_stage(tracked_loop):
    held, values = tracked_loop
    assert all(values[s].get("Alpha") is not None for s in (1, 2))  # the predicted path ran
    # from the second step on (α_{t−1} is projected), a little above the counts where a
    # statistic's size happens to be a bias's
    assert max(held["backward"][1:]) == pytest.approx(2.0, abs=0.01)
    assert max(held["optimizer step"][1:]) == pytest.approx(3.0, abs=0.01)
    assert max(held["between"][1:]) == pytest.approx(2.0, abs=0.01)


@pytest.mark.cpu_path
def test_one_parameter_sized_scratch_buffer():
    """The CPU's parameter-sized temporaries (θ_t − θ₀, p.grad − c·ḡ) share one buffer,
    the size of the largest parameter."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    x, y = torch.randn(16, _WIDTHS[0]), torch.randn(16, _WIDTHS[-1])
    with Cockpit(model, [q.Distance(), q.GradNorm()], optimizer=opt) as cockpit:
        for step in range(2):
            opt.zero_grad()
            losses = ((model(x) - y) ** 2).mean(1)
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        scratch = [nbytes for _, nbytes in _reachable_storages(workspace())
                   if nbytes == largest]
    assert scratch == [largest]


def _peak_allocated(fn) -> int:
    """The most bytes ``fn()`` had allocated at once on the CPU (the allocator's events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int]] = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak


@pytest.mark.cpu_path
@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_prediction_holds_three_temporaries(decoupled):
    """AdamW's predicted update ŝ = θ̂ − θ needs the two new moments and θ̂ (GPT-2's token
    embedding: 154 MB each), and is bit for bit the update the optimizer applies."""
    from cockpit.engine.update_prediction import predict_update

    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(256, 512))
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = kind([param], lr=1e-2, weight_decay=0.1)
    for _ in range(2):  # a state with moments
        param.grad = torch.randn_like(param)
        opt.step()
    grad = torch.randn_like(param)
    size = param.numel() * param.element_size()
    peak = _peak_allocated(lambda: predict_update(opt, param, grad))
    assert peak <= 3 * size + 4096
    predicted = predict_update(opt, param, grad)
    before = param.detach().clone()
    param.grad = grad
    opt.step()
    assert torch.equal(predicted, param.detach() - before)


@pytest.mark.parametrize("scale", [8.0, 1 / 0.01])
def test_linear_rule_scales_the_smaller_factor(scale):
    """An output layer over a sequence (|B| × T × 50 outputs from 6 features): the factor
    1/w of the loss weight goes into the input, not into δ, so no copy of δ is made (GPT-2's
    output layer: 412 MB at the start of the backward pass). The individual
    gradients are those of the scaled δ: bit for bit for a power of two, else to rounding."""
    from cockpit.engine.rules.linear import linear_rule
    from cockpit.engine.rules.sample_grads import SequenceOuterSampleGrads

    torch.manual_seed(0)
    layer = nn.Linear(6, 50)
    x = torch.randn(4, 5, 6)
    delta = torch.randn(4, 5, 50)
    size = delta.numel() * delta.element_size()
    with torch.no_grad():
        out = layer(x)
    peak = _peak_allocated(lambda: linear_rule(layer, (x,), {}, out, delta, scale))
    assert peak < size  # (the scaled input and the bias sums)
    grads = linear_rule(layer, (x,), {}, out, delta, scale)
    reference = SequenceOuterSampleGrads(delta * scale, x)
    for got, expected in [(grads["weight"].materialize(), reference.materialize()),
                          (grads["bias"].materialize(), (delta * scale).sum(1))]:
        if scale == 8.0:
            assert torch.equal(got, expected)
        else:
            # (a different rounding of the same sum over t)
            torch.testing.assert_close(got, expected, rtol=1e-6,
                                       atol=1e-6 * float(expected.abs().max()))
