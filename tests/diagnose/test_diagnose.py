"""Diagnosis: the DeadUnits instrument against brute force, every check on outputs built by
hand, the sources diagnose() reads, the CLI, the sinks and Cockpit(..., diagnose=True)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit import Cockpit, Finding, configuration, diagnose, quantities
from cockpit.diagnose import CHECKS_SKIPPED, CODES, Diagnoser
from cockpit.diagnose import thresholds as T
from cockpit.diagnose.cli import main_diagnose
from cockpit.diagnose.rules.scale import input_rms


def _train(model, steps, x, y, *, quantities_=None, opt=None, logdir=None, diagnose_=False,
           sinks=()):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model, quantities_ or configuration("economy"), optimizer=opt,
                      logdir=logdir, diagnose=diagnose_, sinks=sinks)
    for step in range(steps):
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    cockpit.close()
    return cockpit


# ---------------------------------------------------------------------- DeadUnits
def test_dead_units_against_brute_force_per_sample_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(6 * 5 * 5, 12), nn.ReLU(), nn.Linear(12, 4),
    ).double()
    with torch.no_grad():
        model[0].bias[:2] = -100.0  # two dead channels
        model[3].bias[:5] = -100.0  # five dead units
        model[3].bias[5] = -1.5  # active on a few samples only: alive
    x = torch.randn(16, 1, 5, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (16,))
    cockpit = Cockpit(model, [quantities.DeadUnits()], strict=True)
    losses = F.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, losses=losses):
        losses.mean().backward()
    out = cockpit.get_output()[0]
    cockpit.close()

    params = dict(model.named_parameters())

    def loss_one(p, xi, yi):
        logits = torch.func.functional_call(model, p, (xi[None],))
        return F.cross_entropy(logits, yi[None])

    per_sample = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    total_dead = total_units = 0
    for name in ("0.weight", "3.weight", "5.weight"):
        g = per_sample[name].reshape(16, params[name].shape[0], -1)
        dead = int((g.abs().amax(dim=(0, 2)) == 0).sum())  # zero for every sample
        units = params[name].shape[0]
        assert out[f"DeadUnits/{name}"] == pytest.approx(dead / units)
        total_dead, total_units = total_dead + dead, total_units + units
    assert out["DeadUnits/0.weight"] >= 2 / 6  # the planted dead units are counted
    assert 5 / 12 <= out["DeadUnits/3.weight"] < 1
    assert out["DeadUnits"] == pytest.approx(total_dead / total_units)
    assert "DeadUnits/0.bias" not in out


# ---------------------------------------------------------------------- input RMS
def test_input_rms_equals_weighted_input_norms_of_a_linear_layer():
    """unscaled_inputs reads Σ‖g_n(W)‖²/Σ‖g_n(b)‖² = Σ‖δ_n‖²‖x_n‖²/Σ‖δ_n‖² (per input
    element) from recorded values; compare with the per-sample δ_n computed directly."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = 7.0 + 3.0 * torch.randn(32, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (32,))
    cockpit = _train(model, T.MIN_STEPS, x, y, opt=torch.optim.SGD(model.parameters(), lr=0.0))
    weight, steps, rms = input_rms(_record(cockpit))
    assert weight == "0.weight" and len(steps) == T.MIN_STEPS
    pre = model[0](x).detach().requires_grad_()
    loss = F.cross_entropy(model[2](torch.tanh(pre)), y, reduction="sum")
    (delta,) = torch.autograd.grad(loss, pre)  # δ_n (the sum makes it per sample)
    w = delta.pow(2).sum(1)
    expected = math.sqrt(float((w * x.pow(2).sum(1)).sum() / w.sum() / 8))
    np.testing.assert_allclose(rms, expected, rtol=1e-6)


def _record(cockpit):
    diagnoser = Diagnoser(meta={"parameters": {k: list(p.shape)
                                               for k, p in cockpit._params.items()}})
    diagnoser.update(cockpit.get_output())
    return diagnoser.record


# ---------------------------------------------------------------------- checks on built outputs
def _series(n=40, **per_step):
    """{step: values}; each keyword is a function step -> value."""
    return {s: {k: f(s) for k, f in per_step.items()} for s in range(n)}


def _codes(output, severity=("warning", "error")):
    return [f.code for f in diagnose(output) if f.severity in severity]


def test_finding_contract():
    f = Finding("dead_units", "warning", "Units are dead.", advice="Check the init.",
                parameters=("0.weight",))
    assert f.is_problem and "dead_units" in str(f) and "Check the init." in str(f)
    assert f.to_dict()["parameters"] == ("0.weight",)
    with pytest.raises(ValueError, match="unknown finding code"):
        Finding("bad_code", "warning", "x")
    with pytest.raises(ValueError, match="severity"):
        Finding("dead_units", "fatal", "x")
    assert len(CODES) == 11


def test_non_finite_names_first_step_and_parameters():
    out = _series(Loss=lambda s: math.nan if s >= 7 else 1.0,
                  GradNorm=lambda s: math.nan if s >= 7 else 1.0,
                  **{"GradNorm/a.weight": lambda s: math.inf if s >= 7 else 1.0,
                     "GradNorm/b.weight": lambda s: 1.0})
    (finding,) = [f for f in diagnose(out) if f.code == "non_finite"]
    assert finding.severity == "error" and finding.step == 7
    assert finding.parameters == ("a.weight",)
    assert _codes(_series(Loss=lambda s: 1.0, GradNorm=lambda s: 1.0)) == []


def test_frozen_parameters_needs_gradient_and_no_change():
    out = _series(**{"GradNorm/a.weight": lambda s: 0.5, "UpdateSize/a.weight": lambda s: 0.0,
                     "GradNorm/b.weight": lambda s: 0.5, "UpdateSize/b.weight": lambda s: 0.1,
                     "GradNorm/c.weight": lambda s: 0.0, "UpdateSize/c.weight": lambda s: 0.0,
                     "GradNorm": lambda s: 1.0, "UpdateSize": lambda s: 0.1})
    (finding,) = [f for f in diagnose(out) if f.code == "frozen_parameters"]
    assert finding.parameters == ("a.weight",)  # c gets no gradient: not frozen


def test_missing_zero_grad_reads_gradient_held_not_an_edited_gradient():
    clean = _series(GradientHeld=lambda s: 0.0, GradientMismatch=lambda s: 1e-8)
    assert "missing_zero_grad" not in _codes(clean)
    # clip_grad_value_ (or gradient noise, SAM, L2 added to p.grad): a persistent mismatch
    # but the gradients are zeroed before every step: no finding
    edited = _series(GradientHeld=lambda s: 0.0, GradientMismatch=lambda s: 0.37)
    assert "missing_zero_grad" not in _codes(edited)
    broken = _series(GradientHeld=lambda s: 0.0 if s == 0 else 1.0,
                     GradientMismatch=lambda s: 0.0 if s == 0 else 0.3)
    (finding,) = [f for f in diagnose(broken) if f.code == "missing_zero_grad"]
    assert finding.step == 1
    assert [e.instrument for e in finding.evidence] == ["GradientHeld", "GradientMismatch"]


def test_gradient_held_is_recorded_and_ignores_parameters_outside_the_optimizer():
    """GradientHeld is 1 exactly at the steps whose parameters held a gradient before the
    first block; parameters the optimizer does not step on (never zeroed by it) neither
    count there nor in GradientMismatch."""
    import warnings

    import torch

    from cockpit import Cockpit, quantities
    from tests.models import make_problem

    problem = make_problem("mlp_relu", 8)
    first = next(iter(problem.model.parameters()))
    others = [p for p in problem.model.parameters() if p is not first]
    opt = torch.optim.SGD(others, lr=0.1)  # the first weight is left out: never zeroed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cockpit = Cockpit(problem.model, [quantities.GradNorm()], optimizer=opt)
        for step in range(4):
            if step != 2:  # step 2 forgets zero_grad
                opt.zero_grad()
            losses = problem.losses()
            with cockpit(step, losses=losses):
                losses.mean().backward()
            opt.step()
        cockpit.close()
    out = cockpit.get_output()
    assert [out[s]["GradientHeld"] for s in range(4)] == [0.0, 0.0, 1.0, 0.0]
    assert out[1]["GradientMismatch"] < 1e-10  # the left-out weight's pile-up is not read
    assert out[2]["GradientMismatch"] > 1e-6


def test_learning_rate_checks_on_alpha_and_loss():
    rng = np.random.default_rng(0)
    over = _series(Alpha=lambda s: 1.5 + 0.3 * rng.standard_normal(),
                   Loss=lambda s: 2.0 + 0.5 * (s % 2))
    assert "lr_too_large" in _codes(over)
    # Σ‖g‖‖s‖ = 40 · 0.5 · 1e-3 = 0.02 of the loss: the steps cannot move it
    crawl = _series(Alpha=lambda s: -0.99, Loss=lambda s: 2.3 - 1e-4 * s,
                    GradNorm=lambda s: 0.5, UpdateSize=lambda s: 1e-3)
    assert _codes(crawl) == ["lr_too_small"]
    progress = _series(Alpha=lambda s: -0.99, Loss=lambda s: 2.3 * 0.97**s,
                       GradNorm=lambda s: 0.5, UpdateSize=lambda s: 1e-3)
    assert "lr_too_small" not in _codes(progress)  # short steps, but the loss falls
    # a loss falling by a fifth is progress (5 %), not "barely moves" (the noise rule's 50 %
    # of the same name once replaced this threshold)
    fifth = _series(Alpha=lambda s: -0.99, Loss=lambda s: 2.3 * (1 - 0.006 * s),
                    GradNorm=lambda s: 0.5, UpdateSize=lambda s: 1e-3)
    assert "lr_too_small" not in _codes(fifth)
    plateau = _series(Alpha=lambda s: -0.99, Loss=lambda s: 2.3 - 1e-4 * s,
                      GradNorm=lambda s: 0.5, UpdateSize=lambda s: 0.1)
    assert "lr_too_small" not in _codes(plateau)  # long steps that do not help: not lr
    spike = _series(Alpha=lambda s: 3.0 if s == 9 else 0.0,
                    Loss=lambda s: 9.0 if s == 10 else 2.0)
    (finding,) = [f for f in diagnose(spike) if f.code == "lr_too_large"]
    assert finding.step == 9
    healthy = _series(Alpha=lambda s: 0.1 * rng.standard_normal(), Loss=lambda s: 2.3 * 0.98**s)
    assert _codes(healthy) == []
    sharp = _series(HessMaxEV=lambda s: 50.0, LearningRate=lambda s: 0.1)
    assert _codes(sharp) == ["lr_too_large"]


def test_vanishing_and_exploding_gradients():
    layers = {f"GradNorm/{i}.weight": (lambda s, i=i: 10.0 ** -i) for i in range(5)}
    out = _series(GradNorm=lambda s: 1.0, **layers)
    (finding,) = [f for f in diagnose(out) if f.code == "vanishing_gradients"]
    # recorded in backward order: GradNorm/4 first → model order reversed
    assert set(finding.parameters) == {"3.weight", "4.weight"}  # ≥ 100× below 0.weight
    growing = _series(GradNorm=lambda s: 1.3**s)
    assert _codes(growing) == ["exploding_gradients"]
    huge = _series(GradNorm=lambda s: 5e3)
    assert _codes(huge) == ["exploding_gradients"]


def test_noise_dominated_needs_saturated_norm_test_and_inner_test_spread():
    rng = np.random.default_rng(1)
    small_batch = _series(NormTest=lambda s: 1.0 + 0.05 * rng.standard_normal() ** 2,
                          InnerTest=lambda s: 0.3, BatchSize=lambda s: 2.0,
                          Loss=lambda s: float(rng.uniform(1.0, 3.0)))
    (finding,) = [f for f in diagnose(small_batch) if f.code == "noise_dominated"]
    assert "batch of 2" in finding.message
    assert [e.instrument for e in finding.evidence] == ["NormTest", "InnerTest", "Loss"]
    for step, values in small_batch.items():  # B_simple recorded too: quoted as evidence
        values["GradientNoiseScaleEMA"] = 40.0 if step < 15 else 64.0
    (finding,) = [f for f in diagnose(small_batch) if f.code == "noise_dominated"]
    (scale,) = [e for e in finding.evidence if e.instrument == "GradientNoiseScale"]
    assert "B_simple ≈ 64 samples" in scale.summary and scale.values[-1] == 64.0
    jumping = {"Loss": lambda s: float(rng.uniform(1.0, 3.0))}
    plateau = _series(NormTest=lambda s: 1.0, InnerTest=lambda s: 0.03, **jumping)
    assert "noise_dominated" not in _codes(plateau)
    resolved = _series(NormTest=lambda s: 0.7, InnerTest=lambda s: 0.3, **jumping)
    assert "noise_dominated" not in _codes(resolved)
    same_batch = _series(NormTest=lambda s: 1.0, InnerTest=lambda s: 0.3,
                         Loss=lambda s: 2.0 - 0.01 * s)  # full batch: a smooth loss
    assert "noise_dominated" not in _codes(same_batch)
    # late in a healthy run: a small gradient mostly noise, a small loss jumping by a large
    # share of itself, but still falling through the noise
    converging = _series(NormTest=lambda s: 1.0, InnerTest=lambda s: 0.3,
                         Loss=lambda s: 0.5 * 0.9**s * float(rng.uniform(0.5, 1.5)))
    assert "noise_dominated" not in _codes(converging)


def test_update_ratio_names_a_layer_far_from_the_others_or_far_above_1e_3():
    rng = np.random.default_rng(2)

    def ratios(**scale):
        return {"UpdateRatio": lambda s: 1e-2,
                **{f"UpdateRatio/{k}.weight": (lambda s, f=f: f * 1e-2 * rng.uniform(0.7, 1.4))
                   for k, f in scale.items()}}

    (finding,) = [f for f in diagnose(_series(**ratios(a=1.0, b=40.0, c=1.5, d=0.5)))
                  if f.code == "update_ratio"]
    assert finding.parameters == ("b.weight",) and "faster" in str(finding)
    (finding,) = [f for f in diagnose(_series(**ratios(a=1.0, b=0.02, c=1.0)))
                  if f.code == "update_ratio"]
    assert finding.parameters == ("b.weight",) and "slower" in str(finding)
    assert "update_ratio" not in _codes(_series(**ratios(a=1.0, b=3.0, c=0.4)))
    frozen = {**ratios(a=1.0, b=1.5), "UpdateRatio/c.weight": lambda s: 0.0}
    assert "update_ratio" not in _codes(_series(**frozen))  # frozen_parameters' case
    assert _codes(_series(**ratios(a=50.0))) == ["update_ratio"]  # 0.5 per step
    assert "update_ratio" not in _codes(_series(**ratios(a=3.0)))
    biases = {**ratios(a=1.0, b=1.0), "UpdateRatio/b.bias": lambda s: 1.0}
    assert "update_ratio" not in _codes(_series(**biases))


def test_skipped_checks_are_named_with_the_instruments_that_enable_them():
    findings = diagnose(_series(Loss=lambda s: 1.0))
    (skipped,) = [f for f in findings if f.code == CHECKS_SKIPPED]
    assert skipped.severity == "info"
    why = {e.instrument: e.summary for e in skipped.evidence}
    assert why["dead_units"] == "DeadUnits not recorded"
    assert why["missing_zero_grad"] == "GradientHeld not recorded"
    assert "non_finite" not in why
    assert "dead_units reads DeadUnits" in skipped.advice


def test_instruments_that_are_none_at_every_step_skip_their_checks_with_the_reason():
    reason = "not computed: BatchNorm2d '1' mixes the samples. Ways out: eval mode"
    out = _series(Loss=lambda s: 2.3 - 1e-4 * s, GradNorm=lambda s: 0.5,
                  NormTest=lambda s: None, InnerTest=lambda s: None, Alpha=lambda s: None,
                  DeadUnits=lambda s: None)
    notes = {s: {"NormTest": reason, "InnerTest": reason, "Alpha": reason,
                 "DeadUnits": reason} for s in out}
    diagnoser = Diagnoser()
    diagnoser.update(out, notes)
    (skipped,) = [f for f in diagnoser.findings if f.code == CHECKS_SKIPPED]
    why = {e.instrument: e.summary for e in skipped.evidence}
    assert why["noise_dominated"] == ("NormTest, InnerTest None at every step: BatchNorm2d '1' "
                                      "mixes the samples")
    assert why["dead_units"].startswith("DeadUnits None at every step")
    assert "Alpha None at every step" in why["lr_too_large"]
    assert "could not run" in skipped.message


def test_a_check_with_fewer_steps_than_it_needs_is_skipped_and_says_how_many():
    # a crawl that would be lr_too_small over enough steps, and an overshoot
    crawl = dict(Alpha=lambda s: -0.99, Loss=lambda s: 2.3 - 1e-4 * s,
                 GradNorm=lambda s: 0.5, UpdateSize=lambda s: 1e-3)
    short = diagnose(_series(n=T.LR_SMALL_MIN_STEPS - 1, **crawl))
    assert "lr_too_small" not in [f.code for f in short]
    (skipped,) = [f for f in short if f.code == CHECKS_SKIPPED]
    why = {e.instrument: e.summary for e in skipped.evidence}
    assert why["lr_too_small"] == (f"Loss + GradNorm + UpdateSize at {T.LR_SMALL_MIN_STEPS - 1} "
                                   f"tracked steps, the check needs {T.LR_SMALL_MIN_STEPS}")
    assert "lr_too_small" in _codes(_series(n=T.LR_SMALL_MIN_STEPS, **crawl))
    few = diagnose(_series(n=T.MIN_STEPS - 1, Alpha=lambda s: 3.0, Loss=lambda s: 2.0))
    assert "lr_too_large" not in [f.code for f in few]
    (skipped,) = [f for f in few if f.code == CHECKS_SKIPPED]
    why = {e.instrument: e.summary for e in skipped.evidence}
    assert f"Alpha at {T.MIN_STEPS - 1} tracked steps, the check needs {T.MIN_STEPS}" in \
        why["lr_too_large"]


def test_lr_too_small_agrees_with_alpha():
    """A loss that cannot fall (random labels) with steps that reach the valley floor of the
    fit (median α near 0) is not a learning rate that is too small."""
    flat = dict(Loss=lambda s: 2.3 - 1e-4 * s, GradNorm=lambda s: 0.5, UpdateSize=lambda s: 1e-3)
    assert "lr_too_small" not in _codes(_series(Alpha=lambda s: -0.02, **flat))
    (finding,) = [f for f in diagnose(_series(Alpha=lambda s: -0.9, **flat))
                  if f.code == "lr_too_small"]
    assert "median α -0.90" in str(finding)


def test_bad_sources_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        diagnose(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"cockpit\.sqlite"):
        diagnose(tmp_path)
    with pytest.raises(TypeError, match="get_output"):
        diagnose({"0": {}})
    with pytest.raises(TypeError, match="Cockpit"):
        diagnose(3.0)


# ---------------------------------------------------------------------- real runs
def _frozen_run(tmp_path=None, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)  # first layer left out
    logdir = None if tmp_path is None else str(tmp_path / "run")
    return _train(model, 12, x, y, opt=opt, logdir=logdir, **kwargs), logdir


def test_sources_agree_and_cli_reports(tmp_path, capsys):
    cockpit, logdir = _frozen_run(tmp_path)
    from_cockpit = diagnose(cockpit)
    from_dir = diagnose(logdir)
    from_dict = diagnose(cockpit.get_output())
    assert [f.code for f in from_cockpit] == [f.code for f in from_dir]
    assert "frozen_parameters" in [f.code for f in from_dict]
    (frozen,) = [f for f in from_dir if f.code == "frozen_parameters"]
    assert frozen.parameters == ("0.weight", "0.bias")
    assert main_diagnose([logdir]) == 1
    printed = capsys.readouterr().out
    assert "frozen_parameters" in printed and "0.weight" in printed and "try:" in printed
    # economy records every check's instruments; 12 steps are too few for lr_too_small only
    assert printed.count("  - ") == 1
    assert f"  - lr_too_small: Loss + GradNorm + UpdateSize at 12 tracked steps, the check " \
           f"needs {T.LR_SMALL_MIN_STEPS}" in printed
    assert main_diagnose([str(tmp_path / "nothing")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main_diagnose(["--help"])
    assert exit_.value.code == 0


def test_cli_clean_run_exits_zero(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(64, 6)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, T.LR_SMALL_MIN_STEPS, x, y, opt=opt, logdir=str(tmp_path / "ok"))
    code = main_diagnose([str(tmp_path / "ok")])
    assert code == 0, capsys.readouterr().out
    assert "No problem found" in capsys.readouterr().out


def test_a_run_whose_per_sample_instruments_are_none_gets_no_all_clear(tmp_path, capsys):
    """BatchNorm in training mode: every per-sample instrument is None. The diagnosis says
    which checks it skipped and why; neither the CLI nor the view reads as a pass."""
    import matplotlib

    matplotlib.use("Agg")
    from cockpit.view import plot_run

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(model, 10, x, y, logdir=str(tmp_path / "bn"))
    findings = diagnose(str(tmp_path / "bn"))
    (skipped,) = [f for f in findings if f.code == CHECKS_SKIPPED]
    why = {e.instrument: e.summary for e in skipped.evidence}
    assert "BatchNorm1d" in why["noise_dominated"] and "BatchNorm1d" in why["unscaled_inputs"]
    # the bias right before the BatchNorm has a gradient of rounding noise only: not frozen
    assert [f.code for f in findings] == [CHECKS_SKIPPED]
    main_diagnose([str(tmp_path / "bn")])
    printed = capsys.readouterr().out
    assert "No problem found" not in printed and "could not run" in printed
    fig = plot_run(str(tmp_path / "bn"), tmp_path / "bn.png")
    shown = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert "✓" not in shown and "could not run" in shown


def test_cockpit_diagnose_true_warns_once_and_logs_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator as ea

    from cockpit.store import TensorBoardSink

    sink = TensorBoardSink(tmp_path / "tb")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _frozen_run(diagnose_=True, sinks=[sink])
    messages = [str(w.message) for w in caught if "Cockpit diagnosis" in str(w.message)]
    assert len([m for m in messages if "frozen_parameters" in m]) == 1
    acc = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    tag = "cockpit/diagnosis/frozen_parameters/text_summary"
    assert tag in acc.Tags()["tensors"]
    text = acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
    assert "0.weight" in text


def test_live_diagnosis_never_crashes_training(monkeypatch):
    from cockpit.diagnose import diagnoser as module

    def broken(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(module.Diagnoser, "evaluate", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit, _ = _frozen_run(diagnose_=True)
    assert len(cockpit.get_output()) == 12
    assert any("diagnosis failed" in str(w.message) for w in caught)


def test_wandb_sink_logs_findings_as_text_and_table(monkeypatch):
    import sys
    import types

    logged = []

    class Run:
        def log(self, payload, step=None):
            logged.append((step, payload))

        def define_metric(self, *args, **kwargs):
            pass

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    fake = types.SimpleNamespace(init=lambda **kw: Run(), Table=Table, Histogram=None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from cockpit.store import WandbSink

    sink = WandbSink(Run())
    finding = Finding("frozen_parameters", "warning", "0.weight never changes.",
                      advice="Pass it to the optimizer.", parameters=("0.weight",))
    sink.write_findings(7, [finding])
    ((step, payload),) = logged
    assert step == 7 and "0.weight never changes." in payload["cockpit/diagnosis"]
    table = payload["cockpit/diagnosis_table"]
    assert table.data == [[7, "frozen_parameters", "warning", "0.weight never changes.",
                           "Pass it to the optimizer.", "0.weight"]]


def test_cockpit_command_dispatches_diagnose(tmp_path, capsys):
    from cockpit.cli import main

    _, logdir = _frozen_run(tmp_path)
    assert main(["diagnose", logdir, "--json"]) == 1
    import json

    codes = [f["code"] for f in json.loads(capsys.readouterr().out)]
    assert "frozen_parameters" in codes


def test_since_step_reads_only_later_steps_and_diagnoser_reports_new_findings_once():
    out = _series(Loss=lambda s: math.nan if s == 3 else 1.0, GradNorm=lambda s: 1.0)
    assert "non_finite" in _codes(out)
    assert [f.code for f in diagnose(out, since_step=10) if f.is_problem] == []
    diagnoser = Diagnoser()
    first = diagnoser.update({s: out[s] for s in range(5)})
    assert [f.code for f in first] == ["non_finite"]
    assert diagnoser.update({s: out[s] for s in range(5, 40)}) == []  # reported already
    assert [f.code for f in diagnoser.findings if f.is_problem] == ["non_finite"]


def test_every_threshold_is_defined_once():
    """A second assignment of a name in the thresholds module replaces the first for every
    rule that reads it (lr_too_small read the noise rule's 0.5 as its 0.05)."""
    import ast
    import inspect

    from cockpit.diagnose import thresholds

    tree = ast.parse(inspect.getsource(thresholds))
    names = [target.id for node in tree.body if isinstance(node, ast.Assign)
             for target in node.targets if isinstance(target, ast.Name)]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)
