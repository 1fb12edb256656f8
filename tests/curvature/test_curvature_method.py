"""Curvature instruments say what they computed: the exact Hessian diagonal through LayerNorm,
RMSNorm and smooth activations against dense float64 Hessians (torch.func.hessian); the
method in the notes and the run log; one warning when ``auto`` falls back; standard errors
beside stochastic values; the view's "Tr(GGN)" label; NaN and a note at non-finite steps.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from curvature_reference import single_thread  # noqa: F401  (autouse fixture)
from torch import nn
from torch.func import functional_call, hessian

from cockpit import Cockpit, quantities
from cockpit.store import RunLogReader
from tests.reference import individual_gradients, rel_close


class Seq(nn.Module):
    """Token features [N, T, d] → LayerNorm per position → GELU MLP → mean over T."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm = nn.Linear(3, 4), nn.LayerNorm(4)
        self.act, self.out = nn.GELU(approximate="tanh"), nn.Linear(4, 3)

    def forward(self, x):
        return self.out(self.act(self.norm(self.inp(x)))).mean(1)


def model_of(which: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if which == "layernorm_gelu":  # an MLP with LayerNorm and GELU
        model = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 6),
                              nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 3))
        x = torch.randn(6, 5)
    elif which == "activations":
        model = nn.Sequential(nn.Linear(5, 5), nn.SiLU(), nn.Linear(5, 5), nn.Softplus(beta=2.0),
                              nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 4), nn.Sigmoid(),
                              nn.Linear(4, 3))
        x = torch.randn(6, 5)
    elif which == "rmsnorm":
        model = nn.Sequential(nn.Linear(5, 6), nn.RMSNorm(6), nn.SiLU(), nn.Linear(6, 3))
        x = torch.randn(6, 5)
    else:
        model, x = Seq(), torch.randn(6, 4, 3)
    return model.double(), x.double()


def dense_hessian_diagonal(model, x, y, per_sample=None) -> dict[str, torch.Tensor]:
    """The diagonal of the dense Hessian of the mean of ``per_sample(model(x), y)``
    (default: cross-entropy), per parameter."""
    names = [k for k, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]
    sizes = [p.numel() for p in params]

    def loss(flat):
        chunks = [c.view_as(p) for c, p in zip(flat.split(sizes), params, strict=True)]
        out = functional_call(model, dict(zip(names, chunks, strict=True)), (x,))
        if per_sample is None:
            return F.cross_entropy(out, y)
        return per_sample(out, y).mean()

    diag = torch.diagonal(hessian(loss)(torch.cat([p.reshape(-1) for p in params])))
    return {k: d.view_as(p) for k, d, p in zip(names, diag.split(sizes), params, strict=True)}


def one_step(model, x, y, qs, logdir=None):
    cockpit = Cockpit(model, qs, strict=True, logdir=logdir)
    losses = F.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    return cockpit


@pytest.mark.parametrize("which", ["layernorm_gelu", "activations", "rmsnorm", "sequence"])
def test_auto_gives_the_exact_hessian_diagonal(which):
    model, x = model_of(which)
    y = torch.randint(0, 3, (x.shape[0],))
    exact = dense_hessian_diagonal(model, x, y)
    trace, tic = quantities.HessTrace(), quantities.TICDiag()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the Hessian is used
        cockpit = one_step(model, x, y, [trace, tic])
    out = cockpit.get_output()[0]
    assert trace.method_used == tic.method_used == "diag_hessian"
    total = sum(d.sum().item() for d in exact.values())
    assert rel_close(out["HessTrace"], total, 1e-7)
    for name, d in exact.items():
        assert rel_close(out[f"HessTrace/{name}"], d.sum().item(), 1e-7, atol=1e-10), name
    grads = individual_gradients(model, lambda o, t: F.cross_entropy(o, t, reduction="none"),
                                 x, y)
    tic_diag = sum((grads[k].pow(2).sum(0) / (exact[k].clamp(min=0) + 1e-7)).sum().item()
                   for k in exact) / x.shape[0]
    assert rel_close(out["TICDiag"], tic_diag, 1e-6)  # elementwise, not only the sums
    assert "HessTrace.ggn" not in out and "HessTrace.stderr" not in out
    assert "exact Hessian diagonal" in cockpit.get_notes()[0]["HessTrace"]


class Twice(nn.Module):
    """A Linear (or a LayerNorm) called twice: its second call's input depends on its own
    weights, W·a(W), a diagonal term the exact decomposition does not cover."""

    def __init__(self, layer: str):
        super().__init__()
        self.inp, self.head = nn.Linear(4, 5), nn.Linear(5, 3)
        self.shared = nn.Linear(5, 5) if layer == "linear" else nn.LayerNorm(5)
        self.a1, self.a2, self.a3 = nn.Tanh(), nn.Tanh(), nn.Tanh()

    def forward(self, x):
        h = self.shared(self.a1(self.inp(x)))
        return self.head(self.a3(self.shared(self.a2(h))))


@pytest.mark.parametrize("layer", ["linear", "layernorm"])
def test_a_layer_called_twice_is_not_given_the_decompositions_diagonal(layer):
    """The exact diagonal left out the second call's dependence on the shared weights: a
    Tr(H) of 1.117 for the dense Hessian's 1.368, labelled exact. "auto" now takes the
    unbiased estimator and says why; "diag_hessian" is None with the reason; the estimate
    agrees with the dense Hessian within its standard error."""
    torch.manual_seed(0)
    model, x = Twice(layer).double(), torch.randn(8, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    exact = sum(d.sum().item() for d in dense_hessian_diagonal(model, x, y).values())
    trace = quantities.HessTrace(mc_samples=200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cockpit = one_step(model, x, y, [trace])
    out, note = cockpit.get_output()[0], cockpit.get_notes()[0]["HessTrace"]
    assert trace.method_used == "hutchinson" and "several calls" in note
    assert abs(out["HessTrace"] - exact) <= 4 * out["HessTrace.stderr"]
    refused = Cockpit(model, [quantities.HessTrace(curvature="diag_hessian")])
    losses = F.cross_entropy(model(x), y, reduction="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with refused(0, losses=losses):
            losses.mean().backward()
    refused.close()
    assert refused.get_output()[0]["HessTrace"] is None
    assert "several calls" in refused.get_notes()[0]["HessTrace"]


LOSSES = {
    "class weights": lambda out, y: F.cross_entropy(
        out, y, weight=torch.tensor([0.3, 1.0, 2.5], dtype=out.dtype), reduction="none"),
    "ignored targets": lambda out, y: F.cross_entropy(
        out, torch.where(torch.arange(len(y)) % 3 == 0, -100, y), reduction="none"),
    "sum then mean": lambda out, y: F.mse_loss(out, y, reduction="none").sum(2).mean(1),
    "mean then sum": lambda out, y: F.mse_loss(out, y, reduction="none").mean(2).sum(1),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_weighted_and_partly_reduced_losses_give_the_exact_diagonal(name):
    """Cross-entropy with class weights or ignored targets was taken as plain cross-entropy
    (Tr(H) 4.405 for 5.283), a squared error summed over some entries and averaged over
    others as averaged over all (2–3× off): each sample's loss Hessian is now scaled by
    w_(y_n), by 0 for an ignored target, by 1/(entries averaged). The exact diagonal (and
    the GGN in it) against the dense float64 Hessian of the mean loss."""
    torch.manual_seed(0)
    regression = "then" in name
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 6 if regression else 3),
                          *([nn.Unflatten(1, (2, 3))] if regression else []))  # [N, 2, 3]
    model = model.double()
    x = torch.randn(9, 4, dtype=torch.float64)
    y = torch.randn(9, 2, 3, dtype=torch.float64) if regression else torch.randint(0, 3, (9,))
    per_sample = LOSSES[name]
    exact = dense_hessian_diagonal(model, x, y, per_sample)
    trace = quantities.HessTrace()
    cockpit = Cockpit(model, [trace], strict=True)
    losses = per_sample(model(x), y)
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    assert trace.method_used == "diag_hessian"
    out = cockpit.get_output()[0]
    for key, d in exact.items():
        assert rel_close(out[f"HessTrace/{key}"], d.sum().item(), 1e-9, atol=1e-12), key


def test_a_loss_without_a_factored_hessian_takes_the_unbiased_estimate():
    """Label-smoothed cross-entropy: "auto" chose the exact diagonal, whose GGN part then
    refused the loss (HessTrace None). It now takes Hutchinson's estimate, with the reason;
    the estimate agrees with the dense Hessian within its standard error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    def smoothed(out, target):
        return F.cross_entropy(out, target, label_smoothing=0.2, reduction="none")

    exact = sum(d.sum() for d in dense_hessian_diagonal(model, x, y, smoothed).values())
    trace = quantities.HessTrace(mc_samples=200)
    cockpit = Cockpit(model, [trace])
    losses = smoothed(model(x), y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, losses=losses):
            losses.mean().backward()
    cockpit.close()
    out, note = cockpit.get_output()[0], cockpit.get_notes()[0]["HessTrace"]
    assert trace.method_used == "hutchinson" and "not recognized" in note
    assert abs(out["HessTrace"] - exact.item()) <= 4 * out["HessTrace.stderr"]


def test_issue_model_was_the_ggn_before():
    """On the LayerNorm + GELU MLP the GGN's trace is far from the Hessian's: what "auto"
    reported before. Chosen explicitly, it is labelled as the GGN's everywhere."""
    model, x = model_of("layernorm_gelu")
    y = torch.randint(0, 3, (x.shape[0],))
    exact = sum(d.sum().item() for d in dense_hessian_diagonal(model, x, y).values())
    ggn = one_step(model, x, y, [quantities.HessTrace(curvature="diag_ggn_exact")])
    out, note = ggn.get_output()[0], ggn.get_notes()[0]["HessTrace"]
    assert not rel_close(out["HessTrace"], exact, 0.05)
    assert out["HessTrace.ggn"] == 1.0 and "GGN" in note and "not the Hessian" in note


def test_method_and_standard_error_in_the_run_log(tmp_path):
    model, x = model_of("activations")
    y = torch.randint(0, 3, (x.shape[0],))
    one_step(model, x, y, [quantities.HessTrace(curvature="hutchinson")], logdir=tmp_path)
    with RunLogReader(tmp_path) as reader:
        notes, output = reader.notes(), reader.output()
    assert "Hutchinson" in notes[0]["HessTrace"] and "8 samples" in notes[0]["HessTrace"]
    assert "standard error" in notes[0]["HessTrace"]
    assert output[0]["HessTrace.stderr"] > 0


def transformer_step(steps=2):
    from tests.models import make_problem

    problem = make_problem("transformer", 6)
    quantity = quantities.HessTrace()
    cockpit = Cockpit(problem.model, [quantity], strict=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(steps):
            with sdpa_kernel(SDPBackend.MATH):
                losses = problem.losses()
            with cockpit(step, losses=losses):
                losses.mean().backward()
            problem.model.zero_grad()
    cockpit.close()
    return problem, quantity, cockpit, record


def test_auto_falls_back_to_an_unbiased_estimator_with_its_standard_error():
    """Attention is not covered: HessTrace warns once and uses Hutchinson (8 samples); the
    recorded standard error matches the estimator's true spread, from the dense Hessian:
    Var(vᵀHv) = 2 (‖H‖_F² − Σ_j H_jj²) for Rademacher v."""
    problem, quantity, cockpit, record = transformer_step()
    fallbacks = [w for w in record if "cannot use the exact Hessian" in str(w.message)]
    assert len(fallbacks) == 1
    assert quantity.method_used == "hutchinson"
    from tests.curvature.test_curvature_instruments import dense_hessian

    H, _, _ = dense_hessian(problem)
    true_se = math.sqrt(2 * (H.pow(2).sum() - torch.diagonal(H).pow(2).sum()).item() / 8)
    out = cockpit.get_output()[0]
    assert 0.3 * true_se <= out["HessTrace.stderr"] <= 3 * true_se
    assert abs(out["HessTrace"] - torch.diagonal(H).sum().item()) <= 5 * true_se
    assert "curvature='auto'" in cockpit.get_notes()[1]["HessTrace"]


def test_mc_ggn_standard_error():
    model, x = model_of("activations")
    y = torch.randint(0, 3, (x.shape[0],))
    exact = one_step(model, x, y, [quantities.HessTrace(curvature="diag_ggn_exact")])
    mc = one_step(model, x, y, [quantities.HessTrace(curvature="diag_ggn_mc", mc_samples=16)])
    value, se = mc.get_output()[0]["HessTrace"], mc.get_output()[0]["HessTrace.stderr"]
    assert se > 0 and abs(value - exact.get_output()[0]["HessTrace"]) <= 4 * se
    single = one_step(model, x, y, [quantities.HessTrace(curvature="diag_ggn_mc",
                                                          mc_samples=1)])
    assert "HessTrace.stderr" not in single.get_output()[0]
    assert "single sample" in single.get_notes()[0]["HessTrace"]


def test_replicates_merge_over_backward_passes_per_replicate_and_parameter():
    """Σ_b N_b · (replicate m of pass b) per replicate and parameter, also where a pass
    reaches other parameters."""
    from cockpit.quantities.curvature_base import _merged

    torch.manual_seed(0)

    def replicates(*names):
        return [{k: torch.randn(3, 2) for k in names} for _ in range(4)]

    first, second, other = replicates("a", "b"), replicates("a", "b"), replicates("b", "c")
    total = _merged(_merged([], first, 5), second, 7)
    mixed = _merged(total, other, 2)
    for m in range(4):
        assert list(total[m]) == ["a", "b"] and list(mixed[m]) == ["a", "b", "c"]
        for k in "ab":
            assert torch.allclose(total[m][k], 5 * first[m][k] + 7 * second[m][k])
        assert torch.allclose(mixed[m]["a"], total[m]["a"])
        assert torch.allclose(mixed[m]["b"], total[m]["b"] + 2 * other[m]["b"])
        assert torch.allclose(mixed[m]["c"], 2 * other[m]["c"])


class _Replicates(quantities.Quantity):
    """The MC GGN's replicate diagonals of the mean loss, as the instruments draw them."""

    needs_activations = True  # the diagonal curvature reads the recorded activations

    def __init__(self, samples: int, seed: int):
        super().__init__()
        self.samples, self.seed, self.result = samples, seed, None

    def prepare(self, step, tracker, optimizer, losses):
        from cockpit.curvature.diagonal import diagonal_replicates

        self.result = diagonal_replicates(
            "diag_ggn_mc", tracker, losses, tracker.params, num_samples=self.samples,
            generator=torch.Generator().manual_seed(self.seed))


def test_stochastic_standard_errors_are_those_of_the_replicates():
    """HessTrace's, TICTrace's and TICDiag's standard errors from M = 4 MC replicates equal
    the spread of the replicates' traces and of TICDiag's first-order change with each."""
    from cockpit.quantities.curvature_base import standard_error

    model, x = model_of("activations")
    y = torch.randint(0, 3, (x.shape[0],))
    n, eps = x.shape[0], 1e-7
    kwargs = dict(curvature="diag_ggn_mc", mc_samples=4, seed=3)
    out = one_step(model, x, y, [quantities.HessTrace(**kwargs), quantities.TICDiag(**kwargs),
                                 quantities.TICTrace(**kwargs)]).get_output()[0]
    probe = _Replicates(4, 3)
    one_step(model, x, y, [probe])
    replicates = [{k: d.double() for k, d in r.items()} for r in probe.result]
    totals = [sum(d.sum().item() for d in r.values()) for r in replicates]
    trace = sum(totals) / 4
    assert rel_close(out["HessTrace"], trace, 1e-9)
    assert rel_close(out["HessTrace.stderr"], standard_error(totals), 1e-9)

    grads = individual_gradients(model, lambda f, t: F.cross_entropy(f, t, reduction="none"),
                                 x, y)
    s = {k: g.double().pow(2).sum(0) for k, g in grads.items()}
    h = {k: sum(r[k] for r in replicates) / 4 for k in s}
    c = {k: h[k].clamp_min(0) + eps for k in s}
    assert rel_close(out["TICDiag"], sum((s[k] / c[k]).sum().item() for k in s) / n, 1e-9)
    changes = [sum((-s[k] / c[k] ** 2 * (h[k] > 0) / n * r[k]).sum().item() for k in s)
               for r in replicates]
    assert rel_close(out["TICDiag.stderr"], standard_error(changes), 1e-7)
    tic_trace = sum(g.double().pow(2).sum().item() for g in grads.values()) / n / (trace + eps)
    assert rel_close(out["TICTrace"], tic_trace, 1e-9)
    assert rel_close(out["TICTrace.stderr"],
                     abs(tic_trace) * standard_error(totals) / abs(trace + eps), 1e-7)


def test_replicates_take_as_many_ops_for_any_number_of_them():
    """Merging, summing over replicates and the replicates' traces: the same ops for 2 and
    for 6 replicates of 5 parameters (multi-tensor kernels; on an accelerator each op is a
    launch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cockpit.quantities.curvature_base import _merged, replicate_totals

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for m in (2, 6):
        replicates = [{str(k): torch.randn(3, k + 1) for k in range(5)} for _ in range(m)]
        with Count() as count:
            replicate_totals(_merged(_merged([], replicates, 5), replicates, 7))
        counts.append(count.ops)
    assert counts[0] == counts[1]


def test_view_labels_the_ggn_trace():
    from matplotlib.figure import Figure

    from cockpit.view.curvature_panels import draw_hess_trace

    for ggn in (False, True):
        output = {s: {"HessTrace": 1.0 + s, **({"HessTrace.ggn": 1.0} if ggn else {})}
                  for s in range(3)}
        fig = Figure()
        ax = draw_hess_trace(fig, fig.add_gridspec(1, 1)[0], output)
        assert (ax.get_ylabel() == "Tr(GGN)") is ggn
        assert ("GGN" in ax.get_title(loc="left")) is ggn


@pytest.mark.parametrize("curvature", ["auto", "diag_ggn_mc", "hutchinson"])
def test_non_finite_step_gives_nan_with_a_note_and_leaves_the_next_step_alone(curvature):
    """The finiteness of the losses is not read while the step runs: the curvature is
    computed (or fails: MC sampling from NaN probabilities) and the value read with the
    device flag is NaN with the note; the next, finite step equals that of a Cockpit that
    saw a finite step instead."""
    model, x = model_of("activations")
    y = torch.randint(0, 3, (x.shape[0],))
    bad = x.clone()
    bad[0, 0] = math.nan

    def run(batches):
        qs = [quantities.HessTrace(curvature=curvature), quantities.TICDiag(
            curvature="diag_ggn_exact" if curvature == "hutchinson" else curvature)]
        if curvature != "hutchinson":
            qs.append(quantities.TICTrace(curvature=curvature))
        cockpit = Cockpit(model, qs)
        for step, inputs in enumerate(batches):
            losses = F.cross_entropy(model(inputs), y, reduction="none")
            with cockpit(step, losses=losses):
                losses.mean().backward()
            model.zero_grad()
        cockpit.close()
        return qs, cockpit.get_output(), cockpit.get_notes()

    with pytest.warns(RuntimeWarning, match="non-finite"):
        qs, out, notes = run([bad, x])
    # Hutchinson draws its vectors at the non-finite step too; MC sampling fails before it draws
    reference = run([x, x])[1][1] if curvature == "hutchinson" else run([x])[1][0]
    for q in qs:
        assert math.isnan(out[0][q.name]) and "non-finite loss" in notes[0][q.name]
        assert not [k for k in out[0] if k.startswith(q.name + "/")]
        assert math.isfinite(out[1][q.name])
        assert out[1][q.name] == pytest.approx(reference[q.name], rel=1e-12)


def test_ggn_recognizes_the_loss_behind_a_cast_of_the_model_output():
    """A model whose output is cast after its last layer (accelerate casts a bf16 model's
    outputs to float32): the loss is still cross-entropy of the network output, and the exact
    GGN diagonal equals the one of the uncast float64 network (float32 factor: rtol 1e-5)."""
    from tests.full_reference import ggn_diagonal

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()

    class CastOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x).float()

    model = CastOutput()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    cockpit = Cockpit(model, [quantities.HessTrace(curvature="diag_ggn_exact")], strict=True)
    losses = F.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, losses=losses):
        losses.mean().backward()
    cockpit.close()
    expected = ggn_diagonal(net, lambda m, inputs: m(inputs), x).sum().item()
    assert rel_close(cockpit.get_output()[0]["HessTrace"], expected, 1e-5)
