"""Factored individual gradients (a Linear layer's δ_n a_nᵀ, over sequences Σ_t δ_{n,t}
a_{n,t}ᵀ) formed in sample chunks of at most ``_CHUNK_ELEMENTS`` numbers: the chunks are
the materialized gradients in order, all samples at once (without a split) where they fit;
a factor held narrow (autocast) is widened when read, and dropped again by ``compact``."""

from __future__ import annotations

import pytest
import torch

from cockpit.engine.rules import sample_grads
from cockpit.engine.rules.sample_grads import OuterSampleGrads, SequenceOuterSampleGrads
from tests.engine.test_host_syncs import Count


def factors(kind: str, narrow: bool = False):
    gen = torch.Generator().manual_seed(0)
    if kind == "outer":
        return OuterSampleGrads(torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen))
    delta = torch.randn(6, 5, 4, generator=gen)
    a = torch.randn(6, 5, 3, generator=gen)
    if narrow:
        return SequenceOuterSampleGrads(delta.bfloat16(), a, torch.float32)
    return SequenceOuterSampleGrads(delta, a)


@pytest.mark.parametrize("kind", ["outer", "sequence", "narrow sequence"])
@pytest.mark.parametrize(("elements", "chunks"), [(2**25, 1), (12 * 2, 3), (1, 6)])
def test_chunks_are_the_individual_gradients_in_order(kind, elements, chunks, monkeypatch):
    monkeypatch.setattr(sample_grads, "_CHUNK_ELEMENTS", elements)
    sg = factors(kind.split()[-1], narrow=kind.startswith("narrow"))
    with Count() as counted:
        formed = list(sg.iter_chunks())
    assert len(formed) == chunks
    assert ("split" in counted.ops) == (chunks > 1)
    expected = sg.materialize()
    assert expected.dtype == torch.float32
    torch.testing.assert_close(torch.cat(formed), expected, rtol=1e-6, atol=1e-6)


def test_a_narrow_factor_is_widened_when_read_and_dropped_by_compact():
    sg = factors("sequence", narrow=True)
    assert sg.dtype == torch.float32 and sg._read == [None, None]
    widened = sg.delta
    assert widened.dtype == torch.float32 and sg.delta is widened  # (kept while in use)
    assert torch.equal(widened, sg._factors[0].float())
    assert sg.compact() is sg and sg._read == [None, None]
    part = sg.select(2, 4)
    assert part._factors[0].dtype == torch.bfloat16 and part.dtype == torch.float32
    torch.testing.assert_close(part.materialize(), sg.materialize()[2:4])
