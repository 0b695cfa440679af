"""``benchmarks/ab_compare.py``: runs from two checkouts take turns, and the summary's medians and ratios."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO_ROOT

HEADER = ["size_bytes", "size", "op", "mode", "median_us", "ratio_vs_gloo", "ratio_vs_mpi"]


@pytest.fixture(scope="module")
def ab() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ab_compare", REPO_ROOT / "benchmarks" / "ab_compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, rows: list[list[object]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HEADER)
        writer.writerows(rows)


def test_summary_takes_the_median_over_rounds_per_tree_and_the_ratio(ab: ModuleType, tmp_path: Path) -> None:
    for round_, (base, new) in enumerate([(20.0, 10.0), (30.0, 14.0), (22.0, 40.0)], start=1):
        _write(
            tmp_path / f"collective_bench_base_{round_}.csv",
            [[4096, "4 KiB", "pingpong", "ring", base, "", 4.0]],
        )
        _write(
            tmp_path / f"collective_bench_new_{round_}.csv",
            [[4096, "4 KiB", "pingpong", "ring", new, "", 2.0]],
        )
    text = ab.summarize(tmp_path)
    latency = next(line for line in text.splitlines() if "latency us" in line)
    assert "base 22 [20-30]" in latency and "new 14 [10-40]" in latency
    assert latency.rstrip().endswith(f"new/base {14 / 22:.3f}")
    versus_mpi = next(line for line in text.splitlines() if "ours / MPICH" in line)
    assert versus_mpi.rstrip().endswith("new/base 0.500")
    assert "ours / Gloo" not in text  # an empty column is no measure


def test_p2p_layers_rows_pool_every_round_of_every_run(ab: ModuleType, tmp_path: Path) -> None:
    """``p2p_layers.py`` writes one row per round and mode, with ``half_rtt_us``."""
    for tree, runs in (("base", [(9.0, 9.2), (8.8, 30.0)]), ("new", [(8.5, 8.7), (8.6, 8.4)])):
        for run, rounds in enumerate(runs, start=1):
            with open(tmp_path / f"p2p_layers_{tree}_{run}.csv", "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["size_bytes", "mode", "round", "half_rtt_us"])
                writer.writerows([4096, "interface", i, value] for i, value in enumerate(rounds))
    line = next(line for line in ab.summarize(tmp_path).splitlines() if "half rtt us" in line)
    assert "4096 interface" in line
    assert "base 9.1 [8.8-30]" in line and "new 8.55 [8.4-8.7]" in line
    assert line.rstrip().endswith(f"new/base {8.55 / 9.1:.3f}")


def test_ddp_step_rows_give_the_step_time_and_the_ratio_to_torch_ddp(ab: ModuleType, tmp_path: Path) -> None:
    """``ddp_step_bench.py`` writes a row per mode with ``median_ms`` and ``vs_torch_ddp``."""
    for tree, (ours, theirs) in (("base", (800.0, 850.0)), ("new", (760.0, 850.0))):
        with open(tmp_path / f"ddp_step_bench_{tree}_1.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["mode", "world_size", "median_ms", "vs_torch_ddp"])
            writer.writerows([["ddp-ring", 2, ours, ours / theirs], ["torch-ddp", 2, theirs, 1.0]])
    lines = ab.summarize(tmp_path).splitlines()
    step = next(line for line in lines if line.lstrip().startswith("ddp-ring") and "step ms" in line)
    assert "base 800 [800-800]" in step and step.rstrip().endswith("new/base 0.950")
    ratio = next(
        line for line in lines if line.lstrip().startswith("ddp-ring") and "ours / torch DDP" in line
    )
    assert ratio.rstrip().endswith(f"new/base {(760 / 850) / (800 / 850):.3f}")


def test_a_row_only_one_tree_has_is_listed_alone(ab: ModuleType, tmp_path: Path) -> None:
    _write(tmp_path / "collective_bench_base_1.csv", [[4096, "4 KiB", "all_to_all", "ring", 20.0, "", ""]])
    _write(
        tmp_path / "collective_bench_new_1.csv",
        [
            [4096, "4 KiB", "all_to_all", "ring", 10.0, "", ""],
            [4096, "4 KiB", "all_to_all", "ring+buf", 5.0, "", ""],
        ],
    )
    lines = ab.summarize(tmp_path).splitlines()
    assert any("ring+buf" in line and "(base: none)" in line and "new 5 [5-5]" in line for line in lines)
    assert any(" ring " in line and line.endswith("new/base 0.500") for line in lines)


def test_runs_take_turns_between_the_trees_and_write_one_csv_each(ab: ModuleType, tmp_path: Path) -> None:
    trees = []
    for name in ("base", "new"):
        bench = tmp_path / name / "benchmarks"
        bench.mkdir(parents=True)
        latency = 10 if name == "base" else 5
        (bench / "fake_bench.py").write_text(
            "import csv, sys\n"
            "with open(sys.argv[sys.argv.index('--csv') + 1], 'w', newline='') as f:\n"
            f"    csv.writer(f).writerows([{HEADER!r}, [64, '64 B', 'x', 'ring', {latency}, '', '']])\n"
            f"open({str(tmp_path / 'order.txt')!r}, 'a').write({name!r} + '\\n')\n"
        )
        trees.append(tmp_path / name)
    out = tmp_path / "out"
    status = ab.main(
        [
            "--base",
            str(trees[0]),
            "--new",
            str(trees[1]),
            "--out",
            str(out),
            "--rounds",
            "2",
            "--run",
            "fake_bench.py",
        ]
    )
    assert status == 0
    # Neither tree always goes first.
    assert (tmp_path / "order.txt").read_text().split() == ["base", "new", "new", "base"]
    assert sorted(p.name for p in out.glob("*.csv")) == [
        "fake_bench_base_1.csv",
        "fake_bench_base_2.csv",
        "fake_bench_new_1.csv",
        "fake_bench_new_2.csv",
    ]
    assert "new/base 0.500" in (out / "summary.txt").read_text()
    assert len((out / "commands.txt").read_text().splitlines()) == 4


def test_bad_arguments_exit_2(ab: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ab.main(["--out", str(tmp_path), "--run", "x.py"]) == 2
    assert "--base" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing ran, nothing was written
