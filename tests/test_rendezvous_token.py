"""The job token: where it comes from, that two jobs differ and one job agrees, and that it is never shown."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from backends.common.jobtoken import JobToken, job_token, sign_with, verify_with
from commlib.env import DistEnv

REMOTE = "10.1.2.3"  # not this host: no local identity applies


def _env(rank: int = 1, launcher: str = "torchrun", addr: str = "127.0.0.1", started_by: str = "") -> DistEnv:
    return DistEnv(
        rank=rank, world_size=4, master_addr=addr, master_port=29500, launcher=launcher, started_by=started_by
    )


def test_an_explicit_token_is_shared_by_its_job_and_never_shown() -> None:
    a0 = job_token(_env(0, addr=REMOTE), {"COMMLIB_JOB_TOKEN": "s3cret-alpha"})
    a1 = job_token(_env(1, "slurm"), {"COMMLIB_JOB_TOKEN": "s3cret-alpha", "SLURM_JOB_ID": "7"})
    b1 = job_token(_env(1), {"COMMLIB_JOB_TOKEN": "s3cret-beta"})
    assert a0.key == a1.key != b1.key
    for token in (a0, a1, b1):
        assert "s3cret" not in token.identity and "s3cret" not in repr(token)
        assert token.identity.startswith("COMMLIB_JOB_TOKEN (value not shown), started by pid ")
        assert "rendezvous " in token.identity


@pytest.mark.parametrize(
    ("launcher", "job", "other_job", "shown"),
    [
        (
            "torchrun",
            {"TORCHELASTIC_RUN_ID": "run-a"},
            {"TORCHELASTIC_RUN_ID": "run-b"},
            "TORCHELASTIC_RUN_ID=run-a",
        ),
        ("openmpi", {"OMPI_MCA_ess_base_jobid": "4242"}, {"OMPI_MCA_ess_base_jobid": "4243"}, "jobid=4242"),
        (
            "pmix",
            {"PMIX_NAMESPACE": "prterun-vm-1@1"},
            {"PMIX_NAMESPACE": "prterun-vm-2@1"},
            "prterun-vm-1@1",
        ),
        (
            "slurm",
            {"SLURM_JOB_ID": "900", "SLURM_STEP_ID": "0"},
            {"SLURM_JOB_ID": "900", "SLURM_STEP_ID": "1"},
            "SLURM_JOB_ID=900 SLURM_STEP_ID=0",
        ),
    ],
)
def test_the_launchers_job_id_makes_the_token(launcher: str, job: dict, other_job: dict, shown: str) -> None:
    rank1 = job_token(_env(1, launcher, REMOTE), job)
    rank3 = job_token(_env(3, launcher, "127.0.0.1"), job)  # the rank and the address do not enter it
    other = job_token(_env(1, launcher, REMOTE), other_job)
    assert rank1.key == rank3.key != other.key
    assert shown in rank1.identity and rank1.distinguishes_jobs


def test_only_the_launcher_that_set_the_ranks_counts() -> None:
    """torchrun started inside a Slurm allocation: SLURM_JOB_ID is inherited, TORCHELASTIC_RUN_ID decides."""
    inside = job_token(_env(1, "torchrun", REMOTE), {"SLURM_JOB_ID": "5", "TORCHELASTIC_RUN_ID": "r1"})
    assert inside.identity.startswith("TORCHELASTIC_RUN_ID=r1,") and "SLURM" not in inside.identity


def test_torchruns_default_run_id_is_no_job_id() -> None:
    token = job_token(_env(1, "torchrun", REMOTE), {"TORCHELASTIC_RUN_ID": "none"})
    assert not token.distinguishes_jobs
    assert token.identity.startswith("no job id (COMMLIB_JOB_TOKEN unset, no launcher job id)")


def test_without_any_id_a_local_job_is_the_process_that_started_it() -> None:
    token = job_token(_env(1, "explicit"), {})
    leader = os.getpgrp()  # the process group's leader: the shell's job, or a launcher's parent process
    if leader == os.getpid() == os.getsid(0):  # it leads a session of its own: its parent started it
        leader = os.getppid()
    try:
        with open(f"/proc/{leader}/comm") as f:
            leader_name = f.read().strip()
    except FileNotFoundError:  # the leader has exited (a background job whose shell ended)
        leader_name = "?"
    assert token.identity.startswith(f"local job started by pid {leader} ({leader_name}), rendezvous ")
    assert token.accepted[0] == token.key
    assert job_token(_env(2, "explicit"), {}).key == token.key


_CHILD = (
    "import sys; sys.path.insert(0, {root!r});"
    "from backends.common.jobtoken import job_token; from commlib.env import DistEnv;"
    "print(job_token(DistEnv(rank=1, world_size=2, launcher='explicit'), {{}}).key.hex())"
)


def _child_key(*wrapper: str, new_session: bool = False) -> bytes:
    code = _CHILD.format(root=os.getcwd())
    out = subprocess.run(
        [*wrapper, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=new_session,
    )
    assert out.returncode == 0, out.stderr
    return bytes.fromhex(out.stdout.strip())


def test_ranks_started_by_rank_0_or_each_under_its_own_wrapper_are_one_job() -> None:
    rank0 = job_token(_env(0, "explicit"), {})
    assert _child_key() in rank0.accepted  # this process started the child
    # Each rank under a wrapper of its own (a shell that stays its parent): still the same job.
    assert _child_key("bash", "-c", '"$0" "$@"; exit $?') in rank0.accepted


_LAUNCH_IN_SESSIONS = (
    "import subprocess, sys;"
    "procs = [subprocess.run([sys.executable, '-c', sys.argv[1]], capture_output=True, text=True,"
    " timeout=60, start_new_session=True) for _ in range(2)];"
    "print(' '.join(p.stdout.strip() for p in procs))"
)
"""A launcher that starts each rank in a session of its own (as torchrun and mpirun do); prints their keys."""


def _keys_of_ranks_launched_in_sessions(*wrapper: str) -> list[str]:
    child = _CHILD.format(root=os.getcwd())
    out = subprocess.run(
        [*wrapper, sys.executable, "-c", _LAUNCH_IN_SESSIONS, child],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert out.returncode == 0, out.stderr
    keys = out.stdout.split()
    assert len(keys) == 2, out.stdout
    return keys


def test_ranks_a_launcher_starts_each_in_a_session_of_its_own_are_one_job() -> None:
    """torchrun and mpirun start every rank with setsid: their parent, not the session, is the job."""
    first = _keys_of_ranks_launched_in_sessions()
    assert first[0] == first[1]
    # Another launch (from another terminal, whose shell stays the launcher's parent): another job.
    second = _keys_of_ranks_launched_in_sessions("bash", "-c", '"$0" "$@"; exit $?')
    assert second[0] == second[1] != first[0]


def test_a_rank_in_its_own_session_accepts_the_ranks_it_starts_itself() -> None:
    """``setsid python train.py`` as rank 0, whose ranks 1.. are its children in its process group."""
    code = (
        f"import subprocess, sys; sys.path.insert(0, {os.getcwd()!r});"
        "from backends.common.jobtoken import job_token; from commlib.env import DistEnv;"
        "rank0 = job_token(DistEnv(rank=0, world_size=2, launcher='explicit'), {});"
        "child = subprocess.run([sys.executable, '-c', sys.argv[1]], capture_output=True, timeout=60);"
        "print(bytes.fromhex(child.stdout.decode().strip()) in rank0.accepted,"
        " rank0.accepted[0] != rank0.accepted[-1])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, _CHILD.format(root=os.getcwd())],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def test_a_rank_started_from_another_terminal_is_another_job() -> None:
    """A terminal's shell leads its session; a rank it starts (not in a session of its own) is its job."""
    rank0 = job_token(_env(0, "explicit"), {})
    assert _child_key("bash", "-c", '"$0" "$@"; exit $?', new_session=True) not in rank0.accepted
    assert _child_key("bash", "-c", '"$0" "$@"; exit $?', new_session=True) != _child_key(
        "bash", "-c", '"$0" "$@"; exit $?', new_session=True
    )


@pytest.mark.parametrize(
    ("started_by", "environ", "shown"),
    [
        ("torchrun", {"TORCHELASTIC_RUN_ID": "run-a"}, "TORCHELASTIC_RUN_ID=run-a"),
        ("openmpi", {"OMPI_MCA_ess_base_jobid": "4242"}, "OMPI_MCA_ess_base_jobid=4242"),
        ("slurm", {"SLURM_JOB_ID": "900", "SLURM_STEP_ID": "0"}, "SLURM_JOB_ID=900 SLURM_STEP_ID=0"),
    ],
)
def test_ranks_passed_as_arguments_follow_the_launcher_they_run_under(
    started_by: str, environ: dict, shown: str
) -> None:
    by_argument = job_token(_env(1, "explicit", REMOTE, started_by=started_by), environ)
    by_environment = job_token(_env(1, started_by, REMOTE), environ)
    assert by_argument.key == by_environment.key and by_argument.identity.startswith(shown)


def test_detect_says_which_launcher_a_process_runs_under_whichever_way_its_rank_came() -> None:
    from commlib.env import detect

    mpich = {"PMI_RANK": "1", "PMI_SIZE": "2"}
    assert detect(rank=1, world_size=2, environ=mpich).started_by == "mpich"
    assert detect(rank=1, world_size=2, environ=mpich).launcher == "explicit"
    assert detect(environ=mpich).started_by == "mpich"
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}
    assert detect(rank=0, world_size=2, environ=torchrun).started_by == "torchrun"
    assert detect(rank=0, world_size=2, environ={}).started_by == "explicit"


def test_a_remote_job_without_ids_keeps_strangers_out_but_cannot_tell_jobs_apart() -> None:
    a = job_token(_env(1, "explicit", REMOTE), {})
    b = job_token(_env(2, "explicit", REMOTE), {})
    assert a.key == b.key and not a.distinguishes_jobs


def test_proofs_hold_only_for_the_same_key_and_the_same_words() -> None:
    token = JobToken(key=b"k" * 32, identity="test job", accepted=(b"k" * 32, b"c" * 32))
    proof = token.sign("join", "nonce-1", {"rank": 1})
    assert len(proof) == 64 and "k" * 8 not in proof
    assert verify_with(b"k" * 32, proof, "join", "nonce-1", {"rank": 1})
    assert not verify_with(b"x" * 32, proof, "join", "nonce-1", {"rank": 1})
    assert not verify_with(b"k" * 32, proof, "join", "nonce-2", {"rank": 1})
    assert not verify_with(b"k" * 32, proof, "join", "nonce-1", {"rank": 2})
    assert not verify_with(b"k" * 32, None, "join", "nonce-1", {"rank": 1})
    assert token.matching_key(sign_with(b"c" * 32, "x"), "x") == b"c" * 32
    assert token.matching_key(sign_with(b"z" * 32, "x"), "x") is None
    assert token.matching_key(12, "x") is None


def test_under_torchrun_s_store_the_starting_process_does_not_count() -> None:
    """The agent's store serves one job; its entry point may be a wrapper script per rank."""
    token = job_token(_env(1, "torchrun"), {}, local_parent=False)
    assert not token.distinguishes_jobs and token.identity.startswith("no job id")
    assert job_token(
        _env(1, "torchrun"), {"TORCHELASTIC_RUN_ID": "r9"}, local_parent=False
    ).distinguishes_jobs


def _refusals(timeout: float = 60.0):  # type: ignore[no-untyped-def]
    import time

    from backends.common.admission import Refusals, RendezvousContext

    env = DistEnv(rank=0, world_size=3, master_addr="127.0.0.1", master_port=29500, launcher="explicit")
    token = JobToken(key=b"k" * 32, identity="this job's description", accepted=(b"k" * 32,))
    ctx = RendezvousContext(env, "[rank 0/3] ring.rendezvous: ", time.monotonic() + timeout, timeout, token)
    return Refusals(ctx)


def _claim(rank: int = 1, pid: int = 4242, address: str = "127.0.0.1:35896"):  # type: ignore[no-untyped-def]
    from backends.common.admission import Claim

    return Claim(rank, 3, pid, "vm", "another job's description", address=address)


def test_a_refused_claim_is_logged_at_warning_once_and_rank_0_keeps_waiting() -> None:
    refusals = _refusals()
    level, text = refusals.add(_claim(), missing={1, 2})
    assert level == logging.WARNING
    assert text.startswith(
        "refused pid 4242 on vm (from 127.0.0.1:35896) claiming rank 1 of world size 3 (its job: another "
        "job's description): it holds another job token (this job: this job's description); still waiting "
        "for this job's rank 1 until the rendezvous deadline ("
    )
    assert "set COMMLIB_JOB_TOKEN to the same value on every rank" in text
    assert "give each job its own MASTER_PORT" in text
    # The same process again (a new connection): logged at DEBUG, named once, counted twice.
    level, _ = refusals.add(_claim(address="127.0.0.1:35900"), missing={1, 2})
    assert level == logging.DEBUG
    assert refusals.claims == [_claim()] and refusals.count == 2


def test_what_rank_0_says_it_does_after_a_refusal() -> None:
    refusals = _refusals()
    assert refusals.add(_claim(rank=1), missing={2})[1].endswith("this job's rank 1 is in already")
    assert "it claimed rank 0, which this process is" in refusals.add(_claim(rank=0, pid=1), missing={2})[1]
    assert refusals.add(_claim(rank=7, pid=2), missing={2})[1].endswith(
        "this job has no rank 7 (world size 3)"
    )


def test_a_flood_of_refused_claims_is_warned_about_a_bounded_number_of_times() -> None:
    from backends.common.admission import MAX_WARNED_CLAIMS

    refusals = _refusals()
    levels = [refusals.add(_claim(pid=pid), missing={1})[0] for pid in range(3 * MAX_WARNED_CLAIMS)]
    assert levels.count(logging.WARNING) == MAX_WARNED_CLAIMS
    assert len(refusals.claims) == MAX_WARNED_CLAIMS and refusals.count == 3 * MAX_WARNED_CLAIMS
    assert f"and {2 * MAX_WARNED_CLAIMS} more refusal(s)" in refusals.summary([1])


def test_the_timeout_error_names_the_refused_claims_and_the_fix() -> None:
    from backends.common.admission import missing_ranks_message

    refusals = _refusals()
    env = DistEnv(rank=0, world_size=3, master_addr="127.0.0.1", master_port=29500, launcher="explicit")
    assert missing_ranks_message("[p] ", 5.0, "127.0.0.1:29500", env, [1, 2], refusals) == (
        "[p] timed out after 5.0 s at 127.0.0.1:29500: 1/3 ranks arrived; ranks [1, 2] never did. Check "
        "that every rank was started with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE=3, and that none "
        "crashed at start-up"
    )
    refusals.add(_claim(rank=1), missing={1, 2})
    message = missing_ranks_message("[p] ", 5.0, "127.0.0.1:29500", env, [1, 2], refusals)
    assert (
        ". Rank 0 refused 1 claim(s) holding another job token: pid 4242 on vm (from 127.0.0.1:35896) "
        "claiming rank 1 of world size 3 (its job: another job's description). Ranks [1] were claimed only "
        "with another job token. If the refused process is a rank of this job"
    ) in message
    assert message.endswith("give each job its own MASTER_PORT")
