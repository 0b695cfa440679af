"""Jobs that must not mix, on the ring and on gloo: two jobs started at once on one port, an impostor with
another job token; and the shared-memory files the ring links through (mode 0600, unlinked once both ends
have them mapped)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from commlib.ports import free_port
from tests._launcher import run_ranks_outcomes
from tests._listeners import port_is_listening, wait_until
from tests.conftest import REPO_ROOT, scrubbed_env

pytestmark = pytest.mark.multiprocess

JOB = Path(__file__).with_name("rendezvous_job_main.py")


# ------------------------------------------------------------------ two jobs
class _Job:
    """A job script run as its own process (its own parent of its ranks), killed with its ranks on exit."""

    def __init__(
        self, port: int, base: int, *, hold: str = "", timeout_s: float = 10.0, backend: str = "ring"
    ) -> None:
        self.base = base
        command = [sys.executable, str(JOB), "--port", str(port), "--base", str(base), "--timeout", "90"]
        command += ["--backend", backend]
        self.proc = subprocess.Popen(
            command + ["--hold", hold],
            cwd=REPO_ROOT,
            env=scrubbed_env(COMMLIB_TIMEOUT=str(timeout_s), OMP_NUM_THREADS="1"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def release(self) -> None:
        """Let the held ranks start their rendezvous."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 120.0) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, f"job {self.base} exited {self.proc.returncode}:\n{err[-4000:]}"
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate(timeout=30)


def _check_own_result_or_loud(job: dict[str, Any], base: int) -> None:
    """Every rank computed its own job's sum, or raised a rendezvous error: never another sum."""
    for rank in job["ranks"]:
        if rank["error"] is None:
            assert rank["value"] == 2 * base + 3, (
                f"job {base}, rank {rank['rank']} paired with another job: {rank}"
            )
        else:
            assert rank["error_type"] in ("RendezvousError", "RendezvousTimeoutError"), rank


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["ring", "gloo"])
def test_two_jobs_on_one_port_never_pair_across_jobs(backend: str) -> None:
    """Job A's rank 0 holds the port while its rank 1 is late; job B starts on the same port meanwhile.

    Before the job token, rank 0 of A took B's rank 1 and both computed 1 + 102 = 103 (ring); on gloo,
    B's rank 1 joined A's store, and A's gloo group formed across the jobs.
    Now B's rank 1 is refused (it names both jobs) and A waits for its own rank 1.
    """
    port = free_port()
    a = _Job(port, 0, hold="1", timeout_s=60, backend=backend)
    b = _Job(
        port, 100, hold="0,1", timeout_s=4, backend=backend
    )  # starts (imports torch) meanwhile, joins when released
    try:
        wait_until(lambda: port_is_listening(port) or a.proc.poll() is not None, 90, "job A's rank 0 listens")
        b.release()
        job_b = b.result()
        a.release()
        job_a = a.result()
    finally:
        for job in (a, b):
            job.kill()
    assert [r["value"] for r in job_a["ranks"]] == [3.0, 3.0], job_a
    b0, b1 = job_b["ranks"]
    assert b0["error_type"] == "RendezvousError" and f"cannot listen on 127.0.0.1:{port}" in b0["error"]
    assert b1["error_type"] == "RendezvousError", b1
    message = b1["error"]
    assert message.startswith(f"RendezvousError: [rank 1/2] {backend}.rendezvous: rank 0 at 127.0.0.1:")
    assert f"rank 0 at 127.0.0.1:{port} (pid " in message and "refused this rank (pid " in message
    assert "it holds another job token" in message
    assert f"Rank 0's job: local job started by pid {job_a['parent']} (python" in message
    assert f"this rank's job: local job started by pid {job_b['parent']} (python" in message
    assert "give each job its own MASTER_PORT" in message and "COMMLIB_JOB_TOKEN" in message


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["ring", "gloo"])
def test_two_jobs_started_at_once_on_one_port_each_compute_their_own_sum_or_fail(backend: str) -> None:
    port = free_port()
    jobs = [_Job(port, 0, timeout_s=6, backend=backend), _Job(port, 100, timeout_s=6, backend=backend)]
    try:
        results = [job.result() for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    for job, result in zip(jobs, results, strict=True):
        _check_own_result_or_loud(result, job.base)


# ------------------------------------------------------------------ impostor
def _rank_with_log(gate: Any, release: Any, backend: str) -> dict[str, Any]:
    """Join the group (after ``gate``, if any), all-reduce rank + 1; return the sum and WARNINGs logged."""
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.getMessage()}")

    logging.getLogger("commlib").addHandler(_Keep(logging.WARNING))
    import commlib

    if gate is not None and not gate.wait(60):
        raise TimeoutError("never released")
    if release is not None:  # the impostor: its short timeout starts once rank 0 listens
        port = int(os.environ["MASTER_PORT"])
        wait_until(lambda: port_is_listening(port), 60, "rank 0 listens")
    try:
        group = commlib.init_process_group(backend)
    except commlib.RendezvousError:
        if release is not None:
            release.set()
        raise
    try:
        t = torch.tensor([float(group.rank + 1)])
        group.all_reduce(t)
        return {"sum": t.item(), "log": records}
    finally:
        commlib.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["ring", "gloo"])
def test_an_impostor_with_another_token_is_refused_and_the_job_waits_for_its_rank(backend: str) -> None:
    """A process claims rank 1 with another COMMLIB_JOB_TOKEN before the real rank 1 starts."""
    impostor_refused = multiprocessing.get_context("spawn").Event()
    outcomes = run_ranks_outcomes(
        _rank_with_log,
        3,
        init=False,
        per_rank_args=[
            (None, None, backend),
            (impostor_refused, None, backend),
            (None, impostor_refused, backend),
        ],
        env={"WORLD_SIZE": "2", "COMMLIB_JOB_TOKEN": "alpha-secret", "COMMLIB_TIMEOUT": "60"},
        per_rank_env=[
            {},
            {},
            {"RANK": "1", "LOCAL_RANK": "1", "COMMLIB_JOB_TOKEN": "beta-secret", "COMMLIB_TIMEOUT": "3"},
        ],
        timeout=150,
    )
    rank0, rank1, impostor = outcomes
    assert rank0.ok and rank1.ok, (rank0, rank1)
    assert rank0.value["sum"] == rank1.value["sum"] == 3.0
    assert impostor.error_type == "RendezvousError"
    message = impostor.error or ""
    assert "refused this rank (pid " in message and "it holds another job token" in message
    assert "Rank 0's job: COMMLIB_JOB_TOKEN (value not shown)" in message
    assert "this rank's job: COMMLIB_JOB_TOKEN (value not shown)" in message
    assert "secret" not in message
    warnings = [line for line in rank0.value["log"] if "another job token" in line]
    where = "rendezvous port" if backend == "ring" else "store at"
    assert warnings and warnings[0].startswith(f"WARNING [rank 0/2] {backend}.rendezvous: {where} 127.0.0.1:")
    assert "claiming rank 1 holds another job token" in warnings[0]
    assert "still waiting for this job's rank 1" in warnings[0]
    assert not any("secret" in line for line in rank0.value["log"])


# ------------------------------------------------------------ shared memory
def _shm_files(group: Any, shm_dir: str) -> dict[str, Any]:
    """What this rank sees of its shared-memory inbox files once a collective has run.

    A rank may return from set-up a moment before its neighbour has read that the inbox is mapped
    at both ends and unlinked it; after a collective, every set-up message has been read.
    """
    t = torch.full((1000,), float(group.rank + 1))
    group.all_reduce(t)
    mapped = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(os.path.join(shm_dir, "commlib-ring-")):
                st = os.stat(f"/proc/self/map_files/{fields[0]}")
                mapped.append({"path": fields[5].strip(), "mode": st.st_mode & 0o777, "links": st.st_nlink})
    return {"left_in_dir": sorted(os.listdir(shm_dir)), "mapped": mapped, "sum": t[0].item()}


@pytest.mark.timeout(120)
def test_shared_memory_files_are_private_and_gone_once_mapped(tmp_path: Path) -> None:
    world = 3
    outcomes = run_ranks_outcomes(
        _shm_files,
        world,
        args=(str(tmp_path),),
        env={"COMMLIB_RING_TRANSPORT": "shm", "COMMLIB_RING_SHM_DIR": str(tmp_path), "COMMLIB_TIMEOUT": "30"},
        timeout=90,
    )
    for o in outcomes:
        assert o.ok, o.error
        assert o.value["sum"] == 6.0
        assert o.value["left_in_dir"] == []  # unlinked by the time the group exists
        # Each rank maps its own inbox and its right neighbour's: two files, each mode 0600, no name left.
        assert len(o.value["mapped"]) == 2, o.value["mapped"]
        for m in o.value["mapped"]:
            assert m["mode"] == 0o600 and m["links"] == 0 and m["path"].endswith("(deleted)"), m
    assert os.listdir(tmp_path) == []
