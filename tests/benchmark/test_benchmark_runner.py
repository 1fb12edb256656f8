"""The benchmark runner against a plain training loop written here, its result layout, its
learning-rate schedules, its errors and Cockpit attached to it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cockpit.benchmark.cli import main_bench
from cockpit.benchmark.lr_schedules import schedule_factor
from cockpit.benchmark.problems import get_problem
from cockpit.benchmark.runner import RunSpec, run


def _plain_loop(problem_name: str, lr: float, momentum: float, epochs: int, steps: int,
                seed: int):
    """Train and evaluate by hand: returns per-epoch (test loss, test accuracy) and the
    mini-batch losses."""
    torch.manual_seed(seed)
    problem = get_problem(problem_name, data="real", seed=seed)
    opt = torch.optim.SGD(problem.model.parameters(), lr=lr, momentum=momentum)

    def test_metrics():
        problem.model.eval()
        losses, correct = [], []
        with torch.no_grad():
            for x, y in problem.test_loader:
                out = problem.model(x)
                losses.append(problem.losses(out, y))
                correct.append((out.argmax(1) == y).float())
        problem.model.train()
        return torch.cat(losses).mean().item(), torch.cat(correct).mean().item()

    curve, minibatch = [test_metrics()], []
    for _ in range(epochs):
        for i, (x, y) in enumerate(problem.train_loader):
            if i == steps:
                break
            opt.zero_grad()
            loss = problem.losses(problem.model(x), y).mean() + problem.regularizer()
            loss.backward()
            opt.step()
            minibatch.append(loss.item())
        curve.append(test_metrics())
    return curve, minibatch


def test_run_equals_plain_loop_and_layout(tmp_path):
    spec = RunSpec("digits_logreg", "sgd", {"lr": 0.3, "momentum": 0.5}, seed=3, epochs=2,
                   data="real", output=str(tmp_path), max_steps_per_epoch=4)
    result = run(spec, progress=False)
    path = tmp_path / "digits_logreg/sgd/lr=0.3__momentum=0.5__schedule=constant__epochs=2__" \
                      "steps=4/seed_3.json"
    assert path.exists() and result["path"] == str(path)
    stored = json.loads(path.read_text())
    curve, minibatch = _plain_loop("digits_logreg", 0.3, 0.5, 2, 4, seed=3)
    assert len(stored["test_losses"]) == 3  # epochs 0, 1, 2
    for (loss, acc), got_loss, got_acc in zip(curve, stored["test_losses"],
                                              stored["test_accuracies"], strict=True):
        assert got_loss == pytest.approx(loss, rel=1e-5)
        assert got_acc == pytest.approx(acc, abs=1e-6)  # float32 batch means
    assert stored["minibatch_train_losses"] == pytest.approx(minibatch, rel=1e-5)
    assert stored["metric"] == "accuracy" and stored["diverged"] is False
    assert stored["learning_rates"] == [0.3, 0.3, 0.3]
    # a second call finds the result and does not train again
    assert run(spec, progress=False)["created"] == stored["created"]


def test_schedules_closed_form():
    total = 70
    cosine = schedule_factor("cosine", total)
    assert cosine(0) == 1.0 and cosine(35) == pytest.approx(0.5) and cosine(70) == 0.0
    restarts = schedule_factor("cosine_restarts", total)  # cycles 10, 20, 40
    assert restarts(9) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.9)))
    assert restarts(10) == 1.0 and restarts(30) == 1.0
    assert restarts(20) == pytest.approx(0.5)
    trapezoid = schedule_factor("trapezoidal", total)  # ramps of 7 steps
    assert [trapezoid(t) for t in (0, 6, 7, 62, 63, 69)] == pytest.approx(
        [1 / 7, 1.0, 1.0, 1.0, 1.0, 1 / 7])


def test_cosine_schedule_in_a_run(tmp_path):
    result = run(RunSpec("digits_logreg", "sgd", {"lr": 0.01}, epochs=2, schedule="cosine",
                         output=str(tmp_path), max_steps_per_epoch=5), progress=False)
    # lr recorded at epoch ends: after 5 and 10 of 10 steps
    assert result["learning_rates"] == pytest.approx([0.01, 0.005, 0.0], abs=1e-12)
    assert not result["diverged"]


def test_divergence_is_recorded(tmp_path):
    # Beale's function from DeepOBS's start: SGD with lr 1e-2 overflows in two steps
    result = run(RunSpec("two_d_beale", "sgd", {"lr": 0.01}, epochs=2, output=str(tmp_path),
                         max_steps_per_epoch=5), progress=False)
    assert result["diverged"] and result["metric"] == "loss"
    assert result["test_losses"][1:] == [None, None] and result["test_losses"][0] > 0
    assert result["test_accuracies"] == [None] * 3


def test_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"unknown problem 'cifar11'.*cifar10_3c3d"):
        RunSpec("cifar11", "sgd", {"lr": 0.1}).validate()
    with pytest.raises(ValueError, match=r"unknown optimizer 'adamm'.*adamw"):
        RunSpec("two_d_beale", "adamm", {"lr": 0.1}).validate()
    with pytest.raises(ValueError, match=r"no hyperparameter 'momentun'.*momentum"):
        RunSpec("two_d_beale", "sgd", {"lr": 0.1, "momentun": 0.9}).validate()
    with pytest.raises(ValueError, match="neither a configuration"):
        RunSpec("two_d_beale", "sgd", {"lr": 0.1}, cockpit="Alfa").validate()
    code = main_bench(["run", "two_d_beale", "--optimizer", "nosuch:Opt", "--lr", "0.1",
                       "--output", str(tmp_path)])
    assert code == 2 and "cannot import module 'nosuch'" in capsys.readouterr().err


def test_own_optimizer_by_import_path_and_cockpit_log(tmp_path):
    code = main_bench(["run", "digits_logreg", "--data", "real", "--optimizer",
                       "tests.benchmark.bench_helpers:SlowSGD", "--lr", "0.5", "--hp", "delay=0",
                       "--epochs", "1", "--max-steps-per-epoch", "5", "--cockpit",
                       "Loss,Alpha", "--output", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.rglob("seed_0.json")
    assert path.parent.name == "delay=0__lr=0.5__schedule=constant__epochs=1__steps=5"
    result = json.loads(path.read_text())
    logdir = path.with_suffix(".cockpit")
    assert result["cockpit_logdir"] == logdir.name and (logdir / "cockpit.sqlite").exists()
    from cockpit.store import read_scalars

    scalars = read_scalars(logdir, ["Loss", "Alpha"])
    # digits_logreg has no L2 term: Cockpit's mini-batch loss is the runner's
    assert list(scalars.index) == [0, 1, 2, 3, 4]
    assert scalars["Loss"].tolist() == pytest.approx(result["minibatch_train_losses"],
                                                     rel=1e-6)
    # α of a step needs the loss after it: the last step has none
    assert scalars["Alpha"].iloc[:-1].notna().all()


def _quick(tmp_path, **changes) -> RunSpec:
    fields = {"problem": "digits_logreg", "optimizer": "sgd", "hyperparameters": {"lr": 0.3},
              "epochs": 1, "data": "real", "output": str(tmp_path), "max_steps_per_epoch": 3}
    return RunSpec(**(fields | changes))


def test_a_result_made_with_other_data_is_never_reused(tmp_path, capsys):
    real = run(_quick(tmp_path), progress=False)
    path = tmp_path / "digits_logreg/sgd/lr=0.3__schedule=constant__epochs=1__steps=3/seed_0.json"
    assert real["path"] == str(path) and real["reused"] is False
    stored = json.loads(path.read_text())
    assert stored["data"] == "real" and stored["data_root"] is not None
    # the same file name, other data: an error that names both, the file stays as it is
    with pytest.raises(ValueError, match=r"made with --data real from .*not --data synthetic"):
        run(_quick(tmp_path, data="synthetic"), progress=False)
    with pytest.raises(ValueError, match=r"not --data real from .*elsewhere.*another --output"):
        run(_quick(tmp_path, data_dir=str(tmp_path / "elsewhere")), progress=False)
    assert json.loads(path.read_text()) == stored
    # the same settings: reused, and the CLI says so
    again = run(_quick(tmp_path), progress=False)
    assert again["reused"] is True and again["created"] == stored["created"]
    argv = ["run", "digits_logreg", "--data", "real", "--optimizer", "sgd", "--lr", "0.3",
            "--epochs", "1", "--max-steps-per-epoch", "3", "--output", str(tmp_path)]
    assert main_bench(argv) == 0
    assert f"result: {path} (reused: made earlier" in capsys.readouterr().out
    assert main_bench([*argv[:3], "synthetic", *argv[4:]]) == 2
    assert "another --output" in capsys.readouterr().err
    # --overwrite replaces it with a run on the data asked for, which differs from the real
    fresh = run(_quick(tmp_path / "fresh", data="synthetic"), progress=False)
    replaced = run(_quick(tmp_path, data="synthetic"), progress=False, overwrite=True)
    assert replaced["data"] == "synthetic" and replaced["data_root"] is None
    assert replaced["test_losses"] == fresh["test_losses"] != stored["test_losses"]


def test_a_cockpit_request_without_a_matching_run_log_trains_again(tmp_path):
    from cockpit.store import read_scalars

    plain = run(_quick(tmp_path), progress=False)
    path = plain["path"]
    logdir = tmp_path / "digits_logreg/sgd/lr=0.3__schedule=constant__epochs=1__steps=3" \
                        "/seed_0.cockpit"
    logged = run(_quick(tmp_path, cockpit="Loss"), progress=False)
    assert logged["reused"] is False and "has no Cockpit run log" in logged["rerun_reason"]
    assert logged["path"] == path and logged["cockpit_logdir"] == logdir.name
    # the same training (seeded): the same numbers, and the log holds its mini-batch losses
    assert logged["test_losses"] == plain["test_losses"]
    scalars = read_scalars(logdir, ["Loss"])
    assert list(scalars.index) == [0, 1, 2]
    assert scalars["Loss"].tolist() == pytest.approx(plain["minibatch_train_losses"], rel=1e-6)
    assert run(_quick(tmp_path, cockpit="Loss"), progress=False)["reused"] is True
    # another tracking interval: trained again, the log replaced
    every2 = run(_quick(tmp_path, cockpit="Loss", cockpit_every=2), progress=False)
    assert every2["reused"] is False and "--cockpit-every 1" in every2["rerun_reason"]
    assert list(read_scalars(logdir, ["Loss"]).index) == [0, 2]
    # no Cockpit asked for: the result (with its log) is reused
    assert run(_quick(tmp_path), progress=False)["reused"] is True


def test_the_default_batch_size_and_epochs_given_explicitly_name_the_same_setting(tmp_path):
    from cockpit.benchmark.problems.registry import describe
    from cockpit.benchmark.results import setting_name

    info = describe("digits_logreg")
    batch, epochs = int(info["batch_size"]), int(info["epochs"])
    assert setting_name({"lr": 0.1}, "constant", batch, epochs, default_batch_size=batch,
                        default_epochs=epochs) == "lr=0.1__schedule=constant"
    assert setting_name({"lr": 0.1}, "constant", batch // 2, epochs + 1,
                        default_batch_size=batch, default_epochs=epochs) \
        == f"lr=0.1__schedule=constant__bs={batch // 2}__epochs={epochs + 1}"
    implicit = run(_quick(tmp_path, epochs=None, max_steps_per_epoch=1), progress=False)
    assert implicit["path"].endswith("/lr=0.3__schedule=constant__steps=1/seed_0.json")
    assert implicit["num_epochs"] == epochs and implicit["batch_size"] == batch
    explicit = run(_quick(tmp_path, epochs=epochs, batch_size=batch, max_steps_per_epoch=1),
                   progress=False)
    assert explicit["reused"] is True and explicit["path"] == implicit["path"]
    assert len(list(tmp_path.rglob("seed_*.json"))) == 1


def test_a_non_finite_evaluation_after_the_last_update_marks_the_run_diverged(tmp_path):
    from cockpit.benchmark.selection import selection_value

    # by hand: one SGD step with lr 1e30 from a finite mini-batch loss blows the model up
    torch.manual_seed(0)
    problem = get_problem("digits_mlp", data="real", seed=0)
    opt = torch.optim.SGD(problem.model.parameters(), lr=1e30)
    x, y = next(iter(problem.train_loader))
    loss = problem.losses(problem.model(x), y).mean()
    assert math.isfinite(loss.item())
    loss.backward()
    opt.step()
    with torch.no_grad():
        test_loss = torch.cat([problem.losses(problem.model(a), b)
                               for a, b in problem.test_loader]).mean().item()
    assert not math.isfinite(test_loss)

    result = run(_quick(tmp_path, problem="digits_mlp", hyperparameters={"lr": 1e30},
                        epochs=2, max_steps_per_epoch=1), progress=False)
    assert result["minibatch_train_losses"] == [pytest.approx(loss.item(), rel=1e-5)]
    assert result["diverged"] is True
    assert result["test_losses"][0] > 0 and result["test_losses"][1:] == [None, None]
    # no accuracy of the blown-up model (nor of the epoch not trained) is recorded or ranked
    for split in ("train", "valid", "test"):
        assert result[f"{split}_accuracies"][0] is not None
        assert result[f"{split}_accuracies"][1:] == [None, None]
    assert selection_value(result) == -math.inf
