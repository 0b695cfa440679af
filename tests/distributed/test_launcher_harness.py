"""The test launchers themselves: a stuck rank is reported with its stacks, a pool that cannot start fails
fast, a job past its timeout is killed with every process it started."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import pytest

from tests import _launcher
from tests._launcher import RankPool, RanksFailed, run_ranks_outcomes
from tests.conftest import run_job
from tests.distributed.env_at_import import seen_at_import

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits]


def hang_in_a_named_function(rank_to_hang: int) -> str:
    import os

    if int(os.environ["RANK"]) == rank_to_hang:
        threading.Event().wait()  # never set: the launcher must kill this rank
    return "done"


@pytest.mark.timeout(60)
def test_a_stuck_rank_is_reported_with_where_it_was_stuck() -> None:
    outcomes = run_ranks_outcomes(hang_in_a_named_function, 2, args=(1,), init=False, timeout=10)
    assert outcomes[0].ok and outcomes[0].value == "done"
    stuck = outcomes[1]
    assert stuck.timed_out and not stuck.ok
    assert stuck.traceback is not None and stuck.traceback.startswith(
        "Python stacks of rank 1 when it was killed:"
    )
    assert "hang_in_a_named_function" in stuck.traceback
    report = _launcher.describe_failures(outcomes)
    assert "rank 1: timed out (killed)\nPython stacks of rank 1" in report
    assert "rank 0" not in report


@pytest.mark.timeout(60)
def test_a_ranks_environment_is_set_before_its_function_is_imported() -> None:
    """A test module that asks torch about CUDA at import fixes the devices the process sees, so
    ``CUDA_VISIBLE_DEVICES`` given to the ranks must be set before the function's module is imported."""
    outcomes = run_ranks_outcomes(
        seen_at_import, 2, init=False, env={"COMMLIB_TEST_AT_IMPORT": "the rank's"}, timeout=30
    )
    assert [o.value for o in outcomes] == ["the rank's", "the rank's"], _launcher.describe_failures(outcomes)


@pytest.mark.timeout(90)
def test_a_pool_whose_rank_0_cannot_listen_fails_without_waiting_for_the_others(monkeypatch) -> None:
    """Rank 0 cannot bind the port (a silent listener holds it); rank 1, connected to that listener,
    would wait for its whole start timeout: the pool gives up 2 s after rank 0's error instead."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", _launcher.free_port()))
        squatter.listen(8)
        port = squatter.getsockname()[1]
        monkeypatch.setattr(_launcher, "free_port", lambda: port)
        pool = RankPool(2, "ring", env={"COMMLIB_TIMEOUT": "600"}, start_timeout=600)
        with pytest.raises(RanksFailed) as failed:
            pool.run(hang_in_a_named_function, -1)
    message = str(failed.value)
    assert message.startswith(
        "RankPool(ring, 2) failed to start:\nrank 0: RendezvousError: [rank 0/2] ring.rendezvous: "
    )
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in message
    assert "rank 1: timed out (killed)\nPython stacks of rank 1 when it was killed:" in message
    assert "rendezvous" in message.split("rank 1: timed out")[1]


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its new parent to reap it counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
def test_a_job_past_its_timeout_is_killed_with_every_process_it_started() -> None:
    """``run_job`` kills the launcher's whole session, not just the launcher (``subprocess.run``'s way)."""
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        run_job(["bash", "-c", "sleep 600 & echo $!; wait"], timeout=2)
    rank_pid = int(expired.value.stdout.split()[0])
    # The killed process closes its end of the output pipe (which lets run_job return) a moment
    # before the kernel marks it dead: give the exit a bounded moment to finish.
    deadline = time.monotonic() + 5.0
    while _alive(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(rank_pid), f"process {rank_pid}, started by the job, survived the timeout"
