"""Tests of the run-log exporters (JSON, CSV, Parquet) and the export command."""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np
import pandas as pd
import pytest
from test_store import assert_same_output, make_step

from cockpit.store import (
    RunLogReader,
    RunLogWriter,
    add_export_subcommand,
    export_run,
    load_json_export,
    main_export,
)

SCALARS = {
    0: {"Loss": 2.0, "GradNorm": math.nan, "HessMaxEV": None, "Alpha": math.inf, "Late": 4.0},
    1: {"Loss": 1.25, "GradNorm": 0.1 + 0.2, "HessMaxEV": 3.0, "Alpha": -math.inf},
    2: {"Loss": 1.0},
}


@pytest.fixture
def run(tmp_path):
    rng = np.random.default_rng(1)
    logdir = tmp_path / "run"
    with RunLogWriter(logdir) as writer:
        for step, vals in SCALARS.items():
            writer.write_step(step, {**make_step(rng, step), **vals})
    return logdir


def test_json_export_round_trips_to_output(run, tmp_path):
    path = export_run(run, tmp_path / "out.json", "json")
    text = path.read_text()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    assert doc["format"] == "cockpit-run/1"
    doc = doc["steps"]
    assert list(doc) == ["0", "1", "2"]
    assert doc["0"]["GradNorm"] == "NaN" and doc["0"]["HessMaxEV"] is None
    assert doc["0"]["Alpha"] == "Infinity" and doc["1"]["Alpha"] == "-Infinity"
    assert doc["0"]["Mixed"]["with_nan"] == [1.0, "NaN", "Infinity", "-Infinity"]
    assert len(doc["1"]["GradHist2d"]["counts"]) == 40
    assert len(doc["1"]["GradHist2d"]["counts"][0]) == 50

    expected = RunLogReader(run).output()
    loaded = load_json_export(path)
    # JSON keeps values, not dtypes: compare after casting to the stored dtypes.
    for step, vals in expected.items():
        for name, value in vals.items():
            if isinstance(value, dict):
                for field, x in value.items():
                    if isinstance(x, np.ndarray):
                        got = loaded[step][name][field]
                        loaded[step][name][field] = np.asarray(got, dtype=x.dtype).reshape(x.shape)
    assert_same_output(loaded, expected)


def test_csv_export_is_wide_with_nan_inf_and_empty_for_none(run, tmp_path):
    path = export_run(run, tmp_path / "out.csv", "csv")
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    assert header[0] == "step"
    assert {"Loss", "GradNorm", "HessMaxEV", "Alpha", "CABS"} <= set(header)
    assert not {"GradHist1d", "Parameters/fc.weight"} & set(header)  # arrays are omitted
    rows = {
        int(line.split(",")[0]): dict(zip(header, line.split(","), strict=True))
        for line in lines[1:]
    }
    assert rows[0]["GradNorm"] == "nan" and rows[0]["HessMaxEV"] == ""
    assert rows[0]["Alpha"] == "inf" and rows[1]["Alpha"] == "-inf"
    assert rows[1]["GradNorm"] == repr(0.1 + 0.2)  # shortest round-trip repr
    assert rows[2]["Late"] == "" and rows[2]["CABS"] == ""  # absent at step 2 / None
    frame = pd.read_csv(path, index_col="step")
    pd.testing.assert_frame_equal(frame, RunLogReader(run).scalars(), check_names=False)


def test_parquet_export_keeps_null_apart_from_nan(run, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    path = export_run(run, tmp_path / "out.parquet", "parquet")
    table = pq.read_table(path)
    grad_norm = table.column("GradNorm").to_pylist()
    assert table.column("step").to_pylist() == [0, 1, 2]
    assert math.isnan(grad_norm[0]) and grad_norm[1] == 0.1 + 0.2
    assert table.column("HessMaxEV").to_pylist() == [None, 3.0, math.inf]
    assert table.column("Late").to_pylist() == [4.0, None, None]  # absent → null
    assert table.column("CABS").to_pylist() == [None, None, None]  # None → null
    assert table.column("Alpha").to_pylist() == [math.inf, -math.inf, None]


def test_parquet_without_pyarrow_names_the_install_command(run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"pip install 'torch-cockpit\[parquet\]'"):
        export_run(run, tmp_path / "out.parquet", "parquet")


def test_unknown_format_and_missing_run(run, tmp_path):
    with pytest.raises(ValueError, match="json, csv, parquet"):
        export_run(run, tmp_path / "x", "xml")
    with pytest.raises(FileNotFoundError, match=r"cockpit\.sqlite"):
        export_run(tmp_path / "none", tmp_path / "x.json")


def test_cli_entry_points(run, tmp_path, capsys):
    out = tmp_path / "cli.json"
    assert main_export([str(run), "--format", "json", "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert load_json_export(out).keys() == {0, 1, 2}

    parser = argparse.ArgumentParser(prog="cockpit")
    add_export_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["export", str(run), "-f", "csv"])
    assert args.func(args) == 0
    assert (run / "cockpit.csv").read_text().startswith("step,")


def test_a_json_export_carries_the_runs_metadata_and_notes_to_the_view(tmp_path):
    """The cockpit view of a whole-run JSON export reads its metadata (the title, the
    restarts) and notes (why a value is missing) as the view of the run log does."""
    from cockpit.view._source import load_notes, load_run

    logdir = tmp_path / "run"
    with RunLogWriter(logdir, meta={"model": "Net", "restarts": [{"after_step": 1}]}) as writer:
        writer.write_step(0, {"Loss": 1.0, "Alpha": None}, notes={"Alpha": "the reason"})
        writer.write_step(2, {"Loss": 0.5})
    path = export_run(logdir, tmp_path / "run.json", "json")
    output, meta = load_run(path)
    expected_output, expected_meta = load_run(logdir)
    assert meta == expected_meta and meta["model"] == "Net"
    assert load_notes(path) == load_notes(logdir) == {0: {"Alpha": "the reason"}}
    assert sorted(output) == sorted(expected_output) == [0, 2]
