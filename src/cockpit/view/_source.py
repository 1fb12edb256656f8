"""Where a view gets its data: a run directory (the run log), a JSON export, an output
dict or a live :class:`Cockpit` object (anything with ``get_output()``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cockpit.quantities.descriptor import remember_descriptions
from cockpit.view._data import Output, normalize_output


def _meta_of(obj: Any) -> dict[str, Any] | None:
    """The run metadata of an object with ``get_output()``: for a Cockpit the metadata its
    run log is given (also without a ``logdir``), else what a ``meta``-like attribute holds."""
    from cockpit.cockpit import Cockpit

    if isinstance(obj, Cockpit):
        from cockpit.store.metadata import cockpit_metadata

        return cockpit_metadata(obj)
    for attr in ("meta", "run_meta", "metadata", "_metadata"):
        meta = getattr(obj, attr, None)
        if callable(meta):
            try:
                meta = meta()
            except TypeError:
                continue
        if isinstance(meta, Mapping):
            return dict(meta)
    return None


def load_run(source: Any, meta: Mapping[str, Any] | None = None) -> tuple[Output, dict]:
    """Return ``(output, meta)`` of a run directory, JSON export, output dict or cockpit.

    A JSON export (``*.json``) carries the run's metadata where it is a whole-run export
    (``cockpit export --format json``), none in the bare ``{step: {name: value}}`` layout. The
    descriptors the metadata carries are taken into the registry of instruments
    (:func:`~cockpit.quantities.descriptor.remember_descriptions`), so instruments whose
    classes this process has not imported get their panels too.
    """
    output, run_meta = _load(source, meta)
    remember_descriptions(run_meta)
    return output, run_meta


def _load(source: Any, meta: Mapping[str, Any] | None) -> tuple[Output, dict]:
    if isinstance(source, str | Path):
        path = Path(source)
        if path.suffix == ".json" and path.is_file():
            from cockpit.store.export import load_json_run

            output, stored_meta, _ = load_json_run(path)
            return normalize_output(output), dict(meta or stored_meta)
        from cockpit.store import RunLogReader

        with RunLogReader(path) as reader:
            output, stored_meta = reader.output(), reader.meta()
        return normalize_output(output), dict(meta or stored_meta)
    if isinstance(source, Mapping):
        return normalize_output(source), dict(meta or {})
    if hasattr(source, "get_output"):
        return normalize_output(source.get_output()), dict(meta or _meta_of(source) or {})
    raise TypeError(
        f"Cannot read a Cockpit run from {type(source).__name__}: pass a run directory, "
        "a JSON export path, an output dict {step: {name: value}} or a Cockpit object."
    )


def load_notes(source: Any) -> dict[int, dict[str, str]]:
    """``{step: {name: reason}}``: why values are missing (run log's notes table, a
    Cockpit's ``get_notes()``, a whole-run JSON export's); empty for output dicts and
    bare JSON exports."""
    if isinstance(source, str | Path):
        path = Path(source)
        if path.suffix == ".json" and path.is_file():
            from cockpit.store.export import load_json_run

            return load_json_run(path)[2]
        from cockpit.store import RunLogReader

        try:
            with RunLogReader(path) as reader:
                return {int(s): dict(n) for s, n in reader.notes().items()}
        except FileNotFoundError:
            return {}
    if hasattr(source, "get_notes"):
        return {int(s): dict(n) for s, n in source.get_notes().items()}
    return {}


def run_status(logdir: str | Path) -> dict[str, Any]:
    """``{"last_step", "num_steps", "version"}`` of a run log, cheap enough to poll.

    ``version`` changes whenever the run log's files change (also for values added to
    an already written step, e.g. Alpha); an absent run log gives ``num_steps = 0``.
    """
    from cockpit.store import RunLogReader

    path = Path(logdir)
    try:
        with RunLogReader(path) as reader:
            steps = reader.steps()
    except FileNotFoundError:
        return {"last_step": None, "num_steps": 0, "version": None}
    stamps = []
    # The database and its write-ahead log change with every write; readers touch only
    # the shared-memory index (-shm), which is therefore left out.
    db = path / "cockpit.sqlite" if path.is_dir() else path
    for f in (db, db.with_name(db.name + "-wal")):
        try:
            st = f.stat()
            stamps.append(f"{f.name}:{st.st_mtime_ns}:{st.st_size}")
        except OSError:
            continue
    return {
        "last_step": steps[-1] if steps else None,
        "num_steps": len(steps),
        "version": "|".join(sorted(stamps)),
    }
