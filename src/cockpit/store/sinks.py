"""Sinks: send each step's values to TensorBoard or Weights & Biases as well.

A sink is anything with ``write_step(step, values, notes)`` and ``close()`` (the run log
writer is one too). Names map to tags ``cockpit/<name>`` (names already carry
``/<param>``). Histograms arrive binned (``counts`` and ``edges``) and are forwarded
without re-binning; a 2-D histogram ``GradHist2d`` (``counts[i, j]`` over
``edges_grad[i]`` × ``edges_param[j]``) is sent as its two marginals
``.../grad`` (``Σ_j counts[i, j]``) and ``.../param`` (``Σ_i counts[i, j]``).

Values per parameter (names ``<instrument>/<parameter>``, a few per parameter and
instrument: hundreds of tags for a network of a few dozen tensors) are left out unless the
sink is made with ``log_per_parameter=True``; the totals are always sent and the run log
keeps everything.

Like the run log, a sink never raises into the training loop after construction: a
failing write warns once per episode of failures and is dropped.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from cockpit._extras import missing_extra

__all__ = ["Sink", "SinkWarning", "TensorBoardSink", "WandbSink", "histograms_of",
           "is_per_parameter"]


def is_per_parameter(name: str) -> bool:
    """Whether a value name is one parameter's share (``GradNorm/fc.weight``), not a total."""
    return "/" in name


def _chosen(values: Mapping[str, Any], per_parameter: bool) -> Mapping[str, Any]:
    if per_parameter:
        return values
    return {name: value for name, value in values.items() if not is_per_parameter(name)}


@runtime_checkable
class Sink(Protocol):
    """Receives the values of every tracked step."""

    def write_step(
        self, step: int, values: Mapping[str, Any], notes: Mapping[str, str] | None = None
    ) -> None: ...

    def close(self) -> None: ...


class SinkWarning(RuntimeWarning):
    """A sink failed to write a step; training continues."""


def _as_array(x: Any) -> np.ndarray | None:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return x if isinstance(x, np.ndarray) else None


def _edges_for_axes(value: Mapping[str, Any], counts: np.ndarray) -> list[tuple[str, Any]]:
    """(suffix, edges) per axis of ``counts``: ``edges`` for 1-D, ``edges_<x>`` in order."""
    if counts.ndim == 1 and "edges" in value:
        return [("", value["edges"])]
    keyed = [(k[len("edges_") :], v) for k, v in value.items() if k.startswith("edges_")]
    if len(keyed) != counts.ndim:
        return []
    # Axis order follows the field order; fix it up when the lengths say otherwise.
    if counts.ndim == 2 and counts.shape[0] != counts.shape[1]:
        keyed.sort(key=lambda kv: 0 if len(kv[1]) == counts.shape[0] + 1 else 1)
    return keyed


def histograms_of(name: str, value: Any) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Yield ``(name_suffix, counts, edges)`` 1-D histograms contained in a dict value."""
    if not isinstance(value, Mapping) or "counts" not in value:
        return
    counts = _as_array(value["counts"])
    if counts is None:
        return
    axes = _edges_for_axes(value, counts)
    for axis, (suffix, edges) in enumerate(axes):
        edges = np.asarray(_as_array(edges) if hasattr(edges, "detach") else edges)
        other = tuple(a for a in range(counts.ndim) if a != axis)
        marginal = counts.sum(axis=other) if other else counts
        if edges.shape != (marginal.shape[0] + 1,):
            continue
        yield (f"/{suffix}" if suffix else ""), marginal, edges


def _scalar_items(name: str, value: Any) -> Iterator[tuple[str, float]]:
    """``(tag_suffix, float)`` for a float value or the float fields of a dict value."""
    if isinstance(value, Mapping):
        for field, x in value.items():
            if isinstance(x, int | float) and not isinstance(x, bool):
                yield f"/{field}", float(x)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield "", float(value)
    elif hasattr(value, "detach") and value.numel() == 1:
        yield "", float(value.item())


class _SafeSink:
    """Shared warn-once-per-episode error handling."""

    _failing = False
    failed_writes = 0

    def _guard(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as err:
            self.failed_writes += 1
            if not self._failing:
                self._failing = True
                warnings.warn(
                    f"{type(self).__name__}: {what} failed: {err!r} (further failures are "
                    "counted in .failed_writes until a write succeeds)",
                    SinkWarning,
                    stacklevel=3,
                )
            return
        self._failing = False


class TensorBoardSink(_SafeSink):
    """Write Cockpit values as TensorBoard scalars, histograms and (optionally) figures.

    Args:
        logdir_or_writer: A log directory (a ``SummaryWriter`` is created and owned) or an
            existing ``torch.utils.tensorboard.SummaryWriter`` (flushed, not closed).
        prefix: Tag prefix.
        image_every: Call ``figure_fn`` every ``image_every`` steps (step % n == 0) and
            log its figure as ``<prefix>/view``.
        figure_fn: Returns a matplotlib figure (e.g. the cockpit view of the run so far).
        log_per_parameter: Also log the values of each parameter
            (``<prefix>/<instrument>/<parameter>``); by default only the totals.
    """

    def __init__(
        self,
        logdir_or_writer: str | Path | Any,
        *,
        prefix: str = "cockpit",
        image_every: int | None = None,
        figure_fn: Callable[[], Any] | None = None,
        log_per_parameter: bool = False,
    ) -> None:
        if isinstance(logdir_or_writer, str | Path):
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise missing_extra(err, "tensorboard", "tensorboard", "TensorBoardSink") \
                    from None
            self.writer = SummaryWriter(log_dir=str(logdir_or_writer))
            self._owns_writer = True
        else:
            self.writer = logdir_or_writer
            self._owns_writer = False
        if image_every is not None and image_every < 1:
            raise ValueError(f"image_every must be a positive integer, got {image_every}")
        self.prefix = prefix
        self.image_every = image_every
        self.figure_fn = figure_fn
        self.log_per_parameter = log_per_parameter

    def write_step(
        self, step: int, values: Mapping[str, Any], notes: Mapping[str, str] | None = None
    ) -> None:
        """Log scalars and histograms of ``step`` (``None`` values are skipped)."""
        values = _chosen(values, self.log_per_parameter)
        self._guard(f"writing step {step}", lambda: self._write(int(step), values))
        if self.figure_fn is not None and self.image_every and step % self.image_every == 0:
            self._guard(f"the figure of step {step}", lambda: self._write_figure(int(step)))

    def _write(self, step: int, values: Mapping[str, Any]) -> None:
        for name, value in values.items():
            tag = f"{self.prefix}/{name}"
            for suffix, x in _scalar_items(name, value):
                self.writer.add_scalar(tag + suffix, x, global_step=step)
            for suffix, counts, edges in histograms_of(name, value):
                self._add_binned_histogram(tag + suffix, counts, edges, step)
            if isinstance(value, Mapping) and "counts" not in value:
                for field, x in value.items():  # raw arrays, e.g. Parameters/<p>["values"]
                    arr = _as_array(x)
                    if arr is not None and arr.size and np.isfinite(arr).all():
                        self.writer.add_histogram(f"{tag}/{field}", arr, global_step=step)

    def _add_binned_histogram(
        self, tag: str, counts: np.ndarray, edges: np.ndarray, step: int
    ) -> None:
        """TensorBoard buckets are given by right limits; ``min`` is the first left edge.

        ``sum`` and ``sum_squares`` are estimated from bin centres.
        """
        counts = counts.astype(np.float64)
        edges = edges.astype(np.float64)
        num = counts.sum()
        if num == 0 or not np.isfinite(edges).all():
            return
        centres = 0.5 * (edges[:-1] + edges[1:])
        self.writer.add_histogram_raw(
            tag,
            min=float(edges[0]),
            max=float(edges[-1]),
            num=float(num),
            sum=float(counts @ centres),
            sum_squares=float(counts @ centres**2),
            bucket_limits=edges[1:].tolist(),
            bucket_counts=counts.tolist(),
            global_step=step,
        )

    def _write_figure(self, step: int) -> None:
        assert self.figure_fn is not None
        fig = self.figure_fn()
        if fig is not None:
            self.writer.add_figure(f"{self.prefix}/view", fig, global_step=step)

    def write_findings(self, step: int, findings: Sequence[Any]) -> None:
        """Log diagnosis findings (:class:`cockpit.Finding`) as text under
        ``<prefix>/diagnosis/<code>`` (called by ``Cockpit(..., diagnose=True)``)."""

        def write() -> None:
            for finding in findings:
                text = str(finding).replace("\n", "  \n")  # Markdown line breaks
                self.writer.add_text(f"{self.prefix}/diagnosis/{finding.code}", text,
                                     global_step=int(step))

        self._guard(f"logging findings at step {step}", write)

    def close(self) -> None:
        """Flush, and close the writer if this sink created it."""
        self._guard("closing", self.writer.flush)
        if self._owns_writer:
            self._guard("closing", self.writer.close)


class WandbSink(_SafeSink):
    """Log Cockpit values to Weights & Biases.

    Args:
        run: An active ``wandb`` run; if ``None``, ``wandb.init(**init_kwargs)`` starts
            one (and :meth:`close` finishes it).
        prefix: Key prefix.
        step_metric: If given (e.g. ``"cockpit/step"``), values are logged against this
            custom x-axis instead of ``step=``: W&B drops ``log(step=t)`` calls with a step
            below the latest one, which happens for late values such as Alpha of step t.
        log_per_parameter: Also log the values of each parameter
            (``<prefix>/<instrument>/<parameter>``); by default only the totals.
    """

    def __init__(
        self,
        run: Any = None,
        *,
        prefix: str = "cockpit",
        step_metric: str | None = None,
        log_per_parameter: bool = False,
        **init_kwargs: Any,
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise missing_extra(err, "wandb", "wandb", "WandbSink") from None
        self._wandb = wandb
        self._owns_run = run is None
        self.run = wandb.init(**init_kwargs) if run is None else run
        self.prefix = prefix
        self.step_metric = step_metric
        self.log_per_parameter = log_per_parameter
        self._findings: list[Any] = []
        if step_metric is not None:
            self.run.define_metric(step_metric)
            self.run.define_metric(f"{prefix}/*", step_metric=step_metric)

    def _payload(self, values: Mapping[str, Any]) -> dict[str, Any]:
        payload: dict[str, Any] = {}
        for name, value in _chosen(values, self.log_per_parameter).items():
            key = f"{self.prefix}/{name}"
            for suffix, x in _scalar_items(name, value):
                payload[key + suffix] = x
            for suffix, counts, edges in histograms_of(name, value):
                payload[key + suffix] = self._wandb.Histogram(np_histogram=(counts, edges))
        return payload

    def write_step(
        self, step: int, values: Mapping[str, Any], notes: Mapping[str, str] | None = None
    ) -> None:
        """``run.log({...}, step=step)`` (or against ``step_metric``)."""

        def log() -> None:
            payload = self._payload(values)
            if not payload:
                return
            if self.step_metric is None:
                self.run.log(payload, step=int(step))
            else:
                payload[self.step_metric] = int(step)
                self.run.log(payload)

        self._guard(f"logging step {step}", log)

    def write_findings(self, step: int, findings: Sequence[Any]) -> None:
        """Log diagnosis findings as text: a ``<prefix>/diagnosis`` string per finding
        and a table of all findings so far (called by ``Cockpit(..., diagnose=True)``)."""

        def log() -> None:
            self._findings.extend(findings)
            rows = [[int(step), f.code, f.severity, f.message, f.advice,
                     ", ".join(f.parameters)] for f in self._findings]
            payload: dict[str, Any] = {
                f"{self.prefix}/diagnosis": "\n\n".join(str(f) for f in findings),
                f"{self.prefix}/diagnosis_table": self._wandb.Table(
                    columns=["step", "code", "severity", "message", "advice", "parameters"],
                    data=rows),
            }
            if self.step_metric is None:
                self.run.log(payload, step=int(step))
            else:
                payload[self.step_metric] = int(step)
                self.run.log(payload)

        self._guard(f"logging findings at step {step}", log)

    def close(self) -> None:
        """Finish the run if this sink started it."""
        if self._owns_run:
            self._guard("finishing the run", self.run.finish)
