"""Cockpit's Hugging Face Trainer callback against a plain loop with Cockpit on the whole
batch (tests/split_reference.py): a tiny BERT for sequence classification and a tiny GPT-2
language model (2 layers, hidden size 32, built from configs), with gradient accumulation and
gradient clipping; DDP on 2 gloo processes with and without accumulation; bf16 and fp16 mixed
precision against a plain loop under the same autocast; the per-sequence losses against one
sequence at a time; the scalars in the TensorBoard files of ``report_to``."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from torch.utils.data import IterableDataset

from cockpit import Cockpit, quantities
from cockpit.integrations.transformers import CockpitCallback, sequence_losses
from tests.exit_worker import free_port
from tests.models import Problem
from tests.split_reference import assert_same_values, instruments, whole_batch_run

STEPS = 2  # Alpha of step 0 is completed at step 1
VOCAB, LENGTH = 23, 7


class HFNet(nn.Module):
    """A Hugging Face model called on a dict of inputs, returning its logits, with the same
    parameter names (it shares the model's submodules) — for the plain reference loop."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self._modules = model._modules
        self.hf_forward = model.forward

    def forward(self, inputs: dict) -> torch.Tensor:
        return self.hf_forward(**inputs).logits


class MicroBatches(IterableDataset):
    """Ready-made micro-batches in order (the Trainer's batch size is 1 micro-batch)."""

    def __init__(self, items: list[dict]):
        self.items = items

    def __iter__(self):
        yield from self.items


# freeze_key_bias: softmax attention is invariant to a shift of the keys, so the key bias's
# gradient (batch and individual) is zero up to rounding; ratios of its statistics (NormTest
# per parameter, its elements' SNR in MeanGSNR) are then rounding noise that differs between
# any two ways of summing. The tests keep it out of training.


def bert(dtype: torch.dtype = torch.float64):
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3)
    torch.manual_seed(0)
    # eager attention: the reference's HessMaxEV differentiates twice through it
    model = transformers.BertForSequenceClassification._from_config(
        config, attn_implementation="eager").to(dtype)
    for layer in model.bert.encoder.layer:
        layer.attention.self.key.bias.requires_grad_(False)  # see freeze_key_bias
    return model


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(
        config, attn_implementation="eager").double()
    for block in model.transformer.h:
        block.attn.c_attn.bias.requires_grad_(False)  # holds the key bias: see freeze_key_bias
    return model


def token_batch(size: int, generator: torch.Generator, lm: bool) -> tuple[dict, torch.Tensor]:
    """Padded sequences of random lengths; position ids per sequence [B, T] (explicit)."""
    ids = torch.randint(1, VOCAB, (size, LENGTH), generator=generator)
    lengths = torch.randint(3, LENGTH + 1, (size,), generator=generator)
    mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
    ids = ids * mask
    inputs = {"input_ids": ids, "attention_mask": mask,
              "position_ids": torch.arange(LENGTH).expand(size, LENGTH).clone()}
    if lm:
        labels = ids.masked_fill(mask == 0, -100)
        labels[0, 1] = -100  # a prompt token without target
    else:
        inputs["token_type_ids"] = torch.zeros_like(ids)
        labels = torch.randint(0, 3, (size,), generator=generator)
    return inputs, labels


def cut(inputs: dict, labels: torch.Tensor, micro: int) -> list[dict]:
    parts = [dict(zip(inputs, values, strict=True))
             for values in zip(*(v.chunk(micro) for v in inputs.values()), strict=True)]
    return [{**part, "labels": y} for part, y in zip(parts, labels.chunk(micro), strict=True)]


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)


FP16_SCALE = 2.0 ** 10  # the GradScaler's initial scale in the fp16 tests


def hf_train(model, items, micro, tmp_path, chosen, max_grad_norm, ddp=False,
             precision: str = "no"):
    """``precision="fp16"`` emulates accelerate's fp16 on a GPU (which it does not enable on
    the CPU): float16 autocast and a GradScaler, set on the Trainer's accelerator."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=1,
        gradient_accumulation_steps=micro, learning_rate=0.01, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=max_grad_norm, optim="adamw_torch",
        report_to=["tensorboard"], logging_steps=1,
        save_strategy="no", use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, ddp_backend="gloo" if ddp else None,
        bf16=precision == "bf16", fp16=precision == "fp16",
        accelerator_config={"dispatch_batches": False} if ddp else None)
    callback = CockpitCallback(chosen, strict=True)
    stepped = []
    trainer = transformers.Trainer(model=model, args=args, train_dataset=MicroBatches(items),
                                   data_collator=lambda batch: batch[0], callbacks=[callback])
    callback.attach(trainer)
    if precision == "fp16":  # what accelerate sets up for fp16 on a GPU
        trainer.accelerator.native_amp = True
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=FP16_SCALE)

    class Recorder(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            stepped.append({k: p.grad.detach().clone() for k, p in model.named_parameters()
                            if p.grad is not None})

    trainer.add_callback(Recorder())
    trainer.train()
    return callback, stepped


def tensorboard_scalars(logdir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for path in logdir.rglob("events.out.tfevents.*"):
        events = EventAccumulator(str(path))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    return out


@pytest.mark.parametrize(("kind", "micro"), [("bert", 2), ("gpt2", 2), ("bert", 1)])
def test_trainer_with_accumulation_and_clipping_equals_the_whole_batch(tmp_path, kind, micro):
    """micro = 1: clipping before AdamW without accumulation — Alpha measures the real
    update from the first step (a predicted Adam step from the unclipped gradient fails)."""
    lm = kind == "gpt2"
    make = gpt2 if lm else bert
    size = 6
    generator = torch.Generator().manual_seed(4)
    batches = [token_batch(size, generator, lm) for _ in range(STEPS)]
    items = [item for inputs, labels in batches for item in cut(inputs, labels, micro)]
    # HessMaxEV is None when the batch is split; sequence losses have no Gauss-Newton factor
    left_out = {"HessMaxEV"} | ({"HessTrace", "TICDiag", "TICTrace"} if lm else set())
    chosen = [q for q in instruments() if q.name not in left_out]
    callback, stepped = hf_train(make(), items, micro, tmp_path, chosen, max_grad_norm=0.1)
    output = callback.cockpit.get_output()

    model = make()
    problem = Problem(kind, HFNet(model), None, None,
                      lambda logits, y: sequence_losses(logits, y, shift=lm))
    reference = [q for q in instruments() if q.name not in left_out - {"HessMaxEV"}]
    expected, _ = whole_batch_run(problem, batches, adamw, gradients=stepped, chosen=reference)
    compared = assert_same_values(output, expected, range(STEPS))
    assert compared > (20 if lm else 30) * STEPS
    norms = [float(torch.cat([g.flatten() for g in s.values()]).norm()) for s in stepped]
    assert all(n == pytest.approx(0.1, rel=1e-4) for n in norms), norms  # clipped
    for step in range(STEPS):
        assert output[step]["BatchSize"] == size
        assert output[step]["GradNorm"] > 0.1  # the unclipped gradient
    scalars = tensorboard_scalars(tmp_path / "out")
    logged = scalars["train/cockpit/GradNorm"]
    assert sorted(logged) == list(range(1, STEPS + 1))  # (the Trainer's step of the update)
    for step in range(STEPS):
        assert logged[step + 1] == pytest.approx(output[step]["GradNorm"], rel=1e-6)
    # the totals only (each parameter's values stay in the run log)
    names = [tag[len("train/cockpit/"):] for tag in scalars if tag.startswith("train/cockpit/")]
    assert names and all("/" not in name and name in output[0] for name in names), names


class Autocast(HFNet):
    """The reference's forward pass as accelerate runs it with mixed precision: the model
    under torch.autocast("cpu", dtype), its outputs cast to float32."""

    def __init__(self, model, dtype: torch.dtype):
        super().__init__(model)
        self.dtype = dtype

    def forward(self, inputs: dict) -> torch.Tensor:
        with torch.autocast("cpu", dtype=self.dtype):
            logits = self.hf_forward(**inputs).logits
        return logits.float()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_and_clipping_see_the_unscaled_unclipped_gradient(tmp_path, precision):
    """Mixed precision with max_grad_norm before AdamW. ``bf16=True`` on the CPU (accelerate:
    the forward pass under bf16 autocast, float32 parameters and gradients, no GradScaler).
    ``fp16=True`` as accelerate runs it on a GPU (float16 autocast, the backward pass of the
    scaled loss, the gradients unscaled before clipping): on the CPU transformers 5.24 accepts
    ``fp16=True`` but accelerate 1.15 enables neither autocast nor a GradScaler (float32
    training), so the test sets both on the Trainer's accelerator.

    Mirrors the Lightning bf16-mixed test: every value equals a plain loop on the same float32
    model under the same autocast (and the same scaler) to rtol 1e-5 (float32 arithmetic,
    the same operations; not 1e-6: float32 sums), so Cockpit sees the backward pass unscaled
    and before clipping. The callback makes Alpha measure the real (clipped AdamW) update
    from the first step, as the reference does with Alpha(predict=False). The GGN
    instruments take the logits behind accelerate's cast to float32 as the network output.
    Against float32 without autocast, Loss and GradNorm at step 0 differ by rounding: less
    than 2e-2 (about five units of bf16 roundoff 2⁻⁸ ≈ 3.9e-3, accumulated over the
    network's layers; measured for bf16: 3e-6 for the loss, which is flat near log 3 at
    initialization, 7e-4 for GradNorm), and GradNorm by more than 1e-6 (autocast was on)."""
    size, clip = 6, 0.05
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    generator = torch.Generator().manual_seed(4)
    batches = [token_batch(size, generator, lm=False) for _ in range(STEPS)]
    items = [item for inputs, labels in batches for item in cut(inputs, labels, 1)]

    def chosen():
        return [q for q in instruments() if q.name != "HessMaxEV"]

    callback, stepped = hf_train(bert(torch.float32), items, 1, tmp_path, chosen(),
                                 max_grad_norm=clip, precision=precision)
    assert callback.trainer.accelerator.native_amp
    scaler = callback.cockpit.grad_scaler  # the Trainer's, handed over by the callback
    assert scaler is callback.trainer.accelerator.scaler
    assert (scaler is None) == (precision == "bf16")
    alpha = next(q for q in callback.cockpit.quantities if q.name == "Alpha")
    assert alpha.predict is False  # set by the callback: clipping before AdamW
    output = callback.cockpit.get_output()

    model = Autocast(bert(torch.float32), dtype)
    opt = adamw(model)
    own = torch.amp.GradScaler("cpu", init_scale=FP16_SCALE, enabled=scaler is not None)
    reference = chosen()
    next(q for q in reference if q.name == "Alpha").predict = False
    cockpit = Cockpit(model, reference, optimizer=opt, grad_scaler=own if scaler else None,
                      strict=True)
    for step, (inputs, labels) in enumerate(batches):
        opt.zero_grad()
        losses = sequence_losses(model(inputs), labels)
        with cockpit(step, losses=losses):
            own.scale(losses.mean()).backward()
        own.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        assert norm > clip
        own.step(opt)
        own.update()
    cockpit.close()
    expected = cockpit.get_output()
    assert assert_same_values(output, expected, range(STEPS), rtol=1e-5) > 30 * STEPS
    assert output[0]["Alpha"] is not None and output[0]["HessTrace"] is not None
    for step in range(STEPS):  # the clipped gradient is not what Cockpit reports
        stepped_norm = torch.cat([g.flatten() for g in stepped[step].values()]).norm()
        assert float(stepped_norm) == pytest.approx(clip, rel=1e-4)
        assert output[step]["GradNorm"] > 2 * clip
        assert output[step]["GradNorm"] < 10  # unscaled (the scale is 1024)

    plain = bert(torch.float32)  # θ_0 without autocast
    inputs, labels = batches[0]
    loss = sequence_losses(plain(**inputs).logits, labels).mean()
    loss.backward()
    norm = float(torch.cat([p.grad.flatten() for p in plain.parameters()
                            if p.grad is not None]).norm())
    deviation = {name: abs(output[0][name] - value) / abs(value)
                 for name, value in (("Loss", float(loss.detach())), ("GradNorm", norm))}
    assert max(deviation.values()) < 2e-2, deviation
    assert deviation["GradNorm"] > 1e-6, deviation  # (the loss near log 3 is flat)


def test_resume_from_checkpoint_keeps_distance(tmp_path):
    """Cockpit's state rides in the Trainer's checkpoint folder: after
    ``train(resume_from_checkpoint=True)`` Distance is measured from the first run's θ_0;
    from the resumed parameters, with a warning, where the state holds another rank's θ_0."""
    generator = torch.Generator().manual_seed(8)
    items = [cut(*token_batch(4, generator, lm=False), 1)[0] for _ in range(4)]

    def chosen():
        return [quantities.Loss(), quantities.GradNorm(), quantities.Distance(),
                quantities.UpdateSize()]

    def trainer_for(steps, callback, outdir, save):
        args = transformers.TrainingArguments(
            output_dir=str(outdir), max_steps=steps, per_device_train_batch_size=1,
            learning_rate=0.01, lr_scheduler_type="constant", weight_decay=0.0,
            max_grad_norm=0.0, optim="sgd", report_to=[], use_cpu=True, disable_tqdm=True,
            remove_unused_columns=False, save_strategy="steps" if save else "no",
            save_steps=2)
        trainer = transformers.Trainer(model=bert(), args=args,
                                       train_dataset=MicroBatches(items),
                                       data_collator=lambda batch: batch[0])
        callback.attach(trainer)
        return trainer

    whole = CockpitCallback(chosen(), strict=True)
    trainer_for(4, whole, tmp_path / "whole", save=False).train()
    trainer_for(2, CockpitCallback(chosen(), strict=True), tmp_path / "run", save=True).train()
    assert (tmp_path / "run" / "checkpoint-2" / "cockpit_state.pt").exists()
    resumed = CockpitCallback(chosen(), strict=True)
    trainer_for(4, resumed, tmp_path / "run", save=False).train(resume_from_checkpoint=True)
    got, want = resumed.cockpit.get_output(), whole.cockpit.get_output()
    assert sorted(got) == [2, 3]
    for step in (2, 3):
        for key in ("Loss", "GradNorm", "Distance"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-9), (step, key)
    assert got[2]["Distance"] > 0
    # the state of another rank of a fully_shard run (its slice of θ_0): warned, and
    # Distance is measured from the resumed parameters θ_2 (‖θ_3 − θ_2‖ is the first
    # run's UpdateSize at step 2)
    state_file = tmp_path / "run" / "checkpoint-2" / "cockpit_state.pt"
    torch.save(another_ranks_state(torch.load(state_file, weights_only=True)), state_file)
    elsewhere = CockpitCallback(chosen(), strict=True)
    with pytest.warns(RuntimeWarning, match=r"resumed at step 2 without Cockpit's θ_0 \(the "
                      r"saved .* is rank 1's slice of 2 processes.*from the resumed parameters"):
        trainer_for(4, elsewhere, tmp_path / "run", save=False).train(
            resume_from_checkpoint=True)
    got = elsewhere.cockpit.get_output()
    assert sorted(got) == [2, 3]
    assert got[2]["Distance"] == 0.0
    assert got[3]["Distance"] == pytest.approx(want[2]["UpdateSize"], rel=1e-9)
    assert got[3]["Distance"] > 0


def another_ranks_state(state: dict) -> dict:
    """Cockpit's state as rank 1 of 2 processes saves it under ``fully_shard``: its slice of
    each θ_0 (the second half of dimension 0), and whose slice it is."""
    initial = {k: v.chunk(2)[1].clone() for k, v in state["initial_params"].items()}
    return {**state, "initial_params": initial,
            "initial_params_holder": {"rank": 1, "world": 2}}


def test_sequence_losses_against_one_sequence_at_a_time():
    generator = torch.Generator().manual_seed(2)
    inputs, labels = token_batch(5, generator, lm=True)
    logits = torch.randn(5, LENGTH, VOCAB, generator=generator, dtype=torch.float64)
    got = sequence_losses(logits, labels, shift=True)
    for n in range(5):
        targets = [(t, int(labels[n, t + 1])) for t in range(LENGTH - 1)
                   if labels[n, t + 1] != -100 and inputs["attention_mask"][n, t + 1] == 1]
        want = sum(float(-torch.log_softmax(logits[n, t], -1)[y]) for t, y in targets)
        assert float(got[n]) == pytest.approx(want / len(targets), rel=1e-12)
    # classification and regression outputs
    z = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1])
    for n in range(4):
        expected = float(-torch.log_softmax(z[n], -1)[y[n]])
        assert float(sequence_losses(z, y)[n]) == pytest.approx(expected)
    r, t = torch.randn(4, 1, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(sequence_losses(r, t), (r[:, 0] - t) ** 2)
    with pytest.raises(ValueError, match="no label"):
        sequence_losses(logits, torch.full((5, LENGTH), -100), shift=True)


def test_without_attach_the_way_in_is_named(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True,
                                          report_to=[], disable_tqdm=True,
                                          remove_unused_columns=False)
    generator = torch.Generator().manual_seed(0)
    items = cut(*token_batch(4, generator, lm=False), 1)
    trainer = transformers.Trainer(model=bert(), args=args, train_dataset=MicroBatches(items),
                                   data_collator=lambda batch: batch[0],
                                   callbacks=[CockpitCallback("economy")])
    with pytest.raises(RuntimeError, match="attach"):
        trainer.train()



DDP_SIZE = 8


def ddp_data(micro: int = 1) -> tuple[list[tuple], list[list[dict]]]:
    """The steps' batches, and each rank's micro-batches (half of each batch, cut in
    ``micro``)."""
    generator = torch.Generator().manual_seed(6)
    batches = [token_batch(DDP_SIZE, generator, lm=False) for _ in range(STEPS)]
    shards: list[list[dict]] = [[], []]
    half = DDP_SIZE // 2
    for inputs, labels in batches:
        for rank, part in enumerate((slice(0, half), slice(half, DDP_SIZE))):
            shard = {k: v[part] for k, v in inputs.items()}
            shards[rank].extend(cut(shard, labels[part], micro))
    return batches, shards


def ddp_instruments() -> list:
    return [q for q in instruments() if q.name != "HessMaxEV"]


@pytest.mark.parametrize("micro", [1, 2])
def test_trainer_with_ddp_gives_every_rank_the_global_batch(tmp_path, micro):
    """micro = 1, one micro-batch per process: Cockpit processes the layers against the
    gradient DDP synchronized, which the callback's end-of-backward exit must wait for.
    micro = 2 (gradient_accumulation_steps=2, micro-batches of 2 sequences per process): the
    first backward pass runs under DDP's no_sync (a local gradient), the second one
    synchronizes; the micro-batches merge, then the ranks. In both Alpha predicts the update
    on its fast path (no clipping: clipped Adam is not a rescaled Adam step) and is compared
    with the reference's general path (the real update)."""
    import pickle

    import torch.multiprocessing as mp

    from tests.engine import hf_ddp_worker

    mp.start_processes(hf_ddp_worker.run, args=(2, free_port(), str(tmp_path), micro),
                       nprocs=2, join=True, start_method="spawn")
    ranks = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as file:
            ranks.append(pickle.load(file))
    batches, _ = ddp_data(micro)
    problem = Problem("bert", HFNet(bert()), None, None, sequence_losses)
    expected, _ = whole_batch_run(problem, batches, adamw, gradients=ranks[0]["stepped"],
                                  chosen=ddp_instruments())
    for result in ranks:
        output = result["output"]
        assert assert_same_values(output, expected, range(STEPS)) > 30 * STEPS
        for step in range(STEPS):
            assert output[step]["BatchSize"] == DDP_SIZE
            assert step == STEPS - 1 or output[step]["Alpha"] is not None
