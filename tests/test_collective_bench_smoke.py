"""Smoke test of ``benchmarks/collective_bench.py --quick`` on 2 ranks, plus its helpers in-process."""

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

BENCH = REPO_ROOT / "benchmarks" / "collective_bench.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("collective_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_benchmark_on_two_ranks(tmp_path: Path, bench: ModuleType) -> None:
    csv_path = tmp_path / "collectives.csv"
    if mpi_unavailable_reason() is None:
        cmd = [*mpiexec_command(2), sys.executable, str(BENCH), "--quick", "--csv", str(csv_path)]
        expected = {"ring", "torch-gloo", "mpi4py"}
    else:
        cmd = [sys.executable, str(BENCH), "--spawn", "2", "--quick", "--csv", str(csv_path)]
        expected = {"ring", "torch-gloo"}
    try:
        proc = run_job(cmd, timeout=240, env=mpiexec_env(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"benchmark did not finish within 240 s:\n{e.stdout}\n{e.stderr}")
    report = f"exit code {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert any(line.split() == bench.TABLE_COLUMNS for line in proc.stdout.splitlines()), report
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == bench.CSV_COLUMNS
        rows = list(reader)
    assert {(row["op"], int(row["size_bytes"])) for row in rows} == {
        (op, size) for op in ("pingpong", "all_to_all", "all_gather") for size in (4096, 65536)
    }
    assert expected <= {row["mode"] for row in rows}, report
    assert ("all_to_all", "ring+buf") in {(row["op"], row["mode"]) for row in rows}, report
    assert {row["op"] for row in rows if row["mode"] == "copies"} == {"all_to_all"}, report
    for row in rows:
        assert row["correct"] == ("n/a" if row["mode"] == "copies" else "ok"), row
        assert float(row["median_us"]) > 0 and float(row["bw_GBps"]) > 0
        assert float(row["min_us"]) <= float(row["median_us"]) <= float(row["max_us"])
        if row["mode"] == "torch-gloo":
            assert float(row["ratio_vs_gloo"]) == pytest.approx(1.0)
    assert "the ring against the targets" in proc.stdout, report


def _mode(bench: ModuleType, name: str, kind: str = "commlib") -> object:
    return bench.Mode(name=name, kind=kind, ops={}, barrier=lambda: None, close=lambda: None)


def test_rows_give_half_round_trips_and_ratios_to_the_references(bench: ModuleType) -> None:
    ring, gloo, mpi = (
        _mode(bench, "ring"),
        _mode(bench, "torch-gloo", "reference"),
        _mode(bench, "mpi4py", "reference"),
    )
    results = [
        bench.Result("pingpong", 1 << 20, ring, 20, [4e-4, 5e-4, 6e-4], True),  # round trips
        bench.Result("pingpong", 1 << 20, gloo, 20, [2e-3], True),
        bench.Result("pingpong", 1 << 20, mpi, 20, [4e-4], True),
    ]
    rows = {r["mode"]: r for r in bench.rows_for(results, 2, 3)}
    assert rows["ring"]["median_us"] == "250.0"  # half of the median round trip
    assert (rows["ring"]["min_us"], rows["ring"]["max_us"]) == ("200.0", "300.0")
    assert rows["ring"]["ratio_vs_mpi"] == "1.250" and rows["ring"]["ratio_vs_gloo"] == "0.250"
    assert rows["ring"]["bw_GBps"] == f"{(1 << 20) / 250e-6 / 1e9:.4f}"
    assert list(rows["ring"]) == bench.CSV_COLUMNS
    a2a = bench.rows_for([bench.Result("all_to_all", 4096, ring, 10, [1e-4], True)], 2, 1)[0]
    assert a2a["median_us"] == "100.0" and a2a["ratio_vs_gloo"] == ""


def test_target_lines_say_met_or_not(bench: ModuleType) -> None:
    def row(
        op: str, nbytes: int, vs_mpi: str, vs_gloo: str, mode: str = "ring", us: str = "1.0"
    ) -> dict[str, str]:
        return {
            "mode": mode,
            "op": op,
            "size": bench.format_size(nbytes),
            "size_bytes": str(nbytes),
            "median_us": us,
            "ratio_vs_mpi": vs_mpi,
            "ratio_vs_gloo": vs_gloo,
        }

    lines = bench.target_lines(
        [
            row("pingpong", 4096, "1.5", ""),
            row("pingpong", 1 << 20, "1.5", ""),  # 0.67x MPICH's bandwidth
            row("all_to_all", 1 << 20, "", "0.6"),  # 1.67x Gloo's, no bound measured
            row("all_to_all", 25 << 20, "", "0.25", us="5000.0"),  # 4x Gloo's
            row("all_to_all", 25 << 20, "", "0.2", mode="copies", us="4000.0"),
        ]
    )
    assert lines == [
        "  ping-pong 4 KiB: half round trip 1.50x MPICH's (target <= 2x): met",
        "  send/recv 1 MiB: 0.67x MPICH's bandwidth (target >= 0.8x): NOT met",
        "  all_to_all 1 MiB: 1.67x Gloo's bandwidth (target >= 2x): NOT met",
        "  all_to_all 25 MiB: 4.00x Gloo's bandwidth (target >= 2x): met; 1.25x the time of its copies alone",
    ]


@pytest.mark.parametrize(("rank", "world_size"), [(0, 2), (1, 2), (2, 3)])
def test_copies_bound_moves_every_block_through_the_slot_to_where_it_was(
    bench: ModuleType, rank: int, world_size: int
) -> None:
    """``copies`` makes a two-copy all-to-all's copies: each block lands where it was, a slot at a time."""
    block = bench.SLOT_BYTES // 4 + 13  # two pieces per block: a whole slot, then 13 elements
    inp = torch.arange(block * world_size, dtype=torch.float32)
    out = torch.full_like(inp, -1.0)
    mode = bench.copies_mode(rank, world_size, lambda: None)
    mode.ops["all_to_all"](out, inp)
    assert torch.equal(out, inp)
    assert mode.kind == "bound" and set(mode.ops) == {"all_to_all"}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_p2p_layers_times_every_layer(tmp_path: Path) -> None:
    """``benchmarks/p2p_layers.py``: one short round of each layer's ping-pong, written and printed."""
    reason = mpi_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    csv_path = tmp_path / "layers.csv"
    script = REPO_ROOT / "benchmarks" / "p2p_layers.py"
    args = ["--rounds", "2", "--iters", "20", "--csv", str(csv_path)]
    cmd = [*mpiexec_command(2), sys.executable, str(script), *args]
    proc = run_job(cmd, timeout=240, env=mpiexec_env(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modes = ["mpi4py", "interface", "backend", "links", "bare"]
    printed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert printed == modes, proc.stdout
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    expected = sorted((mode, str(i)) for mode in modes for i in range(2))
    assert sorted((r["mode"], r["round"]) for r in rows) == expected
    assert all(r["size_bytes"] == "4096" and float(r["half_rtt_us"]) > 0 for r in rows), rows


def test_p2p_layers_bare_mode_gives_up_on_a_silent_peer_naming_the_wait(monkeypatch) -> None:
    """The bare ping-pong spins like the ring's doorbell, and like it stops at a deadline."""
    spec = importlib.util.spec_from_file_location("p2p_layers", REPO_ROOT / "benchmarks" / "p2p_layers.py")
    assert spec is not None and spec.loader is not None
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    monkeypatch.setattr(layers, "_BARE_TIMEOUT_S", 0.05)

    class OneRank:  # what _Bare asks of MPI's communicator, for rank 0 alone
        def bcast(self, obj, root):  # type: ignore[no-untyped-def]
            return obj

        def Barrier(self) -> None:  # noqa: N802 - mpi4py's name
            pass

    bare = layers._Bare(OneRank(), 0, torch.zeros(1024))
    with pytest.raises(TimeoutError, match=r"rank 0: the other rank did not post message 1 within 0.05 s"):
        bare.recv()
    with pytest.raises(TimeoutError, match=r"rank 0: the other rank did not take message 1 within 0.05 s"):
        bare.send()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_allreduce_layers_times_every_layer(tmp_path: Path) -> None:
    """``benchmarks/allreduce_layers.py``: one short round of each layer of the mpi all-reduce."""
    reason = mpi_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    csv_path = tmp_path / "layers.csv"
    script = REPO_ROOT / "benchmarks" / "allreduce_layers.py"
    args = ["--rounds", "2", "--iters", "20", "--csv", str(csv_path)]
    cmd = [*mpiexec_command(2), sys.executable, str(script), *args]
    proc = run_job(cmd, timeout=240, env=mpiexec_env(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the check's fingerprints travel over shared memory" in proc.stdout, proc.stdout
    modes = ["mpi4py", "nonblocking", "backend", "interface", "stall", "check", "board"]
    printed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert printed == modes, proc.stdout
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    expected = sorted((mode, str(i)) for mode in modes for i in range(2))
    assert sorted((r["mode"], r["round"]) for r in rows) == expected
    assert all(r["size_bytes"] == "4096" and float(r["us"]) > 0 for r in rows), rows
