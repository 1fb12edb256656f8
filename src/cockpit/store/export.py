"""Export a run log to JSON, CSV or Parquet.

Formats (``export_run(logdir, out_path, fmt)``):

* ``json`` — the whole run: ``{"format": "cockpit-run/1", "meta": {...}, "notes":
  {"<step>": {name: reason}}, "steps": {"<step>": {name: value}}}``. ``meta`` is the run's
  metadata (model, optimizer and its settings, instruments and schedules, versions),
  ``notes`` say why a value is ``null``, ``steps`` is the layout of the original
  ``Cockpit.write``: step keys as strings in ascending order, dict values keep their field
  names, arrays become nested lists. The file is strict JSON: NaN, +inf and -inf (also
  inside arrays) are written as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, and
  ``null`` means ``None`` (not computed), so the two stay distinct. :func:`load_json_export`
  reads such a file (or one of the older steps-only layout) back into the ``output()``
  layout (lists become numpy arrays).
* ``csv`` — the scalar instruments in wide form: a ``step`` column, then one column per
  scalar name (as :meth:`RunLogReader.scalars`). Cells: the float (shortest round-trip
  repr), ``nan``, ``inf``, ``-inf``, or empty when the value is ``None`` or was not
  written at that step. Arrays (histograms, parameters) are omitted.
* ``parquet`` — the same wide scalar table, with ``None``/missing as Parquet null and NaN
  as a float NaN. Arrays are omitted. Needs ``pyarrow`` (``pip install 'torch-cockpit[parquet]'``).

CLI: :func:`add_export_subcommand` registers ``export RUN --format json -o FILE`` on an
``argparse`` sub-parser set; :func:`main_export` parses and runs it standalone.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Literal

import numpy as np

from cockpit.store._schema import RunLogFormatError, newer_format_message
from cockpit.store.reader import RunLogReader

__all__ = ["add_export_subcommand", "export_run", "load_json_export", "load_json_run",
           "main_export"]

FORMATS = ("json", "csv", "parquet")
JSON_FORMAT = "cockpit-run/1"
_JSON_VERSION = int(JSON_FORMAT.rpartition("/")[2])
_NONFINITE_TO_TEXT = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_TEXT_TO_FLOAT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _jsonable(x: Any) -> Any:
    """Arrays → nested lists, non-finite floats → "NaN"/"Infinity"/"-Infinity"."""
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        x = x.tolist()
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return _NONFINITE_TO_TEXT[repr(x)]
    return x


def _from_json(x: Any) -> Any:
    """Inverse of :func:`_jsonable` (lists become numpy arrays, numbers floats)."""
    if isinstance(x, dict):
        return {k: _from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return np.asarray(_from_json_list(x))
    if isinstance(x, str):
        return _TEXT_TO_FLOAT.get(x, x)
    if isinstance(x, int | float) and not isinstance(x, bool):
        return float(x)
    return x


def _from_json_list(x: list) -> list:
    return [_from_json_list(v) if isinstance(v, list) else _TEXT_TO_FLOAT.get(v, v) for v in x]


def load_json_export(path: str | Path) -> dict[int, dict[str, Any]]:
    """Read a JSON export back into the ``{step: {name: value}}`` layout of ``output()``."""
    return load_json_run(path)[0]


def load_json_run(path: str | Path
                  ) -> tuple[dict[int, dict[str, Any]], dict[str, Any], dict[int, dict[str, str]]]:
    """A JSON export read once: its steps (as :func:`load_json_export`), the run's metadata
    and notes (``{step: {name: reason}}``; both empty for the bare ``{step: {name:
    value}}`` layout)."""
    raw = json.loads(Path(path).read_text())
    meta: dict[str, Any] = {}
    notes: dict[int, dict[str, str]] = {}
    if isinstance(raw.get("steps"), dict) and "format" in raw:
        kind, _, version = str(raw["format"]).partition("/")
        if kind != "cockpit-run" or not version.isdigit() or int(version) > _JSON_VERSION:
            raise RunLogFormatError(newer_format_message(path, raw["format"]))
        meta = dict(raw.get("meta", {}))
        notes = {int(step): dict(values) for step, values in raw.get("notes", {}).items()}
        raw = raw["steps"]
    steps = {int(step): {name: _from_json(v) for name, v in values.items()}
             for step, values in raw.items() if step != "format"}
    return steps, meta, notes


def _wide_scalar_columns(reader: RunLogReader) -> tuple[list[int], dict[str, list]]:
    """Steps and per-name lists with None where the value is None or missing (values and
    kinds from one snapshot: a run still being written gains steps between two reads)."""
    frame, kinds = reader.scalar_table()
    columns = {}
    for name in frame.columns:
        valid = kinds[name].isin(["value", "nan", "+inf", "-inf"])
        pairs = zip(frame[name], valid, strict=True)
        columns[name] = [float(v) if ok else None for v, ok in pairs]
    return [int(s) for s in frame.index], columns


def _write_csv(reader: RunLogReader, out_path: Path) -> None:
    steps, columns = _wide_scalar_columns(reader)
    lines = [",".join(["step", *(_csv_quote(n) for n in columns)])]
    for i, step in enumerate(steps):
        cells = ["" if col[i] is None else repr(col[i]) for col in columns.values()]
        lines.append(",".join([str(step), *cells]))
    out_path.write_text("\n".join(lines) + "\n")


def _csv_quote(text: str) -> str:
    if any(c in text for c in ',"\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


def _write_parquet(reader: RunLogReader, out_path: Path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        from cockpit._extras import missing_extra

        raise missing_extra(err, "pyarrow", "parquet", "Parquet export") from None
    steps, columns = _wide_scalar_columns(reader)
    arrays = {"step": pa.array(steps, type=pa.int64())}
    arrays.update({name: pa.array(col, type=pa.float64()) for name, col in columns.items()})
    pq.write_table(pa.table(arrays), out_path)


def export_run(
    logdir: str | Path,
    out_path: str | Path,
    fmt: Literal["json", "csv", "parquet"] = "json",
) -> Path:
    """Write the run log in ``logdir`` to ``out_path`` in format ``fmt``; returns the path."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out_path = Path(out_path)
    with RunLogReader(logdir) as reader:
        if fmt == "parquet":
            _write_parquet(reader, out_path)
        elif fmt == "csv":
            _write_csv(reader, out_path)
        else:
            doc = {
                "format": JSON_FORMAT,
                "meta": _jsonable(reader.meta()),
                "notes": {str(step): notes for step, notes in reader.notes().items()},
                "steps": {str(step): _jsonable(vals) for step, vals in reader.output().items()},
            }
            out_path.write_text(json.dumps(doc, allow_nan=False))
    return out_path


DESCRIPTION = """Export the run log of RUN (a directory with cockpit.sqlite) to a file.

  json     the whole run: metadata, notes (why a value is null) and every recorded value,
           histograms included; NaN/inf as the strings "NaN", "Infinity", "-Infinity"
  csv      the scalar instruments, one row per step, one column per name
  parquet  the same table as csv (needs pyarrow)"""


def _configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("run", help="run directory containing cockpit.sqlite")
    parser.add_argument("--format", "-f", choices=FORMATS, default="json", dest="fmt",
                        help="output format (default: json)")
    parser.add_argument(
        "-o", "--output", default=None, help="output file (default: <run>/cockpit.<format>)"
    )
    parser.set_defaults(func=_run_from_args)
    return parser


def _run_from_args(args: argparse.Namespace) -> int:
    out = args.output or str(Path(args.run) / f"cockpit.{args.fmt}")
    try:
        print(export_run(args.run, out, args.fmt))
    except (FileNotFoundError, ImportError, ValueError, OSError) as err:
        print(f"cockpit export: {err}", file=sys.stderr)
        return 2
    return 0


def add_export_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``export RUN [--format json|csv|parquet] [-o FILE]`` to ``subparsers``.

    The sub-parser sets ``func``: call ``args.func(args)`` (returns an exit code).
    """
    parser = subparsers.add_parser("export", help="export a run log to JSON, CSV or Parquet")
    return _configure_parser(parser)


def main_export(argv: list[str] | None = None) -> int:
    """Standalone ``cockpit export`` entry point; returns the exit code."""
    parser = _configure_parser(argparse.ArgumentParser(prog="cockpit export"))
    args = parser.parse_args(argv)
    return args.func(args)
