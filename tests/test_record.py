"""``benchmarks/record.py``: a benchmark's runs kept as one ``runs.csv``, and their medians [min-max]."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO_ROOT

HEADER = ["size_bytes", "op", "mode", "median_us", "ratio_vs_mpi"]


@pytest.fixture(scope="module")
def record() -> ModuleType:
    spec = importlib.util.spec_from_file_location("record", REPO_ROOT / "benchmarks" / "record.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, rows: list[list[object]], header: list[str] = HEADER) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def test_runs_csv_holds_every_row_with_its_run_and_the_summary_takes_medians(
    record: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mpich = [4096, "pingpong", "mpi4py", 3, 1]
    runs = [
        _write(tmp_path / f"run{i}.csv", [[4096, "pingpong", "ring", us, ratio], mpich])
        for i, (us, ratio) in enumerate([(10.0, 3.0), (30.0, 9.0), (12.0, 4.0)], start=1)
    ]
    out = tmp_path / "rec"
    assert record.main(["collective_bench", "--out", str(out), *map(str, runs)]) == 0
    rows = list(csv.DictReader(open(out / "runs.csv")))
    assert [(r["run"], r["mode"], r["median_us"]) for r in rows] == [
        ("1", "ring", "10.0"), ("1", "mpi4py", "3"),
        ("2", "ring", "30.0"), ("2", "mpi4py", "3"),
        ("3", "ring", "12.0"), ("3", "mpi4py", "3"),
    ]  # fmt: skip
    printed = capsys.readouterr().out
    assert "medians over 3 runs" in printed
    assert "4096 pingpong ring" in printed and "latency us       12 [10-30]" in printed
    assert "ours / MPICH     4 [3-9]" in printed
    assert record.main(["collective_bench", "--out", str(out)]) == 0  # the record's own summary
    assert "latency us       12 [10-30]" in capsys.readouterr().out


def test_labelled_sets_are_summarised_apart(
    record: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        f"{tree}-{i}={_write(tmp_path / f'{tree}{i}.csv', [[4096, 'pingpong', 'ring', us, '']])}"
        for tree, values in (("old", (1.0, 2.0, 6.0)), ("new", (5.0, 7.0, 8.0)))
        for i, us in enumerate(values, start=1)
    ]
    assert record.main(["x", "--out", str(tmp_path / "rec"), *args]) == 0
    printed = capsys.readouterr().out
    assert "old 4096 pingpong ring" in printed and "2 [1-6]" in printed
    assert "new 4096 pingpong ring" in printed and "7 [5-8]" in printed
    assert {r["run"] for r in csv.DictReader(open(tmp_path / "rec" / "runs.csv"))} == {
        "old-1", "old-2", "old-3", "new-1", "new-2", "new-3"
    }  # fmt: skip


def test_runs_of_different_benchmarks_are_refused(
    record: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _write(tmp_path / "a.csv", [[4096, "pingpong", "ring", 1.0, ""]])
    other = _write(tmp_path / "b.csv", [["ddp-ring", 900.0]], header=["mode", "median_ms"])
    assert record.main(["x", "--out", str(tmp_path / "rec"), str(first), str(other)]) == 2
    assert "b.csv: its columns differ from" in capsys.readouterr().err
    assert not (tmp_path / "rec" / "runs.csv").exists()
    assert record.main(["x", "--out", str(tmp_path / "none")]) == 2
    assert "no record to summarise" in capsys.readouterr().err
