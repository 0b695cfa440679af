"""Strangers at the ring rendezvous: garbage, silent, a huge length prefix, closed at once.

Two ranks rendezvous in threads of this process; a stranger connects to rank 0's
rendezvous port, or to its data listener, before rank 1 arrives. Each stranger
must be dropped on its own and logged at DEBUG on the ``commlib`` logger, and the
two ranks must meet as if it had never come: at once, not after the timeout, and
linked to each other rather than to the stranger. An impostor that speaks the protocol
with another job token is refused and logged at WARNING, and must neither end the
rendezvous nor keep this job's rank out; a rank that never comes is named at the
deadline together with the refused claim.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import struct
import time
from collections.abc import Callable, Iterator

import pytest

from backends.ring import lobby
from backends.ring.rendezvous import RingSockets, rendezvous
from backends.ring.wire import SocketReader, recv_json, send_json
from commlib.env import DistEnv
from commlib.errors import RendezvousTimeoutError
from commlib.ports import free_port
from tests._listeners import listening_ports, wait_until

TIMEOUT = 30.0
"""Rendezvous timeout: a stranger that held rank 0 would show as a wait this long."""
FAST = 5.0
"""The two ranks must meet within this, strangers or not (each joins in milliseconds)."""


def _frame(obj: object) -> bytes:
    payload = json.dumps(obj).encode()
    return struct.pack("!I", len(payload)) + payload


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # with a zero linger: RST, not FIN


STRANGERS: dict[str, Callable[[socket.socket], None]] = {
    "garbage": lambda s: s.sendall(b"GET / HTTP/1.1\r\nHost: commlib\r\n\r\n"),
    "garbage_in_a_frame": lambda s: s.sendall(struct.pack("!I", 12) + b"\x00\xffnot json!"),
    "json_nested_too_deep": lambda s: s.sendall(struct.pack("!I", 5000) + b"[" * 5000),
    "silent": lambda s: None,
    "huge_length_prefix": lambda s: s.sendall(struct.pack("!I", 16 * 1024 * 1024)),
    "closed_at_once": lambda s: s.close(),
    "reset_at_once": _reset,
    "json_list": lambda s: s.sendall(_frame([1, 2, 3])),
    "old_protocol_hello": lambda s: s.sendall(_frame({"protocol": 1, "rank": 1, "world_size": 2})),
    "half_a_hello": lambda s: s.sendall(_frame({"protocol": 2, "rank": 1})[:20]),
}
"""What a stranger does once connected; the socket stays open unless it closes it."""

LINK_IMPOSTORS: dict[str, Callable[[socket.socket], None]] = {
    "unsigned_link_hello": lambda s: s.sendall(_frame({"ring_hello": 1})),
    "forged_link_hello": lambda s: s.sendall(_frame({"ring_hello": 1, "proof": "00" * 32})),
}
"""Strangers on a data listener that claim to be the left neighbour."""


def _env(rank: int, port: int) -> DistEnv:
    return DistEnv(rank=rank, world_size=2, master_port=port, launcher="explicit")


@pytest.fixture
def commlib_log(caplog: pytest.LogCaptureFixture, clean_launcher_env: None) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="commlib")
    return caplog


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="rendezvous-rank") as executor:
        yield executor


def _assert_linked(rank0: RingSockets, rank1: RingSockets) -> None:
    """Each rank's right link ends at the other's left link, and frames go both ways."""
    assert rank0.right and rank0.left and rank1.right and rank1.left
    assert rank0.left.getpeername() == rank1.right.getsockname()
    assert rank1.left.getpeername() == rank0.right.getsockname()
    for sender, receiver in ((rank0, rank1), (rank1, rank0)):
        assert sender.right is not None and receiver.left_reader is not None
        send_json(sender.right, {"from": sender.peers[0].pid, "n": 1})
        assert recv_json(receiver.left_reader, "a test frame") == {"from": sender.peers[0].pid, "n": 1}


def _close(*ranks: RingSockets) -> None:
    for r in ranks:
        for sock in (r.left, r.right):
            if sock is not None:
                sock.close()


def _dropped(caplog: pytest.LogCaptureFixture, address: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "commlib" and r.levelno == logging.DEBUG and f"from {address}:" in r.getMessage()
    ]


def _start_rank0(pool: concurrent.futures.ThreadPoolExecutor) -> tuple[concurrent.futures.Future, int]:
    """Start rank 0's rendezvous in a thread on a free port; return it and the port once it listens.

    Waits for this process's own listener, not anyone's: a port another process took between
    ``free_port()`` and rank 0's bind shows as rank 0's "cannot listen", and another port is tried.
    """
    for _ in range(3):
        port = free_port()
        rank0 = pool.submit(rendezvous, _env(0, port), TIMEOUT, {"chunk_bytes": 4096})
        _wait_listening(rank0, port)
        if not rank0.done():
            return rank0, port
        assert "cannot listen" in str(rank0.exception()), rank0.exception()
    raise AssertionError(f"rank 0 could not listen on three free ports: {rank0.exception()}")


def _wait_listening(rank0: concurrent.futures.Future, port: int) -> None:
    wait_until(lambda: port in listening_ports() or rank0.done(), 20, f"rank 0 listens on {port}")


@pytest.mark.parametrize("kind", list(STRANGERS))
def test_a_stranger_on_the_rendezvous_port_is_dropped_alone(kind: str, commlib_log, pool) -> None:
    rank0, port = _start_rank0(pool)
    stranger = socket.create_connection(("127.0.0.1", port))
    address = f"127.0.0.1:{stranger.getsockname()[1]}"
    STRANGERS[kind](stranger)
    start = time.monotonic()
    rank1 = pool.submit(rendezvous, _env(1, port), TIMEOUT, {})
    sockets = rank0.result(TIMEOUT + 5), rank1.result(TIMEOUT + 5)
    elapsed = time.monotonic() - start
    try:
        assert elapsed < FAST, f"the ranks took {elapsed:.1f} s to meet: the stranger held rank 0"
        assert sockets[1].settings == {"chunk_bytes": 4096}
        _assert_linked(*sockets)
        dropped = _dropped(commlib_log, address)
        assert dropped, f"nothing logged at DEBUG about the stranger at {address}"
        assert dropped[0].startswith(f"[rank 0/2] ring.rendezvous: rendezvous port 127.0.0.1:{port}: dropped")
        if kind == "old_protocol_hello":  # an older commlib is told why
            stranger.settimeout(5)
            assert "run the same commlib version on every rank" in recv_json(
                SocketReader(stranger, "rank 0"), "the answer"
            ).get("error", "")
    finally:
        stranger.close()
        _close(*sockets)


@pytest.mark.parametrize("kind", list(STRANGERS) + list(LINK_IMPOSTORS))
def test_a_stranger_on_a_data_listener_is_dropped_alone(kind: str, commlib_log, pool) -> None:
    """Rank 0's data listener is open from the start; a stranger there must not become its left link."""
    before = listening_ports()
    rank0, port = _start_rank0(pool)
    data_ports = listening_ports() - before - {port}
    assert len(data_ports) == 1, f"expected rank 0's data listener among {data_ports}"
    stranger = socket.create_connection(("127.0.0.1", data_ports.pop()))
    address = f"127.0.0.1:{stranger.getsockname()[1]}"
    {**STRANGERS, **LINK_IMPOSTORS}[kind](stranger)
    start = time.monotonic()
    rank1 = pool.submit(rendezvous, _env(1, port), TIMEOUT, {})
    sockets = rank0.result(TIMEOUT + 5), rank1.result(TIMEOUT + 5)
    elapsed = time.monotonic() - start
    try:
        assert elapsed < FAST, f"the ranks took {elapsed:.1f} s to link: the stranger held rank 0"
        _assert_linked(*sockets)
        dropped = _dropped(commlib_log, address)
        assert dropped, f"nothing logged at DEBUG about the stranger at {address}"
        assert dropped[0].startswith("[rank 0/2] ring.rendezvous: data listener: dropped")
    finally:
        stranger.close()
        _close(*sockets)


def test_a_silent_stranger_is_dropped_at_its_own_deadline(commlib_log, pool, monkeypatch) -> None:
    """With nobody else arriving, a silent connection is dropped after its short deadline, not the timeout."""
    monkeypatch.setattr(lobby, "STRANGER_DEADLINE_S", 0.3)
    rank0, port = _start_rank0(pool)
    with socket.create_connection(("127.0.0.1", port)) as stranger:
        expected = f"from 127.0.0.1:{stranger.getsockname()[1]}: sent no complete frame within 0.3 s"
        wait_until(
            lambda: any(expected in r.getMessage() for r in commlib_log.records),
            10,
            "the silent stranger is dropped at its 0.3 s deadline",
        )
        assert stranger.recv(1) == b""  # rank 0 closed it
    rank1 = pool.submit(rendezvous, _env(1, port), TIMEOUT, {})
    sockets = rank0.result(FAST), rank1.result(FAST)
    _assert_linked(*sockets)
    _close(*sockets)


def test_many_strangers_at_once_do_not_delay_the_ranks(commlib_log, pool) -> None:
    """A port scanner's worth of silent connections: the ranks still meet at once; every one is logged."""
    rank0, port = _start_rank0(pool)
    strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    for i, s in enumerate(strangers):
        list(STRANGERS.values())[i % len(STRANGERS)](s)
    start = time.monotonic()
    rank1 = pool.submit(rendezvous, _env(1, port), TIMEOUT, {})
    sockets = rank0.result(TIMEOUT + 5), rank1.result(TIMEOUT + 5)
    try:
        assert time.monotonic() - start < FAST
        _assert_linked(*sockets)
        logged = " ".join(r.getMessage() for r in commlib_log.records if r.levelno == logging.DEBUG)
        for s in strangers:
            if s.fileno() != -1:
                assert f"from 127.0.0.1:{s.getsockname()[1]}:" in logged
    finally:
        for s in strangers:
            s.close()
        _close(*sockets)


def test_a_lobby_whose_listener_is_shut_down_stops_waiting_and_serves_no_more_connections(pool) -> None:
    """Its owner closing: ``next_frame`` returns at once, not at its deadline, and the listener is dropped."""
    listener = socket.create_server(("127.0.0.1", 0))
    hall = lobby.Lobby(listener, "test listener", 4096)
    try:
        waiting = pool.submit(hall.next_frame, time.monotonic() + 40)
        listener.shutdown(socket.SHUT_RDWR)
        assert waiting.result(timeout=20) is None and hall.shut
        assert hall.next_frame(time.monotonic()) is None  # the shut listener is watched no more
    finally:
        hall.close()
        listener.close()


# ------------------------------------------------------------ impostors with another token
def _impostor_hello(port: int, rank: int = 1, world_size: int = 2) -> dict:
    """Claim ``rank`` at rank 0's port as a commlib rank of another job would: hello, then a proof
    under another token. Returns rank 0's answer to the proof."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(20)
        reader = SocketReader(sock, "rank 0")
        hello = {
            "protocol": 2,
            "rank": rank,
            "world_size": world_size,
            "host": "elsewhere/boot",
            "addr": "127.0.0.1",
            "port": 9,
            "pid": 4242,
            "identity": "an impostor's job",
            "nonce": "cd" * 16,
        }
        send_json(sock, hello)
        assert "challenge" in recv_json(reader, "the challenge")
        send_json(sock, {"proof": "ab" * 32})
        return recv_json(reader, "the verdict")


def _refusal_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "claiming rank 1 of world size 2" in r.getMessage()
    ]


def test_an_impostor_claiming_rank_1_first_is_refused_and_the_job_still_forms(commlib_log, pool) -> None:
    """It holds another job token and comes before rank 1: refused, logged at WARNING, and nothing else."""
    rank0, port = _start_rank0(pool)
    answer = _impostor_hello(port)
    assert answer["refused"] == "token" and answer["pid"] > 0
    wait_until(lambda: bool(_refusal_warnings(commlib_log)), 10, "rank 0 warns about the refusal")
    (warning,) = _refusal_warnings(commlib_log)
    assert warning.startswith(
        f"[rank 0/2] ring.rendezvous: rendezvous port 127.0.0.1:{port}: refused pid 4242"
    )
    assert "claiming rank 1 of world size 2 (its job: an impostor's job)" in warning
    assert "still waiting for this job's rank 1 until the rendezvous deadline" in warning
    assert not rank0.done()  # rank 0 still waits for its own rank 1
    rank1 = pool.submit(rendezvous, _env(1, port), TIMEOUT, {})
    sockets = rank0.result(TIMEOUT + 5), rank1.result(TIMEOUT + 5)
    try:
        _assert_linked(*sockets)
    finally:
        _close(*sockets)


def test_a_rank_that_never_comes_after_an_impostor_is_named_with_the_refused_claim(commlib_log, pool) -> None:
    port = free_port()
    rank0 = pool.submit(rendezvous, _env(0, port), 2.0, {})
    _wait_listening(rank0, port)
    assert _impostor_hello(port)["refused"] == "token"
    with pytest.raises(RendezvousTimeoutError) as caught:
        rank0.result(TIMEOUT)
    message = str(caught.value)
    assert message.startswith(f"[rank 0/2] ring.rendezvous: timed out after 2.0 s at 127.0.0.1:{port}")
    assert "ranks [1] never did" in message
    assert (
        "Rank 0 refused 1 claim(s) holding another job token: pid 4242 on elsewhere (from 127.0.0.1:"
        in message
    )
    assert (
        "claiming rank 1 of world size 2 (its job: an impostor's job). Ranks [1] were claimed only with"
        in message
    )
    assert "set COMMLIB_JOB_TOKEN to the same value on every rank" in message
    assert "give each job its own MASTER_PORT" in message
