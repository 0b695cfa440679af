"""Single-process tests of the ring's point-to-point links: two ``PointToPoint`` ends talking through threads.

Each end has its own listener on loopback and the other's address in its peer
table, as two ranks would after the rendezvous; the operations run in threads
because a send waits for its receive.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from backends.ring.link_setup import LinkShape
from backends.ring.p2p import PointToPoint
from backends.ring.p2p_links import PeerLinks
from backends.ring.rendezvous import Peer, host_id, open_listener, p2p_hello, p2p_hello_source
from commlib import CommError, CommTimeoutError, GroupClosedError, MessageMismatchError, MessageSizeError

SESSION = secrets.token_bytes(32)


class Pair:
    """Two point-to-point ends (ranks 0 and 1) and a pool to run their operations in."""

    def __init__(self, transport: str = "auto", timeout: float = 10.0, chunk_bytes: int = 4096) -> None:
        listeners = [open_listener("127.0.0.1") for _ in range(2)]
        self.peers = [Peer(r, host_id(), "127.0.0.1", listeners[r].getsockname()[1], 0) for r in range(2)]
        shape = LinkShape(transport, chunk_bytes, 4, None, 20e-6)
        self.ends = [
            PointToPoint(
                rank=r,
                links=PeerLinks(
                    rank=r,
                    peers=self.peers,
                    listener=listeners[r],
                    session=SESSION,
                    shape=shape,
                    timeout=timeout,
                    prefix=lambda op, r=r: f"[rank {r}/2] ring.{op}: ",
                    early=[],
                ),
                shape=shape,
                timeout=timeout,
            )
            for r in range(2)
        ]
        self.pool = concurrent.futures.ThreadPoolExecutor(4)

    def send(self, rank: int, tensor: torch.Tensor, tag: int = 0) -> concurrent.futures.Future[Any]:
        end = self.ends[rank]
        label = f"[rank {rank}/2] ring.send to rank {1 - rank} tag {tag}"
        return self.pool.submit(end.send, tensor.view(-1), 1 - rank, tag, label)

    def recv(self, rank: int, tensor: torch.Tensor, tag: int = 0, src: int | None = -1) -> Any:
        end = self.ends[rank]
        source = 1 - rank if src == -1 else src
        label = f"[rank {rank}/2] ring.recv from rank {source} tag {tag}"
        return self.pool.submit(end.recv, tensor.view(-1), source, tag, label)

    def close(self) -> None:
        for end in self.ends:
            end.close()
        self.pool.shutdown(wait=True)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def _done(*futures: concurrent.futures.Future[Any]) -> list[Any]:
    return [f.result(timeout=30) for f in futures]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("numel", [0, 1, 1000, 5000])  # 5000 floats: several pieces of a 4 KiB chunk
def test_messages_go_both_ways_over_links_opened_on_first_use(transport: str, numel: int) -> None:
    pair = Pair(transport)
    try:
        assert pair.ends[0].links == ({}, {})
        a, b = torch.arange(numel, dtype=torch.float32), torch.arange(numel, dtype=torch.float32) * -1
        into_a, into_b = torch.empty(numel), torch.empty(numel)
        # Both ends send first: each direction is its own link, opened by its sender.
        results = _done(pair.send(0, a), pair.send(1, b), pair.recv(1, into_b), pair.recv(0, into_a))
        assert results[2:] == [0, 1]  # each receive names its source
        assert torch.equal(into_b, a) and torch.equal(into_a, b)
        assert pair.ends[0].links == ({1: transport}, {1: transport})
    finally:
        pair.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sends_to_one_peer_from_two_threads_take_turns_on_the_link(transport: str) -> None:
    """Each message arrives whole and in its own thread's order, whichever thread sends when."""
    pair = Pair(transport)
    try:

        def sends(tag: int) -> None:
            for i in range(100):  # 6000 bytes: two pieces each, over 4 KiB slots
                pair.ends[0].send(torch.full((1500,), tag * 1000 + i, dtype=torch.int32), 1, tag, "send")

        senders = [pair.pool.submit(sends, tag) for tag in (1, 2)]
        for i in range(100):
            for tag in (1, 2):
                got = torch.empty(1500, dtype=torch.int32)
                pair.ends[1].recv(got, 0, tag, "recv")
                assert torch.equal(got, torch.full_like(got, tag * 1000 + i)), (tag, i)
        _done(*senders)
    finally:
        pair.close()


def test_many_messages_with_one_tag_arrive_in_order(pair: Pair) -> None:
    def sends() -> None:
        for i in range(300):
            pair.ends[0].send(torch.tensor([i]), 1, 3, "send")

    sender = pair.pool.submit(sends)
    got = []
    for _ in range(300):
        x = torch.empty(1, dtype=torch.int64)
        pair.ends[1].recv(x, 0, 3, "recv")
        got.append(int(x))
    sender.result(timeout=30)
    assert got == list(range(300))


@pytest.mark.parametrize(("mine", "theirs"), [(10, 12), (12, 10)])
def test_a_size_mismatch_raises_on_both_sides_naming_both_sizes(pair: Pair, mine: int, theirs: int) -> None:
    send, recv = pair.send(0, torch.ones(mine), tag=7), pair.recv(1, torch.empty(theirs), tag=7)
    with pytest.raises(MessageSizeError) as sent:
        send.result(timeout=30)
    with pytest.raises(MessageSizeError) as received:
        recv.result(timeout=30)
    assert str(sent.value) == (
        f"[rank 0/2] ring.send to rank 1 tag 7: rank 1's matching recv holds {4 * theirs} bytes ({theirs} x "
        f"float32), but this send has {4 * mine} bytes ({mine} x float32); nothing was received (rank 1 "
        "raises too). A send and its recv must have tensors of the same dtype and size; the pair stays usable"
    )
    assert str(received.value).startswith(
        f"[rank 1/2] ring.recv from rank 0 tag 7: rank 0 sends {4 * mine} bytes ({mine} x float32), but this "
        f"recv's tensor holds {4 * theirs} bytes ({theirs} x float32); nothing was written into it"
    )
    assert isinstance(sent.value, ValueError)
    # The link is still in step: the next message goes through.
    x = torch.empty(3)
    _done(pair.send(0, torch.full((3,), 5.0), tag=7), pair.recv(1, x, tag=7))
    assert x.tolist() == [5.0] * 3


@pytest.mark.parametrize("numel", [3, 5000], ids=["one piece", "many pieces"])
def test_a_dtype_mismatch_raises_on_both_sides_before_any_byte_lands(pair: Pair, numel: int) -> None:
    into = torch.full((numel,), -7, dtype=torch.int32)
    send, recv = pair.send(0, torch.ones(numel), tag=8), pair.recv(1, into, tag=8)
    with pytest.raises(MessageMismatchError) as sent:
        send.result(timeout=30)
    with pytest.raises(MessageMismatchError) as received:
        recv.result(timeout=30)
    assert not isinstance(sent.value, MessageSizeError) and isinstance(sent.value, ValueError)
    nbytes = 4 * numel
    assert str(sent.value).startswith(
        f"[rank 0/2] ring.send to rank 1 tag 8: rank 1's matching recv holds {nbytes} bytes "
        f"({numel} x int32), but this send has {nbytes} bytes ({numel} x float32)"
    )
    assert f"rank 0 sends {nbytes} bytes ({numel} x float32), but this recv's tensor holds" in str(
        received.value
    )
    assert bool((into == -7).all()), "bytes of the refused message landed in the receiving tensor"
    x = torch.empty(3)
    _done(pair.send(0, torch.full((3,), 5.0), tag=8), pair.recv(1, x, tag=8))
    assert x.tolist() == [5.0] * 3


def test_a_message_set_aside_of_another_dtype_fails_its_receive_only(pair: Pair) -> None:
    # Tag 1 comes first and is set aside (its send completes then); the receive for it is int64.
    _done(
        pair.send(0, torch.ones(2), tag=1),
        pair.send(0, torch.ones(2), tag=2),
        pair.recv(1, torch.empty(2), tag=2),
    )
    into = torch.full((2,), -7, dtype=torch.int32)
    with pytest.raises(
        MessageMismatchError, match=r"rank 0 was not told: the message came before a recv with its tag"
    ) as received:
        pair.recv(1, into, tag=1).result(timeout=30)
    assert "rank 0 sends 8 bytes (2 x float32), but this recv's tensor holds 8 bytes (2 x int32)" in str(
        received.value
    )
    assert into.tolist() == [-7, -7]


def test_a_message_with_another_tag_waits_aside_for_its_own_recv(pair: Pair) -> None:
    def sends() -> None:  # tag 1 first; its send completes when the receiver sets it aside
        for tag in (1, 2):
            pair.ends[0].send(torch.tensor([float(tag)]), 1, tag, "send")

    sender = pair.pool.submit(sends)
    y2, y1 = torch.empty(1), torch.empty(1)
    _done(pair.recv(1, y2, tag=2), sender)
    _done(pair.recv(1, y1, tag=1))
    assert (y1.item(), y2.item()) == (1.0, 2.0)


def test_a_recv_from_any_source_names_the_sender(pair: Pair) -> None:
    x = torch.empty(4)
    got = pair.recv(1, x, tag=5, src=None)
    _done(pair.send(0, torch.full((4,), 9.0), tag=5))
    assert got.result(timeout=30) == 0 and x.tolist() == [9.0] * 4


def test_a_message_goes_to_the_earliest_posted_receive_that_accepts_it(pair: Pair) -> None:
    end = pair.ends[1]
    into = [torch.zeros(2) for _ in range(4)]
    # Any source then rank 0, both tag 5; rank 0 then any source, tag 6; posted in this order.
    posted = [end.post(into[0], None, 5, "a"), end.post(into[1], 0, 5, "b")]
    posted += [end.post(into[2], 0, 6, "c"), end.post(into[3], None, 6, "d")]
    finished = [pair.pool.submit(end.finish, receive) for receive in reversed(posted)]
    for k, tag in enumerate((5, 5, 6, 6)):
        pair.ends[0].send(torch.full((2,), float(k)), 1, tag, "send")
    assert _done(*finished) == [0, 0, 0, 0]
    assert [x[0].item() for x in into] == [0.0, 1.0, 2.0, 3.0]


def test_a_receive_reading_its_link_hands_another_receives_message_over(pair: Pair) -> None:
    end = pair.ends[1]
    mine, theirs = torch.zeros(3), torch.zeros(3)
    # On its source's lane, as the group runs it: a receive from any source leaves that link to it.
    reading = end.recv_lane(0, 1).submit("recv", functools.partial(end.recv, mine, 0, 1, "tag 1"), True)
    waiting = pair.pool.submit(end.recv, theirs, None, 2, "from any rank, tag 2")
    _done(pair.send(0, torch.full((3,), 2.0), tag=2))  # read by the receive of tag 1, for the other
    assert waiting.result(timeout=30) == 0 and theirs.tolist() == [2.0] * 3
    _done(pair.send(0, torch.full((3,), 1.0), tag=1))
    reading.wait(timeout=30)
    assert mine.tolist() == [1.0] * 3


def test_a_receive_another_reader_landed_returns_while_that_reader_still_waits() -> None:
    pair = Pair(timeout=5.0)
    try:
        end = pair.ends[1]
        _done(pair.send(0, torch.ones(1), tag=9), pair.recv(1, torch.empty(1), tag=9))  # opens the link
        first, second = torch.zeros(1), torch.zeros(1)
        earlier = end.post(first, 0, 0, "earlier")  # posted first: the first message is its
        later = end.post(second, 0, 0, "later")
        reading = pair.pool.submit(end.finish, later)  # holds the link, reading for itself
        deadline = time.monotonic() + 10
        while not end._incoming[0].lock.locked() and time.monotonic() < deadline:  # noqa: SLF001
            time.sleep(0.001)
        landed = pair.pool.submit(end.finish, earlier)
        _done(pair.send(0, torch.tensor([1.0]), tag=0))  # read by ``later``'s reader, for ``earlier``
        assert landed.result(timeout=30) == 0 and first.item() == 1.0
        # The next message follows only the first's receive, as a reply would: ``later`` waits for it.
        _done(pair.send(0, torch.tensor([2.0]), tag=0), reading)
        assert second.item() == 2.0
    finally:
        pair.close()


def test_receives_from_one_source_and_tag_are_issued_in_the_order_their_lane_runs_them() -> None:
    """A receive is issued as it takes its place on its lane, so none waits behind a later one.

    Issued first and queued second, ``a`` would get the first message while its work waited for
    ``b``, which waits for a second message that follows ``a`` (as a reply would): a timeout.
    """
    pair = Pair(timeout=5.0)
    try:
        end = pair.ends[1]
        _done(pair.send(0, torch.ones(1), tag=9), pair.recv(1, torch.empty(1), tag=9))  # opens the link
        lane = end.recv_lane(0, 0)
        a, b = torch.zeros(1), torch.zeros(1)
        works = {}
        for name, into in (("b", b), ("a", a)):  # b takes its place on the lane first
            receive = end.receive(into, 0, 0, name)
            issue = functools.partial(end.post_receive, receive)
            works[name] = lane.submit(name, functools.partial(end.finish, receive), True, None, None, issue)
        _done(pair.send(0, torch.tensor([1.0]), tag=0))
        works["b"].wait(timeout=30)
        assert b.item() == 1.0 and a.item() == 0.0
        _done(pair.send(0, torch.tensor([2.0]), tag=0))  # sent only once the first receive is done
        works["a"].wait(timeout=30)
        assert a.item() == 2.0
    finally:
        pair.close()


def test_a_send_nobody_receives_times_out_naming_peer_and_tag_and_the_link_stays_usable() -> None:
    pair = Pair(timeout=0.5)
    try:
        # No link yet: the receiver never asked for one.
        with pytest.raises(
            CommTimeoutError,
            match=r"\[rank 0/2\] ring\.send to rank 1 tag 4: rank 1 did not receive the message within 0\.5",
        ):
            pair.send(0, torch.ones(2), tag=4).result(timeout=30)
        # Over an open link: the message waits in it, and a later recv still takes it.
        _done(pair.send(0, torch.ones(1), tag=0), pair.recv(1, torch.empty(1), tag=0))
        with pytest.raises(
            CommTimeoutError, match=r"tag 6: rank 1 did not receive the message within 0\.5 s"
        ):
            pair.send(0, torch.full((2,), 3.0), tag=6).result(timeout=30)
        late = torch.empty(2)
        _done(pair.recv(1, late, tag=6))
        assert late.tolist() == [3.0, 3.0]
        y = torch.empty(1)
        _done(pair.send(0, torch.tensor([8.0]), tag=0), pair.recv(1, y, tag=0))
        assert y.item() == 8.0
    finally:
        pair.close()


def test_a_recv_nobody_sends_to_times_out_naming_peer_and_tag() -> None:
    pair = Pair(timeout=0.3)
    try:
        with pytest.raises(
            CommTimeoutError,
            match=r"\[rank 1/2\] ring\.recv from rank 0 tag 2: no message from rank 0 within",
        ):
            pair.recv(1, torch.empty(1), tag=2).result(timeout=30)
    finally:
        pair.close()


def test_a_receive_that_fails_is_withdrawn_before_it_lets_go_of_its_link() -> None:
    # Once the link is free, a receive from any rank may read the next message and hand it to the
    # earliest posted receive that accepts it: one that failed must not be posted by then, or the
    # message lands in a receive nobody waits for.
    pair = Pair(timeout=0.3)
    try:
        end = pair.ends[1]
        _done(pair.send(0, torch.ones(1), tag=9), pair.recv(1, torch.empty(1), tag=9))  # opens the link
        holding: list[bool] = []
        withdraw = end.withdraw

        def recording(receive: Any) -> None:
            holding.append(end._incoming[0].lock.locked())  # noqa: SLF001
            withdraw(receive)

        end.withdraw = recording  # type: ignore[method-assign]
        with pytest.raises(CommTimeoutError, match="no message from rank 0 within"):
            pair.recv(1, torch.empty(1), tag=2).result(timeout=30)
        assert holding[:1] == [True], holding
        late = torch.empty(1)
        _done(pair.send(0, torch.tensor([5.0]), tag=2), pair.recv(1, late, tag=2))
        assert late.item() == 5.0
    finally:
        pair.close()


def _connect(pair: Pair, rank: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", pair.peers[rank].port), timeout=5)


def _frame(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("!I", len(body)) + body


def test_strangers_and_replayed_hellos_are_dropped_while_ranks_get_through(pair: Pair) -> None:
    pair.ends[1]._peer_links.start_acceptor()  # noqa: SLF001 - serve the listener before any recv
    silent = _connect(pair, 1)  # says nothing at all
    garbage = _connect(pair, 1)
    garbage.sendall(b"GET / HTTP/1.0\r\n\r\n")
    huge = _connect(pair, 1)
    huge.sendall(struct.pack("!I", 1 << 30))
    forged = _connect(pair, 1)
    forged.sendall(_frame({"p2p_hello": 0, "to": 1, "nonce": "x", "proof": "00" * 32}))
    x = torch.empty(2)
    _done(pair.send(0, torch.ones(2), tag=1), pair.recv(1, x, tag=1))  # the real rank gets through
    assert x.tolist() == [1.0, 1.0]
    # A hello copied off the wire is good for one link only.
    hello = p2p_hello(SESSION, 0, 1)
    first, second = _connect(pair, 1), _connect(pair, 1)
    first.sendall(_frame(hello))
    deadline = time.monotonic() + 10
    while hello["nonce"] not in pair.ends[1]._peer_links._nonces and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.01)
    second.sendall(_frame(hello))
    second.settimeout(5)
    assert second.recv(100) == b""  # dropped
    for sock in (silent, garbage, huge, forged, first, second):
        sock.close()
    assert pair.ends[1].links[1] == {0: pair.ends[1].links[1][0]}  # still the one link from rank 0


def test_p2p_hellos_verify_only_for_their_own_session_source_and_destination() -> None:
    hello = p2p_hello(SESSION, 2, 5)
    assert p2p_hello_source(SESSION, hello, 5) == (2, hello["nonce"])
    assert p2p_hello_source(SESSION, hello, 4) is None
    assert p2p_hello_source(secrets.token_bytes(32), hello, 5) is None
    assert p2p_hello_source(SESSION, {**hello, "p2p_hello": 3}, 5) is None
    assert p2p_hello_source(SESSION, ["not", "a", "dict"], 5) is None


def test_close_wakes_a_send_waiting_for_its_link(pair: Pair) -> None:
    waiting = pair.send(0, torch.ones(1))  # rank 1 never receives: the link's set-up waits for it
    deadline = time.monotonic() + 10
    while not pair.ends[0]._peer_links._connecting and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.01)
    pair.ends[0].close()
    with pytest.raises(GroupClosedError):
        waiting.result(timeout=5)  # well before the pair's 10 s timeout


def test_close_wakes_a_waiting_recv(pair: Pair) -> None:
    waiting = pair.recv(1, torch.empty(1))
    time.sleep(0.05)
    pair.ends[1].close()
    with pytest.raises(GroupClosedError):
        waiting.result(timeout=30)


class _FailingLink:
    """A link whose next header read fails, after ``meanwhile`` ran (another reader's work)."""

    def __init__(self, link: Any, meanwhile: Callable[[], None]) -> None:
        self._link, self._meanwhile = link, meanwhile

    def ready(self) -> bool:
        return True

    def recv_record(self, record: Any) -> Any:
        self._meanwhile()
        raise CommError("the link broke (end of file)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)


def test_a_receive_from_any_source_whose_link_fails_keeps_a_message_another_reader_landed() -> None:
    # A receive from any source reads one link while another source's reader matches it and lands
    # its message; then the first link breaks. The receive returns that message: raising would lose
    # a message its sender was told was taken. A link that breaks before anyone matched it fails it.
    pair = Pair(timeout=5.0)
    try:
        end = pair.ends[1]
        _done(pair.send(0, torch.ones(1), tag=9), pair.recv(1, torch.empty(1), tag=9))  # opens the link
        incoming = end._incoming[0]  # noqa: SLF001
        into = torch.zeros(2)
        receive = end.post(into, None, 3, "[rank 1/2] ring.recv from any rank tag 3")

        def another_reader_lands_it() -> None:  # as the reader of a third rank's link would
            with end._matching:  # noqa: SLF001
                assert end._posted.match(2, 3) is receive  # noqa: SLF001
            into.copy_(torch.tensor([4.0, 5.0]))
            end._landed(receive, 2)  # noqa: SLF001

        incoming.link = _FailingLink(incoming.link, another_reader_lands_it)
        assert end.finish(receive) == 2 and into.tolist() == [4.0, 5.0]
        assert incoming.failed is not None  # the link stays failed for the receives that read it

        incoming.failed = None
        incoming.link = _FailingLink(incoming.link._link, lambda: None)  # noqa: SLF001
        lone = end.post(torch.zeros(1), None, 4, "[rank 1/2] ring.recv from any rank tag 4")
        with pytest.raises(CommError, match="the link broke"):
            end.finish(lone)
        with end._matching:  # noqa: SLF001
            assert not end._posted.withdraw(lone)  # noqa: SLF001 - withdrawn with its error
    finally:
        pair.close()
