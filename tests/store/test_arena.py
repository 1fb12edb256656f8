"""Recorded arrays are packed into large blocks (cockpit.store.arena): same values, shared
copies of repeating bin edges, and views into blocks rather than one allocation per array."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cockpit import Cockpit, quantities
from cockpit.store.arena import ArrayArena
from tests.models import make_problem, train


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.float32, np.int8, np.bool_])
def test_kept_arrays_equal_their_originals_and_share_blocks(dtype):
    arena = ArrayArena(block_bytes=4096)
    rng = np.random.default_rng(0)
    originals = [(rng.standard_normal((3, 7)) * 10).astype(dtype) for _ in range(40)]
    kept = [arena.keep(a) for a in originals]
    for a, k in zip(originals, kept, strict=True):
        assert k.dtype == a.dtype and k.shape == a.shape
        np.testing.assert_array_equal(k, a)
        assert k.ctypes.data % 64 == 0  # aligned
    assert all(k.base is not None for k in kept)  # views into blocks
    blocks = {id(k.base) for k in kept}
    per_block = 4096 // (-(-originals[0].nbytes // 64) * 64)
    assert len(blocks) == -(-len(originals) // per_block)
    saved = originals[0].copy()
    originals[0][...] = 0  # the kept copy is independent of the original
    np.testing.assert_array_equal(kept[0], saved)


def test_large_empty_object_and_strided_arrays():
    arena = ArrayArena(block_bytes=4096)
    large = np.arange(1000, dtype=np.int64)  # > block / 8: kept as it is (no copy)
    assert arena.keep(large) is large
    assert arena.keep(np.zeros(0)).shape == (0,)
    objects = np.array([{"a": 1}, None], dtype=object)
    assert arena.keep(objects)[0] == {"a": 1}
    strided = np.arange(20, dtype=np.float64)[::3]
    np.testing.assert_array_equal(arena.keep(strided), strided)


def test_interned_arrays_are_stored_once():
    arena = ArrayArena()
    edges = np.linspace(-2, 2, 101)
    first, second = arena.keep(edges, intern=True), arena.keep(edges.copy(), intern=True)
    assert first is second
    assert arena.keep(edges + 1, intern=True) is not first


def test_recorded_histograms_live_in_blocks_with_shared_edges():
    problem = make_problem("mlp_relu", 5, torch.float64)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.01)
    cockpit = Cockpit(problem.model, [quantities.GradHist1d(), quantities.GradNorm()],
                      optimizer=opt)
    train(problem, cockpit, 3, opt)
    cockpit.close()
    out = cockpit.get_output()
    h0, h1 = out[0]["GradHist1d"], out[1]["GradHist1d"]
    assert h0["edges"] is h1["edges"]
    assert h0["counts"].base is not None and h0["counts"].sum() > 0
    names = [k for k in out[0] if k.startswith("GradHist1d/")]
    assert sum(out[0][k]["counts"].sum() for k in names) == h0["counts"].sum()
    assert isinstance(out[0]["GradNorm"], float)
