"""The job token: where it comes from, that two jobs differ and one job agrees, and that it is never shown."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from backends.common.jobtoken import JobToken, job_token, sign_with, verify_with
from commlib.env import DistEnv

REMOTE = "10.1.2.3"  # not this host: no local identity applies


def _env(rank: int = 1, launcher: str = "torchrun", addr: str = "127.0.0.1") -> DistEnv:
    return DistEnv(rank=rank, world_size=4, master_addr=addr, master_port=29500, launcher=launcher)


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
    leader = os.getpgrp()  # the process group's leader: the shell's job, or whoever ran setsid
    try:
        with open(f"/proc/{leader}/comm") as f:
            leader_name = f.read().strip()
    except FileNotFoundError:  # the leader has exited (a background job whose shell ended)
        leader_name = "?"
    assert token.identity.startswith(f"local job started by pid {leader} ({leader_name}), rendezvous ")
    assert token.accepted == (token.key,)
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


def test_a_rank_started_in_another_session_is_another_job() -> None:
    """What a second terminal, or a launcher that runs setsid, gives: another job on the same port."""
    rank0 = job_token(_env(0, "explicit"), {})
    assert _child_key(new_session=True) not in rank0.accepted
    assert _child_key("bash", "-c", '"$0" "$@"; exit $?', new_session=True) not in rank0.accepted


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


def test_a_refusal_grace_counts_only_for_ranks_still_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's wait after refusing a derived token ends early only for a rank that has not come since."""
    from backends.common import admission

    now = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: now[0])
    grace = admission.RefusalGrace()
    grace.start(1, "rank 1 never came")
    grace.start(1, "a later refusal does not extend the first")
    grace.start(2, "rank 2 never came")
    due = 100.0 + admission.REFUSAL_GRACE_S
    assert grace.deadline(500.0, {1, 2}) == due
    assert grace.deadline(500.0, {3}) == 500.0  # ranks 1 and 2 are in: the rendezvous deadline holds
    assert grace.deadline(101.0, {1}) == 101.0
    assert grace.over({1, 2}) is None  # not yet
    now[0] = due
    assert grace.over({1, 2}) == "rank 1 never came"
    assert grace.over({2}) == "rank 2 never came"
    assert grace.over({3}) is None  # whoever was refused, this job's ranks 1 and 2 came


def test_rank0s_log_line_after_a_refusal_says_what_it_does_next() -> None:
    from backends.common.admission import REFUSAL_GRACE_S, still_waiting

    assert still_waiting(1, {1, 2}, False) == f"waiting {REFUSAL_GRACE_S:g} s for this job's rank 1"
    assert still_waiting(1, {1}, True).startswith("stopping: COMMLIB_JOB_TOKEN is set")  # no wait then
    assert still_waiting(1, {2}, False) == "this job's rank 1 is in already"
    assert still_waiting(0, {1}, False).startswith("it claimed rank 0")
