"""Smoke tests of ``allreduce_bench.py --quick`` (2 ranks, and its helpers) and ``ddp_forward_bench.py``."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.conftest import REPO_ROOT, mpi_unavailable_reason, mpiexec_command, mpiexec_env, run_job

BENCH = REPO_ROOT / "benchmarks" / "allreduce_bench.py"
TABLE_HEADER = [
    "size",
    "mode",
    "kind",
    "iters",
    "lat_us",
    "min_us",
    "algbw_GB/s",
    "busbw_GB/s",
    "vs_gloo",
    "vs_mpi",
    "vs_plain",
    "check",
]
CSV_HEADER = [
    "size_bytes",
    "size",
    "dtype",
    "numel",
    "world_size",
    "mode",
    "kind",
    "iters",
    "rounds",
    "median_us",
    "min_us",
    "max_us",
    "algbw_GBps",
    "busbw_GBps",
    "ratio_vs_gloo",
    "ratio_vs_mpi",
    "ratio_vs_plain",
    "correct",
    "threads",
    "buffer",
]


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("allreduce_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def run_bench(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run the benchmark; on timeout every rank is killed, not just the launcher."""
    try:
        return run_job(args, timeout=timeout, env=mpiexec_env(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"benchmark did not finish within {timeout} s:\n{e.stdout}\n{e.stderr}")


def check_output(proc: subprocess.CompletedProcess[str], csv_path: Path, expected_modes: set[str]) -> None:
    report = f"exit code {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, report
    lines = proc.stdout.splitlines()
    assert any(line.split() == TABLE_HEADER for line in lines), report
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_HEADER
        rows = list(reader)
    modes = {row["mode"] for row in rows}
    assert expected_modes <= modes, f"modes measured: {sorted(modes)}\n{report}"
    sizes = sorted({int(row["size_bytes"]) for row in rows})
    assert sizes == [4096, 65536, 1 << 20], sizes
    for row in rows:
        assert row["correct"] == "ok", row
        assert row["world_size"] == "2"
        assert float(row["median_us"]) > 0 and float(row["algbw_GBps"]) > 0
        assert float(row["busbw_GBps"]) == pytest.approx(float(row["algbw_GBps"]), rel=1e-3)  # 2(n-1)/n = 1
        assert row["ratio_vs_plain"] == ""
        if row["mode"] == "torch-gloo":
            assert float(row["ratio_vs_gloo"]) == pytest.approx(1.0)
    # One table line per CSV row.
    table_rows = [line for line in lines if line.split()[:1] and line.split()[-1:] == ["ok"]]
    assert len(table_rows) == len(rows), report


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_benchmark_on_two_ranks(tmp_path: Path) -> None:
    csv_path = tmp_path / "allreduce.csv"
    if mpi_unavailable_reason() is None:
        cmd = [*mpiexec_command(2), sys.executable, str(BENCH), "--quick", "--csv", str(csv_path)]
        expected = {"torch-gloo", "mpi4py"}
    else:
        cmd = [sys.executable, str(BENCH), "--spawn", "2", "--quick", "--csv", str(csv_path)]
        expected = {"torch-gloo"}
    if importlib.util.find_spec("backends.ring") is not None:
        expected |= {"ring", "ring+buf"}  # on ordinary tensors and on its own shared buffers
    check_output(run_bench(cmd), csv_path, expected)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_benchmark_spawned_without_mpi(tmp_path: Path) -> None:
    if mpi_unavailable_reason() is not None:
        pytest.skip("covered by test_quick_benchmark_on_two_ranks on this machine (no MPI)")
    csv_path = tmp_path / "allreduce.csv"
    proc = run_bench(
        [sys.executable, str(BENCH), "--spawn", "2", "--quick", "--backends", "none", "--csv", str(csv_path)]
    )
    check_output(proc, csv_path, {"torch-gloo"})
    assert "skipped mpi4py: not launched by an MPI launcher" in proc.stdout


# ------------------------------------------------------------- helpers
@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("4K", 4096),
        ("64k", 65536),
        ("1M", 1 << 20),
        ("25MiB", 25 << 20),
        ("100M", 100 << 20),
        ("1G", 1 << 30),
        ("4096", 4096),
        ("0.5K", 512),
    ],
)
def test_parse_size(bench: ModuleType, text: str, nbytes: int) -> None:
    assert bench.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "abc", "-4K", "0"])
def test_parse_size_refuses_bad_text(bench: ModuleType, text: str) -> None:
    with pytest.raises(Exception, match="bad size"):
        bench.parse_size(text)


def test_format_size_and_bandwidths(bench: ModuleType) -> None:
    assert [bench.format_size(n) for n in (4096, 25 << 20, 1000, 1 << 30)] == [
        "4 KiB",
        "25 MiB",
        "1000 B",
        "1 GiB",
    ]
    algbw, busbw = bench.bandwidths(2_000_000_000, 2.0, 4)
    assert algbw == pytest.approx(1.0) and busbw == pytest.approx(1.5)


def _mode(bench: ModuleType, all_reduce) -> object:  # noqa: ANN001
    return bench.Mode(
        name="unit", kind="commlib", all_reduce=all_reduce, barrier=lambda: None, close=lambda: None
    )


def test_check_once_accepts_a_correct_sum(bench: ModuleType) -> None:
    pattern = (torch.arange(100) % 251).float()
    buf = torch.empty(100)
    # Pretend to be rank 0 of 2: the other rank contributed 2 * pattern.
    mode = _mode(bench, lambda t: t.add_(2 * pattern))
    assert bench.check_once(mode, buf, pattern, 0, 2)


def test_check_once_catches_a_wrong_sum(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    pattern = (torch.arange(100) % 251).float()
    buf = torch.empty(100)

    def almost(t: torch.Tensor) -> None:
        t.add_(2 * pattern)
        t[42] += 1

    assert not bench.check_once(_mode(bench, almost), buf, pattern, 0, 2)
    assert not bench.check_once(_mode(bench, lambda t: None), buf, pattern, 1, 2)
    err = capsys.readouterr().err
    assert (
        "[rank 0/2] unit: WRONG result for 100 elements: 1 differ; "
        "first at index 42: got 127.0, expected 126.0" in err
    )


def test_rows_report_ratios_to_the_references(bench: ModuleType) -> None:
    modes = {
        name: bench.Mode(name=name, kind=kind, all_reduce=None, barrier=None, close=None)
        for name, kind in (("ring", "commlib"), ("torch-gloo", "reference"), ("mpi4py", "reference"))
    }
    results = [
        bench.Result(4096, 1024, modes["ring"], 10, [2e-4, 3e-4, 1e-4], True),
        bench.Result(4096, 1024, modes["torch-gloo"], 10, [8e-4], True),
        bench.Result(4096, 1024, modes["mpi4py"], 10, [1e-5], True),
    ]
    rows = {r["mode"]: r for r in bench.rows_for_size(results, 2, "float32", 3)}
    ring = rows["ring"]
    assert ring["median_us"] == "200.0" and ring["min_us"] == "100.0" and ring["max_us"] == "300.0"
    assert ring["ratio_vs_gloo"] == "0.250" and ring["ratio_vs_mpi"] == "20.000"
    assert ring["algbw_GBps"] == f"{4096 / 2e-4 / 1e9:.4f}"
    assert ring["correct"] == "ok"
    assert list(ring) == CSV_HEADER


def test_deterministic_rows_compare_with_the_same_backends_plain_mode(bench: ModuleType) -> None:
    def mode(name: str, plain: str = "") -> object:
        return bench.Mode(name=name, kind="commlib", all_reduce=None, barrier=None, close=None, plain=plain)

    base = [mode("ring"), mode("ring+det", "ring"), mode("ring+buf"), mode("ring+buf+det", "ring+buf")]
    modes = {m.name: m for m in bench.with_thread_counts(base, [1, 2])}
    assert modes["ring+buf+det@2t"].plain == "ring+buf"
    results = [
        bench.Result(1 << 20, 1 << 18, modes[name], 4, [seconds], True)
        for name, seconds in (
            ("ring@1t", 1e-3),
            ("ring+det@1t", 1.2e-3),
            ("ring+buf@1t", 8e-4),
            ("ring+buf+det@1t", 1.2e-3),
            ("ring@2t", 2e-3),
            ("ring+det@2t", 5e-3),
        )
    ]
    rows = {r["mode"]: r for r in bench.rows_for_size(results, 4, "float32", 1)}
    assert rows["ring+det@1t"]["ratio_vs_plain"] == "1.200"
    assert rows["ring+buf+det@1t"]["ratio_vs_plain"] == "1.500"
    assert rows["ring+det@2t"]["ratio_vs_plain"] == "2.500"
    assert rows["ring@1t"]["ratio_vs_plain"] == ""
    assert bench.table_row(rows["ring+det@1t"]).split()[-2:] == ["1.200", "ok"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_benchmark_in_deterministic_mode(tmp_path: Path) -> None:
    """Three spawned ranks: every backend beside its deterministic twin, each result checked."""
    csv_path = tmp_path / "allreduce.csv"
    cmd = [sys.executable, str(BENCH), "--spawn", "3", "--quick", "--backends", "ring,gloo", "--references"]
    proc = run_bench([*cmd, "none", "--buffers", "plain", "--deterministic", "--csv", str(csv_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert {row["mode"] for row in rows} == {"ring", "ring+det", "gloo", "gloo+det"}
    for row in rows:
        assert row["correct"] == "ok" and row["world_size"] == "3", row
        det = row["mode"].endswith("+det")
        assert (row["ratio_vs_plain"] != "") == det and (not det or float(row["ratio_vs_plain"]) > 0), row


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path without CUDA")
def test_device_cuda_without_cuda_fails_fast_with_one_line() -> None:
    proc = run_bench([sys.executable, str(BENCH), "--device", "cuda", "--spawn", "2"], timeout=120)
    assert proc.returncode == 2, proc
    assert proc.stdout == "", proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda needs a CUDA device" in lines[0], proc.stderr


def test_cuda_rows_compare_with_the_host_twin_and_report_hidden_copies(bench: ModuleType) -> None:
    def mode(name: str, kind: str = "commlib", **kw: object) -> object:
        return bench.Mode(name=name, kind=kind, all_reduce=None, barrier=None, close=None, **kw)

    mpi = mode("mpi", device="cuda:0", host_twin="mpi[host]")
    results = [
        bench.Result(1 << 20, 1 << 18, mpi, 4, [5e-3], True, copy_s=2e-3),
        bench.Result(1 << 20, 1 << 18, mode("mpi[host]"), 4, [4e-3], True),
        bench.Result(1 << 20, 1 << 18, mode("torch-gloo", "reference", device="cuda:0"), 4, [8e-3], True),
    ]
    rows = {r["mode"]: r for r in bench.rows_for_size(results, 2, "float32", 1, bench.CUDA_CSV_COLUMNS)}
    assert list(rows["mpi"]) == bench.CUDA_CSV_COLUMNS
    # CUDA 5 ms against host 4 ms: 0.8 of the host bandwidth; of 2 ms of copies, 1 ms was hidden.
    assert (rows["mpi"]["busbw_vs_host"], rows["mpi"]["copy_ms"], rows["mpi"]["copy_hidden"]) == (
        "0.800",
        "2.000",
        "0.50",
    )
    assert rows["mpi"]["ratio_vs_gloo"] == "0.625" and rows["mpi"]["device"] == "cuda:0"
    assert rows["mpi[host]"]["busbw_vs_host"] == "" and rows["torch-gloo"]["copy_hidden"] == ""
    assert bench.copy_hidden(4e-3, 6e-3, 2e-3) == 0.0 and bench.copy_hidden(4e-3, 3e-3, 2e-3) == 1.0
    assert bench.table_row(rows["mpi"]).split()[-3:] == ["0.800", "0.50", "ok"]


def test_thread_variants_are_compared_with_the_references_at_their_own_count(bench: ModuleType) -> None:
    base = [
        bench.Mode(name=name, kind=kind, all_reduce=None, barrier=None, close=None)
        for name, kind in (("ring", "commlib"), ("torch-gloo", "reference"))
    ]
    modes = {m.name: m for m in bench.with_thread_counts(base, [1, 2])}
    assert sorted(modes) == ["ring@1t", "ring@2t", "torch-gloo@1t", "torch-gloo@2t"]
    results = [
        bench.Result(4096, 1024, modes[name], 10, [seconds], True)
        for name, seconds in (
            ("ring@1t", 1e-4),
            ("ring@2t", 3e-4),
            ("torch-gloo@1t", 4e-4),
            ("torch-gloo@2t", 6e-4),
        )
    ]
    rows = {r["mode"]: r for r in bench.rows_for_size(results, 2, "float32", 1)}
    assert (rows["ring@1t"]["ratio_vs_gloo"], rows["ring@2t"]["ratio_vs_gloo"]) == ("0.250", "0.500")
    assert (rows["ring@2t"]["threads"], rows["ring@2t"]["buffer"]) == (2, "plain")
    assert [m.threads for m in bench.with_thread_counts(base, [3])] == [3, 3]
    assert [m.name for m in bench.with_thread_counts(base, [3])] == ["ring", "torch-gloo"]


def test_thread_counts_are_parsed_with_torchs_default(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert bench.parse_thread_counts(None, 3) == ([3], None)
    monkeypatch.setattr(bench, "torch_default_threads", lambda: 2)
    assert bench.parse_thread_counts("1, 2,default", 1) == ([1, 2], 2)
    with pytest.raises(SystemExit, match=r"--thread-counts: expected numbers or 'default', got 'one'"):
        bench.parse_thread_counts("one", 1)
    with pytest.raises(SystemExit, match=r"--thread-counts: 0 threads; need at least 1"):
        bench.parse_thread_counts("0", 1)


# ------------------------------------------------------------ ddp_forward_bench.py
def test_ddp_forward_bench_times_every_mode_and_counts_calls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location(
        "ddp_forward_bench", REPO_ROOT / "benchmarks" / "ddp_forward_bench.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out_csv = tmp_path / "forward.csv"
    argv = ["--params", "40", "--rounds", "2", "--block", "2", "--backward-calls", "--csv", str(out_csv)]
    assert module.main(argv) == 0
    rows = list(csv.DictReader(out_csv.open()))
    assert [(r["params"], r["mode"]) for r in rows] == [("40", m) for m in ("module", "ddp", "ddp-no_sync")]
    assert rows[0]["overhead_us"] == "" and all(float(r["us_per_forward"]) > 0 for r in rows)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("one backward")]
    calls = [int(line.split(": ")[1].split()[0]) for line in lines]
    assert len(calls) == 2 and 0 < calls[0] < calls[1], lines  # 50 buckets: 50 collectives more
