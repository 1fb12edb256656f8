"""Recurrent layers (nn.RNN, nn.GRU, nn.LSTM): individual-gradient instruments against one
float64 backward pass per sample, in every layout PyTorch offers."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from cockpit import Cockpit, quantities
from tests.full_reference import check_full
from tests.reference import gradient_tests, rel_close


class SequenceNet(nn.Module):
    """A recurrent layer read through its output (mean over time) and/or its last state;
    h0 (and c0) computed from the first input, or left to the layer; optionally packed."""

    def __init__(self, cell, batch_first, bidirectional, layers, given_h0, read, packed,
                 **options):
        super().__init__()
        self.rnn = getattr(nn, cell)(5, 4, num_layers=layers, bidirectional=bidirectional,
                                     batch_first=batch_first, **options)
        directions = 2 if bidirectional else 1
        out = options.get("proj_size", 0) or 4
        self.init = nn.Linear(5, out)
        self.head = nn.Linear(out * directions + out, 3)
        self.cell, self.batch_first, self.given_h0 = cell, batch_first, given_h0
        self.read, self.packed, self.states = read, packed, layers * directions

    def forward(self, x, lengths=None):  # x: [N, T, 5]
        n = x.shape[0]
        inputs = x if self.batch_first else x.transpose(0, 1)
        if self.packed:
            inputs = pack_padded_sequence(inputs, lengths, batch_first=self.batch_first,
                                          enforce_sorted=False)
        hx = None
        if self.given_h0:
            h0 = torch.tanh(self.init(x[:, 0])).unsqueeze(0).expand(self.states, -1, -1)
            if self.cell == "LSTM":
                c0 = torch.zeros(self.states, n, self.rnn.hidden_size, dtype=x.dtype)
                hx = (h0.contiguous(), c0 + h0.sum(-1, keepdim=True))
            else:
                hx = h0.contiguous()
        output, state = self.rnn(inputs, hx)
        h_n = state[0] if self.cell == "LSTM" else state
        if self.packed:
            output, _ = pad_packed_sequence(output, batch_first=self.batch_first,
                                            total_length=x.shape[1])
        output = output if self.batch_first else output.transpose(0, 1)
        features = output.mean(1) if self.read != "state" else torch.zeros_like(output[:, 0])
        last = h_n[-1] if self.read != "output" else torch.zeros_like(h_n[-1])
        return self.head(torch.cat([features, last], -1))


CASES = {
    "lstm-bi-2layers-batch_first-h0": ("LSTM", True, True, 2, True, "both", False, {}),
    "lstm-seq_first-state_only": ("LSTM", False, False, 1, False, "state", False, {}),
    "lstm-proj-bi": ("LSTM", True, True, 2, True, "both", False, {"proj_size": 3}),
    "gru-bi-2layers-seq_first": ("GRU", False, True, 2, False, "both", False, {}),
    "gru-output_only-h0": ("GRU", True, False, 1, True, "output", False, {}),
    "rnn-relu-3layers-h0": ("RNN", True, False, 3, True, "both", False,
                            {"nonlinearity": "relu"}),
    "rnn-tanh-bi-seq_first": ("RNN", False, True, 1, False, "both", False, {}),
    "lstm-packed-bi-h0": ("LSTM", True, True, 2, True, "both", True, {}),
    "gru-packed-seq_first": ("GRU", False, False, 2, False, "both", True, {}),
}
LENGTHS = torch.tensor([6, 2, 4, 6, 1])


def per_sample(model, x, y, lengths):
    rows = []
    for n in range(x.shape[0]):
        model.zero_grad()
        part = None if lengths is None else lengths[n : n + 1]
        nn.functional.cross_entropy(model(x[n : n + 1], part), y[n : n + 1]).backward()
        rows.append(torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if p.grad is None
                               else p.grad.flatten() for p in model.parameters()]))
    model.zero_grad()
    return torch.stack(rows)


@pytest.mark.parametrize("case", list(CASES))
def test_recurrent_individual_gradients_match_per_sample_backward(case):
    cell, batch_first, bidirectional, layers, given_h0, read, packed, options = CASES[case]
    torch.manual_seed(0)
    model = SequenceNet(cell, batch_first, bidirectional, layers, given_h0, read, packed,
                        **options).double()
    x, y = torch.randn(5, 6, 5, dtype=torch.float64), torch.randint(0, 3, (5,))
    lengths = LENGTHS if packed else None
    G = per_sample(model, x, y, lengths)
    expected = {**gradient_tests(G), "GradNorm": G.mean(0).norm().item()}
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.InnerTest(),
                              quantities.OrthoTest(), quantities.GradNorm()], strict=True)
    losses = nn.functional.cross_entropy(model(x, lengths), y, reduction="none")
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    out = cockpit.get_output()[0]
    for key, value in expected.items():
        assert rel_close(out[key], value, 1e-10), (key, out[key], value)


def test_full_configuration_on_a_char_rnn():
    """A character model (embedding, 2-layer LSTM, the next character from the last
    output): every instrument of configuration("full") against the reference (Alpha's
    projections, both histograms, curvature from the dense Hessian or the GGN)."""
    torch.manual_seed(0)

    class CharRNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(6, 3)
            self.lstm = nn.LSTM(3, 3, num_layers=2, batch_first=True)
            self.out = nn.Linear(3, 6)

        def forward(self, x):
            return self.out(self.lstm(self.embed(x))[0][:, -1])

    def loss_of(model, x, y):
        return nn.functional.cross_entropy(model(x), y, reduction="none")

    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 6, (4, 5), generator=generator),
                torch.randint(0, 6, (4,), generator=generator)) for _ in range(2)]
    check_full(CharRNN().double(), loss_of, batches, logits_of=lambda model, x: model(x))


def test_dropout_between_layers_is_reported():
    model = nn.ModuleList([nn.GRU(5, 4, num_layers=2, dropout=0.5, batch_first=True),
                           nn.Linear(4, 3)])
    x, y = torch.randn(4, 3, 5), torch.randint(0, 3, (4,))
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.GradNorm()])
    losses = nn.functional.cross_entropy(model[1](model[0](x)[1][-1]), y, reduction="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cockpit(0, losses=losses):
            losses.mean().backward()
        cockpit.close()
    assert any("dropout" in str(w.message) for w in caught)
    assert cockpit.get_output()[0]["NormTest"] is None
    assert "dropout=0.5" in cockpit.get_notes()[0]["NormTest"]
    assert cockpit.get_output()[0]["GradNorm"] > 0
