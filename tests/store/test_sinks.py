"""Tests of the TensorBoard and W&B sinks (event files read back; W&B faked or offline)."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest

from cockpit.store import RunLogWriter, Sink, SinkWarning, TensorBoardSink, WandbSink


def make_values(rng: np.random.Generator, step: int) -> tuple[dict, dict]:
    """Values as Cockpit produces them, and the raw data the histograms were binned from."""
    grads = rng.standard_normal(500) * (step + 1)
    params = rng.uniform(-1, 1, 500)
    bias_grads = rng.standard_normal(30)
    counts, edges = np.histogram(grads, bins=20)
    c2d, eg, ep = np.histogram2d(grads, params, bins=(8, 12))
    bc, be = np.histogram(bias_grads, bins=5)
    values = {
        "Loss": 1.0 / (step + 1),
        "GradNorm/fc.weight": float(np.linalg.norm(grads)),
        "NormTest": math.nan,
        "CABS": None,
        "GradHist1d": {"counts": counts.astype(np.int64), "edges": edges},
        "GradHist1d/fc.bias": {"counts": bc.astype(np.int64), "edges": be},
        "GradHist2d": {"counts": c2d.astype(np.int64), "edges_grad": eg, "edges_param": ep},
        "Parameters/fc.bias": {"values": params[:6].astype(np.float32)},
    }
    return values, {"grads": grads, "params": params, "bias_grads": bias_grads}


def _accumulator(logdir):
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(logdir), size_guidance={k: 0 for k in ea.DEFAULT_SIZE_GUIDANCE})
    acc.Reload()
    return acc


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    return fig


def test_tensorboard_sink_scalars_histograms_and_figures(tmp_path):
    pytest.importorskip("tensorboard")
    rng = np.random.default_rng(0)
    sink = TensorBoardSink(tmp_path / "tb", image_every=2, figure_fn=_figure,
                           log_per_parameter=True)
    assert isinstance(sink, Sink)
    steps = [0, 1, 2, 3]
    written = {}
    for step in steps:
        values, raw = make_values(rng, step)
        written[step] = (values, raw)
        sink.write_step(step, values, notes={"CABS": "off"})
    sink.close()

    acc = _accumulator(tmp_path / "tb")
    tags = acc.Tags()
    assert set(tags["scalars"]) == {
        "cockpit/Loss",
        "cockpit/GradNorm/fc.weight",
        "cockpit/NormTest",
    }
    assert set(tags["histograms"]) == {
        "cockpit/GradHist1d",
        "cockpit/GradHist1d/fc.bias",
        "cockpit/GradHist2d/grad",
        "cockpit/GradHist2d/param",
        "cockpit/Parameters/fc.bias/values",
    }
    loss = acc.Scalars("cockpit/Loss")
    assert [e.step for e in loss] == steps
    np.testing.assert_allclose([e.value for e in loss], [1 / (s + 1) for s in steps], rtol=1e-6)
    norms = [e.value for e in acc.Scalars("cockpit/GradNorm/fc.weight")]
    want = [np.linalg.norm(written[s][1]["grads"]) for s in steps]
    np.testing.assert_allclose(norms, want, rtol=1e-6)
    assert all(math.isnan(e.value) for e in acc.Scalars("cockpit/NormTest"))

    # Histogram buckets against np.histogram of the raw numbers (brute-force reference).
    for tag, data_key, edges_key, name in [
        ("cockpit/GradHist1d", "grads", "edges", "GradHist1d"),
        ("cockpit/GradHist1d/fc.bias", "bias_grads", "edges", "GradHist1d/fc.bias"),
        ("cockpit/GradHist2d/grad", "grads", "edges_grad", "GradHist2d"),
        ("cockpit/GradHist2d/param", "params", "edges_param", "GradHist2d"),
    ]:
        events = acc.Histograms(tag)
        assert [e.step for e in events] == steps
        for event in events:
            values, raw = written[event.step]
            edges = values[name][edges_key]
            want_counts, _ = np.histogram(raw[data_key], bins=edges)
            hist = event.histogram_value
            np.testing.assert_array_equal(hist.bucket, want_counts)
            np.testing.assert_allclose(hist.bucket_limit, edges[1:])
            assert hist.min == edges[0] and hist.max == edges[-1]
            assert hist.num == len(raw[data_key])
            centres = (edges[1:] + edges[:-1]) / 2
            np.testing.assert_allclose(hist.sum, want_counts @ centres, rtol=1e-9, atol=1e-9)

    images = acc.Images("cockpit/view")
    assert [e.step for e in images] == [0, 2]
    assert images[0].encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"


def test_tensorboard_sink_with_given_writer_does_not_close_it(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    sink = TensorBoardSink(writer, prefix="cp")
    sink.write_step(5, {"Loss": 0.5})
    sink.close()
    writer.add_scalar("after", 1.0, 6)  # still open
    writer.close()
    acc = _accumulator(tmp_path)
    assert [e.value for e in acc.Scalars("cp/Loss")] == [0.5]
    assert [e.step for e in acc.Scalars("after")] == [6]


def test_tensorboard_failures_warn_once(tmp_path):
    class BrokenWriter:
        def add_scalar(self, *args, **kwargs):
            raise OSError("disk full")

        flush = close = lambda self: None

    sink = TensorBoardSink(BrokenWriter())
    with pytest.warns(SinkWarning, match="disk full"):
        sink.write_step(0, {"Loss": 1.0})
    sink.write_step(1, {"Loss": 1.0})  # same episode: counted, no new warning
    assert sink.failed_writes == 2


def test_tensorboard_sink_sends_totals_unless_asked_for_each_parameter(tmp_path):
    pytest.importorskip("tensorboard")
    values, _ = make_values(np.random.default_rng(0), 0)
    sink = TensorBoardSink(tmp_path / "tb")
    sink.write_step(0, values)
    sink.close()
    tags = _accumulator(tmp_path / "tb").Tags()
    assert sorted(tags["scalars"]) == ["cockpit/Loss", "cockpit/NormTest"]
    assert sorted(tags["histograms"]) == [
        "cockpit/GradHist1d", "cockpit/GradHist2d/grad", "cockpit/GradHist2d/param"]


def test_missing_tensorboard_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(ImportError) as caught:
        TensorBoardSink(tmp_path)
    assert str(caught.value) == ("TensorBoardSink needs tensorboard, which is not installed: "
                                 "pip install 'torch-cockpit[tensorboard]'")
    assert TensorBoardSink(_Writer()).writer is not None  # a writer given needs no import


class _Writer:
    def flush(self):
        pass


def test_missing_wandb_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError) as caught:
        WandbSink(project="x")
    assert str(caught.value) == ("WandbSink needs wandb, which is not installed: "
                                 "pip install 'torch-cockpit[wandb]'")


class _FakeRun:
    def __init__(self):
        self.logged, self.metrics, self.finished = [], [], False

    def log(self, payload, step=None):
        self.logged.append((payload, step))

    def define_metric(self, name, step_metric=None):
        self.metrics.append((name, step_metric))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.ModuleType("wandb")
    module.init_kwargs = None

    def init(**kwargs):
        module.init_kwargs = kwargs
        return _FakeRun()

    class Histogram:
        def __init__(self, np_histogram):
            self.counts, self.edges = np_histogram

    module.init, module.Histogram = init, Histogram
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_wandb_sink_payload(fake_wandb):
    rng = np.random.default_rng(1)
    values, raw = make_values(rng, 0)
    sink = WandbSink(project="p", mode="offline", log_per_parameter=True)
    assert fake_wandb.init_kwargs == {"project": "p", "mode": "offline"}
    sink.write_step(3, values)
    sink.write_step(4, {"CABS": None})  # nothing to log
    sink.close()
    assert sink.run.finished
    ((payload, step),) = sink.run.logged
    assert step == 3
    assert payload["cockpit/Loss"] == 1.0
    assert payload["cockpit/GradNorm/fc.weight"] == np.linalg.norm(raw["grads"])
    assert "cockpit/CABS" not in payload
    hist = payload["cockpit/GradHist2d/param"]
    want, _ = np.histogram(raw["params"], bins=values["GradHist2d"]["edges_param"])
    np.testing.assert_array_equal(hist.counts, want)
    np.testing.assert_array_equal(hist.edges, values["GradHist2d"]["edges_param"])


def test_wandb_sink_sends_totals_unless_asked_for_each_parameter(fake_wandb):
    values, _ = make_values(np.random.default_rng(1), 0)
    sink = WandbSink(_FakeRun())
    sink.write_step(3, values)
    ((payload, _),) = sink.run.logged
    assert sorted(payload) == ["cockpit/GradHist1d", "cockpit/GradHist2d/grad",
                               "cockpit/GradHist2d/param", "cockpit/Loss", "cockpit/NormTest"]


def test_wandb_sink_with_step_metric_and_given_run(fake_wandb):
    run = _FakeRun()
    sink = WandbSink(run, step_metric="cockpit/step")
    assert run.metrics == [("cockpit/step", None), ("cockpit/*", "cockpit/step")]
    sink.write_step(2, {"Alpha": 0.5})
    sink.close()
    assert run.logged == [({"cockpit/Alpha": 0.5, "cockpit/step": 2}, None)]
    assert not run.finished  # a run the user passed in is theirs to finish


def test_wandb_offline_if_installed(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    sink = WandbSink(dir=str(tmp_path), project="cockpit-test")
    sink.write_step(0, {"Loss": 1.0, "GradHist1d": {"counts": np.ones(3), "edges": np.arange(4.0)}})
    sink.close()
    assert wandb.run is None


def test_run_log_writer_is_a_sink(tmp_path):
    with RunLogWriter(tmp_path) as writer:
        assert isinstance(writer, Sink)
