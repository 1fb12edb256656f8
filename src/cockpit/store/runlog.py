"""Crash-safe run log: one SQLite database per run, written step by step.

``RunLogWriter(logdir).write_step(step, values, notes)`` commits one transaction per call
and upserts by ``(step, name)``, so values that become known later (Alpha of step t is
known after step t+1) are added to an already written step. The database is in WAL mode
with ``synchronous=NORMAL``: a committed step survives the death of the process
(``kill -9``); only an operating-system crash or power loss may lose the last commits.

After construction the writer never raises into the training loop: a failing write emits
one :class:`RunLogWarning` per episode of failures (and counts them in ``failed_writes``)
and the run goes on. Any number of readers (:class:`~cockpit.store.reader.RunLogReader`,
other processes too) may read meanwhile.

One run per log directory, one writer at a time:

* a directory whose run log already holds steps is refused (:class:`RunLogExistsError`)
  unless ``resume=True`` continues that run — two runs merged into one log would look like
  one run whose instruments jump at the seam;
* a second writer of the same directory, in this process or another, is refused
  (:class:`RunLogLockedError`) while the first is open: an exclusive lock on
  ``<logdir>/cockpit.lock`` (``flock``), released by :meth:`close` or the process' death.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cockpit.store._schema import (
    ARRAY,
    BARE_ARRAY_FIELD,
    DB_FILENAME,
    NONE,
    SCHEMA_SQL,
    SCHEMA_VERSION,
    RunLogFormatError,
    encode_array,
    encode_float,
    newer_format_message,
    normalize_value,
)
from cockpit.store.reader import RunLogReader, read_meta, read_output, read_scalars

__all__ = [
    "RunLogExistsError",
    "RunLogLockedError",
    "RunLogReader",
    "RunLogWarning",
    "RunLogWriter",
    "read_meta",
    "read_output",
    "read_scalars",
]


class RunLogWarning(RuntimeWarning):
    """A run-log write failed; training continues without that step in the log."""


class RunLogExistsError(FileExistsError):
    """The log directory already holds a run and ``resume=True`` was not given."""


class RunLogLockedError(RuntimeError):
    """Another writer (this process or another one) has the log directory open."""


LOCK_FILENAME = "cockpit.lock"


def _json_dumps(obj: Any) -> str:
    """JSON text of a metadata entry; anything not JSON-able is written as its ``str``."""

    def fallback(o: Any) -> Any:
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
        return str(o)

    return json.dumps(obj, default=fallback)


class RunLogWriter:
    """Write Cockpit values into ``<logdir>/cockpit.sqlite``.

    Args:
        logdir: Directory of the run (created if missing).
        meta: Run metadata written at once (see :meth:`write_meta`).
        compress: zlib-compress integer arrays of >= 512 bytes (histogram counts) when
            that makes them smaller; float arrays are always stored raw.
        resume: continue the run log in ``logdir`` (its steps are kept; later values of
            a written step are added to it). Without it a ``logdir`` whose log holds steps
            is refused.

    Raises:
        RunLogExistsError: ``logdir`` holds a run log with steps and ``resume`` is False.
        RunLogLockedError: another writer has ``logdir`` open.
        OSError: ``logdir`` cannot be created or written (the message names it).
    """

    def __init__(
        self, logdir: str | Path, *, meta: dict | None = None, compress: bool = True,
        resume: bool = False,
    ) -> None:
        self.logdir = Path(logdir)
        self.path = self.logdir / DB_FILENAME
        self.compress = compress
        self.failed_writes = 0
        self._failing = False
        self._closed = False
        self._warned_closed = False
        self._lock = threading.Lock()
        self._lock_file = _acquire_lock(self.logdir)
        try:
            self._conn = self._open_database()
            (max_step,) = self._conn.execute("SELECT max(step) FROM steps").fetchone()
            if max_step is not None and not resume:
                self._conn.close()
                raise RunLogExistsError(
                    f"{str(self.logdir)!r} already holds a Cockpit run log (steps up to "
                    f"{max_step}): pass resume=True (Cockpit(..., logdir=..., resume=True)) "
                    "to continue that run, or give this run a new directory")
        except BaseException:
            self._lock_file.close()
            raise
        self.resumed_from: int | None = max_step  # the last step of the continued run
        # Steps above this one cannot have rows yet, so writing them needs no delete.
        self._max_step = -(2**63) if max_step is None else max_step
        if meta:
            self.write_meta(meta)
        if max_step is not None:
            self._mark_restart(max_step)

    def _mark_restart(self, after_step: int) -> None:
        """Append ``{"after_step", "wall_time"}`` to the metadata's ``restarts`` (the views
        mark where a resumed run went on)."""
        row = self._conn.execute("SELECT value FROM meta WHERE key='restarts'").fetchone()
        restarts = json.loads(row[0]) if row else []
        restarts.append({"after_step": int(after_step), "wall_time": time.time()})
        self.write_meta({"restarts": restarts})

    def _open_database(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=10.0
            )
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            if version > SCHEMA_VERSION:  # (the schema script would stamp it back)
                conn.close()
                raise RunLogFormatError(newer_format_message(self.path, version))
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(f"BEGIN; {SCHEMA_SQL} COMMIT;")
        except sqlite3.Error as err:
            raise OSError(
                f"the Cockpit run log {str(self.path)!r} cannot be opened for writing ({err}): "
                "give Cockpit a logdir in a writable directory") from err
        return conn

    # ------------------------------------------------------------------ public API
    def write_meta(self, meta: Mapping[str, Any]) -> None:
        """Merge ``meta`` into the stored metadata (top-level keys are replaced)."""
        try:
            rows = [(str(k), _json_dumps(v)) for k, v in meta.items()]
        except Exception as err:  # e.g. a circular structure
            self._warn(f"metadata could not be encoded: {err!r}")
            return
        self._commit(
            lambda cur: cur.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", rows),
            what="metadata",
        )

    def write_step(
        self,
        step: int,
        values: Mapping[str, Any],
        notes: Mapping[str, str] | None = None,
    ) -> None:
        """Store the values of ``step`` in one transaction, replacing earlier ``(step, name)``.

        ``values`` maps names to a float, ``None`` or a dict of float/array fields;
        ``notes`` maps names to the reason their value is ``None``. A note for a name
        without a value also records the value ``None`` (unless the step has one already).
        """
        step = int(step)
        scalar_rows, field_rows = self._encode(step, values)
        note_rows = [(step, str(k), str(v)) for k, v in (notes or {}).items()]
        names = [(step, str(name)) for name in values]

        def transaction(cur: sqlite3.Cursor) -> None:
            cur.execute("INSERT OR IGNORE INTO steps VALUES (?, ?)", (step, time.time()))
            if step <= self._max_step:
                for table in ("scalars", "fields", "notes"):
                    cur.executemany(f"DELETE FROM {table} WHERE step=? AND name=?", names)
            cur.executemany("INSERT INTO scalars VALUES (?, ?, ?, ?)", scalar_rows)
            cur.executemany("INSERT INTO fields VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", field_rows)
            cur.executemany("INSERT OR REPLACE INTO notes VALUES (?, ?, ?)", note_rows)
            missing = [(s, n, None, NONE) for s, n, _ in note_rows if n not in values]
            if missing:
                cur.executemany(
                    "INSERT OR IGNORE INTO scalars SELECT ?1, ?2, ?3, ?4 WHERE NOT EXISTS ("
                    " SELECT 1 FROM fields WHERE step=?1 AND name=?2)",
                    missing,
                )
            # Updated under the lock: a concurrent upsert of this step must see it.
            self._max_step = max(self._max_step, step)

        self._commit(transaction, what=f"step {step}")

    def close(self) -> None:
        """Close the database (idempotent). Later writes warn and are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._conn.close()
            except Exception as err:
                self._warn(f"closing the run log failed: {err!r}")
            finally:
                self._lock_file.close()  # releases the lock

    def __enter__(self) -> RunLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _encode(self, step: int, values: Mapping[str, Any]) -> tuple[list, list]:
        """Rows for the scalars and fields tables; unstorable values warn and are skipped."""
        scalar_rows: list[tuple] = []
        field_rows: list[tuple] = []
        for name, raw in values.items():
            name = str(name)
            try:
                value = normalize_value(raw)
                if isinstance(value, np.ndarray):
                    value = {BARE_ARRAY_FIELD: value}
                if isinstance(value, dict):
                    field_rows.extend(self._field_rows(step, name, value))
                else:
                    scalar_rows.append((step, name, *encode_float(value)))
            except Exception as err:
                self._warn(f"value {name!r} of step {step} was not stored: {err}", count=False)
        return scalar_rows, field_rows

    def _field_rows(self, step: int, name: str, fields: dict[str, Any]) -> list[tuple]:
        rows = []
        for pos, (field, x) in enumerate(fields.items()):
            if isinstance(x, np.ndarray):
                dtype, shape, codec, data = encode_array(x, self.compress)
                rows.append((step, name, field, pos, None, ARRAY, dtype, shape, codec, data))
            else:
                rows.append((step, name, field, pos, *encode_float(x), None, None, None, None))
        return rows

    def _commit(self, body: Any, *, what: str) -> bool:
        """Run ``body(cursor)`` in one transaction; on failure roll back and warn."""
        with self._lock:
            if self._closed:
                self.failed_writes += 1
                if not self._warned_closed:  # once, whatever happened before
                    self._warned_closed = True
                    self._failing = False
                    self._warn(
                        f"{what} was not written: the run log {self.path} is closed "
                        "(later writes are dropped silently)",
                        count=False,
                    )
                return False
            try:
                cur = self._conn.cursor()
                cur.execute("BEGIN IMMEDIATE")
                try:
                    body(cur)
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise
                cur.execute("COMMIT")
            except Exception as err:
                self._warn(f"{what} was not written to the run log {self.path}: {err!r}")
                return False
            self._failing = False
            return True

    def _warn(self, message: str, *, count: bool = True) -> None:
        """Warn once per episode of failed writes (every unstorable value warns)."""
        if count:
            self.failed_writes += 1
            if self._failing:
                return
            self._failing = True
            message += " (further write failures are counted in .failed_writes until one succeeds)"
        warnings.warn(f"Cockpit run log: {message}", RunLogWarning, stacklevel=4)


def _acquire_lock(logdir: Path):
    """The open lock file of ``logdir``, exclusively locked (see the module docstring)."""
    try:
        logdir.mkdir(parents=True, exist_ok=True)
        handle = open(logdir / LOCK_FILENAME, "a+")  # noqa: SIM115 (held until close)
    except OSError as err:
        raise OSError(
            f"the Cockpit run log directory {str(logdir)!r} cannot be created or written "
            f"({err.strerror or err}): give Cockpit a logdir in a writable directory"
        ) from err
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one writer is the user's promise
        return handle
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            warnings.warn(  # e.g. a network file system without locks
                f"Cockpit run log: {str(logdir)!r} cannot be locked ({err.strerror or err}); "
                "make sure no other Cockpit writes to it", RunLogWarning, stacklevel=4)
            return handle
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunLogLockedError(
            f"the Cockpit run log in {str(logdir)!r} is being written by another Cockpit "
            f"(process {holder}); one run log has one writer: give this run its own logdir, "
            "or close the other Cockpit first") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle
