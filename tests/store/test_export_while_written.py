"""Exporting the run log of a run that is still being written: the scalar table is read
from one snapshot, so a step written during the export is in every column or in none."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from cockpit.store import RunLogReader, RunLogWriter, export_run, main_export
from tests.models import recorded_run

STEPS = 4


@pytest.fixture
def appending_run(tmp_path, monkeypatch, one_thread):
    """A recorded run whose log gains a step (a copy of its last step's scalars, one of
    them a NaN) before each read of the run log, as a training process still writing it
    would add them between two reads."""
    logdir = tmp_path / "run"
    recorded_run(logdir, STEPS)
    with RunLogReader(logdir) as reader:
        last = reader.output()[STEPS - 1]
    scalars = {k: v for k, v in last.items() if isinstance(v, float)}
    writer = RunLogWriter(logdir, resume=True)
    written = []
    query = RunLogReader._query

    def query_after_a_new_step(self, *statements):
        step = STEPS + len(written)
        writer.write_step(step, {**scalars, "Loss": float(step), "GradNorm": math.nan})
        written.append(step)
        return query(self, *statements)

    monkeypatch.setattr(RunLogReader, "_query", query_after_a_new_step)
    yield logdir, written
    monkeypatch.undo()
    writer.close()


def _final_scalars(logdir: Path) -> pd.DataFrame:
    with RunLogReader(logdir) as reader:
        return reader.scalars()


def test_csv_export_of_a_run_being_written_has_whole_columns(appending_run, tmp_path):
    logdir, written = appending_run
    assert main_export([str(logdir), "--format", "csv", "-o", str(tmp_path / "out.csv")]) == 0
    lines = (tmp_path / "out.csv").read_text().splitlines()
    assert len({line.count(",") for line in lines}) == 1  # every row has every column
    frame = pd.read_csv(tmp_path / "out.csv", index_col="step")
    # the export holds the recorded steps and the step written before its one read
    assert list(frame.index) == [*range(STEPS), written[0]]
    final = _final_scalars(logdir)
    pd.testing.assert_frame_equal(frame, final.loc[frame.index, list(frame.columns)],
                                  check_names=False)
    assert frame.loc[written[0], "Loss"] == float(written[0])
    assert math.isnan(frame.loc[written[0], "GradNorm"])


def test_parquet_export_of_a_run_being_written_keeps_nan_apart_from_missing(appending_run,
                                                                           tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    logdir, written = appending_run
    table = pq.read_table(export_run(logdir, tmp_path / "out.parquet", "parquet"))
    steps = table.column("step").to_pylist()
    assert steps == [*range(STEPS), written[0]]
    with RunLogReader(logdir) as reader:
        final, kinds = reader.scalars(), reader.scalar_kinds()
    for name in ("Loss", "GradNorm", "Alpha"):
        expected = [final.loc[s, name] if kinds.loc[s, name] in ("value", "nan") else None
                    for s in steps]
        got = table.column(name).to_pylist()
        assert [x is None for x in got] == [x is None for x in expected], name
        for g, e in zip(got, expected, strict=True):
            if e is not None:
                assert g == e or (math.isnan(g) and math.isnan(e)), name
    assert table.column("Alpha").to_pylist()[-1] is None  # not in the appended step


def test_scalar_table_reads_values_and_kinds_from_one_snapshot(appending_run):
    logdir, written = appending_run
    with RunLogReader(logdir) as reader:
        values, kinds = reader.scalar_table()
    assert list(values.index) == list(kinds.index) == [*range(STEPS), written[0]]
    assert list(values.columns) == list(kinds.columns)
    assert kinds.loc[written[0], "GradNorm"] == "nan"
    assert kinds.loc[0, "GradNorm"] == "value" and values.loc[0, "GradNorm"] > 0
