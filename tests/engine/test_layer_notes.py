"""Layers at the edge of the per-sample rules: cells called step by step, EmbeddingBag with
offsets, parametrized weights (weight_norm, spectral_norm, …) — exact against per-sample
backward passes in float64 — and the notes for what cannot be formed (dropout inside a
layer the general rule re-runs, a layer whose input is not batched on its first
dimension)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations

from cockpit import Cockpit, quantities
from tests.reference import gradient_tests, rel_close

QUANTITIES = (quantities.GradNorm, quantities.NormTest, quantities.InnerTest,
              quantities.OrthoTest)


def per_sample(model: nn.Module, sample_loss: Callable[[int], Tensor], n: int) -> Tensor:
    """Individual gradients [N, D] by one backward pass per sample (zeros for parameters a
    sample does not reach)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(n):
        model.zero_grad()
        sample_loss(i).backward()
        rows.append(torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if p.grad is None
                               else p.grad.to_dense().flatten() for p in params]))
    model.zero_grad()
    return torch.stack(rows).double()


def tracked(model: nn.Module, losses_of: Callable[[], Tensor], strict: bool = False
            ) -> tuple[dict, dict, list[str]]:
    """One tracked step: (output, notes, warnings) of step 0."""
    cockpit = Cockpit(model, [q() for q in QUANTITIES], strict=strict)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = losses_of()
        with cockpit(0, losses=losses):
            losses.mean().backward()
        cockpit.close()
    return (cockpit.get_output()[0], cockpit.get_notes().get(0, {}),
            [str(w.message) for w in caught])


def assert_exact(out: dict, G: Tensor, rtol: float = 1e-9) -> None:
    expected = {**gradient_tests(G), "GradNorm": G.mean(0).norm().item()}
    for key, value in expected.items():
        assert out[key] is not None, key
        assert rel_close(out[key], value, rtol), (key, out[key], value)


# ---------------------------------------------------------------------------- cells
class CellNet(nn.Module):
    """A cell stepped over the sequence; the LSTM cell's c also feeds the output."""

    def __init__(self, cell: str, given_state: bool, **options):
        super().__init__()
        self.cell = getattr(nn, cell)(3, 4, **options)
        self.head = nn.Linear(4, 3)
        self.given_state = given_state

    def forward(self, x: Tensor) -> Tensor:
        n, lstm = x.shape[0], isinstance(self.cell, nn.LSTMCell)
        state = None
        if self.given_state:
            h0 = torch.full((n, 4), 0.3, dtype=x.dtype)
            state = (h0, torch.full((n, 4), -0.2, dtype=x.dtype)) if lstm else h0
        extra = 0
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
            if lstm:
                extra = extra + state[1].sum(1, keepdim=True)
        return self.head(state[0] if lstm else state) + extra


@pytest.mark.parametrize("given_state", [False, True], ids=["hx_none", "hx_given"])
@pytest.mark.parametrize("cell,options", [
    ("RNNCell", {}), ("RNNCell", {"nonlinearity": "relu"}), ("GRUCell", {}),
    ("LSTMCell", {}), ("LSTMCell", {"bias": False})],
    ids=["rnn-tanh", "rnn-relu", "gru", "lstm", "lstm-nobias"])
def test_cells_match_per_sample_backward(cell, options, given_state):
    torch.manual_seed(0)
    model = CellNet(cell, given_state, **options).double()
    x, y = torch.randn(4, 3, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    G = per_sample(model, lambda i: F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), 4)
    out, notes, _ = tracked(model, lambda: F.cross_entropy(model(x), y, reduction="none"),
                            strict=True)
    assert not notes
    assert_exact(out, G)


# ---------------------------------------------------------------------------- EmbeddingBag
BAGS = [[1, 2, 3], [], [2, 2], [4, 1, 4, 0, 6], [5]]


class BagNet(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.bag = nn.EmbeddingBag(7, 3, **options)
        self.head = nn.Linear(3, 3)

    def forward(self, *args, **kwargs) -> Tensor:
        return self.head(torch.tanh(self.bag(*args, **kwargs)))


@pytest.mark.parametrize("last", [False, True], ids=["offsets", "include_last_offset"])
@pytest.mark.parametrize("padding_idx", [None, 2], ids=["no_padding", "padding_2"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_with_offsets_matches_per_bag_backward(mode, padding_idx, last):
    """1-D input and offsets (bags of any length, an empty one, a bag of padding only):
    each bag is one sample."""
    torch.manual_seed(0)
    model = BagNet(mode=mode, padding_idx=padding_idx, include_last_offset=last).double()
    bags = [torch.tensor(b, dtype=torch.long) for b in BAGS]
    ends = torch.tensor([len(b) for b in BAGS]).cumsum(0)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), ends if last else ends[:-1]])
    text, y = torch.cat(bags), torch.randint(0, 3, (len(bags),))

    def sample_loss(i: int) -> Tensor:
        alone = torch.tensor([0, len(bags[i])] if last else [0])
        return F.cross_entropy(model(bags[i], alone), y[i : i + 1])

    G = per_sample(model, sample_loss, len(bags))
    out, notes, _ = tracked(
        model, lambda: F.cross_entropy(model(text, offsets), y, reduction="none"), strict=True)
    assert not notes
    assert_exact(out, G)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_2d_and_per_sample_weights(mode):
    """2-D input [N, L] (as keyword), and per_sample_weights with offsets (sum mode)."""
    torch.manual_seed(1)
    model = BagNet(mode=mode).double()
    x, y = torch.randint(0, 7, (5, 4)), torch.randint(0, 3, (5,))
    G = per_sample(model, lambda i: F.cross_entropy(model(input=x[i : i + 1]),
                                                    y[i : i + 1]), 5)
    out, _, _ = tracked(model, lambda: F.cross_entropy(model(input=x), y, reduction="none"),
                        strict=True)
    assert_exact(out, G)
    if mode != "sum":
        return
    weights = torch.rand(x.numel(), dtype=torch.float64)
    offsets = torch.arange(0, x.numel(), 4)
    G = per_sample(model, lambda i: F.cross_entropy(
        model(x[i], torch.tensor([0]), weights[4 * i : 4 * i + 4]), y[i : i + 1]), 5)
    out, _, _ = tracked(model, lambda: F.cross_entropy(
        model(x.reshape(-1), offsets, weights), y, reduction="none"), strict=True)
    assert_exact(out, G)


# ---------------------------------------------------------------------------- parametrized
def linear_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))


def conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3))


class Twice(nn.Module):
    """One layer called twice per forward pass (its weight is computed at each call)."""

    def __init__(self):
        super().__init__()
        self.layer, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.layer(torch.tanh(self.layer(x)))))


def first_layer(model: nn.Module) -> nn.Module:
    return model.layer if isinstance(model, Twice) else model[0]


WRAPS = {
    "weight_norm": parametrizations.weight_norm,
    "spectral_norm": parametrizations.spectral_norm,
    "orthogonal": parametrizations.orthogonal,
    "hook_weight_norm": torch.nn.utils.weight_norm,
    "hook_spectral_norm": torch.nn.utils.spectral_norm,
}


@pytest.mark.parametrize("net", [linear_net, conv_net, Twice], ids=["linear", "conv", "twice"])
@pytest.mark.parametrize("wrap", list(WRAPS))
def test_parametrized_weights_match_per_sample_backward(wrap, net):
    """g_n(θ_i) = (∂P/∂θ_i)ᵀ g_n(W) for W = P(θ). Spectral norm's power iteration updates
    u, v in the training forward pass; the reference then runs in eval mode with them."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (the hook-based forms)
        model = net().double()
        WRAPS[wrap](first_layer(model))
    shape = (5, 2, 6) if net is conv_net else (5, 4)
    x, y = torch.randn(*shape, dtype=torch.float64), torch.randint(0, 3, (5,))
    out, notes, _ = tracked(model, lambda: F.cross_entropy(model(x), y, reduction="none"))
    if "spectral" in wrap and net is Twice:  # two calls, two power iterations, two weights
        assert out["NormTest"] is None
        assert "power iteration" in notes["NormTest"] and "once per forward" in notes["NormTest"]
        return
    assert not notes
    if "spectral" in wrap:
        model.eval()  # (u, v as the tracked forward pass left them; no further iteration)
    G = per_sample(model, lambda i: F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), 5)
    assert_exact(out, G)


def test_parametrized_weight_read_outside_its_layer_is_reported():
    """The weight also used outside the layer's forward: its individual gradients from the
    layer alone would be incomplete."""
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = parametrizations.weight_norm(nn.Linear(4, 4))

        def forward(self, x: Tensor) -> Tensor:
            return torch.tanh(self.layer(x)) @ self.layer.weight.T

    model = Tied().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 4, (5,))
    out, notes, _ = tracked(model, lambda: F.cross_entropy(model(x), y, reduction="none"))
    assert out["NormTest"] is None and out["GradNorm"] > 0
    assert "layer: the parametrized weight" in notes["NormTest"]
    assert "outside the layer's forward" in notes["NormTest"]


def test_parametrized_weight_of_a_layer_without_rule_is_reported():
    torch.manual_seed(0)

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: Tensor) -> Tensor:
            return x @ self.weight

    model = nn.Sequential(Scale(), nn.Tanh(), nn.Linear(4, 3)).double()
    parametrizations.weight_norm(model[0])
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    out, notes, _ = tracked(model, lambda: F.cross_entropy(model(x), y, reduction="none"))
    assert out["NormTest"] is None
    note = notes["NormTest"]
    assert note.startswith("0.parametrizations.weight: ") and "Scale" in note
    assert "remove_parametrizations" in note


# ---------------------------------------------------------------------------- dropout
def test_dropout_in_attention_is_reported_with_the_way_out():
    torch.manual_seed(0)

    class Encoder(nn.Module):
        def __init__(self, dropout: float):
            super().__init__()
            self.block = nn.TransformerEncoderLayer(8, 2, 16, dropout=dropout,
                                                    batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.block(x).mean(1))

    model = Encoder(0.1).double()
    x, y = torch.randn(4, 5, 8, dtype=torch.float64), torch.randint(0, 3, (4,))
    out, notes, caught = tracked(model, lambda: F.cross_entropy(model(x), y, reduction="none"))
    assert out["NormTest"] is None and out["GradNorm"] > 0
    note = notes["NormTest"]
    assert note.startswith("block.self_attn: MultiheadAttention with dropout=0.1")
    assert "`model.block.self_attn.dropout = 0.0`" in note
    assert "vmap" not in note and any("dropout" in w for w in caught)
    # the way out: the attention's own dropout 0 (the block's other dropouts are then the
    # only random ones; all 0 here, for the reference)
    exact = Encoder(0.0).double()
    G = per_sample(exact, lambda i: F.cross_entropy(exact(x[i : i + 1]), y[i : i + 1]), 4)
    out, notes, _ = tracked(exact, lambda: F.cross_entropy(exact(x), y, reduction="none"))
    assert not notes
    assert_exact(out, G, rtol=1e-8)


@pytest.mark.parametrize("kind", ["dropout_child", "sdpa_dropout"])
def test_dropout_inside_a_custom_layer_is_reported(kind):
    torch.manual_seed(0)

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(6, 6) / 6**0.5)
            self.drop = nn.Dropout(0.3)

        def forward(self, x: Tensor) -> Tensor:
            h = x @ self.weight
            if kind == "dropout_child":
                return self.drop(h)
            return F.scaled_dot_product_attention(h, h, h, dropout_p=0.2)

    model = nn.Sequential(Mixer(), nn.Flatten(), nn.Linear(18, 3))
    x, y = torch.randn(4, 3, 6), torch.randint(0, 3, (4,))
    out, notes, _ = tracked(model, lambda: F.cross_entropy(model(x), y, reduction="none"))
    assert out["NormTest"] is None
    note = notes["NormTest"]
    assert note.startswith("0: this layer (Mixer) draws random numbers")
    assert "`model.0.eval()`" in note and "outside the module" in note


# ---------------------------------------------------------------------------- batch layout
def test_sequence_first_input_note_names_the_layout():
    """A Linear on a sequence-first tensor [T, N, F] with T ≠ N: the note says where Cockpit
    reads the batch and both possible causes (not only the losses)."""
    torch.manual_seed(0)

    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(5, 6), nn.Linear(6, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(torch.tanh(self.lin(x.transpose(0, 1))).mean(0))

    model = SeqFirst()
    x, y = torch.randn(4, 7, 5), torch.randint(0, 3, (4,))
    out, notes, _ = tracked(model, lambda: F.cross_entropy(model(x), y, reduction="none"))
    assert out["NormTest"] is None
    note = notes["NormTest"]
    assert note.startswith("lin: this layer (Linear) has 7 rows")
    for part in ("`losses` has 4 entries", "first dimension of each layer's input",
                 "batch_first=True", "sequence-first", "shared by the whole batch"):
        assert part in note, part


def test_shared_table_note_and_its_way_out():
    """A Linear applied to a table shared by the batch (C ≠ N): the note; then the way it
    names, a per-sample view of the table, gives exact numbers."""
    torch.manual_seed(0)

    class LabelEmbed(nn.Module):
        def __init__(self, per_sample_view: bool):
            super().__init__()
            self.f, self.g = nn.Linear(5, 6), nn.Linear(3, 6, bias=False)
            self.register_buffer("table", torch.randn(3, 3))
            self.per_sample_view = per_sample_view

        def forward(self, x: Tensor) -> Tensor:
            if not self.per_sample_view:
                return torch.tanh(self.f(x)) @ self.g(self.table).T
            table = self.g(self.table.expand(x.shape[0], *self.table.shape))
            return torch.einsum("nf,ncf->nc", torch.tanh(self.f(x)), table)

    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    model = LabelEmbed(False).double()
    out, notes, _ = tracked(model, lambda: F.cross_entropy(model(x), y, reduction="none"))
    assert out["NormTest"] is None
    assert notes["NormTest"].startswith("g: this layer (Linear) has 3 rows")
    assert "table.expand(batch_size, *table.shape)" in notes["NormTest"]
    model.per_sample_view = True
    G = per_sample(model, lambda i: F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), 4)
    out, notes, _ = tracked(model, lambda: F.cross_entropy(model(x), y, reduction="none"))
    assert not notes
    assert_exact(out, G)


# ------------------------------------------------- inputs shared by the batch (fallback)
class MaskedMix(nn.Module):
    """A user's own attention layer (the general rule) that takes a causal mask [T, T],
    shared by every sample, and counts its calls in a buffer."""

    def __init__(self, width: int):
        super().__init__()
        self.q = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.v = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, mask):
        self.calls += 1
        scores = (x @ self.q) @ x.transpose(1, 2)
        return scores.masked_fill(mask, float("-inf")).softmax(-1) @ (x @ self.v)


class MaskedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix, self.head = MaskedMix(6), nn.Linear(6, 3)

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        return self.head(self.mix(x, mask).mean(1))


@pytest.mark.parametrize("length", [8, 5], ids=["T = N", "T != N"])
def test_an_input_shared_by_the_batch_is_not_sliced_even_when_its_size_is_the_batchs(length):
    """A mask [T, T] with T = |B| looks batched by its shape; run once per layer and input
    shapes, the layer tells it apart (exact), leaving no trace: the buffers it changes and
    the random numbers of the training are as without Cockpit."""
    n = 8
    torch.manual_seed(0)
    model = MaskedNet().double()
    x = torch.randn(n, length, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    G = per_sample(model, lambda i: F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), n)
    calls = float(model.mix.calls)
    torch.manual_seed(5)
    first_draw = torch.rand(())
    torch.manual_seed(5)
    out, _, _ = tracked(model, lambda: F.cross_entropy(model(x), y, reduction="none"))
    assert torch.rand(()) == first_draw  # (Cockpit took no random number of the training's)
    assert float(model.mix.calls) == calls + 1  # (the tracked forward pass only)
    assert_exact(out, G)


# --------------------------------------------------- sequence-first transformer layers
class SequenceFirstEncoder(nn.Module):
    """PyTorch's transformer layers with their default batch_first=False: every layer in
    them sees [T, N, …]."""

    def __init__(self, layers: int):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0)
        self.enc = (nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
                    if layers > 1 else layer)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.enc(self.emb(tokens).transpose(0, 1)).mean(0))


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("length", [4, 6], ids=["T = N", "T != N"])
def test_layers_inside_a_sequence_first_transformer_layer_are_exact(layers, length):
    """Their Linear and LayerNorm layers read [T, N, …] with the batch moved to the front
    (also where T = |B|, which no shape could tell apart)."""
    n = 4
    torch.manual_seed(0)
    model = SequenceFirstEncoder(layers).double()
    tokens, y = torch.randint(0, 10, (n, length)), torch.randint(0, 3, (n,))
    G = per_sample(model, lambda i: F.cross_entropy(model(tokens[i:i + 1]), y[i:i + 1]), n)
    out, _, _ = tracked(model, lambda: F.cross_entropy(model(tokens), y, reduction="none"))
    assert_exact(out, G)
