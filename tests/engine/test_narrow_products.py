"""Half-precision factors' products summed in float32 (``cockpit.engine.narrow_products``):
where a device has the op, a Linear layer's individual gradients under autocast come from its
bfloat16/float16 factors as they are, the loss weight's scale c in the product. A CPU has no
such kernel, so the op is emulated here by the widened float32 product (the real one against
it: ``tests/test_cuda.py``): single layers, their sample chunks and stacks against brute
force, without widened copies of the factors, and tracked steps under autocast that equal
the path that widens the factors first."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cockpit import Cockpit, configuration, every
from cockpit.engine import narrow_products, stacked
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.rules import sample_grads
from cockpit.engine.rules.sample_grads import SequenceOuterSampleGrads
from cockpit.engine.stacked import StackedGrads
from tests.engine.test_memory_budget import assert_same_outputs
from tests.engine.test_stacked import Tokens, brute_force

C = 1 / 0.3  # the loss weight's scale (not a power of two: where it is multiplied in shows)


@pytest.fixture
def emulated(monkeypatch) -> list[tuple]:
    """The op on every device, as α · (x y) of the widened factors; each call's (dtype of x,
    dtype of y, α) recorded."""
    calls: list[tuple] = []

    def products(x, y, alpha=1.0):
        calls.append((x.dtype, y.dtype, alpha))
        return alpha * torch.bmm(x.float(), y.float())

    monkeypatch.setattr(narrow_products, "_runs", lambda device_type: (True, True))
    monkeypatch.setattr(narrow_products, "_bmm", products)
    monkeypatch.setattr(narrow_products, "_baddbmm", products)
    return calls


def narrow_layer(dtype: torch.dtype, scaled: int, seed: int = 0, n: int = 5
                 ) -> SequenceOuterSampleGrads:
    gen = torch.Generator().manual_seed(seed)
    return SequenceOuterSampleGrads(torch.randn(n, 3, 4, generator=gen).to(dtype),
                                    torch.randn(n, 3, 6, generator=gen).to(dtype),
                                    torch.float32, C, scaled)


def test_a_cpu_widens_the_factors_itself():
    sg = narrow_layer(torch.bfloat16, 0)
    assert not narrow_products.available(*sg.factors, torch.float32)
    torch.testing.assert_close(sg.materialize().double(), C * brute_force(sg), rtol=1e-6,
                               atol=1e-6)
    assert all(x is not None and x.dtype == torch.float32 for x in sg._read[:1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaled", [0, 1])
def test_a_layer_forms_its_gradients_from_the_narrow_factors(dtype, scaled, emulated,
                                                             monkeypatch):
    """g_n = c Σ_t δ_{n,t} a_{n,t}ᵀ from the factors as handed, c as the product's α, in one
    chunk and in chunks of two samples; the factors are never widened."""
    sg = narrow_layer(dtype, scaled)
    expected = C * brute_force(sg)
    torch.testing.assert_close(sg.materialize().double(), expected, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(sample_grads, "_CHUNK_ELEMENTS", 2 * 24)
    chunks = sg.chunks()
    assert [len(c) for c in chunks] == [2, 2, 1]
    torch.testing.assert_close(torch.cat(chunks).double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sg.norms().double(), expected.flatten(1).norm(dim=1),
                               rtol=1e-6, atol=1e-6)
    assert emulated and all(call == (dtype, dtype, C) for call in emulated)
    assert sg._read == [None, None]


@pytest.mark.parametrize("scaled", [0, 1])
def test_a_layers_dot_products_read_g_from_the_narrow_factors(scaled, emulated, monkeypatch):
    """One layer's dot products with one direction and with several (the step after a
    tracked one, a tied output layer's call): where T·K reaches _G_ROUTE from G formed chunk
    by chunk on tensor cores, the factors never widened, one chunk's G the scratch declared;
    below it from the factors widened to float32 (δ U), as without the op."""
    gen = torch.Generator().manual_seed(5)
    us = [torch.randn(4, 6, generator=gen) for _ in range(3)]
    expected = (C * brute_force(narrow_layer(torch.bfloat16, scaled)).flatten(1)
                @ torch.stack(us).double().flatten(1).T)  # [N, K]
    monkeypatch.setattr(sample_grads, "_CHUNK_ELEMENTS", 2 * 24)
    for route in (1, 2**62):  # (T·K = 3 or 9: G's route, then the factors')
        monkeypatch.setattr(sample_grads, "_G_ROUTE", route)
        sg = narrow_layer(torch.bfloat16, scaled)
        emulated.clear()
        torch.testing.assert_close(sg.dots_many(us).T.double(), expected, rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(sg.dots(us[1]).double(), expected[:, 1], rtol=1e-5,
                                   atol=1e-5)
        if route == 1:
            assert len(emulated) == 2 * 3  # (three chunks of two samples, twice)
            assert sg._read == [None, None]  # (the factors never widened)
            assert sg.dots_scratch_bytes(3) == 2 * 24 * 4
        else:
            assert not emulated and sg._read[0] is not None
            assert sg.dots_scratch_bytes(3) == 5 * 3 * 3 * 6 * 4


@pytest.mark.parametrize("scaled", [0, 1])
def test_a_stack_forms_g_from_the_narrow_factors(scaled, emulated):
    """G of three layers by one product of their concatenated bfloat16 factors, c as its α;
    the factors are never widened: also where one direction's dot products would come from
    the factors in float32 (the step after a tracked one), G is formed on tensor cores and
    the dot products read it."""
    grads = [narrow_layer(torch.bfloat16, scaled, seed) for seed in range(3)]
    stack = StackedGrads(grads)
    for index, sg in enumerate(grads):
        torch.testing.assert_close(stack.layer(index).double(), C * brute_force(sg),
                                   rtol=1e-6, atol=1e-6)
    assert emulated == [(torch.bfloat16, torch.bfloat16, C)]
    assert stack._factors is None
    gen = torch.Generator().manual_seed(7)
    directions = [[torch.randn(4, 6, generator=gen)] for _ in grads]
    fresh = StackedGrads(grads)
    block = fresh.dots(directions)
    assert fresh._rows is not None and fresh._factors is None
    for index, (sg, (u,)) in enumerate(zip(grads, directions, strict=True)):
        expected = C * brute_force(sg).flatten(1) @ u.double().reshape(-1)
        torch.testing.assert_close(block[0, :, index].double(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stack.dots(directions)[0, :, index].double(), expected,
                                   rtol=1e-5, atol=1e-5)


def autocast_outputs(config: str, monkeypatch, device: str = "cpu", every_k: int = 1,
                     head_on_positions: bool = False) -> tuple[dict, list[int]]:
    """Three steps (four tracked every other) of six Linear layers of one shape on sequences
    under bfloat16 autocast (AdamW, the accelerators' path), every instrument's output, and
    the stacks' sizes (``head_on_positions``: the head a lone Linear layer on sequences)."""
    sizes: list[int] = []
    original = StackedGrads.__init__

    def spy(self, grads):
        sizes.append(len(grads))
        original(self, grads)

    with monkeypatch.context() as patch:
        patch.setattr(StackedGrads, "__init__", spy)
        patch.setattr(histogram_device, "_forced", True)
        torch.manual_seed(0)
        model = Tokens(6, head_on_positions=head_on_positions).to(device)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(12, 5, 6, generator=gen).to(device)
        y = torch.randint(0, 3, (12,), generator=gen).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cockpit = Cockpit(model, configuration(config, every(every_k)), optimizer=opt,
                          strict=True)
        for step in range(3 if every_k == 1 else 4):
            opt.zero_grad()
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = model(x)
            losses = nn.functional.cross_entropy(logits.float(), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()
    return cockpit.get_output(), sizes


@pytest.mark.parametrize("every_k", [1, 2])
def test_a_tracked_step_under_autocast_equals_the_widening_path(every_k, emulated,
                                                                monkeypatch):
    """Economy under bfloat16 autocast, tracked every step and every other (the step after
    a tracked one projects on s_t: from G here, from the widened factors there): every
    value equals the one of factors widened first, up to float32's rounding of c multiplied
    into G instead of into a factor (the histograms' counts may move a value across an
    edge)."""
    narrow, sizes = autocast_outputs("economy", monkeypatch, every_k=every_k)
    products = list(emulated)
    monkeypatch.setattr(narrow_products, "_runs", lambda device_type: (False, False))
    wide, wide_sizes = autocast_outputs("economy", monkeypatch, every_k=every_k)
    assert sizes == wide_sizes and sizes and all(size == 6 for size in sizes)
    assert len(products) == len(sizes)  # (G formed once per stack, also after a tracked one)
    assert products and all(dtype == torch.bfloat16 for dtype, _, _ in products)
    assert len(emulated) == len(products)  # (none without the op)
    assert_close_outputs(wide, narrow)


def test_the_step_after_a_tracked_one_projects_a_lone_layer_through_g(emulated, monkeypatch):
    """Tracked every other step, a lone Linear layer on sequences projects its individual
    gradients on s_t through G formed on tensor cores (T·K from _G_ROUTE on): every value
    equals the one of factors widened first."""
    monkeypatch.setattr(sample_grads, "_G_ROUTE", 1)
    routes: list = []
    real = SequenceOuterSampleGrads._projects_by_g
    monkeypatch.setattr(SequenceOuterSampleGrads, "_projects_by_g",
                        lambda self, k: routes.append(real(self, k)) or routes[-1])
    narrow, _ = autocast_outputs("economy", monkeypatch, every_k=2, head_on_positions=True)
    assert any(routes)  # (the head, at the steps after the tracked ones)
    monkeypatch.setattr(narrow_products, "_runs", lambda device_type: (False, False))
    routes.clear()
    wide, _ = autocast_outputs("economy", monkeypatch, every_k=2, head_on_positions=True)
    assert not any(routes)
    assert_close_outputs(wide, narrow)


def assert_close_outputs(wide: dict, narrow: dict) -> None:
    """Every value of ``narrow`` equal to ``wide``'s to float32 rounding; counts within 4."""
    assert assert_same_outputs(wide, narrow, rtol=1e-4, atol=1e-7, counts_within=4) > 100


def test_the_stack_key_keeps_narrow_layers_apart_from_wide_ones():
    """Layers whose factors arrive in bfloat16 and layers whose factors arrive in float32
    are never stacked together (G would mix the two routes)."""
    narrow = narrow_layer(torch.bfloat16, 0)
    wide = SequenceOuterSampleGrads(*(x.float() for x in narrow.factors), torch.float32, C, 0)
    assert stacked.key(narrow) != stacked.key(wide)
