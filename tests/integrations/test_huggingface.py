"""Hugging Face models built from tiny configs (no weights are downloaded), called as in the
transformers documentation (``model(input_ids=...)``, position ids left to the model, so
they are [1, T] and broadcast over the batch): every instrument of configuration("full")
against float64 brute force (tests/full_reference.py). Attention runs in the eager
implementation: the curvature instruments need its second derivatives."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers
from torch import nn

from cockpit import Cockpit, quantities
from tests.full_reference import check_full, ggn_diagonal
from tests.reference import gradient_tests, per_sample_backward, rel_close

VOCAB = 7


def lm_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over the tokens of the cross-entropy, [N]."""
    tokens = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                         labels.reshape(-1), reduction="none")
    return tokens.view(labels.shape[0], -1).mean(1)


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=5, n_embd=2, n_layer=1, n_head=1, n_inner=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config)

    def loss_of(model, x, y):
        logits = model(input_ids=x).logits
        return lm_losses(logits[:, :-1], x[:, 1:])

    def batch(generator):
        tokens = torch.randint(0, VOCAB, (4, 5), generator=generator)
        return tokens, tokens

    return model, loss_of, batch


def bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=4, max_position_embeddings=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3, attn_implementation="eager")
    model = transformers.BertForSequenceClassification(config)

    def loss_of(model, x, y):
        return nn.functional.cross_entropy(model(input_ids=x).logits, y, reduction="none")

    return model, loss_of, lambda g: (torch.randint(0, VOCAB, (4, 5), generator=g),
                                      torch.randint(0, 3, (4,), generator=g))


def t5():
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=4, d_kv=2, d_ff=8, num_layers=1, num_decoder_layers=1,
        num_heads=2, dropout_rate=0.0, relative_attention_num_buckets=4,
        decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager")
    model = transformers.T5ForConditionalGeneration(config)

    def loss_of(model, x, y):
        return lm_losses(model(input_ids=x, labels=y).logits, y)

    return model, loss_of, lambda g: (torch.randint(1, VOCAB, (4, 5), generator=g),
                                      torch.randint(1, VOCAB, (4, 3), generator=g))


def vit():
    config = transformers.ViTConfig(
        image_size=4, patch_size=2, num_channels=1, hidden_size=4, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=8, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3, attn_implementation="eager")
    model = transformers.ViTForImageClassification(config)

    def loss_of(model, x, y):
        return nn.functional.cross_entropy(model(pixel_values=x).logits, y, reduction="none")

    return model, loss_of, lambda g: (torch.randn(4, 1, 4, 4, generator=g, dtype=torch.float64),
                                      torch.randint(0, 3, (4,), generator=g))


MODELS = {"gpt2": gpt2, "bert": bert, "t5": t5, "vit": vit}
# the logits of the classifiers' cross-entropy, for the GGN reference; the language models'
# losses (shifted or flattened token losses) are not a loss of the whole output the GGN covers
LOGITS = {"bert": lambda model, x: model(input_ids=x).logits,
          "vit": lambda model, x: model(pixel_values=x).logits}


def build(name: str):
    torch.manual_seed(0)
    model, loss_of, batch = MODELS[name]()
    model = model.double().train()
    generator = torch.Generator().manual_seed(1)
    return model, loss_of, [batch(generator) for _ in range(2)]


@pytest.mark.parametrize("name", list(MODELS))
def test_full_configuration_on_hugging_face_models(name):
    """GPT-2 and BERT pass position ids [1, T] (broadcast over the batch); T5 adds a
    relative-position bias [1, H, T, T] computed once and reused in every layer; ViT's
    position embeddings and class token are parameters broadcast over the batch. Every value
    of configuration("full") equals the float64 reference (T5 computes its layer norms'
    variance in float32, hence its tolerance). Cockpit takes the ``logits`` of the model's
    ``ModelOutput`` as the network output: TICDiag of the classifiers is the exact GGN's,
    against the GGN from the logits' Jacobians."""
    model, loss_of, batches = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_full(model, loss_of, batches, rtol=1e-6 if name == "t5" else 1e-9,
                   logits_of=LOGITS.get(name), ggn_loss=name in LOGITS)


def test_curvature_reads_the_logits_of_a_model_output():
    """A Hugging Face model returns a ModelOutput, not a tensor: Cockpit takes its
    ``logits`` as the network output f(x), so the instruments built on the GGN
    (1/|B|) Σ_n J_nᵀ ∇²_f ℓ_n J_n work in a plain loop: HessTrace and TICTrace on the exact
    GGN, and TICDiag with curvature="auto" (attention is not covered by the exact Hessian
    diagonal, so TICDiag falls back to the GGN). Against the GGN diagonal from the logits'
    Jacobians and one backward pass per sample (float64)."""
    model, loss_of, batches = build("bert")
    x, y = batches[0]
    reference = copy.deepcopy(model)
    tic_diag = quantities.TICDiag()
    chosen = [quantities.HessTrace(curvature="diag_ggn_exact"), tic_diag,
              quantities.TICTrace(curvature="diag_ggn_exact")]
    cockpit = Cockpit(model, chosen, strict=True)
    losses = loss_of(model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TICDiag's note: auto uses the GGN
        with cockpit(0, losses=losses):
            losses.mean().backward()
    cockpit.close()
    out = cockpit.get_output()[0]
    assert tic_diag.method_used == "diag_ggn_exact"
    diag = ggn_diagonal(reference, LOGITS["bert"], x)
    G = per_sample_backward(reference, x, y, loss_of=lambda xn, yn: loss_of(reference, xn, yn))
    n = G.shape[0]
    assert rel_close(out["HessTrace"], diag.sum().item(), 1e-9)
    expected = (G.pow(2).sum(0) / (diag.clamp(min=0) + 1e-7)).sum().item() / n
    assert rel_close(out["TICDiag"], expected, 1e-9)
    expected = G.pow(2).sum(1).mean().item() / (diag.sum().item() + 1e-7)
    assert rel_close(out["TICTrace"], expected, 1e-9)


class _SharedPositions(nn.Module):
    """Position embeddings of ids [T] (no batch dimension at all) and [1, T], plus a learned
    query broadcast by ``expand`` inside a custom layer."""

    def __init__(self, ids_shape: str):
        super().__init__()
        self.ids_shape = ids_shape
        self.tokens, self.positions = nn.Embedding(7, 4), nn.Embedding(5, 4)
        self.query = nn.Linear(1, 4, bias=False)  # a learned query computed from a constant
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        t = torch.arange(x.shape[1])
        ids = t if self.ids_shape == "T" else t.unsqueeze(0)
        h = torch.tanh(self.tokens(x) + self.positions(ids))
        q = self.query(torch.ones(1, 1, 1, dtype=h.dtype)).expand(x.shape[0], -1, -1)
        weights = torch.softmax((h * q).sum(-1), dim=1)
        return self.out((weights.unsqueeze(-1) * h).sum(1))


@pytest.mark.parametrize("ids_shape", ["T", "1T"])
def test_broadcast_layers_have_exact_individual_gradients(ids_shape):
    torch.manual_seed(0)
    model = _SharedPositions(ids_shape).double()
    x, y = torch.randint(0, 7, (6, 5)), torch.randint(0, 3, (6,))
    expected = gradient_tests(per_sample_backward(model, x, y))
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.InnerTest(),
                              quantities.OrthoTest()], strict=True)
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    for test, value in expected.items():
        assert rel_close(cockpit.get_output()[0][test], value, 1e-10), test


def test_sequence_length_equal_to_batch_size_is_not_taken_for_the_batch():
    """Relative-position ids [T, T] with T = N: the output looks batched by its shape; the
    autograd graph shows it is broadcast over the batch."""
    torch.manual_seed(0)

    class RelativeBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias, self.value = nn.Embedding(9, 1), nn.Linear(3, 3)

        def forward(self, x):  # x: [N, T, 3]
            t = torch.arange(x.shape[1])
            relative = (t[None, :] - t[:, None]) + 4  # [T, T]
            scores = self.bias(relative).squeeze(-1).unsqueeze(0) + x @ x.transpose(1, 2)
            return (torch.softmax(scores, -1) @ self.value(x)).mean(1)

    model = RelativeBias().double()
    x, y = torch.randn(4, 4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    expected = gradient_tests(per_sample_backward(model, x, y))
    cockpit = Cockpit(model, [quantities.NormTest()], strict=True)
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    assert rel_close(cockpit.get_output()[0]["NormTest"], expected["NormTest"], 1e-10)


def test_ggn_diagonal_alone_sees_each_samples_share_of_a_broadcast():
    """HessTrace without any per-sample instrument: the GGN backprops of a position
    embedding of ids [1, T] must also be split per sample (summed, the trace was 10 % high)."""
    torch.manual_seed(0)

    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(7, 4), nn.Embedding(5, 4)
            self.out = nn.Linear(4, 3)

        def forward(self, x):
            ids = torch.arange(x.shape[1]).unsqueeze(0)
            return self.out(torch.tanh(self.tokens(x) + self.positions(ids)).mean(1))

    model = Positions().double()
    x, y = torch.randint(0, 7, (6, 5)), torch.randint(0, 3, (6,))
    expected = ggn_diagonal(model, lambda m, inputs: m(inputs), x)
    cockpit = Cockpit(model, [quantities.HessTrace(curvature="diag_ggn_exact")], strict=True)
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    assert rel_close(cockpit.get_output()[0]["HessTrace"], expected.sum().item(), 1e-10)
