"""Start-up refusals and rendezvous attacks: who fails, when, and with the fix in the message.

Each case runs real ranks under a harness deadline well below ``COMMLIB_TIMEOUT``: a rank that only
gave up at the timeout fails the test by that deadline, without any timed assertion. A rank refused for
another job token fails at once; the job's own ranks go on waiting for their peer, and a rank 0 whose
peer never comes names the refused claim at its own (short) deadline.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from commlib.ports import free_port
from tests._launcher import RankOutcome, run_ranks_outcomes
from tests.conftest import REPO_ROOT, scrubbed_env
from tests.distributed import startup_bodies

pytestmark = pytest.mark.multiprocess

LONG_TIMEOUT = "120"
"""COMMLIB_TIMEOUT where the ranks must not wait for it: the harness gives up long before."""
DEADLINE_S = 60.0
RANK_MAIN = Path(__file__).with_name("startup_rank_main.py")


def _reports(outcomes: list[RankOutcome]) -> list[dict[str, Any]]:
    for o in outcomes:
        assert o.ok, f"rank {o.rank}: {o.error}\n{o.traceback}"
    return [o.value for o in outcomes]


# ------------------------------------------------------------ store attacks
def test_a_forged_challenge_in_the_store_fails_both_ranks_by_the_deadline() -> None:
    """A store client replaces rank 0's challenge before rank 1 starts (gloo): once, both ranks looped."""
    rank0, rank1 = _reports(
        run_ranks_outcomes(
            startup_bodies.forged_challenge_job,
            2,
            init=False,
            args=("gloo",),
            env={"COMMLIB_TIMEOUT": "5", "COMMLIB_JOB_TOKEN": "one-job"},
            timeout=DEADLINE_S,
        )
    )
    assert rank0["error_type"] == "RendezvousError", rank0
    assert rank0["error"].startswith("[rank 0/2] gloo.rendezvous: the challenge in the store at 127.0.0.1:")
    assert "was replaced by another process" in rank0["error"] and "MASTER_PORT" in rank0["error"]
    assert rank1["error_type"] == "RendezvousError", rank1
    assert rank1["error"].startswith("[rank 1/2] gloo.rendezvous: rendezvous failed on rank 0: the challenge")


# ------------------------------------------------------------- wrong token
SHORT_TIMEOUT = "6"
"""COMMLIB_TIMEOUT of a rank 0 whose peer never comes: its error at the deadline is the one checked."""


@pytest.mark.waits
@pytest.mark.parametrize("backend", ["ring", "gloo"])
def test_a_wrong_job_token_fails_its_rank_at_once_and_rank_0_names_it_at_the_deadline(backend: str) -> None:
    rank0, rank1 = _reports(
        run_ranks_outcomes(
            startup_bodies.join_and_sum,
            2,
            init=False,
            args=(backend,),
            per_rank_env=[
                {"COMMLIB_JOB_TOKEN": "alpha-secret", "COMMLIB_TIMEOUT": SHORT_TIMEOUT},
                {"COMMLIB_JOB_TOKEN": "beta-secret", "COMMLIB_TIMEOUT": LONG_TIMEOUT},
            ],
            timeout=DEADLINE_S,
        )
    )
    message = rank1["error"]
    assert rank1["error_type"] == "RendezvousError", rank1
    assert message.startswith(f"[rank 1/2] {backend}.rendezvous: rank 0 at 127.0.0.1:")
    assert "refused this rank (pid " in message and "it holds another job token" in message
    assert "Rank 0's job: COMMLIB_JOB_TOKEN (value not shown)" in message
    assert "this rank's job: COMMLIB_JOB_TOKEN (value not shown)" in message
    assert "set COMMLIB_JOB_TOKEN to the same value on every rank" in message
    # Rank 0 waited for a rank 1 of its own until its deadline, then named the claim it refused.
    assert rank0["error_type"] == "RendezvousTimeoutError", rank0
    error = rank0["error"]
    assert error.startswith(f"[rank 0/2] {backend}.rendezvous: timed out after {SHORT_TIMEOUT}.0 s"), error
    assert "ranks [1] never did" in error
    assert "Rank 0 refused 1 claim(s) holding another job token: pid " in error
    assert "claiming rank 1 of world size 2 (its job: COMMLIB_JOB_TOKEN (value not shown)" in error
    assert "Ranks [1] were claimed only with another job token" in error
    assert "set COMMLIB_JOB_TOKEN to the same value on every rank" in error
    assert "secret" not in message + error


@pytest.mark.parametrize("backend", ["ring", "gloo"])
def test_an_impostor_claiming_rank_1_before_it_comes_cannot_stop_the_job(backend: str) -> None:
    """Another job token claims rank 1 first: it fails at once, rank 0 warns, and the job forms and sums."""
    gate = multiprocessing.get_context("forkserver").Event()  # the impostor sets it once refused
    roles = ["rank0", "impostor", "rank1"]
    job = {"COMMLIB_JOB_TOKEN": "the-job", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    rank0, impostor, rank1 = _reports(
        run_ranks_outcomes(
            startup_bodies.impostor_or_rank,
            3,
            init=False,
            per_rank_args=[(role, backend, gate) for role in roles],
            env={"COMMLIB_TIMEOUT": LONG_TIMEOUT},
            per_rank_env=[
                job | {"RANK": "0", "LOCAL_RANK": "0"},
                job | {"RANK": "1", "LOCAL_RANK": "1", "COMMLIB_JOB_TOKEN": "an-impostor"},
                job | {"RANK": "1", "LOCAL_RANK": "1"},
            ],
            timeout=DEADLINE_S,
        )
    )
    assert impostor["error_type"] == "RendezvousError", impostor
    assert "refused this rank (pid " in impostor["error"], impostor
    assert "it holds another job token" in impostor["error"], impostor
    assert rank0.get("sum") == rank1.get("sum") == 3.0, (rank0, rank1)
    refusals = [w for w in rank0["warnings"] if "claiming rank 1 of world size 2" in w]
    assert len(refusals) == 1, rank0["warnings"]
    assert f"refused pid {impostor['pid']} on " in refusals[0], refusals
    assert "its job: COMMLIB_JOB_TOKEN (value not shown)" in refusals[0], refusals
    assert "still waiting for this job's rank 1 until the rendezvous deadline" in refusals[0], refusals


# --------------------------------------------------------- duplicate rank 0
@pytest.mark.parametrize("backend", ["ring", "gloo"])
def test_two_processes_started_as_rank_0_both_say_so(backend: str) -> None:
    reports = _reports(
        run_ranks_outcomes(
            startup_bodies.join_and_sum,
            2,
            init=False,
            args=(backend,),
            env={"COMMLIB_TIMEOUT": LONG_TIMEOUT},
            per_rank_env=[{}, {"RANK": "0", "LOCAL_RANK": "0"}],
            timeout=DEADLINE_S,
        )
    )
    for report in reports:
        assert report["error_type"] == "RendezvousError", report
        assert report["error"].startswith(f"[rank 0/2] {backend}.rendezvous: "), report
        assert "rank 0 is duplicated: two processes announced rank 0 (pids " in report["error"], report
        assert "every rank needs its own RANK, 0..1" in report["error"], report
    assert any("cannot listen on 127.0.0.1:" in r["error"] for r in reports), reports


# ------------------------------------------------------ a wrapper per rank
_EACH_UNDER_ITS_WRAPPER = 'for r in 0 1; do RANK=$r bash -c \'"$0" "$1"; exit $?\' "$PY" "$MAIN" & done; wait'
"""A launch script that starts each rank under a shell of its own (which stays the rank's parent)."""


def _env(port: int, backend: str, timeout: str = LONG_TIMEOUT, **extra: str) -> dict[str, str]:
    return scrubbed_env(
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        COMMLIB_BACKEND=backend,
        COMMLIB_TIMEOUT=timeout,
        OMP_NUM_THREADS="1",
        PY=sys.executable,
        MAIN=str(RANK_MAIN),
        **extra,
    )


def _session(script: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """Run ``script`` in a session of its own (as from a terminal of its own), killed whole on clean-up."""
    return subprocess.Popen(
        ["bash", "-c", script],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _lines(proc: subprocess.Popen[str]) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _kill(proc: subprocess.Popen[str] | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)


@pytest.mark.parametrize("backend", ["ring", "gloo"])
def test_ranks_each_under_its_own_wrapper_form_one_job(backend: str) -> None:
    script = _session(_EACH_UNDER_ITS_WRAPPER, _env(free_port(), backend))
    try:
        results = _lines(script)
    finally:
        _kill(script)
    assert sorted(r["rank"] for r in results) == [0, 1], results
    assert [r.get("sum") for r in results] == [3.0, 3.0], results


@pytest.mark.waits
@pytest.mark.parametrize("backend", ["ring", "gloo"])
def test_ranks_started_in_two_sessions_are_both_told_to_set_the_job_token(backend: str) -> None:
    """Two terminals, one rank in each: nothing says they are one job, and both ranks say what to set.

    The refused rank raises at once. Rank 0 cannot tell it from another job's rank 1 (or from a process
    claiming rank 1 to stop the job): it waits for a rank 1 of its own until its deadline, then names the
    refused claim. Rank 1 starts first (it retries until rank 0 listens), so that it is refused well
    before rank 0's short deadline.
    """
    port = free_port()
    one_rank = '"$PY" "$MAIN"; exit $?'  # the terminal's shell stays the rank's parent and leads its session
    rank1 = _session(one_rank, _env(port, backend, RANK="1"))
    rank0 = None
    try:
        rank0 = _session(one_rank, _env(port, backend, timeout="6", RANK="0"))
        (refused,) = _lines(rank1)
        (leader,) = _lines(rank0)
    finally:
        _kill(rank0)
        _kill(rank1)
    assert refused["error_type"] == "RendezvousError", refused
    assert "it holds another job token" in refused["error"]
    fix = "If these ranks are one job, set COMMLIB_JOB_TOKEN to the same value on every rank"
    assert fix in refused["error"], refused
    assert leader["error_type"] == "RendezvousTimeoutError", leader
    assert leader["error"].startswith(f"[rank 0/2] {backend}.rendezvous: timed out after 6.0 s"), leader
    assert "claiming rank 1 of world size 2 (its job: local job started by pid " in leader["error"], leader
    assert "Ranks [1] were claimed only with another job token" in leader["error"], leader
    assert "(started from another terminal or session, or given another COMMLIB_JOB_TOKEN)" in leader["error"]
    assert "set COMMLIB_JOB_TOKEN to the same value on every rank" in leader["error"], leader


# ------------------------------------------------ explicit ranks, two hosts
def test_explicit_ranks_on_two_hosts_reach_rank_0s_diagnosis_side_channel() -> None:
    """``init_process_group("ring", rank=r, world_size=2, master_addr=<rank 0's host>)``, no launcher vars.

    With explicit ranks nothing says where the ranks run; rank 0 used to serve the side channel on
    loopback, out of rank 1's reach, so DETAIL caught nothing across hosts.
    """
    from tests import _netns

    reason = _netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"separate hosts need network namespaces: {reason}")
    with _netns.separate_hosts(2) as hosts:
        port = free_port()
        reports = _reports(
            run_ranks_outcomes(
                startup_bodies.join_explicitly_on_own_host,
                2,
                backend=None,
                init=False,
                per_rank_args=[
                    (hosts.namespaces[r], hosts.hostnames[r], hosts.addresses[0], port, r) for r in range(2)
                ],
                env={"COMMLIB_DEBUG": "DETAIL", "COMMLIB_TIMEOUT": "20", "COMMLIB_JOB_TOKEN": "two-hosts"},
                timeout=DEADLINE_S,
            )
        )
    for rank, report in enumerate(reports):
        assert report["hostname"] == hosts.hostnames[rank] and report["sum"] == 2.0, report
        assert not [w for w in report["warnings"] if "side channel" in w], report["warnings"]
        assert report["error_type"] == "CollectiveMismatchError", report
        assert report["error"].startswith(f"[rank {rank}/2] ring.all_reduce #"), report["error"]
        assert "each rank's call" in report["error"], report["error"]


def test_a_subgroup_of_explicit_ranks_away_from_rank_0s_host_serves_its_own_side_channel() -> None:
    from tests import _netns

    reason = _netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"separate hosts need network namespaces: {reason}")
    with _netns.separate_hosts(3) as hosts:
        port = free_port()
        reports = _reports(
            run_ranks_outcomes(
                startup_bodies.subgroup_on_other_hosts,
                3,
                backend=None,
                init=False,
                per_rank_args=[
                    (hosts.namespaces[r], hosts.hostnames[r], hosts.addresses[0], port, r) for r in range(3)
                ],
                env={"COMMLIB_DEBUG": "DETAIL", "COMMLIB_TIMEOUT": "20", "COMMLIB_JOB_TOKEN": "three-hosts"},
                timeout=DEADLINE_S,
            )
        )
    assert "error" not in reports[0], reports[0]
    for rank in (1, 2):
        report = reports[rank]
        assert not [w for w in report["warnings"] if "side channel" in w], report["warnings"]
        assert report["error_type"] == "CollectiveMismatchError", report
        assert report["error"].startswith(f"[rank {rank - 1}/2] ring.all_reduce #"), report["error"]
        assert "each rank's call" in report["error"], report["error"]
