"""Cockpit's Lightning callback against a plain loop with Cockpit on the whole batch
(tests/split_reference.py): accumulate_grad_batches, the DDP strategy on 2 gloo processes,
bf16 autocast with gradient clipping, a checkpoint resume, and the trainer's CSV logger."""

from __future__ import annotations

import csv
import pickle

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from cockpit import Cockpit, quantities
from cockpit.integrations.lightning import CockpitCallback
from tests.exit_worker import free_port
from tests.integrations import lightning_worker
from tests.integrations.lightning_worker import fit, micro_batches
from tests.models import make_problem
from tests.split_reference import assert_same_values, batches_of, whole_batch_run

STEPS = 3


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def shard(sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def strip(output: dict) -> dict:
    """Cockpit watches the LightningModule's network (``model``): the same names as the
    plain loop's."""
    return {step: dict(values) for step, values in output.items()}


@pytest.mark.parametrize(("name", "micro", "make_optimizer"), [
    ("mlp_relu", 3, sgd),
    ("mlp_sigmoid", 2, adam),  # squared error, Adam
])
def test_accumulate_grad_batches_equals_the_whole_batch(tmp_path, name, micro, make_optimizer):
    problem = make_problem(name, 48)
    batches = batches_of(problem, STEPS, 24)
    # a validation loop after every optimizer step: its forward passes leave Cockpit alone
    callback, _, trainer = fit(problem, micro_batches(batches, micro), make_optimizer, STEPS,
                               accumulate=micro, logger=pl_csv_logger(tmp_path),
                               val_items=[(problem.x[:8], problem.y[:8])],
                               val_check_interval=micro)
    output = strip(callback.cockpit.get_output())
    expected, _ = whole_batch_run(make_problem(name, 48), batches, make_optimizer)
    assert assert_same_values(output, expected, range(STEPS)) > 30 * STEPS
    for step in range(STEPS):
        assert output[step]["BatchSize"] == 24
    # the scalars reached the trainer's logger (a CSV file written by Lightning)
    trainer.loggers[0].save()
    with open(trainer.loggers[0].experiment.metrics_file_path) as file:
        table = list(csv.DictReader(file))
    assert sum(1 for row in table if row.get("val_loss")) == STEPS  # validation ran
    rows = [row for row in table if row.get("cockpit/GradNorm")]
    logged = {int(row["step"]): float(row["cockpit/GradNorm"]) for row in rows}
    assert sorted(logged) == list(range(STEPS))
    for step, value in logged.items():
        assert value == pytest.approx(expected[step]["GradNorm"], rel=1e-6)


def test_a_checkpoint_between_micro_batches_leaves_the_step_whole(tmp_path):
    """Validation after every 2nd of 3 micro-batches, and the checkpoint it triggers
    (ModelCheckpoint saves the callback's state there): the steps are those of the whole
    batch (the state was taken by finishing the step, which recorded its first micro-batches
    alone and refused the rest as a step seen before)."""
    problem = make_problem("mlp_relu", 48)
    batches = batches_of(problem, STEPS, 24)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1,
                                               filename="{step}")
    callback, _, _ = fit(problem, micro_batches(batches, 3), sgd, STEPS, accumulate=3,
                         val_items=[(problem.x[:8], problem.y[:8])], val_check_interval=2,
                         enable_checkpointing=True, extra_callbacks=[checkpoints])
    saved = [torch.load(path, weights_only=False)["callbacks"] for path in tmp_path.iterdir()]
    assert len(saved) >= 2  # (taken between micro-batches)
    output = strip(callback.cockpit.get_output())
    expected, _ = whole_batch_run(make_problem("mlp_relu", 48), batches, sgd)
    assert assert_same_values(output, expected, range(STEPS)) > 30 * STEPS
    assert all(output[step]["BatchSize"] == 24 for step in range(STEPS))


def pl_csv_logger(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    return CSVLogger(str(tmp_path), name="csv")



def test_ddp_strategy_with_accumulation_gives_every_rank_the_global_batch(tmp_path):
    name, sizes, micro = "mlp_relu", [12, 12], 2
    problem = make_problem(name, 48)
    batches = batches_of(problem, STEPS, sum(sizes), seed=5)
    config = {"problem": name, "batches": batches, "shard_sizes": sizes, "micro": micro,
              "make_optimizer": sgd}
    mp.start_processes(lightning_worker.run_ddp, args=(2, free_port(), config, str(tmp_path)),
                       nprocs=2, join=True, start_method="spawn")
    ranks = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as file:
            ranks.append(pickle.load(file))
    expected, _ = whole_batch_run(make_problem(name, 48), batches, sgd)
    for result in ranks:
        output = strip(result["output"])
        assert assert_same_values(output, expected, range(STEPS)) > 30 * STEPS
        for step in range(STEPS):
            assert output[step]["BatchSize"] == sum(sizes)


def test_bf16_autocast_and_clipping_see_the_unclipped_gradient():
    """precision="bf16-mixed" (autocast on the CPU) with gradient clipping: Cockpit sees the
    backward pass before clipping, exactly as a plain loop under the same autocast."""
    name = "mlp_relu"
    problem = make_problem(name, 48, dtype=torch.float32)
    batches = batches_of(problem, STEPS, 24)
    chosen = [quantities.Loss(), quantities.GradNorm(), quantities.NormTest(),
              quantities.InnerTest(), quantities.Distance(), quantities.UpdateSize()]
    callback = CockpitCallback(chosen, strict=True)
    _, recorder, _ = fit(problem, micro_batches(batches, 1), sgd, STEPS, callback=callback,
                         precision="bf16-mixed", gradient_clip_val=0.05)
    output = strip(callback.cockpit.get_output())

    reference = make_problem(name, 48, dtype=torch.float32)
    model = reference.model
    opt = sgd(model)
    cockpit = Cockpit(model, [type(q)() for q in chosen], optimizer=opt, strict=True)
    clipped = 0
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = reference.loss_fn(model(x), y)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        clipped += int(norm > 0.05)
        opt.step()
    cockpit.close()
    expected = cockpit.get_output()
    assert clipped == STEPS  # clipping changed every update
    assert assert_same_values(output, expected, range(STEPS), rtol=1e-5) >= 5 * STEPS
    for step in range(STEPS):  # the clipped gradient is not what Cockpit reports
        stepped = torch.cat([g.flatten() for g in recorder.stepped[step].values()]).norm()
        assert stepped == pytest.approx(0.05, rel=1e-4)
        assert output[step]["GradNorm"] > 0.1


def test_float16_with_a_grad_scaler_sees_unscaled_gradients():
    """A MixedPrecision plugin with a GradScaler (float16 autocast; the backward pass of the
    scaled loss): the callback hands the scaler to Cockpit, whose values equal a plain loop's
    with the same scaler — and Alpha's Adam prediction is exact despite the scaling."""
    from lightning.pytorch.plugins import MixedPrecision

    name = "mlp_relu"
    problem = make_problem(name, 48, dtype=torch.float32)
    batches = batches_of(problem, STEPS, 24)

    def chosen():
        return [quantities.Loss(), quantities.GradNorm(), quantities.NormTest(),
                quantities.Alpha(), quantities.UpdateSize()]

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    callback = CockpitCallback(chosen(), strict=True)
    fit(problem, micro_batches(batches, 1), adam, STEPS, callback=callback,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert callback.cockpit.grad_scaler is scaler
    output = callback.cockpit.get_output()

    reference = make_problem(name, 48, dtype=torch.float32)
    model = reference.model
    opt = adam(model)
    own = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    cockpit = Cockpit(model, chosen(), optimizer=opt, grad_scaler=own, strict=True)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            losses = reference.loss_fn(model(x), y)
        with cockpit(step, losses=losses):
            own.scale(losses.mean()).backward()
        own.step(opt)
        own.update()
    cockpit.close()
    expected = cockpit.get_output()
    assert assert_same_values(output, expected, range(STEPS), rtol=1e-5) >= 4 * STEPS
    assert all(output[step]["Alpha"] is not None for step in range(STEPS - 1))
    assert output[0]["GradNorm"] < 10  # unscaled (the scale is 1024)


class ParameterRecorder(pl.Callback):
    """θ_t at the start of each step t."""

    def __init__(self):
        self.params: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.params[trainer.global_step] = torch.cat(
            [p.detach().flatten().clone() for p in pl_module.parameters()])


def test_checkpoint_resume_keeps_distance_and_step_numbers(tmp_path):
    """The resumed run's Distance is ‖θ_t − θ_0‖ with θ_0 of the first run (kept by the
    callback's state in the checkpoint), and its steps continue the numbering."""
    name = "mlp_relu"
    batches = batches_of(make_problem(name, 48), 4, 24)
    items = micro_batches(batches, 1)

    def chosen():
        return [quantities.Loss(), quantities.GradNorm(), quantities.Distance(),
                quantities.UpdateSize()]

    whole, _, _ = fit(make_problem(name, 48), items, sgd, 4,
                      callback=CockpitCallback(chosen(), strict=True))
    theta0 = torch.cat([p.detach().flatten() for p in make_problem(name, 48).model.parameters()])

    _, _, trainer = fit(make_problem(name, 48), items[:2], sgd, 2,
                        callback=CockpitCallback(chosen(), strict=True))
    path = str(tmp_path / "two.ckpt")
    trainer.save_checkpoint(path)
    # a new process builds a fresh model: its parameters come from the checkpoint
    recorder = ParameterRecorder()
    resumed, _, _ = fit(make_problem(name, 48, seed=7), items[2:], sgd, 4, ckpt_path=path,
                        callback=CockpitCallback(chosen(), strict=True),
                        extra_callbacks=[recorder])
    got = resumed.cockpit.get_output()
    assert sorted(got) == [2, 3]
    want = whole.cockpit.get_output()[2]  # the first step after the resume: the same batch
    for key in ("Loss", "GradNorm", "Distance", "UpdateSize"):
        assert got[2][key] == pytest.approx(want[key], rel=1e-10), key
    for step in (2, 3):
        distance = float((recorder.params[step] - theta0).norm())
        assert got[step]["Distance"] == pytest.approx(distance, rel=1e-10)
        assert distance > 0.01


def another_ranks_state(state: dict) -> dict:
    """Cockpit's state as rank 1 of 2 processes saves it under ``fully_shard``: its slice of
    each θ_0 (the second half of dimension 0), and whose slice it is."""
    initial = {k: v.chunk(2)[1].clone() for k, v in state["initial_params"].items()}
    return {**state, "initial_params": initial,
            "initial_params_holder": {"rank": 1, "world": 2}}


def test_resume_with_another_ranks_theta0_measures_from_the_resumed_parameters(tmp_path):
    """A checkpoint whose Cockpit state holds another rank's slice of θ_0 (a fully_shard
    run's, resumed on another rank or without sharding): the callback warns with the reason
    and measures Distance from the resumed parameters, ‖θ_t − θ_2‖, instead of refusing to
    train or giving a distance from a wrong θ_0; the step numbering continues."""
    name = "mlp_relu"
    items = micro_batches(batches_of(make_problem(name, 48), 4, 24), 1)

    def chosen():
        return [quantities.Loss(), quantities.Distance()]

    _, _, trainer = fit(make_problem(name, 48), items[:2], sgd, 2,
                        callback=CockpitCallback(chosen(), strict=True))
    path = str(tmp_path / "two.ckpt")
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    (key,) = [k for k in checkpoint["callbacks"] if "CockpitCallback" in k]
    checkpoint["callbacks"][key] = another_ranks_state(checkpoint["callbacks"][key])
    torch.save(checkpoint, path)
    recorder = ParameterRecorder()
    with pytest.warns(RuntimeWarning, match=r"without Cockpit's θ_0 \(the saved 0\.weight is "
                      r"rank 1's slice of 2 processes.*measured from the resumed parameters"):
        resumed, _, _ = fit(make_problem(name, 48, seed=7), items[2:], sgd, 4, ckpt_path=path,
                            callback=CockpitCallback(chosen(), strict=True),
                            extra_callbacks=[recorder])
    got = resumed.cockpit.get_output()
    assert sorted(got) == [2, 3]
    for step in (2, 3):
        distance = float((recorder.params[step] - recorder.params[2]).norm())
        assert got[step]["Distance"] == pytest.approx(distance, rel=1e-10, abs=1e-12)
    assert got[3]["Distance"] > 0.01


def test_resume_from_a_checkpoint_without_cockpits_state_says_so(tmp_path):
    """A checkpoint saved without the callback: the resumed run warns that θ_0 is unknown and
    measures Distance from the resumed parameters (before, silently: Distance 0 at the first
    resumed step)."""
    items = micro_batches(batches_of(make_problem("mlp_relu", 48), 4, 24), 1)
    _, _, trainer = fit(make_problem("mlp_relu", 48), items[:2], sgd, 2,
                        callback=CockpitCallback([quantities.Distance()], strict=True))
    path = str(tmp_path / "two.ckpt")
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["callbacks"] = {k: v for k, v in checkpoint["callbacks"].items()
                               if "CockpitCallback" not in k}
    torch.save(checkpoint, path)
    recorder = ParameterRecorder()
    with pytest.warns(RuntimeWarning, match="resumed at step 2 without Cockpit's state"):
        resumed, _, _ = fit(make_problem("mlp_relu", 48, seed=7), items[2:], sgd, 4,
                            ckpt_path=path, extra_callbacks=[recorder],
                            callback=CockpitCallback([quantities.Distance()], strict=True))
    got = resumed.cockpit.get_output()
    distance = float((recorder.params[3] - recorder.params[2]).norm())
    assert got[3]["Distance"] == pytest.approx(distance, rel=1e-10) and distance > 0.01


def test_clipping_by_value_with_sgd_gives_alpha_from_the_real_update():
    """gradient_clip_algorithm="value" clamps each element: the update leaves the span of
    the gradient and the momentum buffer that Alpha predicts for SGD, so Alpha measures the
    real update (before: None at the first step, with a warning of a state changed behind
    its back). The reference: a plain loop clamping the same way, Alpha's general path."""
    problem = make_problem("mlp_relu", 48, dtype=torch.float32)
    batches = batches_of(problem, STEPS, 24)
    callback = CockpitCallback([quantities.Alpha()], strict=True)
    fit(problem, micro_batches(batches, 1), sgd, STEPS, callback=callback,
        gradient_clip_val=0.01, gradient_clip_algorithm="value")
    output = callback.cockpit.get_output()
    reference = make_problem("mlp_relu", 48, dtype=torch.float32)
    model, alpha = reference.model, quantities.Alpha()
    alpha.predict = False
    opt = sgd(model)
    cockpit = Cockpit(model, [alpha], optimizer=opt, strict=True)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        losses = reference.loss_fn(model(x), y)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        opt.step()
    cockpit.close()
    expected = cockpit.get_output()
    for step in range(STEPS - 1):
        assert output[step]["Alpha"] == pytest.approx(expected[step]["Alpha"], rel=1e-5)


def test_individual_losses_missing_gives_the_way_out():
    class NoLosses(lightning_worker.Module):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.loss_fn(self.model(x), y).mean()

    problem = make_problem("mlp_relu", 8)

    trainer = pl.Trainer(max_steps=1, callbacks=[CockpitCallback("economy")], logger=False,
                         accelerator="cpu", enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(lightning_worker.Batches([(problem.x, problem.y)]), batch_size=None)
    with pytest.raises(ValueError, match="'losses': losses"):
        trainer.fit(NoLosses(problem.model, problem.loss_fn, sgd), train_dataloaders=loader)


def test_trainer_owned_arguments_are_refused():
    with pytest.raises(TypeError, match="optimizer"):
        CockpitCallback("economy", optimizer=None)


def test_lightning_example_runs(tmp_path):
    import runpy
    from pathlib import Path

    from cockpit.store import read_output

    path = Path(__file__).parents[2] / "examples" / "lightning_example.py"
    output = runpy.run_path(str(path))["main"](["--steps", "4", "--logdir", str(tmp_path)])
    assert sorted(output) == [0, 1, 2, 3]
    assert all(output[step]["BatchSize"] == 64 for step in output)  # 2 micro-batches of 32
    assert output[2]["Alpha"] is not None
    assert read_output(tmp_path)[3]["NormTest"] == output[3]["NormTest"]


class RecordingLogger(pl.loggers.Logger):
    """A trainer logger that keeps every ``log_metrics`` call."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))

    def per_step(self) -> dict[int, dict[str, float]]:
        steps: dict[int, dict[str, float]] = {}
        for step, metrics in self.calls:
            steps.setdefault(step, {}).update(
                {k: v for k, v in metrics.items() if k.startswith("cockpit/")})
        return steps


def _deep_run(**callback_kwargs) -> tuple[CockpitCallback, RecordingLogger]:
    """The economy configuration on a network of 25 linear layers (50 parameters)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(25):
        layers += [torch.nn.Linear(4, 4), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1]).double()
    assert len(list(model.parameters())) == 50
    x, y = torch.randn(3 * 16, 4, dtype=torch.float64), torch.randint(0, 4, (3 * 16,))
    items = list(zip(x.split(16), y.split(16), strict=True))
    callback = CockpitCallback("economy", **callback_kwargs)
    logger = RecordingLogger()
    trainer = pl.Trainer(max_steps=3, callbacks=[callback], logger=logger, accelerator="cpu",
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1)
    module = lightning_worker.Module(model, lambda z, t: torch.nn.functional.cross_entropy(
        z, t, reduction="none"), sgd)
    trainer.fit(module, train_dataloaders=DataLoader(lightning_worker.Batches(items),
                                                     batch_size=None))
    return callback, logger


def test_trainer_loggers_get_the_totals_not_every_parameter():
    """50 parameters: the trainer's logger gets at most 15 scalars a tracked step (the
    totals, equal to the run's values; not the learning rate and batch size the trainer logs
    itself); each parameter's values only when asked for."""
    callback, logger = _deep_run()
    output = callback.cockpit.get_output()
    logged = logger.per_step()
    assert sorted(logged) == [0, 1, 2]
    for step, metrics in logged.items():
        assert 8 <= len(metrics) <= 15, sorted(metrics)
        assert "cockpit/LearningRate" not in metrics
        for key, value in metrics.items():
            assert "/" not in key[len("cockpit/"):]
            assert value == pytest.approx(output[step][key[len("cockpit/"):]], rel=1e-12,
                                          nan_ok=True)
    assert {"cockpit/Loss", "cockpit/GradNorm", "cockpit/NormTest"} <= set(logged[0])

    callback, logger = _deep_run(log_per_parameter=True)
    logged = logger.per_step()
    output = callback.cockpit.get_output()
    assert len(logged[0]) > 100
    assert logged[0]["cockpit/GradNorm/0.weight"] == pytest.approx(
        output[0]["GradNorm/0.weight"], rel=1e-12)


# ---------------------------------------------------------------- several optimizers (a GAN)
def _gan_nets() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 4)).double()
    discriminator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                        torch.nn.Linear(8, 1)).double()
    return generator, discriminator


def _gan_optimizers(generator, discriminator) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(generator.parameters(), lr=0.01),
            torch.optim.SGD(discriminator.parameters(), lr=0.05, momentum=0.9)]


def _gan_instruments() -> list:
    return [quantities.Loss(), quantities.GradNorm(), quantities.NormTest(),
            quantities.InnerTest(), quantities.Distance(), quantities.UpdateSize(),
            quantities.Alpha()]


def _discriminator_losses(discriminator, real, fake):
    """ℓ_n of the discriminator: real and generated samples, 2B in all."""
    logits = discriminator(torch.cat([real, fake])).squeeze(-1)
    target = torch.cat([torch.ones(len(real)), torch.zeros(len(fake))]).double()
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, target,
                                                                reduction="none")


def _generator_losses(discriminator, fake):
    logits = discriminator(fake).squeeze(-1)
    return torch.nn.functional.binary_cross_entropy_with_logits(
        logits, torch.ones(len(fake), dtype=torch.float64), reduction="none")


def _gan_step(step, real, z, generator, discriminator, optimizers, cockpits, backward):
    """One step of each optimizer, each backward pass inside its own Cockpit; returns the
    gradient norm each optimizer stepped on (discriminator, generator)."""
    opt_g, opt_d = optimizers
    cockpit_g, cockpit_d = cockpits
    norms = []
    fake = generator(z)
    opt_d.zero_grad()
    losses = _discriminator_losses(discriminator, real, fake.detach())
    with cockpit_d(step, losses=losses):
        backward(losses.mean())
    norms.append(float(torch.cat([p.grad.flatten() for p in discriminator.parameters()]).norm()))
    opt_d.step()
    opt_g.zero_grad()
    losses = _generator_losses(discriminator, fake)
    with cockpit_g(step, losses=losses):
        backward(losses.mean())
    norms.append(float(torch.cat([p.grad.flatten() for p in generator.parameters()]).norm()))
    opt_g.step()
    return norms


class GAN(pl.LightningModule):
    """Manual optimization with two optimizers, one Cockpit for each (the README's way)."""

    def __init__(self):
        super().__init__()
        self.generator, self.discriminator = _gan_nets()
        self.automatic_optimization = False
        self.norms: list[list[float]] = []

    def configure_optimizers(self):
        return _gan_optimizers(self.generator, self.discriminator)

    def on_train_start(self):
        opt_g, opt_d = self.trainer.optimizers
        self.cockpit_g = Cockpit(self.generator, _gan_instruments(), optimizer=opt_g)
        self.cockpit_d = Cockpit(self.discriminator, _gan_instruments(), optimizer=opt_d)

    def on_train_end(self):
        self.cockpit_g.close()
        self.cockpit_d.close()

    def training_step(self, batch, batch_idx):
        real, z = batch
        self.norms.append(_gan_step(batch_idx, real, z, self.generator, self.discriminator,
                                    self.optimizers(), (self.cockpit_g, self.cockpit_d),
                                    self.manual_backward))


def _gan_batches() -> list[tuple]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 4, generator=generator, dtype=torch.float64),
             torch.randn(16, 3, generator=generator, dtype=torch.float64))
            for _ in range(STEPS)]


def _trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(max_epochs=1, logger=False, accelerator="cpu",
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


def test_several_optimizers_with_one_cockpit_each_equal_a_plain_loop():
    """A GAN in Lightning's manual optimization, a Cockpit per optimizer's network: the
    same values as the same two-optimizer loop without Lightning, and GradNorm is the norm
    of the gradient each optimizer stepped on."""
    batches = _gan_batches()
    module = GAN()
    _trainer().fit(module, train_dataloaders=DataLoader(lightning_worker.Batches(batches),
                                                        batch_size=None))
    generator, discriminator = _gan_nets()
    optimizers = _gan_optimizers(generator, discriminator)
    cockpits = (Cockpit(generator, _gan_instruments(), optimizer=optimizers[0]),
                Cockpit(discriminator, _gan_instruments(), optimizer=optimizers[1]))
    norms = [_gan_step(step, real, z, generator, discriminator, optimizers, cockpits,
                       lambda loss: loss.backward())
             for step, (real, z) in enumerate(batches)]
    for cockpit in cockpits:
        cockpit.close()
    assert norms == module.norms  # the same training
    for ours, plain, size, index in [(module.cockpit_d, cockpits[1], 32, 0),
                                     (module.cockpit_g, cockpits[0], 16, 1)]:
        output, expected = ours.get_output(), plain.get_output()
        assert assert_same_values(output, expected, range(STEPS), rtol=1e-12) >= 5 * STEPS
        for step in range(STEPS):
            assert output[step]["BatchSize"] == size
            assert output[step]["GradNorm"] == pytest.approx(norms[step][index], rel=1e-12)
            assert output[step]["NormTest"] is not None


def test_the_callback_with_manual_optimization_names_the_way_out():
    class Manual(GAN):
        def on_train_start(self):
            pass

    callback = CockpitCallback("economy")
    with pytest.raises(NotImplementedError, match="manual optimization: drop the callback and "
                                                  "use one Cockpit per optimizer"):
        _trainer(callbacks=[callback]).fit(
            Manual(), train_dataloaders=DataLoader(lightning_worker.Batches(_gan_batches()),
                                                   batch_size=None))
    assert callback.cockpit is None
