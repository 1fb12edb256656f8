"""What a new user hits first: messages that name the fix, notes for every
missing value, the command line, the demo's progress bar, the JSON export, the example."""

from __future__ import annotations

import json
import math
import re
import runpy
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
import tomllib
import torch
from torch import nn

from cockpit import Cockpit, every, quantities
from cockpit.cli import main
from cockpit.store import RunLogReader, read_meta
from tests.models import make_problem

ROOT = Path(__file__).resolve().parents[1]


def train(problem, cockpit, opt, steps):
    for step in range(steps):
        opt.zero_grad()
        problem.model.zero_grad()  # also the parameters another optimizer would own
        losses = problem.losses()
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()


# ---------------------------------------------------------------- optimizer ownership
def test_an_optimizer_of_another_model_is_said_and_its_settings_not_recorded(tmp_path):
    problem = make_problem("mlp_relu", 8)
    other = nn.Linear(3, 3)
    opt = torch.optim.SGD(other.parameters(), lr=0.123)
    with pytest.warns(RuntimeWarning, match="owns none of the model's parameters"):
        cockpit = Cockpit(problem.model, [quantities.Loss(), quantities.GradNorm()],
                          optimizer=opt, logdir=str(tmp_path / "run"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(2):
            opt.zero_grad()
            problem.model.zero_grad()
            losses = problem.losses()
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
    cockpit.close()
    output = cockpit.get_output()
    assert all("LearningRate" not in output[s] for s in output)
    meta = read_meta(tmp_path / "run")
    assert meta["optimizer"] is None and meta["optimizer_hyperparameters"] is None
    assert meta["parameters_not_in_optimizer"] == [n for n, _ in
                                                   problem.model.named_parameters()]
    assert "0.123" not in json.dumps(meta)


def test_an_optimizer_owning_part_of_the_model_names_the_rest(tmp_path):
    problem = make_problem("mlp_relu", 8)
    model = problem.model
    head = torch.nn.Linear(2, 2)  # a group of another model in the same optimizer
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.05},
                           {"params": head.parameters(), "lr": 0.9}])
    with pytest.warns(RuntimeWarning, match=r"does not own 4 of the model's 6 trainable "
                                            r"parameters: 2\.weight, 2\.bias, 4\.weight, "
                                            r"4\.bias"):
        cockpit = Cockpit(model, [quantities.Loss()], optimizer=opt,
                          logdir=str(tmp_path / "run"))
    train(problem, cockpit, opt, 2)
    cockpit.close()
    assert cockpit.get_output()[0]["LearningRate"] == 0.05  # not 0.9, not "mixed"
    meta = read_meta(tmp_path / "run")
    assert meta["optimizer"] == "SGD"
    assert [g["lr"] for g in meta["optimizer_hyperparameters"]] == [0.05]
    assert meta["parameters_not_in_optimizer"] == ["2.weight", "2.bias", "4.weight", "4.bias"]


def test_frozen_parameters_outside_the_optimizer_are_fine():
    problem = make_problem("mlp_relu", 8)
    for p in problem.model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in problem.model.parameters() if p.requires_grad], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Cockpit(problem.model, [quantities.Loss()], optimizer=opt).close()


# ---------------------------------------------------------------- losses=
def test_missing_losses_names_the_instruments_that_need_them():
    problem = make_problem("mlp_relu", 8)
    cockpit = Cockpit(problem.model, [quantities.GradNorm(), quantities.NormTest(),
                                      quantities.Loss(every(2)), quantities.Distance()])
    with pytest.raises(ValueError) as raised, cockpit(0):
        pass
    message = str(raised.value)
    assert message.startswith("Loss, NormTest need the individual losses at step 0")
    assert "GradNorm" not in message.split(":")[0] and "losses=losses" in message
    with pytest.raises(ValueError, match=r"^NormTest need"), cockpit(1):
        pass
    cockpit.close()


# ---------------------------------------------------------------- notes
def test_every_missing_value_has_its_reason_in_the_notes():
    problem = make_problem("mlp_relu", 8)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.05)
    chosen = [quantities.Loss(), quantities.Alpha(every(3)), quantities.NormTest(every(2)),
              quantities.Parameters(every(4))]
    cockpit = Cockpit(problem.model, chosen, optimizer=opt)
    train(problem, cockpit, opt, 7)
    before_close = cockpit.get_notes()
    assert before_close[6]["Alpha"].startswith("pending: ")
    cockpit.close()
    output, notes = cockpit.get_output(), cockpit.get_notes()
    assert "next step" in notes[6]["Alpha"] and output[6]["Alpha"] is None
    for step, values in output.items():
        for q in chosen:
            present = [k for k in values if k == q.name or k.startswith(q.name + "/")]
            if present and all(values[k] is not None for k in present):
                assert q.name not in notes.get(step, {}), (step, q.name)
                continue
            assert q.name in notes.get(step, {}), (step, q.name)  # absent or None: a reason
            scheduled = q.schedule(step)
            assert notes[step][q.name].startswith(
                "not scheduled" if not scheduled else ("not computed", "pending")), (step, q)
    assert notes[1]["NormTest"] == "not scheduled at this step: every(2)"
    assert "NormTest" not in notes.get(2, {})


def test_the_last_steps_alpha_note_reaches_the_run_log(tmp_path):
    problem = make_problem("mlp_relu", 8)
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.05)
    cockpit = Cockpit(problem.model, [quantities.Alpha()], optimizer=opt,
                      logdir=str(tmp_path / "run"))
    train(problem, cockpit, opt, 3)
    cockpit.close()
    with RunLogReader(tmp_path / "run") as reader:
        assert reader.output()[2]["Alpha"] is None and reader.output()[1]["Alpha"] is not None
        assert "next step" in reader.notes()[2]["Alpha"]


# ---------------------------------------------------------------- command line
def test_cockpit_without_a_command_exits_nonzero_with_usage(capsys):
    assert main([]) == 2
    assert "usage: cockpit COMMAND" in capsys.readouterr().err


def test_version(capsys):
    import cockpit

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"cockpit {cockpit.__version__}"


def test_export_of_a_missing_run_is_a_clean_message(tmp_path, capsys):
    assert main(["export", str(tmp_path / "missing")]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert captured.err.startswith("cockpit export: ") and "cockpit.sqlite" in captured.err


@pytest.mark.parametrize("command", ["demo", "export"])
def test_help_texts_describe_every_option_with_defaults(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text  # no raw reST markup
    description = text.split("\n\n")[1]
    assert len(description) > 40, text
    options = re.findall(r"^  (--?[\w-]+)", text, re.MULTILINE)
    for option in options:  # every option explains itself (help on the same or next line)
        block = text.split(option, 1)[1].split("\n  -", 1)[0]
        assert len(block.strip().split()) > 2, (option, block)
    if command == "demo":
        for default in ("(default: 300)", "(default: 64)", "(default: 0)"):
            assert default in text
    else:
        assert "(default: json)" in text


# ---------------------------------------------------------------- demo's progress bar
class RecordingBar:
    """Stands in for tqdm: records what the bar would show, per step."""

    instances: ClassVar[list[RecordingBar]] = []

    def __init__(self, iterable, **kwargs):
        self.iterable, self.shown = iterable, []
        self.step: int | None = None
        RecordingBar.instances.append(self)

    def __iter__(self):
        for step in self.iterable:
            self.step = step
            yield step

    def set_postfix(self, refresh=True, **values):
        self.shown.append((self.step, ", ".join(f"{k}={v}" for k, v in values.items())))

    def set_postfix_str(self, text="", refresh=True):
        self.shown.append((self.step, text))


def test_demo_bar_says_what_the_first_step_does_and_shows_each_steps_loss(
        tmp_path, monkeypatch, capsys):
    import tqdm.auto

    RecordingBar.instances = []
    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingBar)
    logdir = tmp_path / "demo"
    assert main(["demo", "--steps", "5", "--no-plot", "--logdir", str(logdir)]) == 0
    (bar,) = RecordingBar.instances
    first_step = [text for step, text in bar.shown if step == 0]
    assert "first tracked step" in first_step[0] and "convolution" in first_step[0]
    losses = {step: text for step, text in bar.shown if text.startswith("loss=")}
    recorded = {s: v["Loss"] for s, v in RunLogReader(logdir).output().items()}
    assert losses == {s: f"loss={recorded[s]:.3f}" for s in range(5)}  # fresh every step


# ---------------------------------------------------------------- JSON export
def test_json_export_holds_metadata_and_notes(tmp_path):
    problem = make_problem("mlp_relu", 1)  # a batch of one: the gradient tests are None
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.05)
    cockpit = Cockpit(problem.model, [quantities.Loss(), quantities.NormTest()], optimizer=opt,
                      logdir=str(tmp_path / "run"))
    train(problem, cockpit, opt, 2)
    cockpit.close()
    out = tmp_path / "run.json"
    assert main(["export", str(tmp_path / "run"), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"] == read_meta(tmp_path / "run") and doc["meta"]["optimizer"] == "SGD"
    assert doc["notes"]["1"]["NormTest"] == cockpit.get_notes()[1]["NormTest"]
    assert doc["steps"]["1"]["NormTest"] is None
    assert doc["steps"]["0"]["Loss"] == cockpit.get_output()[0]["Loss"]


# ---------------------------------------------------------------- example and extras
@pytest.mark.parametrize("steps", [50, 51])
def test_training_loop_example_ends_on_any_step_count(steps, tmp_path, capsys):
    example = runpy.run_path(str(ROOT / "examples" / "training_loop.py"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny MLP: more threads only spin on a shared CPU
    try:
        output = example["main"](["--steps", str(steps), "--logdir", str(tmp_path / "run")])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    gsnr = 50 if steps > 50 else 45  # every(5)
    assert f"MeanGSNR: {output[gsnr]['MeanGSNR']:.4g} at step {gsnr}" in printed
    assert f"HessMaxEV: {output[50 if steps > 50 else 25]['HessMaxEV']:.4g} at step" in printed
    assert math.isfinite(output[steps - 1]["Loss"])


def test_test_extra_installs_every_package_the_tests_import_optionally():
    """A test that skips when a package is missing is skipped in CI unless the [test]
    extra installs the package."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~\[ ]", d)[0].lower()
                for d in project["dependencies"] + project["optional-dependencies"]["test"]}
    distribution = {"IPython": "ipython", "sklearn": "scikit-learn"}
    optional = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for module in re.findall(r"importorskip\(\s*[\"']([\w.]+)", path.read_text()):
            top = module.split(".")[0]
            optional.add(distribution.get(top, top).lower())
    assert "ipython" in optional
    assert optional <= declared, optional - declared
    constraints = (ROOT / "constraints.txt").read_text()
    assert all(re.search(rf"^{name}==", constraints, re.MULTILINE) for name in optional)


def test_a_logdir_that_is_not_a_path_is_refused_by_name():
    problem = make_problem("mlp_relu", 8)
    for wrong in (5, b"runs/x", ["runs/x"]):
        with pytest.raises(TypeError, match="logdir must be a directory path"):
            Cockpit(problem.model, [quantities.Loss()], logdir=wrong)
        assert not problem.model._forward_hooks  # (refused before any hook)
