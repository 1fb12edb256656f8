"""Run log (crash-safe SQLite), readers, exporters and sinks (TensorBoard, W&B)."""

from cockpit.store._schema import RunLogFormatError
from cockpit.store.export import add_export_subcommand, export_run, load_json_export, main_export
from cockpit.store.reader import RunLogReader, read_meta, read_output, read_scalars
from cockpit.store.runlog import (
    RunLogExistsError,
    RunLogLockedError,
    RunLogWarning,
    RunLogWriter,
)
from cockpit.store.sinks import Sink, SinkWarning, TensorBoardSink, WandbSink

__all__ = [
    "RunLogExistsError",
    "RunLogFormatError",
    "RunLogLockedError",
    "RunLogReader",
    "RunLogWarning",
    "RunLogWriter",
    "Sink",
    "SinkWarning",
    "TensorBoardSink",
    "WandbSink",
    "add_export_subcommand",
    "export_run",
    "load_json_export",
    "main_export",
    "read_meta",
    "read_output",
    "read_scalars",
]
