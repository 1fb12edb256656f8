"""Cockpit's Hugging Face Trainer callback against the Trainer without Cockpit: attaching it
must not change what the Trainer trains (label smoothing, the problem types of
classification heads, a causal LM the class names do not tell), and must say so where it
cannot keep the objective (an auxiliary loss) or sees nothing (an overridden
``compute_loss``). Resuming from a checkpoint in another folder keeps Distance's θ_0, and the
``report_to`` loggers get Cockpit's values at the Trainer's step of the same update. Tiny
float64 models built from configs; SGD, so equal losses give equal parameters."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.data import Dataset

from cockpit import quantities
from cockpit.integrations import transformers as integration
from cockpit.integrations.transformers import CockpitCallback, sequence_losses

VOCAB, LENGTH, SIZE = 11, 6, 8

pytestmark = pytest.mark.usefixtures("one_thread")


class Examples(Dataset):
    """Token sequences of one length (no padding) with the labels ``label(n, generator)``."""

    def __init__(self, label, size: int = SIZE, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(size):
            ids = torch.randint(1, VOCAB, (LENGTH,), generator=generator)
            self.items.append({"input_ids": ids, "labels": label(ids, generator)})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, n: int) -> dict:
        return self.items[n]


def trainer_for(model, data, outdir, *, callback=None, steps: int = 2, trainer_class=None,
                **arguments) -> transformers.Trainer:
    """SGD with a constant learning rate, batches of 4, nothing saved unless asked."""
    settings = {"max_steps": steps, "per_device_train_batch_size": 4, "learning_rate": 0.1,
                "optim": "sgd", "lr_scheduler_type": "constant", "weight_decay": 0.0,
                "max_grad_norm": 0.0, "report_to": [], "save_strategy": "no",
                "use_cpu": True, "disable_tqdm": True, **arguments}
    args = transformers.TrainingArguments(output_dir=str(outdir), **settings)
    trainer = (trainer_class or transformers.Trainer)(model=model, args=args,
                                                      train_dataset=data)
    if callback is not None:
        callback.attach(trainer)
    return trainer


def parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def assert_same_training(make, data, tmp_path, atol: float = 1e-14,
                         **arguments) -> CockpitCallback:
    """The parameters after the Trainer's steps with Cockpit attached equal those without
    (to ``atol``, rtol 1e-12), and moved (the update is not zero)."""
    plain = make()
    start = parameters(plain)
    trainer_for(plain, data, tmp_path / "plain", **arguments).train()
    tracked = make()
    callback = CockpitCallback([quantities.Loss(), quantities.GradNorm()], strict=True)
    trainer_for(tracked, data, tmp_path / "tracked", callback=callback, **arguments).train()
    torch.testing.assert_close(parameters(tracked), parameters(plain), rtol=1e-12, atol=atol)
    assert (parameters(plain) - start).norm() > 1e-3
    return callback


def bert_classifier(num_labels: int = 3, problem_type: str | None = None):
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=8, max_position_embeddings=8, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=num_labels, problem_type=problem_type)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification._from_config(
        config, attn_implementation="eager").double()


def class_label(ids, generator):
    return torch.randint(0, 3, (), generator=generator)


# ----------------------------------------------------------------- label smoothing
def test_label_smoothing_trains_as_the_trainer_does(tmp_path):
    """``label_smoothing_factor=0.2`` on a classifier: the Trainer's label smoother averages
    (1 − ε)·(−log p_y) + ε·mean_c(−log p_c) over the batch; Cockpit's mean of the smoothed
    individual losses is the same loss, so the parameters after three steps are equal (they
    differ from a run without smoothing by more than 1e-6). The smoother sums its ε term in
    float32: ~1e-11 from float64, hence atol 1e-9."""
    data = Examples(class_label)
    callback = assert_same_training(bert_classifier, data, tmp_path, atol=1e-9, steps=3,
                                    label_smoothing_factor=0.2)
    unsmoothed = bert_classifier()
    trainer_for(unsmoothed, data, tmp_path / "unsmoothed", steps=3).train()
    smoothed = bert_classifier()
    trainer_for(smoothed, data, tmp_path / "smoothed", steps=3,
                label_smoothing_factor=0.2).train()
    assert (parameters(smoothed) - parameters(unsmoothed)).norm() > 1e-6
    assert sorted(callback.cockpit.get_output()) == [0, 1, 2]


def test_smoothed_token_losses_equal_the_label_smoother_per_sequence():
    """Token labels with −100 (padding, a prompt token), shifted as for a causal LM and
    not: ℓ_n is the mean over the sequence's targets of (1 − ε)·(−log p_y) + ε·mean_c(−log
    p_c) (a loop over the tokens), and the Trainer's ``LabelSmoother`` on sequence n alone
    (to 1e-6: it sums the ε term in float32)."""
    from transformers.trainer_pt_utils import LabelSmoother

    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, LENGTH, VOCAB, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (4, LENGTH), generator=generator)
    labels[0, 4:] = -100
    labels[2, 1] = -100
    epsilon = 0.3
    for shift in (False, True):
        got = sequence_losses(logits, labels, shift=shift, label_smoothing=epsilon)
        for n in range(4):
            terms = []
            for t in range(LENGTH - shift):
                y = int(labels[n, t + shift])
                if y != -100:
                    nll = -torch.log_softmax(logits[n, t], -1)
                    terms.append((1 - epsilon) * nll[y] + epsilon * nll.mean())
            assert float(got[n]) == pytest.approx(float(sum(terms) / len(terms)), rel=1e-12)
            smoother = LabelSmoother(epsilon=epsilon)
            want = smoother({"logits": logits[n:n + 1]}, labels[n:n + 1], shift_labels=shift)
            assert float(got[n]) == pytest.approx(float(want), rel=1e-6)


# ----------------------------------------------------------------- problem types
PROBLEMS = {
    # num_labels, config.problem_type, label of an example
    "regression, one output, integer scores": (1, None, lambda ids, g: torch.randint(0, 5, ())),
    "regression, one output": (1, None, lambda ids, g: torch.randn((), dtype=torch.float64,
                                                                    generator=g)),
    "regression, two outputs": (2, "regression",
                                lambda ids, g: torch.randn(2, dtype=torch.float64, generator=g)),
    "single label": (3, None, class_label),
    "multi-label": (3, "multi_label_classification",
                    lambda ids, g: torch.randint(0, 2, (3,), generator=g).double()),
    "multi-label, inferred": (3, None,
                              lambda ids, g: torch.randint(0, 2, (3,), generator=g).double()),
}


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_classification_heads_follow_the_models_problem_type(tmp_path, problem):
    """The individual losses of a ``*ForSequenceClassification`` head follow its
    ``config.problem_type`` (or the model's rule where it is None: one output is
    regression, integer labels single-label, else multi-label): their mean is the model's
    own loss (the model called with the labels), and training with Cockpit equals the
    Trainer's without it."""
    num_labels, problem_type, label = PROBLEMS[problem]
    data = Examples(label)
    model = bert_classifier(num_labels, problem_type)
    batch = torch.utils.data.default_collate(data.items)
    logits = model(input_ids=batch["input_ids"]).logits
    losses = sequence_losses(logits, batch["labels"],
                             problem_type=model.config.problem_type).detach()
    assert losses.shape == (SIZE,)
    own = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.detach()
    assert float(losses.mean()) == pytest.approx(float(own), rel=1e-12)
    assert_same_training(lambda: bert_classifier(num_labels, problem_type), data, tmp_path)


# ----------------------------------------------------------------- shifted token labels
class TinyConfig(transformers.PretrainedConfig):
    model_type = "cockpit_test_tiny_lm"

    def __init__(self, vocab_size: int = VOCAB, hidden: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.hidden = vocab_size, hidden


class TinyLM(transformers.PreTrainedModel):
    """A causal LM whose class name none of transformers' mappings knows: position t sees
    the tokens up to t (a running mean); its own loss is the shifted token cross-entropy."""

    config_class = TinyConfig

    def __init__(self, config: TinyConfig):
        super().__init__(config)
        self.embedding = nn.Embedding(config.vocab_size, config.hidden)
        self.out = nn.Linear(config.hidden, config.vocab_size)
        self.post_init()

    def forward(self, input_ids, labels=None, **kwargs):
        counts = torch.arange(1, input_ids.shape[1] + 1, dtype=torch.float64)
        logits = self.out(torch.tanh(self.embedding(input_ids).cumsum(1) / counts[:, None]))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1))
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


def tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyConfig()).double()


def copy_label(ids, generator):
    return ids.clone()


def record_losses(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The labels and individual losses the callback computes, as (labels, losses)."""
    recorded = []

    def recording(logits, labels, **kwargs):
        losses = sequence_losses(logits, labels, **kwargs)
        recorded.append((labels.clone(), losses.detach().clone()))
        return losses

    monkeypatch.setattr(integration, "sequence_losses", recording)
    return recorded


def test_shift_labels_gives_the_models_own_shifted_losses(tmp_path, monkeypatch):
    """``shift_labels=True`` for a custom causal LM: each recorded ℓ_n is the model's own
    loss on sequence n alone (at θ_0, the first step), and training equals the Trainer's on
    the model's own loss (sequences of one length: its token mean is the mean of ℓ_n)."""
    recorded = record_losses(monkeypatch)
    data = Examples(copy_label)
    reference = tiny_lm()
    callback = CockpitCallback([quantities.Loss()], shift_labels=True, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # shift_labels given: no warning
        trainer_for(tiny_lm(), data, tmp_path / "tracked", callback=callback).train()
    labels, losses = recorded[0]
    for n in range(len(labels)):
        own = reference(input_ids=labels[n:n + 1], labels=labels[n:n + 1]).loss.detach()
        assert float(losses[n]) == pytest.approx(float(own), rel=1e-12)
    plain = tiny_lm()
    trainer_for(plain, data, tmp_path / "plain").train()
    tracked = tiny_lm()
    trainer_for(tracked, data, tmp_path / "again",
                callback=CockpitCallback([quantities.Loss()], shift_labels=True)).train()
    torch.testing.assert_close(parameters(tracked), parameters(plain), rtol=1e-12, atol=1e-14)


def test_a_class_that_does_not_tell_the_shift_is_warned_once(tmp_path):
    """Without ``shift_labels`` Cockpit cannot know that TinyLM is causal: one
    RuntimeWarning over the run, which names the assumption and the argument."""
    callback = CockpitCallback([quantities.Loss()])
    trainer = trainer_for(tiny_lm(), Examples(copy_label), tmp_path, callback=callback)
    with pytest.warns(RuntimeWarning) as caught:
        trainer.train()
    told = [w for w in caught if "cannot tell" in str(w.message)]
    assert len(told) == 1
    assert "TinyLM" in str(told[0].message)
    assert "assumes t (labels not shifted)" in str(told[0].message)
    assert "shift_labels=True" in str(told[0].message)


def test_the_classes_that_tell_the_shift():
    """Causal LMs shift; token classification, masked LM and encoder-decoder models do
    not; a class in none of transformers' mappings does not tell."""
    bert = transformers.BertConfig(vocab_size=VOCAB, hidden_size=4, num_hidden_layers=1,
                                   num_attention_heads=1, intermediate_size=4)
    gpt2 = transformers.GPT2Config(vocab_size=VOCAB, n_embd=4, n_layer=1, n_head=1)
    t5 = transformers.T5Config(vocab_size=VOCAB, d_model=4, d_kv=2, d_ff=4, num_layers=1,
                               num_heads=1)
    cases = [(transformers.GPT2LMHeadModel(gpt2), True),
             (transformers.BertForTokenClassification(bert), False),
             (transformers.BertForMaskedLM(bert), False),
             (transformers.T5ForConditionalGeneration(t5), False),
             (tiny_lm(), None)]
    for model, shifts in cases:
        assert integration._class_shifts_labels(model, loss_shifts=False) is shifts, model


# ----------------------------------------------------------------- auxiliary losses
def mixtral(router_loss: bool):
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=16, output_router_logits=router_loss,
        router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM._from_config(
        config, attn_implementation="eager", experts_implementation="eager").double()


def test_an_auxiliary_loss_is_refused_and_training_without_it_is_the_models(tmp_path):
    """Mixtral with ``output_router_logits=True`` adds router_aux_loss_coef·aux_loss to its
    own loss; Cockpit's loss would leave it out: ValueError at the first step, before any
    update. Without the router loss training equals the Trainer's on the model's own loss
    (to 1e-7: that loss casts the logits to float32; a loss with the router term, or
    unshifted, moves the parameters by ~1e-3 more)."""
    data = Examples(copy_label)
    model = mixtral(router_loss=True)
    start = parameters(model)
    trainer = trainer_for(model, data, tmp_path / "aux", callback=CockpitCallback("economy"))
    with pytest.raises(ValueError, match=r"auxiliary loss \(aux_loss.*output_router_logits"):
        trainer.train()
    assert torch.equal(parameters(model), start)
    assert_same_training(lambda: mixtral(router_loss=False), data, tmp_path, atol=1e-7)


# ----------------------------------------------------------------- an overridden compute_loss
class OwnLossTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = F.cross_entropy(outputs.logits, labels)
        return (loss, outputs) if return_outputs else loss


class DelegatingTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        return (loss, outputs) if return_outputs else loss


def test_an_overridden_compute_loss_is_warned_once(tmp_path):
    """A ``compute_loss`` that never calls ``compute_loss_func``: nothing is recorded, and
    one RuntimeWarning after the first step says why; one that calls it is recorded."""
    data = Examples(class_label)
    callback = CockpitCallback([quantities.Loss()])
    trainer = trainer_for(bert_classifier(), data, tmp_path / "own", callback=callback,
                          steps=3, trainer_class=OwnLossTrainer)
    with pytest.warns(RuntimeWarning) as caught:
        trainer.train()
    told = [w for w in caught if "did not call compute_loss_func" in str(w.message)]
    assert len(told) == 1
    assert "OwnLossTrainer.compute_loss overridden" in str(told[0].message)
    assert callback.cockpit.get_output() == {}

    callback = CockpitCallback([quantities.Loss()])
    trainer = trainer_for(bert_classifier(), data, tmp_path / "delegating", callback=callback,
                          steps=3, trainer_class=DelegatingTrainer)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Cockpit recorded nothing", RuntimeWarning)
        trainer.train()
    assert sorted(callback.cockpit.get_output()) == [0, 1, 2]


# ----------------------------------------------------------------- resume, loggers
def test_resume_from_a_checkpoint_in_another_folder_keeps_distance(tmp_path):
    """``train(resume_from_checkpoint=<first run>/checkpoint-2)`` with another
    ``output_dir``: Cockpit's state is read from that checkpoint (no warning), and Loss and
    Distance at steps 2 and 3 equal those of an uninterrupted run."""
    data = Examples(class_label, size=16)

    def chosen():
        return [quantities.Loss(), quantities.Distance()]

    whole = CockpitCallback(chosen(), strict=True)
    trainer_for(bert_classifier(), data, tmp_path / "whole", callback=whole, steps=4).train()
    trainer_for(bert_classifier(), data, tmp_path / "first", steps=2,
                callback=CockpitCallback(chosen(), strict=True), save_strategy="steps",
                save_steps=2).train()
    resumed = CockpitCallback(chosen(), strict=True)
    trainer = trainer_for(bert_classifier(), data, tmp_path / "second", callback=resumed,
                          steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-2"))
    assert not [w for w in caught if "Cockpit" in str(w.message)]
    got, want = resumed.cockpit.get_output(), whole.cockpit.get_output()
    assert sorted(got) == [2, 3]
    for step in (2, 3):
        for key in ("Loss", "Distance"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-10), (step, key)
    assert got[2]["Distance"] > 0


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for path in folder.rglob("events.out.tfevents.*"):
        events = EventAccumulator(str(path))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    return out


def test_loggers_get_cockpits_values_at_the_trainers_step(tmp_path):
    """TensorBoard of ``report_to``: the Trainer logs the loss and gradient norm of the
    update from θ_t at step t + 1; Cockpit's Loss and GradNorm of its step t (the same
    update) are logged at t + 1 too, with the same values."""
    callback = CockpitCallback([quantities.Loss(), quantities.GradNorm()])
    trainer = trainer_for(bert_classifier(), Examples(class_label, size=12), tmp_path,
                          callback=callback, steps=3, report_to=["tensorboard"],
                          logging_steps=1, max_grad_norm=1.0)
    trainer.train()
    scalars = tensorboard_scalars(tmp_path)
    output = callback.cockpit.get_output()
    for trainers, cockpits, name in (("train/loss", "train/cockpit/Loss", "Loss"),
                                     ("train/grad_norm", "train/cockpit/GradNorm", "GradNorm")):
        assert sorted(scalars[trainers]) == sorted(scalars[cockpits]) == [1, 2, 3]
        for step in (1, 2, 3):
            assert scalars[cockpits][step] == pytest.approx(scalars[trainers][step], rel=1e-6)
            assert scalars[cockpits][step] == pytest.approx(output[step - 1][name], rel=1e-6)
