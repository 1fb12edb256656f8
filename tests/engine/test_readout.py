"""The step's values cross to the host once (cockpit.engine.readout)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cockpit import Cockpit, quantities
from cockpit.engine.readout import Failed, Later, Noted, Readout
from cockpit.quantities.base import Quantity
from tests.models import make_problem


def test_tensors_are_read_as_they_were_when_sent_exactly_in_float64():
    readout = Readout()
    x = torch.tensor([1.0, 2.0 ** -20 + 1.0], dtype=torch.float32)
    counts = torch.tensor([[2**40 + 1, 3]])
    first = readout.later(Later(lambda a, c: (a.copy(), c.copy()), x, counts))
    readout.send()
    x.zero_()  # changed after the record: the copy holds the sent numbers
    second = readout.later(Later(lambda y: float(y), torch.tensor(0.1, dtype=torch.bfloat16)))
    failing = readout.later(Later(lambda: 1 / 0, name="Broken"))
    results = readout.receive()
    a, c = results[first]
    assert a.tolist() == [1.0, 2.0 ** -20 + 1.0] and a.dtype == np.float64
    assert c.shape == (1, 2) and c[0, 0] == 2**40 + 1
    assert results[second] == float(torch.tensor(0.1, dtype=torch.bfloat16))
    assert isinstance(results[failing], Failed) and results[failing].name == "Broken"
    assert not readout


@pytest.mark.parametrize("with_float64", [False, True])
def test_mixed_dtypes_arrive_exactly(with_float64):
    """Counts beyond 2^24 (int64) next to float32 values are packed without passing through
    float32, with or without a float64 tensor in the record (which decides how the record is
    promoted)."""
    readout = Readout()
    counts = torch.tensor([[2**40 + 1, 2**24 + 1]])
    x = torch.tensor([2.0 ** -20 + 1.0, 1e-30], dtype=torch.float32)
    tensors = [counts, x, torch.tensor(0.1, dtype=torch.float16)]
    if with_float64:
        tensors.append(torch.tensor([1.0 + 2.0**-50], dtype=torch.float64))
    index = readout.later(Later(lambda *arrays: [a.copy() for a in arrays], *tensors))
    readout.send()
    got = readout.receive()[index]
    for array, tensor in zip(got, tensors, strict=True):
        assert array.dtype == np.float64 and array.shape == tuple(tensor.shape)
        assert array.tolist() == tensor.double().tolist()
    assert got[0][0, 0] == 2**40 + 1 and got[0][0, 1] == 2**24 + 1


class _Noted(Quantity):
    needs_losses = False

    def __init__(self, fail: bool):
        super().__init__()
        self.fail = fail

    def compute(self, data):
        def values(total):
            if self.fail:
                raise ValueError("no value")
            return Noted({"_Noted": float(total)}, {"_Noted": "a note"},
                         (("a warning", "noted"),))

        grads = list(data.batch_grads.values())
        return Later(values, sum(g.sum() for g in grads))


@pytest.mark.parametrize("fail", [False, True])
def test_values_notes_and_failures_arrive_at_the_next_step(fail):
    problem = make_problem("mlp_relu", 4)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.1)
    written = []

    class Sink:
        def write_step(self, step, values, notes):
            written.append(step)

        def close(self):
            pass

    cockpit = Cockpit(problem.model, [_Noted(fail), quantities.Loss()], optimizer=opt,
                      sinks=[Sink()])
    with pytest.warns(RuntimeWarning, match="no value" if fail else "a warning"):
        for step in range(2):
            opt.zero_grad()
            losses = problem.losses()
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
            assert written == list(range(step))  # step t is read when step t + 1 starts
        output, notes = cockpit.get_output(), cockpit.get_notes()
    assert written == [0, 1]
    if fail:
        assert output[1]["_Noted"] is None and notes[1]["_Noted"] == "failed: no value"
    else:
        assert output[1]["_Noted"] == pytest.approx(float(
            sum(p.grad.sum() for p in problem.model.parameters())))
        assert notes[1]["_Noted"] == "a note"
    assert output[1]["Loss"] == pytest.approx(float(losses.mean()))
    cockpit.close()


def test_scalars_travel_stacked_and_arrive_in_their_places():
    """0-dim tensors of a record are stacked into one part (one op, not a view each), placed
    after the others; each value arrives where its Later expects it, exactly (int64 beside
    float32 does not pass through float32)."""
    from cockpit.engine.readout import Later, Readout

    readout = Readout()
    big = 2**40 + 1
    tensors = [torch.tensor(1.5), torch.arange(3.0), torch.tensor(big),
               torch.ones(2, 2, dtype=torch.float64), torch.tensor(0.25, dtype=torch.float32)]
    readout.later(Later(lambda a, b: {"a": float(a), "b": b.tolist()}, *tensors[:2]))
    readout.later(Later(lambda c, d, e: {"c": int(c), "d": d.tolist(), "e": float(e)},
                        *tensors[2:]))
    first, second = readout.receive()
    assert first == {"a": 1.5, "b": [0.0, 1.0, 2.0]}
    assert second == {"c": big, "d": [[1.0, 1.0], [1.0, 1.0]], "e": 0.25}
