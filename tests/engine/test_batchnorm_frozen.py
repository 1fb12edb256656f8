"""BatchNorm in training mode with batchnorm='frozen_statistics': individual gradients with
every BatchNorm layer's batch mean and variance held constant, against a brute-force
torch.func reference in float64 (the same network in eval mode, its running statistics set to
the batch's), and the instruments computed from them."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from cockpit import Cockpit, quantities
from cockpit.engine.rules.batchnorm_frozen import APPROXIMATION, FROZEN_STATISTICS
from cockpit.engine.statistics import SAMPLE_GRAD_SUM, SQ_NORMS
from cockpit.quantities.base import Quantity
from cockpit.view.cockpit_view import describe_run
from tests.reference import flat, gradient_tests, individual_gradients, rel_close, same_histogram


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
        nn.Conv2d(4, 5, 3, padding=1), nn.BatchNorm2d(5, affine=False), nn.Sigmoid(),
        nn.Flatten(), nn.Linear(5 * 4 * 4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3),
    ).double()


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.BatchNorm1d(5), nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 6),
        nn.BatchNorm1d(6), nn.Sigmoid(), nn.Linear(6, 3),
    ).double()


def frozen_reference(model: nn.Module, x, y) -> dict[str, torch.Tensor]:
    """g_n with the batch statistics as constants: a copy whose BatchNorm layers run in eval
    mode with running mean and (biased) variance set to those of this batch."""
    frozen = copy.deepcopy(model)
    inputs: dict[nn.Module, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda m, a, o: inputs.__setitem__(m, a[0].detach()))
             for m in frozen.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    with torch.no_grad():
        frozen(x)
    for hook in hooks:
        hook.remove()
    for module, a in inputs.items():
        dims = [0, *range(2, a.dim())]
        module.running_mean.copy_(a.mean(dims))
        module.running_var.copy_(a.var(dims, unbiased=False))
    frozen.eval()
    return individual_gradients(frozen, loss_fn, x, y)


class PerSample(Quantity):
    """Keeps ‖g_n‖² per parameter and Σ_n g_n of the frozen definition (test only)."""

    needs = frozenset({SQ_NORMS})

    def compute(self, data):
        self.sq_norms = {k: v.clone() for k, v in data.stats.sq_norms.items()}
        self.sums = {k: v.clone() for k, v in data.stats.sample_sums[SAMPLE_GRAD_SUM].items()}
        return {}


def data_for(model, n=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (n, 3, 6, 6) if isinstance(model[0], nn.Conv2d) else (n, 5)
    return (torch.randn(shape, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g))


def sync_mlp() -> nn.Module:
    """The MLP with SyncBatchNorm (one process: it normalizes as BatchNorm does)."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(mlp())


@pytest.mark.parametrize("make", [cnn, mlp, sync_mlp],
                         ids=["cnn_bn2d", "mlp_bn1d", "mlp_sync_bn"])
def test_individual_gradients_and_instruments_match_the_frozen_reference(make, tmp_path):
    torch.manual_seed(0)
    model = make()
    plain = copy.deepcopy(model)
    x, y = data_for(model)
    reference = frozen_reference(model, x, y)
    names = list(reference)
    G = flat(reference, names)
    probe = PerSample()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [quantities.GradNorm(), quantities.NormTest(),
                              quantities.InnerTest(), quantities.OrthoTest(),
                              quantities.GradHist1d(), quantities.GradientNoiseScale(),
                              probe],
                      optimizer=opt, batchnorm=FROZEN_STATISTICS, strict=True, logdir=tmp_path)
    losses = loss_fn(model(x), y)
    with cockpit(0, losses=losses):
        losses.mean().backward()
    out, notes = cockpit.get_output()[0], cockpit.get_notes()[0]
    # every layer's individual gradients (below, at and above BatchNorm layers)
    for k in names:
        assert torch.allclose(probe.sq_norms[k], reference[k].flatten(1).pow(2).sum(1),
                              rtol=1e-10, atol=1e-14), k
        assert torch.allclose(probe.sums[k], reference[k].sum(0), rtol=1e-10, atol=1e-14), k
    # the user's gradient is the exact batch gradient, untouched (a plain loop's)
    plain_losses = loss_fn(plain(x), y)
    plain_losses.mean().backward()
    true = torch.cat([p.grad.flatten() for p in plain.parameters()])
    assert torch.equal(true, torch.cat([p.grad.flatten() for p in model.parameters()]))
    for a, b in zip(plain.buffers(), model.buffers(), strict=True):  # running statistics
        assert torch.equal(a, b)
    assert rel_close(out["GradNorm"], true.norm().item(), 1e-12)
    # ... and not the sum of the frozen individual gradients (an approximation)
    assert (G.mean(0) - true).norm() > 1e-3 * true.norm()
    expected = gradient_tests(G)
    for name in ("NormTest", "InnerTest", "OrthoTest"):
        assert rel_close(out[name], expected[name], 1e-9), name
        assert notes[name] == APPROXIMATION
    # the noise scale of the same vectors: tr(Σ)/‖G‖² with ḡ their own mean
    n, mean_sq = G.shape[0], G.mean(0).pow(2).sum().item()
    trace = (G.pow(2).sum().item() - n * mean_sq) / (n - 1)
    signal = mean_sq - trace / n
    if signal > 0:
        assert rel_close(out["GradientNoiseScale"], trace / signal, 1e-9)
    else:  # no finite noise scale fits the batch
        assert math.isnan(out["GradientNoiseScale"])
    edges = out["GradHist1d"]["edges"]
    spec = (edges[0], edges[-1], len(edges) - 1)  # the range set from this step's elements
    assert same_histogram(out["GradHist1d"]["counts"], G, *spec)
    for k in names:
        assert same_histogram(out[f"GradHist1d/{k}"]["counts"], reference[k].flatten(1),
                              *spec), k
    cockpit.close()
    from cockpit.store import RunLogReader

    with RunLogReader(tmp_path) as reader:
        meta = reader.meta()
    assert meta["batchnorm"] == {"mode": FROZEN_STATISTICS, "note": APPROXIMATION}
    assert "BatchNorm statistics frozen" in describe_run(meta)  # the view's title
    assert "BatchNorm" not in describe_run({**meta, "batchnorm": None})


def test_default_stays_none_with_a_reason_naming_the_option():
    torch.manual_seed(0)
    model = mlp()
    x, y = data_for(model)
    with pytest.warns(RuntimeWarning, match="frozen_statistics"):
        cockpit = Cockpit(model, [quantities.NormTest(), quantities.GradHist1d()], strict=True)
    losses = loss_fn(model(x), y)
    with cockpit(0, losses=losses):
        losses.mean().backward()
    out, notes = cockpit.get_output()[0], cockpit.get_notes()[0]
    cockpit.close()
    assert out["NormTest"] is None and out["GradHist1d"] is None
    assert "batchnorm='frozen_statistics'" in notes["NormTest"]


def test_alpha_and_later_steps_with_frozen_statistics():
    """A few training steps: every economy instrument has a value, the per-sample ones
    labelled; layers in eval mode need no approximation (no label, no extra pass)."""
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cockpit = Cockpit(model, "economy", optimizer=opt, batchnorm=FROZEN_STATISTICS,
                      strict=True)
    for step in range(3):
        x, y = data_for(model, seed=step)
        opt.zero_grad()
        losses = loss_fn(model(x), y)
        with cockpit(step, losses=losses):
            losses.mean().backward()
        opt.step()
    model.eval()
    x, y = data_for(model, seed=5)
    reference = individual_gradients(model, loss_fn, x, y)
    opt.zero_grad()
    losses = loss_fn(model(x), y)
    with cockpit(3, losses=losses):
        losses.mean().backward()
    opt.step()
    out, notes = cockpit.get_output(), cockpit.get_notes()
    cockpit.close()
    for step in range(3):
        assert out[step]["NormTest"] is not None and out[step]["GradHist1d"] is not None
        assert notes[step]["NormTest"] == APPROXIMATION
    assert out[0]["Alpha"] is not None and notes[0]["Alpha"] == APPROXIMATION
    assert rel_close(out[3]["NormTest"], gradient_tests(flat(reference))["NormTest"], 1e-9)
    assert "NormTest" not in notes[3]


def test_unknown_batchnorm_mode_is_refused():
    with pytest.raises(ValueError, match="frozen_statistics"):
        Cockpit(mlp(), "economy", batchnorm="frozen")


def test_accumulated_micro_batches_are_refused_with_the_reason():
    """Micro-batches normalize with their own statistics: not formed, said so."""
    torch.manual_seed(0)
    model = mlp()
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.GradNorm()],
                      batchnorm=FROZEN_STATISTICS, grad_accumulation=True)
    for seed in (1, 2):
        x, y = data_for(model, seed=seed)
        losses = loss_fn(model(x), y)
        with cockpit(0, losses=losses):
            (losses.mean() / 2).backward()
    out, notes = cockpit.get_output()[0], cockpit.get_notes()[0]
    cockpit.close()
    assert out["NormTest"] is None and "one backward pass per step" in notes["NormTest"]
    assert out["GradNorm"] is not None


def test_sync_batch_norm_over_processes_is_refused_with_the_way_out(monkeypatch):
    """Over several processes a SyncBatchNorm normalizes with all processes' statistics,
    which one process cannot hold constant: its frozen rule refuses (a CPU cannot run
    SyncBatchNorm under DistributedDataParallel; the rule is asked directly)."""
    import torch.distributed as dist

    from cockpit.engine.rules.batchnorm_frozen import frozen_batch_norm_rule, frozen_rule
    from cockpit.engine.rules.norms import SampleMixingError

    layer = nn.SyncBatchNorm(4)
    assert frozen_rule(layer) is frozen_batch_norm_rule  # (one process)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(SampleMixingError, match=r"SyncBatchNorm.*all processes.*nn\.BatchNorm"):
        frozen_rule(layer)
    assert frozen_rule(nn.BatchNorm1d(4)) is frozen_batch_norm_rule
