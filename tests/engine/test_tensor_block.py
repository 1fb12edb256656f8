"""Many tensors side by side in one block (``cockpit.engine.tensor_block``): every tensor's
sum of squares and the norms of differences against float64 sums over the tensors
themselves, a few ops and tensors made however many tensors there are; the lists a block
does not take; tracked steps whose instruments read many parameters by blocks equal those
by multi-tensor ops, at far fewer tensors made."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cockpit import Cockpit, configuration
from cockpit.engine import tensor_block
from cockpit.engine.histograms import device as histogram_device
from cockpit.engine.tensor_block import ROWS, TensorBlock
from tests.engine.test_memory_budget import assert_same_outputs
from tests.models import Problem, train

# a convolution, its bias, Linear weights wider and narrower than the block's rows, an
# embedding, short vectors
SHAPES = [(64, 3, 5, 5), (64,), (96, 64, 3, 3), (96,), (512, 288), (512,), (10, 512),
          (10,), (1000, 16), (7,), (3, 40)]


class Made(TorchDispatchMode):
    """The ops and the tensors they make."""

    def __init__(self):
        super().__init__()
        self.ops, self.tensors = collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func.overloadpacket.__name__] += 1
        self.tensors += sum(isinstance(t, torch.Tensor) for t in tree_leaves(out))
        return out


def tensors(count: int, dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPES[k % len(SHAPES)], generator=gen).to(dtype) * (k + 1)
            for k in range(count)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sums_of_squares_are_each_tensors_own(dtype):
    """Against float64 sums over each tensor: exact in float64; from a float32 or bfloat16
    block, each column's 32 squares summed in float32 (a few units of its ε)."""
    xs = tensors(40, dtype)
    block = TensorBlock.of(xs)
    assert block is not None and block.values.shape[0] == ROWS
    expected = torch.stack([x.double().square().sum() for x in xs])
    sums = block.sq_norms()
    assert sums.dtype == torch.float64
    rtol = 1e-13 if dtype == torch.float64 else 4 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(sums, expected, rtol=rtol, atol=0)


def test_sums_of_squares_make_no_float64_copy_of_the_block():
    """The columns' norms read the float32 block as it is: no copy of it (a float64 norm
    of it widens the whole block first, twice its memory), only the W column sums widened."""
    block = TensorBlock.of(tensors(40))
    assert block is not None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        block.sq_norms()
    copied = [e.input_shapes for e in prof.events()
              if e.name in ("aten::_to_copy", "aten::copy_")]
    assert [list(block.values.shape)] not in [shapes[:1] for shapes in copied]
    assert copied  # (the column sums' widening, [W], is seen)


@pytest.mark.parametrize("scaled", [False, True])
def test_differences_are_each_pairs_own(scaled):
    xs, ys = tensors(40, torch.float64, seed=1), tensors(40, torch.float64, seed=2)
    c = torch.tensor(0.37, dtype=torch.float64)
    diff = TensorBlock.of(xs).subtract(TensorBlock.of(ys), c if scaled else None)
    factor = 0.37 if scaled else 1.0
    expected = torch.stack([(x - factor * y).square().sum() for x, y in zip(xs, ys, strict=True)])
    torch.testing.assert_close(diff.sq_norms(), expected, rtol=1e-12, atol=0)


def test_a_block_reads_each_tensor_in_its_logical_order():
    """p.grad may be channels-last or transposed where Cockpit's copies are contiguous: the
    blocks of both lists hold the same numbers in the same places (differences of zero)."""
    xs = tensors(40, torch.float64)
    strided = [x.contiguous(memory_format=torch.channels_last) if x.dim() == 4
               else x.T.contiguous().T if x.dim() == 2 else x for x in xs]
    assert any(not x.is_contiguous() for x in strided)
    diff = TensorBlock.of(strided).subtract(TensorBlock.of(xs)).sq_norms()
    assert torch.equal(diff, torch.zeros_like(diff))


def test_the_tensors_made_do_not_grow_with_their_number():
    """40 or 120 tensors: the same ops, the same few tensors made (a multi-tensor norm
    makes one per tensor)."""
    counted = []
    for count in (40, 120):
        xs = tensors(count)
        TensorBlock.of(xs)  # (the layout's lengths are made once per set of shapes)
        with Made() as made:
            TensorBlock.of(xs).sq_norms()
        counted.append((made.ops, made.tensors))
        with Made() as foreach:
            torch.stack(torch._foreach_norm(xs, dtype=torch.float64))
        assert foreach.tensors == count + 1
    assert counted[0] == counted[1] and counted[0][1] <= 5


def test_lists_a_block_does_not_take():
    many = tensors(40)
    assert TensorBlock.of(many[:31]) is None  # (few: a multi-tensor op pays)
    assert TensorBlock.of([*many[:-1], many[-1].double()]) is None
    assert TensorBlock.of([*many[:-1], torch.tensor(1.0)]) is None
    assert TensorBlock.of([*many[:-1], torch.zeros(0)]) is None
    assert TensorBlock.of([torch.ones(4, 3, dtype=torch.long)] * 40) is None
    assert TensorBlock.of([*many[:-1], torch.randn(2, 3, device="meta")]) is None

    class Shard(torch.Tensor):  # (a subclass: its values need not be its elements)
        pass

    assert TensorBlock.of([*many[:-1], many[-1].as_subclass(Shard)]) is None
    # one row of many numbers would take a block of ROWS rows: too much padding
    assert TensorBlock.of([*many[:-1], torch.randn(1, 2 ** 21)]) is None


def test_a_pair_of_lists_shares_one_layout(monkeypatch):
    """Two lists in blocks whose difference is one op only where their shapes and dtype
    are the same (on the accelerators' path)."""
    monkeypatch.setattr(histogram_device, "_forced", True)
    xs = tensors(40)
    pair = TensorBlock.pair(xs, [x * 2 for x in xs])
    assert pair is not None and pair[0].lengths is pair[1].lengths
    assert TensorBlock.pair(xs, [x.reshape(-1) for x in xs]) is None
    assert TensorBlock.pair(xs, [x.double() for x in xs]) is None
    monkeypatch.setattr(histogram_device, "_forced", False)
    assert TensorBlock.pair(xs, xs) is None  # (a CPU loops over the tensors either way)


def test_a_kernel_that_refuses_or_lays_out_otherwise_leaves_the_multi_tensor_ops(
        monkeypatch):
    xs = tensors(40)
    assert TensorBlock.of(xs) is not None

    def refused(tensors, dim, chunks):
        raise RuntimeError("not these inputs")

    monkeypatch.setattr(torch, "_chunk_cat", refused)
    assert TensorBlock.of(xs) is None
    monkeypatch.setattr(torch, "_chunk_cat", lambda tensors, dim, chunks: torch.zeros(chunks, 5))
    assert TensorBlock.of(xs) is None


def deep_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers = [m for _ in range(20) for m in (nn.Linear(6, 6), nn.Tanh())]
    model = nn.Sequential(*layers, nn.Linear(6, 3)).double()  # 42 parameters
    return model, torch.randn(16, 6, dtype=torch.float64), torch.randint(0, 3, (16,))


def run(blocks: bool, monkeypatch, optimizer: str = "sgd") -> tuple[dict, int]:
    """Economy over three steps on the accelerators' path (Alpha, the distances, the
    gradient check read every parameter; Alpha checks SGD's update by a fit, Adam's by a
    match), and the tensors the gradient check and the update's instruments made."""
    from cockpit.step.tracked_step import TrackedStep
    with monkeypatch.context() as patch:
        patch.setattr(histogram_device, "_forced", True)
        if not blocks:
            patch.setattr(tensor_block, "_MIN_TENSORS", 10**9)
        made = Made()
        for method in ("measure_gradient_mismatch", "finish_update"):
            original = getattr(TrackedStep, method)

            def counted(self, original=original):
                with made:
                    return original(self)

            patch.setattr(TrackedStep, method, counted)
        model, x, y = deep_mlp()
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
               if optimizer == "sgd" else torch.optim.AdamW(model.parameters(), lr=1e-2))
        cockpit = Cockpit(model, configuration("economy"), optimizer=opt, strict=True)
        problem = Problem("deep MLP", model, x, y, functools.partial(
            nn.functional.cross_entropy, reduction="none"))
        train(problem, cockpit, 3, opt)
        cockpit.close()
    return cockpit.get_output(), made.tensors


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_instruments_of_many_parameters_equal_the_multi_tensor_ops(optimizer, monkeypatch):
    expected, without = run(False, monkeypatch, optimizer)
    got, with_blocks = run(True, monkeypatch, optimizer)
    for name in ("GradientMismatch", "GradNorm", "Distance", "UpdateSize", "ParamNorm",
                 "Alpha"):
        assert all(expected[step].get(name) is not None for step in (0, 1)), name
    assert_same_outputs(expected, got)
    assert with_blocks < without / 3, (with_blocks, without)
