"""SQLite layout of a Cockpit run log and the encoding of values into rows.

One run log is one SQLite file ``<logdir>/cockpit.sqlite`` in WAL mode with five tables:

* ``meta(key, value)``: run metadata, one JSON document per top-level key.
* ``steps(step, wall_time)``: every step that was written (also steps without values).
* ``scalars(step, name, value, kind)``: float-valued and ``None`` instruments.
* ``fields(step, name, field, pos, value, kind, dtype, shape, codec, data)``: one row per
  field of a dict-valued instrument (``GradHist1d`` → ``counts``, ``edges``); a field is a
  float (``value``/``kind``) or an array (``dtype``, ``shape``, raw or zlib bytes in
  ``data``). A bare array value is stored as the field ``""``.
* ``notes(step, name, reason)``: why a value is ``None``.

SQLite stores NaN as NULL, so each float carries a ``kind`` and ``value`` holds only
finite numbers: NaN, +inf, -inf and ``None`` round-trip distinctly.
"""

from __future__ import annotations

import math
import numbers
import zlib
from typing import Any

import numpy as np

SCHEMA_VERSION = 1
DB_FILENAME = "cockpit.sqlite"

# ``kind`` codes of a stored float; ARRAY marks an array field.
FINITE, NAN, POS_INF, NEG_INF, NONE, ARRAY = 0, 1, 2, 3, 4, 5
KIND_NAMES = {FINITE: "value", NAN: "nan", POS_INF: "+inf", NEG_INF: "-inf", NONE: "none"}

BARE_ARRAY_FIELD = ""
# Histogram counts (integers, many zeros) shrink 3-10x under zlib; float arrays (edges,
# parameter values) hardly shrink, so they are stored raw and cost no compression time.
COMPRESS_MIN_BYTES = 512
COMPRESS_KINDS = "biu"

SCHEMA_SQL = f"""
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps(step INTEGER PRIMARY KEY, wall_time REAL);
CREATE TABLE IF NOT EXISTS scalars(
    step INTEGER NOT NULL, name TEXT NOT NULL, value REAL, kind INTEGER NOT NULL,
    PRIMARY KEY(step, name));
CREATE TABLE IF NOT EXISTS fields(
    step INTEGER NOT NULL, name TEXT NOT NULL, field TEXT NOT NULL, pos INTEGER NOT NULL,
    value REAL, kind INTEGER NOT NULL, dtype TEXT, shape TEXT, codec TEXT, data BLOB,
    PRIMARY KEY(step, name, field));
CREATE TABLE IF NOT EXISTS notes(
    step INTEGER NOT NULL, name TEXT NOT NULL, reason TEXT NOT NULL,
    PRIMARY KEY(step, name));
PRAGMA user_version = {SCHEMA_VERSION};
"""


def encode_float(x: float | None) -> tuple[float | None, int]:
    """Map a float (or None) to ``(value, kind)``; ``value`` is finite or NULL."""
    if x is None:
        return None, NONE
    if math.isnan(x):
        return None, NAN
    if math.isinf(x):
        return None, POS_INF if x > 0 else NEG_INF
    return x, FINITE


def decode_float(value: float | None, kind: int) -> float | None:
    """Inverse of :func:`encode_float`."""
    if kind == FINITE:
        return float(value)
    return {NAN: math.nan, POS_INF: math.inf, NEG_INF: -math.inf, NONE: None}[kind]


def encode_array(arr: np.ndarray, compress: bool) -> tuple[str, str, str, bytes]:
    """Return ``(dtype, shape, codec, data)``: C-order raw bytes; integer arrays of at least
    ``COMPRESS_MIN_BYTES`` are zlib'ed (level 1) when that makes them smaller."""
    if arr.dtype.hasobject:
        raise TypeError(f"cannot store an array of dtype {arr.dtype} (object arrays)")
    raw = arr.tobytes(order="C")  # (np.ascontiguousarray would turn 0-d into 1-d)
    codec = "raw"
    if compress and arr.dtype.kind in COMPRESS_KINDS and len(raw) >= COMPRESS_MIN_BYTES:
        packed = zlib.compress(raw, 1)
        if len(packed) < len(raw):
            raw, codec = packed, "zlib"
    return arr.dtype.str, ",".join(map(str, arr.shape)), codec, raw


def decode_array(dtype: str, shape: str, codec: str, data: bytes) -> np.ndarray:
    """Inverse of :func:`encode_array`; returns a writable array."""
    if codec == "zlib":
        data = zlib.decompress(data)
    dims = tuple(int(s) for s in shape.split(",")) if shape else ()
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(dims).copy()


def _to_numpy(x: Any) -> Any:
    """Turn torch tensors (any device) and sequences into numpy; leave other values alone."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        return x.detach().cpu().numpy()
    if isinstance(x, list | tuple):
        return np.asarray(x)
    return x


def normalize_field(x: Any) -> float | np.ndarray | None:
    """A field of a dict value: float, None or numpy array (0-d arrays stay arrays)."""
    if x is None or type(x) is float or type(x) is np.ndarray:  # fast path
        return x
    x = _to_numpy(x)
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, numbers.Real):
        return float(x)
    raise TypeError(f"unsupported field type {type(x).__name__}")


def normalize_value(x: Any) -> float | np.ndarray | dict[str, Any] | None:
    """A top-level value: float, None, dict of fields (or, leniently, a bare array)."""
    if x is None or type(x) is float:  # fast path
        return x
    x = _to_numpy(x)
    if isinstance(x, dict):
        return {str(k): normalize_field(v) for k, v in x.items()}
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "biuf":
        return float(x)
    return normalize_field(x)


class RunLogFormatError(ValueError):
    """A file that is not a Cockpit run log this package reads (another SQLite database,
    a damaged file, a newer format)."""


def newer_format_message(path: object, version: object) -> str:
    """Why a run log (or export) in a format this package does not know is not read."""
    return (f"the Cockpit run {str(path)!r} is in format {version}, newer than this "
            f"package reads (format {SCHEMA_VERSION}): it was written by a newer torch-cockpit; "
            "upgrade (pip install -U torch-cockpit) to read or continue it")

