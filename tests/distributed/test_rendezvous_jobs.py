"""Jobs that must not mix, on the ring and on gloo: two jobs started at once on one port, an impostor with
another job token; and the shared-memory files the ring links through (mode 0600, unlinked once both ends
have them mapped)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from commlib.ports import free_port
from tests._launcher import run_ranks_outcomes
from tests._listeners import port_is_listening, wait_until
from tests._strangers import stranger_first
from tests.conftest import REPO_ROOT, scrubbed_env
from tests.distributed.startup_bodies import join_and_sum

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

    def stderr_until(self, text: str, timeout: float) -> list[str]:
        """Read the job's stderr line by line until a line holds ``text``; return the lines read.

        The rest is read by ``result``.
        """
        assert self.proc.stderr is not None
        lines: list[str] = []
        found = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:  # type: ignore[union-attr]
                lines.append(line)
                if text in line:
                    found.set()
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert found.wait(timeout), f"job {self.base} never wrote {text!r}:\n{''.join(lines)[-3000:]}"
        self._read_err = "".join(lines)
        return lines

    _read_err = ""

    def release(self) -> None:
        """Let the held ranks start their rendezvous."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 120.0) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=timeout)
        err = self._read_err + err
        assert self.proc.returncode == 0, f"job {self.base} exited {self.proc.returncode}:\n{err[-4000:]}"
        return json.loads(out.strip().splitlines()[-1]) | {"stderr": err}

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
    """Job A's rank 0 holds the port while its rank 1 is held back; job B starts on the same port meanwhile.

    Before the job token, rank 0 of A took B's rank 1 and both computed 1 + 102 = 103 (ring); on gloo,
    B's rank 1 joined A's store, and A's gloo group formed across the jobs.
    Now B's rank 1 is refused (it names both jobs), and A's rank 0 logs the refusal and goes on waiting
    for its own rank 1, released as soon as A's rank 0 has said whom it refused.
    """
    port = free_port()
    a = _Job(port, 0, hold="1", timeout_s=60, backend=backend)
    b = _Job(
        port, 100, hold="0,1", timeout_s=4, backend=backend
    )  # starts (imports torch) meanwhile, joins when released
    try:
        wait_until(lambda: port_is_listening(port) or a.proc.poll() is not None, 90, "job A's rank 0 listens")
        b.release()
        a.stderr_until("claiming rank 1 of world size 2", 90)
        a.release()
        job_b = b.result()
        job_a = a.result()
    finally:
        for job in (a, b):
            job.kill()
    assert [r["value"] for r in job_a["ranks"]] == [3.0, 3.0], job_a
    # Job A's rank 0 said whom it refused, and went on waiting for its own rank.
    warnings = [line for line in job_a["stderr"].splitlines() if "claiming rank 1 of world size 2" in line]
    where = "rendezvous port" if backend == "ring" else "store at"
    assert warnings, job_a["stderr"][-3000:]
    assert warnings[0].startswith(f"[rank 0/2] {backend}.rendezvous: {where} 127.0.0.1:"), warnings
    assert "claiming rank 1 of world size 2 (its job: local job started by pid " in warnings[0]
    assert "it holds another job token" in warnings[0]
    assert "still waiting for this job's rank 1 until the rendezvous deadline" in warnings[0]
    b0, b1 = job_b["ranks"]
    # Job B's rank 0 finds the port held by A, or, when it reaches it after A has finished and let it
    # go, waits in vain for its rank 1 (refused by A): loud either way, never a sum across the jobs.
    if b0["error_type"] == "RendezvousError":
        assert f"cannot listen on 127.0.0.1:{port}" in b0["error"], b0
    else:
        assert b0["error_type"] == "RendezvousTimeoutError", b0
        assert "1/2 ranks arrived; ranks [1] never did" in b0["error"], b0
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


# One rank of a ring job under torchrun's agent store, which the test process serves in its place.
_AGENT_STORE_RANK = """
import torch, commlib
group = commlib.init_process_group("ring")
t = torch.tensor([group.rank + 1.0])
group.all_reduce(t)
print("SUM", t.item(), flush=True)
commlib.destroy_process_group()
"""


@pytest.mark.waits
@pytest.mark.timeout(240)
def test_under_torchrun_s_store_a_rank_with_another_token_waits_alone_and_the_job_forms() -> None:
    """A process with another job token claims rank 1 first in torchrun's store: it alone fails.

    It waits in its own token's part of the store, warns at once that only another token's rank 0
    is there, and fails at its own deadline; this job's rank 1, started after it has ended, joins,
    and the job sums 1 + 2.
    """
    from torch.distributed import TCPStore

    port = free_port()
    agent = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def rank(r: int, token: str) -> subprocess.Popen[str]:
        torchrun = {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"}
        torchrun |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        torchrun["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        return subprocess.Popen(
            [sys.executable, "-c", _AGENT_STORE_RANK],
            cwd=REPO_ROOT,
            env=scrubbed_env(
                **torchrun,
                COMMLIB_JOB_TOKEN=token,
                COMMLIB_TIMEOUT="60" if token == "ours" else "3",
                PYTHONPATH=str(REPO_ROOT),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def rank0_in(store: Any = agent) -> None:
        wait_until(
            lambda: store.check(["commlib/job-check/v1/present/rank0/1"]), 60, "rank 0 is in the store"
        )

    try:
        stray, ours = stranger_first(rank, rank0_in)
    finally:
        del agent
    assert stray.returncode != 0 and "SUM" not in stray.out
    assert (
        "RendezvousTimeoutError: [rank 1/2] ring.rendezvous: no rank 0 holding this job's token "
        "(COMMLIB_JOB_TOKEN (value not shown)"
    ) in stray.err, stray.err[-2000:]
    assert f"came to torchrun's store at 127.0.0.1:{port} within 3.0 s. Under another job token" in stray.err
    assert "no rank 0 of this job's token has come to the store in 0." in stray.err  # a quarter of 3 s
    assert stray.err.count("claiming rank 0 of world size 2") == 2  # in the warning and in the error
    for finished in ours:
        assert finished.returncode == 0 and "SUM 3.0" in finished.out, finished.err[-3000:]


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


def _exited_process() -> tuple[int, int]:
    """The pid and start time (clock ticks) of a process that has exited."""
    code = "import os; from commlib.procfs import read_process as r; print(os.getpid(), r(os.getpid()).start)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    pid, start = out.stdout.split()
    return int(pid), int(start)


@pytest.mark.timeout(120)
def test_a_group_start_reaps_the_files_of_ranks_killed_inside_link_set_up(tmp_path: Path) -> None:
    """Files a killed rank left (its inbox and wake pipes) go; a live process's, and others', stay."""
    from backends.ring.shm_files import new_path
    from commlib.procfs import read_process

    namespace = os.stat("/proc/self/ns/pid").st_ino
    dead_pid, dead_start = _exited_process()
    dead = f"commlib-ring-{namespace}-{dead_pid}-{dead_start}-0123456789ab"
    live = os.path.basename(new_path(str(tmp_path)))  # this (live) process's
    init = read_process(1)
    assert init is not None
    reused = f"commlib-ring-{namespace}-1-{init.start + 1}-0123456789ab"  # pid 1, but not the process now
    foreign = f"commlib-ring-{namespace + 1}-{dead_pid}-{dead_start}-0123456789ab"  # another pid namespace
    old_style = f"commlib-ring-{dead_pid}-0123456789ab"  # no start time, no namespace: whose is unknown
    stale = [dead, f"{dead}.wake-recv", f"{dead}.wake-send", reused]
    kept = [live, f"{live}.wake-send", foreign, old_style]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"")
    outcomes = run_ranks_outcomes(
        join_and_sum,
        2,
        init=False,
        args=("ring",),
        env={"COMMLIB_RING_TRANSPORT": "shm", "COMMLIB_RING_SHM_DIR": str(tmp_path), "COMMLIB_TIMEOUT": "30"},
        timeout=90,
    )
    for o in outcomes:
        assert o.ok and o.value["sum"] == 3.0, (o.error, o.value)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


# ------------------------------------------------------------ a group after another
def _next_group_meets_the_end_of_the_last(fifo: str, drop: bool) -> float:
    """Rank 1 starts the next gloo group while rank 0 still serves the last group's store.

    Rank 0 destroys its group only once rank 1 has read the end of that group's check and
    paused to connect again (its pause writes to ``fifo``); then both make the next group.
    ``drop``: the first read of the challenge after that pause fails as it does when the last
    group's server closes under it (torch's "Failed to recv, got 0 bytes").
    """
    import select
    import types

    import commlib
    from backends.common import store_rendezvous

    group = commlib.init_process_group("gloo", timeout=30)
    group.barrier()
    if group.rank == 1:
        group.close()  # closed alone: destroy_process_group's barrier would wait for rank 0
        commlib.destroy_process_group()
        told: list[bool] = []

        def pause(seconds: float) -> None:
            if not told:
                fd = os.open(fifo, os.O_WRONLY)
                os.write(fd, b"x")
                os.close(fd)
                told.append(True)
            time.sleep(seconds)

        store_rendezvous.time = types.SimpleNamespace(sleep=pause, monotonic=time.monotonic)  # type: ignore[assignment]
        if drop:
            real_get = store_rendezvous._get

            def get_dropped_once(store: Any, key: str, wait: Any) -> bytes:
                if told and len(told) == 1 and key.endswith("/challenge"):
                    told.append(True)
                    raise torch.distributed.DistNetworkError("Failed to recv, got 0 bytes.")
                return real_get(store, key, wait)

            store_rendezvous._get = get_dropped_once  # type: ignore[assignment]
    else:
        fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer of its own: never an end-of-file
        try:
            ready, _, _ = select.select([fd], [], [], 20.0)
            if not ready or os.read(fd, 1) != b"x":
                raise AssertionError("rank 1 never paused at the end of the last group's check")
        finally:
            os.close(fd)
        commlib.destroy_process_group()
    group = commlib.init_process_group("gloo", timeout=30)
    t = torch.full((1,), float(group.rank + 1))
    group.all_reduce(t)
    commlib.destroy_process_group()
    return t.item()


@pytest.mark.parametrize("drop", [False, True], ids=["ends-before-a-read", "ends-mid-read"])
def test_a_rank_that_reaches_the_last_groups_store_waits_for_the_next(tmp_path: Path, drop: bool) -> None:
    """Re-creating a group: a rank faster than rank 0 finds its old store, and must not answer it.

    Without rank 0 closing its check, rank 1 answered the old challenge, waited for a verdict
    nobody would give, and failed when the old store closed, while rank 0 timed out. Once rank 1
    has seen that end, the old server closing while rank 1 reads it is not rank 0 leaving: rank 1
    connects again (before, it failed with "rank 0 dropped the rendezvous", and rank 0 timed out).
    """
    fifo = tmp_path / "paused"
    os.mkfifo(fifo)
    outcomes = run_ranks_outcomes(
        _next_group_meets_the_end_of_the_last, 2, backend=None, init=False, args=(str(fifo), drop), timeout=90
    )
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    assert [o.value for o in outcomes] == [3.0, 3.0]
