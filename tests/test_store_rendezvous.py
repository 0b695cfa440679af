"""The job check in front of torch's store (gloo/nccl): ranks in threads of this process, no process group.

What is checked here needs no second process: that two ranks of one job meet and share one scoped
store; that garbage in an answer slot, a forged verdict, a port held by another program and a
listener that is not a store each give their own clear outcome within the timeout; and that an
answer under another job token is refused without keeping this job's rank out.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import json
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
from torch.distributed import TCPStore

from backends.common.store_rendezvous import _claim_slot, join_job_store
from commlib.env import DistEnv
from commlib.errors import RendezvousError, RendezvousTimeoutError
from commlib.ports import free_port
from tests._listeners import port_is_listening, wait_until
from tests.conftest import REPO_ROOT

BASE = "commlib/job-check/v1"
IDLE = 100  # idle connections: torch's store spends 60-100 ms on each before it serves the next client


def _env(rank: int, port: int, world_size: int = 2) -> DistEnv:
    return DistEnv(
        rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, launcher="explicit"
    )


@pytest.fixture(autouse=True)
def _one_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads of one process are one job: give them one explicit token."""
    monkeypatch.setenv("COMMLIB_JOB_TOKEN", "unit-test-job")


def test_two_ranks_meet_and_share_one_scoped_store() -> None:
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(join_job_store, _env(rank, port), 20.0, "gloo") for rank in range(2)]
        stores = [f.result(timeout=60) for f in futures]
    stores[0].set("k", "from rank 0")
    assert stores[1].get("k") == b"from rank 0"
    # The scope is this rendezvous's own: the key is not at the store's root.
    raw = TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=5), wait_for_workers=False)
    assert not raw.check(["k"])


def test_garbage_in_an_answer_slot_is_dropped_and_the_job_still_forms(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    caplog.set_level(logging.DEBUG, logger="commlib")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        leader = pool.submit(join_job_store, _env(0, port), 20.0, "gloo")
        wait_until(lambda: port_is_listening(port), 20, "rank 0 listens")
        stranger = TCPStore(
            "127.0.0.1", port, 2, False, datetime.timedelta(seconds=5), wait_for_workers=False
        )
        stranger.compare_set(f"{BASE}/answer/1", "", "GET / HTTP/1.1")
        stranger.compare_set(f"{BASE}/answer/2", "", json.dumps({"record": [1, 2, 3], "proof": "x"}))
        follower = pool.submit(join_job_store, _env(1, port), 20.0, "gloo")
        stores = [leader.result(timeout=60), follower.result(timeout=60)]
    stores[1].set("k", "v")
    assert stores[0].get("k") == b"v"
    assert json.loads(stranger.get(f"{BASE}/verdict/1"))["error"].startswith("rank 0 dropped this answer")
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 2 and all(
        r.levelno == logging.DEBUG for r in caplog.records if "dropped" in r.getMessage()
    )
    assert dropped[0].startswith("[rank 0/2] gloo.rendezvous: answer slot 1 at 127.0.0.1:")


def test_a_verdict_not_signed_by_this_jobs_rank_0_is_refused() -> None:
    """Another program hosts a store on the port and waves every answer through."""
    port = free_port()
    fake = TCPStore("127.0.0.1", port, 2, True, datetime.timedelta(seconds=20), wait_for_workers=False)
    fake.set(f"{BASE}/challenge", json.dumps({"nonce": "00" * 16, "identity": "fake", "pid": 1, "host": "h"}))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        follower = pool.submit(join_job_store, _env(1, port), 20.0, "gloo")
        fake.wait([f"{BASE}/answer/1"], datetime.timedelta(seconds=20))
        fake.set(f"{BASE}/verdict/1", json.dumps({"accepted": True, "scope": "s/", "proof": "ab" * 32}))
        with pytest.raises(RendezvousError) as caught:
            follower.result(timeout=60)
    assert str(caught.value).startswith(
        f"[rank 1/2] gloo.rendezvous: the verdict from 127.0.0.1:{port} is not"
    )
    assert "no proof of this job's token" in str(caught.value)


def test_a_port_held_by_another_program_is_named_as_such() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(RendezvousError) as at_rank0:
            join_job_store(_env(0, port), 5.0, "nccl")
        start = time.monotonic()
        with pytest.raises(RendezvousTimeoutError) as at_rank1:
            join_job_store(_env(1, port), 1.0, "gloo")  # the listener accepts and stays silent
        waited = time.monotonic() - start
    assert str(at_rank0.value) == (
        f"[rank 0/2] nccl.rendezvous: cannot listen on 127.0.0.1:{port}: Address already in use. Another "
        "job (or a previous run that is still exiting) holds this port: set MASTER_PORT to a free port, or "
        "stop the other job"
    )
    assert str(at_rank1.value).startswith(
        f"[rank 1/2] gloo.rendezvous: something accepted the connection at 127.0.0.1:{port} but never "
        "answered as rank 0's store within 1.0 s"
    )
    assert waited < 10, waited


def test_with_nothing_listening_rank_1_asks_whether_rank_0_runs_at_its_timeout() -> None:
    """torch's client retries past its timeout while nothing listens: not a silent program on the port."""
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError) as at_rank1:
        join_job_store(_env(1, port), 5.0, "gloo")  # long enough for torch's client to retry past it
    waited = time.monotonic() - start
    assert str(at_rank1.value).startswith(
        f"[rank 1/2] gloo.rendezvous: cannot reach rank 0 at 127.0.0.1:{port} after 5.0 s. Is rank 0 running"
    )
    assert waited < 5.0 + 1.5, waited  # at its timeout, not a retry or a grace later


def test_a_duplicate_rank_fails_the_job_on_rank_0_and_is_told_so() -> None:
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        leader = pool.submit(join_job_store, _env(0, port, 3), 20.0, "gloo")
        first, second = (pool.submit(join_job_store, _env(1, port, 3), 20.0, "gloo") for _ in range(2))
        with pytest.raises(RendezvousError) as at_rank0:
            leader.result(timeout=60)
        outcomes: list[Any] = []
        for f in (first, second):
            try:
                outcomes.append(f.result(timeout=60))
            except RendezvousError as e:
                outcomes.append(e)
    assert "two processes announced rank 1" in str(at_rank0.value)
    assert all(
        isinstance(o, RendezvousError) and "two processes announced rank 1" in str(o) for o in outcomes
    )


def test_a_store_left_from_an_earlier_group_of_this_process_does_not_confuse_the_next() -> None:
    """torch shares one store server per port within a process (multi_tenant): an earlier group's keys remain.

    Rank 1 arrives first and answers the earlier group's challenge; rank 0 asks it again, and they meet.
    """
    port = free_port()
    earlier = TCPStore(
        "127.0.0.1", port, 2, True, datetime.timedelta(seconds=20), wait_for_workers=False, multi_tenant=True
    )
    old = {"nonce": "11" * 16, "identity": "earlier", "pid": 1, "host": "h"}
    earlier.set(f"{BASE}/challenge", json.dumps(old))
    record = {
        "rank": 1,
        "world_size": 2,
        "pid": 1,
        "host": "h",
        "identity": "x",
        "nonce": "1",
        "challenge": "11" * 16,
    }
    earlier.set(f"{BASE}/answer/1", json.dumps({"record": record, "proof": "00"}))
    earlier.set(f"{BASE}/verdict/1", json.dumps({"accepted": True, "scope": "old/", "proof": "00"}))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        follower = pool.submit(join_job_store, _env(1, port), 20.0, "gloo")
        earlier.wait(
            [f"{BASE}/answer/2"], datetime.timedelta(seconds=20)
        )  # rank 1 answered the old challenge
        leader = pool.submit(join_job_store, _env(0, port), 20.0, "gloo")
        stores = [leader.result(timeout=60), follower.result(timeout=60)]
    assert json.loads(earlier.get(f"{BASE}/verdict/2")) == {"stale": True}
    stores[0].set("k", "v")
    assert stores[1].get("k") == b"v"


def test_a_store_that_drops_a_rank_before_any_notice_fails_it_at_once_as_a_rendezvous_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the notice that rank 0's earlier check is over, a dropped connection is rank 0 gone.

    The rank fails at once (it does not connect again until its deadline), with the error a caller
    of the rendezvous knows: a ``RendezvousError``, not the private class that marks the drop.
    """
    import torch

    from backends.common import store_rendezvous

    port = free_port()
    server = TCPStore(
        "127.0.0.1", port, 2, True, datetime.timedelta(seconds=20), wait_for_workers=False, multi_tenant=True
    )
    reads: list[str] = []

    def dropped(store: Any, key: str, wait: Any) -> bytes:
        reads.append(key)
        raise torch.distributed.DistNetworkError("Failed to recv, got 0 bytes.")

    monkeypatch.setattr(store_rendezvous, "_get", dropped)
    started = time.monotonic()
    with pytest.raises(RendezvousError) as failed:
        join_job_store(_env(1, port), 20.0, "gloo")
    assert type(failed.value) is RendezvousError
    assert "rank 0 dropped the rendezvous" in str(failed.value)
    assert reads == [f"{BASE}/challenge"]  # read once: not connected again
    assert time.monotonic() - started < 10
    del server


def _impostor_answer(port: int) -> dict[str, Any]:
    """Answer rank 0's challenge as rank 1 of another job would (a proof under another token); return
    rank 0's verdict."""
    store = TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=20), wait_for_workers=False)
    challenge = json.loads(store.get(f"{BASE}/challenge"))
    record = {
        "rank": 1,
        "world_size": 2,
        "pid": 4242,
        "host": "elsewhere",
        "identity": "an impostor's job",
        "nonce": "cd" * 16,
        "challenge": challenge["nonce"],
    }
    slot = _claim_slot(store, BASE, json.dumps({"record": record, "proof": "ab" * 32}))
    store.wait([f"{BASE}/verdict/{slot}"], datetime.timedelta(seconds=20))
    return json.loads(store.get(f"{BASE}/verdict/{slot}"))


def _refusal_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "claiming rank 1 of world size 2" in r.getMessage()
    ]


def test_an_impostor_answering_as_rank_1_first_is_refused_and_the_job_still_forms(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    caplog.set_level(logging.DEBUG, logger="commlib")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        leader = pool.submit(join_job_store, _env(0, port), 30.0, "gloo")
        wait_until(lambda: port_is_listening(port), 20, "rank 0 listens")
        assert _impostor_answer(port)["refused"] == "token"
        wait_until(lambda: bool(_refusal_warnings(caplog)), 10, "rank 0 warns about the refusal")
        assert not leader.done()  # still waiting for its own rank 1
        follower = pool.submit(join_job_store, _env(1, port), 30.0, "gloo")
        stores = [leader.result(timeout=60), follower.result(timeout=60)]
    stores[1].set("k", "v")
    assert stores[0].get("k") == b"v"
    (warning,) = _refusal_warnings(caplog)
    assert warning.startswith(
        f"[rank 0/2] gloo.rendezvous: store at 127.0.0.1:{port}: answer slot 1: refused pid 4242 on "
        "elsewhere claiming rank 1 of world size 2 (its job: an impostor's job): it holds another job token"
    )
    assert "still waiting for this job's rank 1 until the rendezvous deadline" in warning


def test_a_rank_that_never_comes_after_an_impostor_is_named_with_the_refused_claim() -> None:
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        leader = pool.submit(join_job_store, _env(0, port), 3.0, "gloo")
        wait_until(lambda: port_is_listening(port), 20, "rank 0 listens")
        assert _impostor_answer(port)["refused"] == "token"
        with pytest.raises(RendezvousTimeoutError) as caught:
            leader.result(timeout=60)
    message = str(caught.value)
    assert message.startswith(f"[rank 0/2] gloo.rendezvous: timed out after 3.0 s at 127.0.0.1:{port}")
    assert "ranks [1] never did" in message
    assert (
        "Rank 0 refused 1 claim(s) holding another job token: pid 4242 on elsewhere claiming rank 1 of "
        "world size 2 (its job: an impostor's job). Ranks [1] were claimed only with another job token"
    ) in message
    assert "set COMMLIB_JOB_TOKEN to the same value on every rank" in message


class _CountingStore:
    """A torch ``HashStore`` that counts the calls made to it."""

    def __init__(self) -> None:
        from torch.distributed import HashStore

        self.store = HashStore()
        self.calls = 0

    def check(self, keys: list[str]) -> bool:
        self.calls += 1
        return bool(self.store.check(keys))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self.calls += 1
        return bytes(self.store.compare_set(key, expected, desired))


@pytest.mark.parametrize("taken", [0, 1, 2, 3, 7, 8, 9, 100, 1000, 4095])
def test_an_answer_slot_is_claimed_after_the_taken_ones_in_log_store_calls(taken: int) -> None:
    store = _CountingStore()
    for slot in range(1, taken + 1):
        store.store.set(f"{BASE}/answer/{slot}", f"rank {slot}")
    store.calls = 0
    assert _claim_slot(store, BASE, "mine") == taken + 1
    assert store.store.get(f"{BASE}/answer/{taken + 1}") == b"mine"
    # A gallop and a bisection over the taken slots, then one compare_set; a scan would need taken + 1.
    assert store.calls <= 2 * max(taken, 1).bit_length() + 2
    for slot in range(1, taken + 1):  # nobody's answer was replaced
        assert store.store.get(f"{BASE}/answer/{slot}") == f"rank {slot}".encode()


def test_concurrent_claims_fill_the_answer_slots_without_gaps_or_overwrites() -> None:
    port = free_port()
    server = TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    clients = [
        TCPStore("127.0.0.1", port, 1, False, datetime.timedelta(seconds=30), wait_for_workers=False)
        for _ in range(48)
    ]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        slots = list(pool.map(lambda i: _claim_slot(clients[i], BASE, f"answer {i}"), range(len(clients))))
    assert sorted(slots) == list(range(1, len(clients) + 1))
    for i, slot in enumerate(slots):
        assert server.get(f"{BASE}/answer/{slot}") == f"answer {i}".encode()


def test_answer_slots_filled_for_ever_end_at_the_deadline() -> None:
    """Someone keeps claiming every answer slot ahead of rank 1: its claim gives up at the deadline."""
    from backends.common.jobtoken import job_token
    from backends.common.store_rendezvous import _Context

    store = _CountingStore()
    real = store.compare_set

    def always_taken(key: str, expected: str, desired: str) -> bytes:
        real(key, expected, f"someone else's {key}")  # the attacker got there first, every time
        return b"someone else's"

    store.compare_set = always_taken  # type: ignore[method-assign]
    env = _env(1, free_port())
    deadline = time.monotonic() + 0.5
    ctx = _Context(env, "[rank 1/2] gloo.rendezvous: ", deadline, 0.5, job_token(env), base=BASE)
    with pytest.raises(RendezvousTimeoutError) as caught:
        _claim_slot(store, BASE, "mine", ctx)
    assert str(caught.value).startswith("[rank 1/2] gloo.rendezvous: could not claim an answer slot")
    assert ctx.remaining().total_seconds() == 0.0  # what is left of the deadline reaches zero


def test_idle_connections_to_the_store_port_delay_the_job_but_it_forms() -> None:
    """Strangers hold idle connections to MASTER_PORT before rank 1 comes; the store serves each first."""
    port = free_port()
    idle: list[socket.socket] = []
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            leader = pool.submit(join_job_store, _env(0, port), 60.0, "gloo")
            wait_until(lambda: port_is_listening(port), 20, "rank 0 listens")
            idle += [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(IDLE)]
            follower = pool.submit(join_job_store, _env(1, port), 60.0, "gloo")
            stores = [leader.result(timeout=90), follower.result(timeout=90)]
    finally:
        for sock in idle:
            sock.close()
    stores[1].set("k", "v")
    assert stores[0].get("k") == b"v"


_GIVEN_UP_BEHIND_A_FLOOD = """
import datetime, os, socket, sys
os.environ["COMMLIB_JOB_TOKEN"] = "flood"
from torch.distributed import TCPStore
from backends.common.store_rendezvous import join_job_store
from commlib.env import DistEnv
from commlib.errors import RendezvousTimeoutError
from commlib.ports import free_port
port = free_port()
server = TCPStore("127.0.0.1", port, 2, True, datetime.timedelta(seconds=30), wait_for_workers=False)
idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(int(sys.argv[1]))]
try:
    join_job_store(DistEnv(1, 2, master_addr="127.0.0.1", master_port=port, launcher="explicit"), 2.0, "gloo")
except RendezvousTimeoutError as e:
    print("raised:", e, flush=True)
"""


@pytest.mark.waits
@pytest.mark.multiprocess
@pytest.mark.parametrize("idle", [100, 600])
def test_a_rank_that_gave_up_behind_idle_connections_exits_with_its_own_status(idle: int) -> None:
    """Its connect attempt is still inside torch's client when it exits: that used to abort the process.

    600 idle connections keep the store busy for longer than the process lives.
    """
    out = subprocess.run(
        [sys.executable, "-c", _GIVEN_UP_BEHIND_A_FLOOD, str(idle)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    # Where it gives up depends on how fast the store gets through the flood: before its
    # connection is accepted (a slow machine), once it is and finds no challenge, or waiting for
    # rank 0. Whichever way, it gives up at its timeout and exits with its own status.
    assert out.stdout.startswith(
        (
            "raised: [rank 1/2] gloo.rendezvous: cannot reach rank 0 at 127.0.0.1:",
            "raised: [rank 1/2] gloo.rendezvous: something accepted the connection",
            "raised: [rank 1/2] gloo.rendezvous: rank 0 never published its challenge",
        )
    ), out.stdout + out.stderr[-2000:]
    assert "terminate called" not in out.stderr
    assert out.returncode == 0, out.stderr[-2000:]


# ------------------------------------------------------------ a store the group is given
def _given(store: Any, rank: int, world_size: int = 2) -> DistEnv:
    return DistEnv(rank=rank, world_size=world_size, launcher="explicit", store=store)


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Each thread's job token: ``COMMLIB_JOB_TOKEN=tokens.value`` (default ``ours``), or ``tokens.token``."""
    import threading

    import backends.common.store_rendezvous as store_rendezvous
    from backends.common.jobtoken import job_token

    chosen = threading.local()

    def token(env: DistEnv, **kw: Any) -> Any:
        given = getattr(chosen, "token", None)
        return given or job_token(env, {"COMMLIB_JOB_TOKEN": getattr(chosen, "value", "ours")}, **kw)

    monkeypatch.setattr(store_rendezvous, "job_token", token)
    return chosen


def _join_as(tokens: Any, store: Any, rank: int, token: str, timeout: float = 20.0) -> Any:
    """Join ``store`` as ``rank`` with ``COMMLIB_JOB_TOKEN=token`` here (``tokens``: the fixture)."""
    tokens.value = token
    return join_job_store(_given(store, rank), timeout, "gloo")


def test_in_a_given_store_two_jobs_form_side_by_side_whoever_comes_first(tokens: Any) -> None:
    """Two jobs share one store: the other job's rank 0 and rank 1 come first, and neither job ends the other.

    Each job meets in its own token's part of the store: the other's rank 0 never takes this
    job's challenge, and neither job's rank 1 answers the other's rank 0.
    """
    from torch.distributed import HashStore

    store = HashStore()
    join = functools.partial(_join_as, tokens, store)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        theirs = [pool.submit(join, 0, "theirs")]
        wait_until(lambda: store.check([f"{BASE}/present/rank0/1"]), 20, "their rank 0 is in the store")
        theirs.append(pool.submit(join, 1, "theirs"))
        wait_until(lambda: store.check([f"{BASE}/present/ranks/1"]), 20, "their rank 1 is in the store")
        ours = [pool.submit(join, 0, "ours"), pool.submit(join, 1, "ours")]
        stores = {
            name: [f.result(timeout=60) for f in job] for name, job in (("ours", ours), ("theirs", theirs))
        }
    for name, (leader, follower) in stores.items():
        leader.set("k", name)
        assert follower.get("k") == name.encode()  # each job's ranks share one part, and only their own
    stores["theirs"][0].set("only", "theirs")
    assert not stores["ours"][1].check(["only"])


def test_in_a_given_store_a_rank_with_another_token_waits_alone_and_names_the_rank_0_it_found(
    tokens: Any,
) -> None:
    """A rank 1 holding another token does not end this job: it times out alone, naming this job's rank 0.

    This job's rank 0 goes on waiting; when its own rank 1 never comes either, its timeout names
    the claim made under another token.
    """
    from torch.distributed import HashStore

    store = HashStore()
    join = functools.partial(_join_as, tokens, store)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        leader = pool.submit(join, 0, "ours", 6.0)
        wait_until(lambda: store.check([f"{BASE}/present/rank0/1"]), 20, "rank 0 is in the store")
        with pytest.raises(RendezvousTimeoutError) as stranger:
            pool.submit(join, 1, "theirs", 1.0).result(timeout=60)
        assert not leader.done()
        with pytest.raises(RendezvousTimeoutError) as ours:
            leader.result(timeout=60)
    message = str(stranger.value)
    assert message.startswith(
        "[rank 1/2] gloo.rendezvous: no rank 0 holding this job's token (COMMLIB_JOB_TOKEN (value not shown)"
    ), message
    assert (
        "came to the group's store within 1.0 s. Under another job token, 1 process(es) came to this "
        in message
    )
    assert (
        f"pid {os.getpid()} on {socket.gethostname()} claiming rank 0 of world size 2 (its job: " in message
    )
    assert "set COMMLIB_JOB_TOKEN to the same value on every rank" in message
    message = str(ours.value)
    assert message.startswith("[rank 0/2] gloo.rendezvous: timed out after 6.0 s"), message
    assert "ranks [1] never did" in message
    assert "Under another job token, 1 process(es) came to this store: " in message
    assert "claiming rank 1 of world size 2" in message


def test_in_a_given_store_a_second_rank_0_of_this_job_fails_alone_naming_the_first() -> None:
    """A duplicated ``RANK=0`` meets no rank (each rank counts its groups): it times out alone, naming it.

    The ranks count the groups they formed in the store per rank, so the second rank 0 leads in the
    part of this job's next group; the job forms with the first.
    """
    from torch.distributed import HashStore

    store = HashStore()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(join_job_store, _given(store, 0), 20.0, "gloo")
        wait_until(lambda: store.check([f"{BASE}/present/rank0/1"]), 20, "rank 0 is in the store")
        with pytest.raises(RendezvousTimeoutError) as second:
            join_job_store(_given(store, 0), 1.0, "gloo")
        follower = pool.submit(join_job_store, _given(store, 1), 20.0, "gloo")
        stores = [first.result(timeout=60), follower.result(timeout=60)]
    stores[0].set("k", "v")
    assert stores[1].get("k") == b"v"
    message = str(second.value)
    assert message.startswith("[rank 0/2] gloo.rendezvous: timed out after 1.0 s"), message
    assert (
        "Another process with this job's token came to this store as rank 0 and has not finished its check "
        f"(pid {os.getpid()} on {socket.gethostname()}): rank 0 is duplicated"
    ) in message


def test_in_a_given_store_an_earlier_group_of_the_job_is_not_taken_for_a_second_rank_0() -> None:
    """A group formed and finished in the store; the next one's rank 0 times out: no "duplicated" claim."""
    from torch.distributed import HashStore

    store = HashStore()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = [pool.submit(join_job_store, _given(store, r), 20.0, "gloo") for r in range(2)]
        [f.result(timeout=60) for f in first]
    with pytest.raises(RendezvousTimeoutError) as alone:
        join_job_store(_given(store, 0), 1.0, "gloo")
    assert "ranks [1] never did" in str(alone.value)
    assert "duplicated" not in str(alone.value), alone.value


def test_in_a_given_store_rank_0_warns_of_a_rank_of_another_token_while_its_own_is_late(
    tokens: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The other token's rank 1 came first: once rank 0's own is late (a quarter of the timeout), it warns."""
    from torch.distributed import HashStore

    caplog.set_level(logging.WARNING, logger="commlib")

    store = HashStore()
    join = functools.partial(_join_as, tokens, store)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        stranger = pool.submit(join, 1, "theirs", 2.0)
        wait_until(lambda: store.check([f"{BASE}/present/ranks/1"]), 20, "the other token's rank 1 is in")
        leader = pool.submit(join, 0, "ours", 8.0)
        wait_until(lambda: any("have not come" in r.getMessage() for r in caplog.records), 20, "rank 0 warns")
        follower = pool.submit(join, 1, "ours", 8.0)
        stores = [leader.result(timeout=60), follower.result(timeout=60)]
        with pytest.raises(RendezvousTimeoutError):
            stranger.result(timeout=60)
    stores[0].set("k", "v")
    assert stores[1].get("k") == b"v"
    (warning,) = [r.getMessage() for r in caplog.records if "have not come" in r.getMessage()]
    assert warning.startswith("[rank 0/2] gloo.rendezvous: ranks [1] have not come to the store yet"), warning
    assert "Under another job token, 1 process(es) came to this store: " in warning
    assert "claiming rank 1 of world size 2" in warning


def test_in_a_shared_tcp_store_garbage_in_the_arrival_lists_does_not_keep_a_job_from_forming(
    tokens: Any,
) -> None:
    """Values no record has, and keys a counter would use, written first: the job forms; its store works.

    (torch's store server drops a client whose ``add`` meets a value that is not a number; nothing
    under ``present/`` is added to.) No record names the job token's tag.
    """
    from backends.common.jobtoken import job_token

    port = free_port()
    server = TCPStore("127.0.0.1", port, 3, True, datetime.timedelta(seconds=20), wait_for_workers=False)
    for where in ("rank0", "ranks"):
        server.set(f"{BASE}/present/{where}/count", "not a number")
        server.set(f"{BASE}/present/{where}/1", "x" * 100_000)
        server.set(f"{BASE}/present/{where}/2", json.dumps({"rank": 1, "marks": "all"}))
        server.set(f"{BASE}/present/{where}/40", "a stray write past the end")

    def join(rank: int) -> Any:
        client = TCPStore("127.0.0.1", port, 3, False, datetime.timedelta(seconds=20), wait_for_workers=False)
        return client, join_job_store(_given(client, rank), 20.0, "gloo")

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        joined = list(pool.map(join, range(2), timeout=60))
    joined[0][1].set("k", "v")
    assert joined[1][1].get("k") == b"v"
    assert joined[1][0].add("still-works", 1) == 1  # the connection the group was given is intact
    tag = job_token(_given(server, 0), {"COMMLIB_JOB_TOKEN": "ours"}).tag
    for where in ("rank0", "ranks"):
        assert server.check([f"{BASE}/present/{where}/3"])
        assert tag not in server.get(f"{BASE}/present/{where}/3").decode()


def test_in_a_given_store_a_rank_0_accepting_two_keys_meets_ranks_holding_either(tokens: Any) -> None:
    """A rank 0 that leads its own session accepts its parent's key and its own; its children hold its own."""
    from torch.distributed import HashStore

    from backends.common.jobtoken import JobToken

    parent, own = b"p" * 32, b"o" * 32
    held = {
        0: JobToken(parent, "rank 0", accepted=(parent, own)),
        1: JobToken(own, "a child"),
        2: JobToken(parent, "a sibling"),
    }

    def join(rank: int) -> Any:
        tokens.token = held[rank]
        return join_job_store(_given(store, rank, 3), 20.0, "gloo")

    store = HashStore()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        stores = list(pool.map(join, range(3), timeout=60))
    stores[0].set("k", "v")
    assert stores[1].get("k") == b"v" and stores[2].get("k") == b"v"


def test_in_a_given_store_a_rank_that_comes_after_rank_0_failed_reads_why() -> None:
    """Rank 0 refuses rank 1's world size and gives up; rank 2, coming later, reads rank 0's error."""
    from torch.distributed import HashStore

    store = HashStore()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(join_job_store, _given(store, 0, 3), 20.0, "gloo")]
        futures.append(pool.submit(join_job_store, _given(store, 1, 2), 20.0, "gloo"))
        for future in futures:
            with pytest.raises(RendezvousError, match="rank 1 was started with world size 2, rank 0 with 3"):
                future.result(timeout=60)
    with pytest.raises(RendezvousError) as late:
        join_job_store(_given(store, 2, 3), 20.0, "gloo")
    assert str(late.value).startswith(
        "[rank 2/3] gloo.rendezvous: rendezvous failed on rank 0: [rank 0/3] gloo.rendezvous: rank 1 was "
        "started with world size 2, rank 0 with 3; start every rank with the same WORLD_SIZE"
    )


# ------------------------------------------------------------------ MASTER_ADDR
@pytest.mark.parametrize("rank", [0, 1])
def test_a_master_addr_that_names_no_host_fails_at_once_saying_so(rank: int) -> None:
    """torch's store would retry the name until the timeout, and rank 0 said it "cannot listen"."""
    env = DistEnv(rank=rank, world_size=2, master_addr="no-such-host.invalid", master_port=free_port())
    with pytest.raises(RendezvousError) as failed:
        join_job_store(env, 30.0, "gloo")
    assert type(failed.value) is RendezvousError
    assert str(failed.value).startswith(
        f"[rank {rank}/2] gloo.rendezvous: cannot resolve MASTER_ADDR 'no-such-host.invalid': "
    ), failed.value
    assert str(failed.value).endswith(
        "Set MASTER_ADDR to the name or address of rank 0's host, the same on every rank"
    )


def test_the_ring_names_an_ipv6_master_addr_as_what_it_cannot_use() -> None:
    from backends.ring.rendezvous import _master_ipv4

    assert _master_ipv4("localhost", "") == "127.0.0.1"
    with pytest.raises(
        RendezvousError, match=r"MASTER_ADDR '::1' has only IPv6 addresses \(::1\), and the ring"
    ):
        _master_ipv4("::1", "")
    with pytest.raises(RendezvousError, match=r"^cannot resolve MASTER_ADDR 'no-such-host.invalid'"):
        _master_ipv4("no-such-host.invalid", "")


def test_ipv6_loopback_counts_as_loopback() -> None:
    from commlib.net import is_loopback, resolves_to_loopback

    assert is_loopback("::1") and resolves_to_loopback("::1") and resolves_to_loopback("localhost")
    assert not resolves_to_loopback("192.0.2.1") and not resolves_to_loopback("no-such-host.invalid")


# ------------------------------------------------------------ the arrival lists
def test_a_gap_in_the_arrival_lists_costs_no_wait_and_a_flood_a_bounded_number_of_checks() -> None:
    """Stray slots 1, 2 and 4 (no 3), then 2**k for k < 40: a rank never waits on a slot, nor checks all."""
    from torch.distributed import HashStore

    from backends.common.jobtoken import JobToken
    from backends.common.store_presence import Presence

    gap, flood = HashStore(), HashStore()
    for slot in (1, 2, 4):
        gap.set(f"{BASE}/present/rank0/{slot}", "stray")
    for k in range(40):
        flood.set(f"{BASE}/present/rank0/{2**k}", "stray")
    for store in (gap, flood):
        store.set_timeout(datetime.timedelta(seconds=60))  # a wait on a missing slot would take this long
        presence = Presence(store, 0, 2, JobToken(b"k" * 32, "ours"), horizon=60.0)
        started = time.monotonic()
        presence.note()
        assert presence.arrivals(rank0=True, newest=64) == []
        assert time.monotonic() - started < 10
    assert gap.check([f"{BASE}/present/rank0/3"]) or gap.check([f"{BASE}/present/rank0/5"])  # its record


def test_a_copied_record_with_a_field_changed_is_not_taken_for_this_jobs() -> None:
    from torch.distributed import HashStore

    from backends.common.jobtoken import JobToken
    from backends.common.store_presence import Presence

    store, token = HashStore(), JobToken(b"k" * 32, "ours")
    first = Presence(store, 0, 2, token, horizon=60.0)
    first.note()
    first.finished()
    record = json.loads(store.get(f"{BASE}/present/rank0/1"))
    del record["finished"]
    store.set(f"{BASE}/present/rank0/2", json.dumps(record))  # a copy, "not finished"
    reader = Presence(store, 0, 2, token, horizon=60.0)
    (copied, original) = reader.arrivals(rank0=True, newest=8)
    assert (copied.ours, original.ours, original.finished) == (False, True, True)


def test_many_ranks_arriving_at_once_each_leave_a_record() -> None:
    from torch.distributed import HashStore

    from backends.common.jobtoken import JobToken
    from backends.common.store_presence import Presence

    store, token = HashStore(), JobToken(b"k" * 32, "ours")
    presences = [Presence(store, r, 33, token, horizon=60.0) for r in range(1, 33)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda p: p.note(), presences, timeout=60))
    assert sorted(p._slot for p in presences) == list(range(1, 33))


def test_json_nested_deeper_than_the_parser_goes_in_an_answer_slot_is_dropped() -> None:
    """On rank 0's own port: it used to end rank 0 with a bare RecursionError."""
    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        leader = pool.submit(join_job_store, _env(0, port), 30.0, "gloo")
        wait_until(lambda: port_is_listening(port), 20, "rank 0 listens")
        stray = TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=20), wait_for_workers=False)
        stray.wait([f"{BASE}/challenge"], datetime.timedelta(seconds=20))
        _claim_slot(stray, BASE, "[" * 5000)  # within the size an answer may have
        follower = pool.submit(join_job_store, _env(1, port), 30.0, "gloo")
        stores = [leader.result(timeout=60), follower.result(timeout=60)]
    stores[0].set("k", "v")
    assert stores[1].get("k") == b"v"


def test_a_failed_check_leaves_the_given_store_with_the_timeout_it_had() -> None:
    from torch.distributed import HashStore

    store = HashStore()
    store.set_timeout(datetime.timedelta(seconds=123))
    with pytest.raises(RendezvousTimeoutError):
        join_job_store(_given(store, 1), 0.5, "gloo")
    assert store.timeout == datetime.timedelta(seconds=123)


def test_a_rank_that_came_before_any_rank_0_still_warns_of_another_tokens_rank_0(
    tokens: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.distributed import HashStore

    caplog.set_level(logging.WARNING, logger="commlib")

    store = HashStore()
    join = functools.partial(_join_as, tokens, store)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        follower = pool.submit(join, 1, "theirs", 4.0)
        wait_until(lambda: store.check([f"{BASE}/present/ranks/1"]), 20, "the rank is in")
        leader = pool.submit(join, 0, "ours", 30.0)
        with pytest.raises(RendezvousTimeoutError):
            follower.result(timeout=60)
        leader.cancel()
        warned = [
            r.getMessage()
            for r in caplog.records
            if "no rank 0 of this job's token has come" in r.getMessage()
        ]
        assert len(warned) == 1 and "claiming rank 0 of world size 2" in warned[0], warned
        join(1, "ours", 30.0)  # this job's rank 1, so that rank 0 forms
        leader.result(timeout=60)
