"""Smoke tests of the diagnosis benchmarks: they run on 2 ranks and print their tables."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, mpi_unavailable_reason, mpiexec_command, mpiexec_env, run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    try:
        proc = run_job(cmd, timeout=timeout, env=mpiexec_env(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"benchmark did not finish within {timeout} s:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_diagnosis_overhead_prints_every_mode() -> None:
    script = str(REPO_ROOT / "benchmarks" / "diagnosis_overhead.py")
    args = ["--sizes", "4K", "--rounds", "1", "--async-too"]
    if mpi_unavailable_reason() is None:
        cmd = [*mpiexec_command(2), sys.executable, script, "--backends", "ring,mpi", *args]
        backends = {"ring", "mpi"}
    else:
        cmd = [sys.executable, script, "--spawn", "2", "--backends", "ring", *args]
        backends = {"ring"}
    rows = [
        line.split()
        for line in _run(cmd).stdout.splitlines()
        if line.split()[:1] and line.split()[1:2] == ["4096"]
    ]
    modes = {(row[0], row[2]) for row in rows}
    for backend in backends:
        for mode in ("off", "default", "stall", "detail", "flight"):
            assert (backend, mode) in modes and (backend, f"{mode}-async") in modes, modes
    assert all(float(row[3]) > 0 for row in rows)


@pytest.mark.waits
def test_failure_times_reports_every_case() -> None:
    script = str(REPO_ROOT / "benchmarks" / "failure_times.py")
    cmd = [sys.executable, script, "--spawn", "2", "--backends", "ring", "--timeout", "3", "--late", "2"]
    out = _run(cmd).stdout
    lines = [line for line in out.splitlines() if line.startswith("ring ")]
    assert len(lines) == 14, out
    assert sum("CollectiveMismatchError" in line for line in lines) == 12, out
    assert "has waited 1 s (COMMLIB_STALL_S=1)" in out
    assert "CommTimeoutError: [rank 0/2] ring.all_reduce" in out
