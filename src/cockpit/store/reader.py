"""Read a Cockpit run log, also while another process is still writing it.

Every method reads one consistent snapshot (one SQLite read transaction), so a step
written by :meth:`RunLogWriter.write_step` is seen either completely or not at all.

``output()`` has the layout of ``Cockpit.get_output()``: ``{step: {name: value}}`` with
``value`` a float (NaN/±inf kept), ``None``, or a dict of float/``np.ndarray`` fields.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cockpit.store._schema import (
    ARRAY,
    BARE_ARRAY_FIELD,
    DB_FILENAME,
    KIND_NAMES,
    NONE,
    SCHEMA_VERSION,
    RunLogFormatError,
    decode_array,
    decode_float,
    newer_format_message,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["RunLogReader", "read_meta", "read_output", "read_scalars"]


def resolve_db_path(logdir: str | Path) -> Path:
    """``<logdir>/cockpit.sqlite`` (a path to the database file itself is accepted too)."""
    path = Path(logdir)
    return path if path.is_file() else path / DB_FILENAME


class RunLogReader:
    """Read-only view of the run log in ``logdir``.

    Raises:
        FileNotFoundError: If ``<logdir>/cockpit.sqlite`` does not exist.
    """

    def __init__(self, logdir: str | Path) -> None:
        self.path = resolve_db_path(logdir)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"No Cockpit run log in {str(logdir)!r}: expected the SQLite file "
                f"{str(self.path)!r} (written by cockpit.store.RunLogWriter)."
            )
        uri = self.path.resolve().as_uri() + "?mode=ro"
        self._conn = sqlite3.connect(
            uri, uri=True, isolation_level=None, check_same_thread=False, timeout=10.0
        )
        self._lock = threading.Lock()
        self._ready = False

    # ------------------------------------------------------------------ plumbing
    def _query(self, *statements: tuple[str, tuple]) -> list[list[tuple]]:
        """Run SELECTs in one read transaction; an empty/uninitialised log gives no rows."""
        with self._lock:
            try:
                if not self._ready:
                    (version,) = self._conn.execute("PRAGMA user_version").fetchone()
                    if version < 1:  # the writer has not created its tables yet
                        return [[] for _ in statements]
                    if version > SCHEMA_VERSION:
                        raise RunLogFormatError(newer_format_message(self.path, version))
                    self._ready = True
                self._conn.execute("BEGIN")
                try:
                    return [self._conn.execute(sql, args).fetchall() for sql, args in statements]
                finally:
                    self._conn.execute("COMMIT")
            except sqlite3.DatabaseError as error:  # (a damaged file, another database)
                if isinstance(error, sqlite3.OperationalError) and "locked" in str(error):
                    raise
                raise RunLogFormatError(
                    f"{str(self.path)!r} is not a Cockpit run log this package can read "
                    f"({error}): give the directory a Cockpit run wrote (its logdir)") from None

    @staticmethod
    def _since(since: int | None) -> tuple[str, tuple]:
        return ("step > ?", (since,)) if since is not None else ("1", ())

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._conn.close()

    def __enter__(self) -> RunLogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ API
    def steps(self) -> list[int]:
        """All written steps, ascending."""
        (rows,) = self._query(("SELECT step FROM steps ORDER BY step", ()))
        return [r[0] for r in rows]

    def last_step(self) -> int | None:
        """The largest written step, ``None`` for an empty log."""
        (rows,) = self._query(("SELECT max(step) FROM steps", ()))
        return rows[0][0] if rows else None

    def wall_times(self) -> dict[int, float]:
        """Step → wall-clock time (``time.time()``) of its first write."""
        (rows,) = self._query(("SELECT step, wall_time FROM steps ORDER BY step", ()))
        return dict(rows)

    def names(self) -> list[str]:
        """All value names that occur in the log, sorted."""
        (rows,) = self._query(
            (
                "SELECT name FROM scalars UNION SELECT name FROM fields"
                " UNION SELECT name FROM notes ORDER BY name",
                (),
            )
        )
        return [r[0] for r in rows]

    def meta(self) -> dict[str, Any]:
        """The run metadata (merged over all ``write_meta`` calls)."""
        (rows,) = self._query(("SELECT key, value FROM meta ORDER BY key", ()))
        return {k: json.loads(v) for k, v in rows}

    def notes(self) -> dict[int, dict[str, str]]:
        """Step → {name: reason the value is ``None``}."""
        (rows,) = self._query(("SELECT step, name, reason FROM notes ORDER BY step, name", ()))
        out: dict[int, dict[str, str]] = {}
        for step, name, reason in rows:
            out.setdefault(step, {})[name] = reason
        return out

    def _scalar_snapshot(self, names: list[str] | None,
                         since: int | None) -> tuple[list[tuple], list[str]]:
        """The scalar rows ``(step, name, value, kind)`` and the frame's columns, read in
        one transaction: a step written meanwhile is in both or in neither."""
        where, args = self._since(since)
        rows, dict_rows = self._query(
            (f"SELECT step, name, value, kind FROM scalars WHERE {where} ORDER BY step, name",
             args),
            ("SELECT DISTINCT name FROM fields", ()),
        )
        if names is not None:
            wanted = set(names)
            return [r for r in rows if r[1] in wanted], list(names)
        return rows, self._scalar_names(rows, {r[0] for r in dict_rows})

    @staticmethod
    def _scalar_names(rows: list[tuple], dict_names: set[str]) -> list[str]:
        """Columns: names with a float somewhere or never a dict."""
        floats = {r[1] for r in rows if r[3] != NONE}
        nones = {r[1] for r in rows if r[3] == NONE} - dict_names
        return sorted(floats | nones)

    @staticmethod
    def _frames(rows: list[tuple], columns: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
        """The value and kind frames of :meth:`scalar_table` from one set of rows."""
        import pandas as pd  # imported lazily: writing a run log does not need pandas

        values: dict[str, dict[int, float]] = {c: {} for c in columns}
        kinds: dict[str, dict[int, str]] = {c: {} for c in columns}
        for step, name, value, kind in rows:
            if name in values:
                x = decode_float(value, kind)
                values[name][step] = np.nan if x is None else x
                kinds[name][step] = KIND_NAMES[kind]
        index = pd.Index(sorted({r[0] for r in rows}), name="step")
        return (pd.DataFrame(values, index=index, columns=columns).astype("float64"),
                pd.DataFrame(kinds, index=index, columns=columns))

    def scalar_table(
        self, names: Iterable[str] | None = None, *, since: int | None = None
    ) -> tuple[pd.DataFrame, pd.DataFrame]:
        """``(scalars(), scalar_kinds())`` read from one snapshot: the same steps and
        columns in both, also while another process appends steps."""
        rows, columns = self._scalar_snapshot(None if names is None else list(names), since)
        return self._frames(rows, columns)

    def scalars(
        self, names: Iterable[str] | None = None, *, since: int | None = None
    ) -> pd.DataFrame:
        """Float instruments as a frame: index ``step``, one float64 column per name.

        Missing and ``None`` values are NaN here; :meth:`scalar_kinds` and :meth:`notes`
        tell them apart from a NaN the instrument produced (:meth:`scalar_table` reads
        both at once). ``since`` keeps steps > since.
        """
        return self.scalar_table(names, since=since)[0]

    def scalar_kinds(
        self, names: Iterable[str] | None = None, *, since: int | None = None
    ) -> pd.DataFrame:
        """Same shape as :meth:`scalars`, cells ``"value"``, ``"nan"``, ``"+inf"``,
        ``"-inf"``, ``"none"`` (not computed) or NaN (not written at that step)."""
        return self.scalar_table(names, since=since)[1]

    def array(self, name: str, field: str = BARE_ARRAY_FIELD) -> dict[int, np.ndarray]:
        """Step → array of ``name[field]`` (a float field comes back as a 0-d array)."""
        (rows,) = self._query(
            (
                "SELECT step, value, kind, dtype, shape, codec, data FROM fields"
                " WHERE name=? AND field=? ORDER BY step",
                (name, field),
            )
        )
        out = {}
        for step, value, kind, dtype, shape, codec, data in rows:
            if kind == ARRAY:
                out[step] = decode_array(dtype, shape, codec, data)
            elif kind != NONE:
                out[step] = np.asarray(decode_float(value, kind))
        return out

    def output(self, *, since: int | None = None) -> dict[int, dict[str, Any]]:
        """``{step: {name: value}}`` exactly as written (``since`` keeps steps > since)."""
        where, args = self._since(since)
        steps, scalars, fields = self._query(
            (f"SELECT step FROM steps WHERE {where} ORDER BY step", args),
            (f"SELECT step, name, value, kind FROM scalars WHERE {where}", args),
            (
                "SELECT step, name, field, value, kind, dtype, shape, codec, data"
                f" FROM fields WHERE {where} ORDER BY step, name, pos",
                args,
            ),
        )
        out: dict[int, dict[str, Any]] = {step: {} for (step,) in steps}
        for step, name, value, kind in scalars:
            out.setdefault(step, {})[name] = decode_float(value, kind)
        for step, name, field, value, kind, dtype, shape, codec, data in fields:
            if kind == ARRAY:
                x = decode_array(dtype, shape, codec, data)
            else:
                x = decode_float(value, kind)
            if field == BARE_ARRAY_FIELD:
                out.setdefault(step, {})[name] = x
            else:
                out.setdefault(step, {}).setdefault(name, {})[field] = x
        return {step: dict(sorted(vals.items())) for step, vals in sorted(out.items())}


def read_output(logdir: str | Path) -> dict[int, dict[str, Any]]:
    """``RunLogReader(logdir).output()``."""
    with RunLogReader(logdir) as reader:
        return reader.output()


def read_meta(logdir: str | Path) -> dict[str, Any]:
    """``RunLogReader(logdir).meta()``."""
    with RunLogReader(logdir) as reader:
        return reader.meta()


def read_scalars(logdir: str | Path, names: Iterable[str] | None = None) -> pd.DataFrame:
    """``RunLogReader(logdir).scalars(names)``."""
    with RunLogReader(logdir) as reader:
        return reader.scalars(names)
