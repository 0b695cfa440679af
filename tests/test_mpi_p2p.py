"""backends.mpi.p2p in-process: matching in posting order, sends in issue order, the dtype and size answer.

A fake MPI stands in for mpi4py: messages "arrive" on a schedule (after a given
number of probes), so the cases that real timing makes rare are made to happen:
a message that arrives while the engine is between two probes must still go to
the earliest posted receive that accepts it, exactly as MPI would match it.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import pytest

from backends.mpi.p2p import DirectPayload, Mismatch, P2PEngine

ANY = -1


FLOAT32, INT32 = 0, 4
"""Dtype codes (any distinct integers do: the engine only compares them)."""


@dataclasses.dataclass
class Message:
    """A message's header, as the receiver probes it; its data follows on the same source and tag."""

    source: int
    tag: int
    nbytes: int
    numel: int = 0
    code: int = FLOAT32

    def Recv(self, buffer: list[Any]) -> None:  # noqa: N802
        buffer[0][:] = struct.pack("<qqq", self.nbytes, self.numel, self.code)


class Done:
    def Test(self) -> bool:  # noqa: N802
        return True


class Pending:
    """A request that completes when ``done`` is set (an answer the peer has not sent yet)."""

    def __init__(self, buffer: Any = None) -> None:
        self.buffer = buffer
        self.done = False

    def Test(self) -> bool:  # noqa: N802
        return self.done

    def Cancel(self) -> None:  # noqa: N802
        self.cancelled = self.done = True


class Status:
    def __init__(self) -> None:
        self.source = self.count = -1

    def Get_source(self) -> int:  # noqa: N802
        return self.source

    def Get_count(self, datatype: object) -> int:  # noqa: N802
        return self.count


class FakeMPI:
    ANY_SOURCE = ANY
    BYTE = "BYTE"
    ERR_TRUNCATE = 15
    Status = Status

    class Exception(Exception):  # noqa: N818 - mpi4py's name
        pass


class DataComm:
    """Messages arrive on a schedule: ``arrive_after[n]`` lands once ``n`` probes have been made."""

    def __init__(self) -> None:
        self.queue: list[Message] = []
        self.arrive_after: dict[int, list[Message]] = {}
        self.probes = 0
        self.sent: list[tuple[int, int, Any]] = []
        self.received: list[tuple[int, int, Any]] = []
        """The data receives posted: source, tag, buffer."""

    def Improbe(self, source: int, tag: int, status: Status) -> Message | None:  # noqa: N802
        try:
            for message in self.queue:
                if message.tag == tag and source in (ANY, message.source):
                    self.queue.remove(message)
                    status.source, status.count = message.source, message.nbytes
                    return message
            return None
        finally:
            self.probes += 1
            self.queue.extend(self.arrive_after.pop(self.probes, []))

    def Isend(self, buffer: Any, dest: int, tag: int) -> Done:  # noqa: N802
        self.sent.append((dest, tag, buffer))
        return Done()

    def Irecv(self, buffer: Any, source: int, tag: int) -> Done:  # noqa: N802
        self.received.append((source, tag, buffer))
        return Done()

    def data_sent(self) -> list[Any]:
        """The data buffers sent, in order (each after its 24-byte header)."""
        headers, data = self.sent[0::2], self.sent[1::2]
        assert all(len(h[2][0]) == 24 for h in headers)
        return [buffer for _, _, buffer in data]


class VerdictComm:
    def __init__(self) -> None:
        self.answers_sent: list[tuple[int, int, int]] = []
        self.awaited: list[tuple[int, int, Pending]] = []

    def Isend(self, buffer: list[Any], dest: int, tag: int) -> Done:  # noqa: N802
        self.answers_sent.append((dest, tag, *struct.unpack("<qqq", buffer[0])))
        return Done()

    def Irecv(self, buffer: list[Any], source: int, tag: int) -> Pending:  # noqa: N802
        request = Pending(buffer[0])
        self.awaited.append((source, tag, request))
        return request

    def answer(self, index: int, nbytes: int, numel: int = 0, code: int = -1) -> None:
        """The receiver's answer to the ``index``-th send arrives."""
        request = self.awaited[index][2]
        request.buffer[:] = struct.pack("<qqq", nbytes, numel, code)
        request.done = True


class LatePayload(DirectPayload):
    """A staged send's payload: not on the host until ``arrived`` is set."""

    def __init__(self, buffer: Any) -> None:
        super().__init__(buffer)
        self.arrived = False

    def ready(self) -> bool:
        return self.arrived


def _engine() -> tuple[P2PEngine, DataComm, VerdictComm]:
    data, verdict = DataComm(), VerdictComm()
    return P2PEngine(FakeMPI, data, verdict), data, verdict


def _holds(nbytes: int, numel: int = 0, code: int = FLOAT32) -> tuple[int, int, int]:
    return nbytes, numel, code


def test_a_message_goes_to_the_earliest_posted_receive_that_accepts_it() -> None:
    engine, data, _ = _engine()
    from_one = engine.recv(DirectPayload("a"), _holds(8), 1, tag=0)
    from_any = engine.recv(DirectPayload("b"), _holds(8), None, tag=0)
    # Rank 1's message lands after the first receive probed and found nothing: the receive from
    # any rank finds it, but MPI would have matched it with the earlier receive from rank 1.
    data.arrive_after[data.probes + 1] = [Message(1, 0, 8)]
    engine.match()
    assert from_one.matched and from_one.source == 1
    assert not from_any.matched
    data.queue.append(Message(2, 0, 8))
    engine.match()
    assert from_any.source == 2
    # Each receive takes the data that follows its header: from the header's source, with its tag.
    assert data.received == [(1, 0, "a"), (2, 0, "b")]


def test_receives_match_in_posting_order_and_other_tags_do_not_interfere() -> None:
    engine, data, verdict = _engine()
    data.queue += [Message(1, 5, 4, 1, INT32), Message(1, 0, 8, 2), Message(1, 0, 8, 2)]
    first = engine.recv(DirectPayload("first"), (8, 2, FLOAT32), None, tag=0)
    second = engine.recv(DirectPayload("second"), (8, 2, FLOAT32), 1, tag=0)
    other_tag = engine.recv(DirectPayload("other"), (4, 1, INT32), 1, tag=5)
    assert [r.source for r in (first, second, other_tag)] == [1, 1, 1]
    assert data.queue == []  # every message taken
    assert [r.Test() for r in (first, second, other_tag)] == [True, True, True]
    # Each receive answered its sender with what its buffer holds, in matching order.
    assert verdict.answers_sent == [(1, 0, 8, 2, FLOAT32), (1, 0, 8, 2, FLOAT32), (1, 5, 4, 1, INT32)]


def test_an_unmatched_receive_is_withdrawn_and_a_matched_one_is_not() -> None:
    engine, data, _ = _engine()
    waiting = engine.recv(DirectPayload("w"), _holds(8), 3, tag=1)
    assert engine.waiting
    assert engine.cancel(waiting) and waiting.cancelled
    assert not engine.waiting
    data.queue.append(Message(3, 1, 8))
    taken = engine.recv(DirectPayload("t"), _holds(8), 3, tag=1)
    assert taken.matched and not engine.cancel(taken)
    assert engine.cancel_all() == []


def test_sends_to_one_peer_and_tag_are_posted_in_the_order_issued() -> None:
    engine, data, verdict = _engine()
    slow = LatePayload("slow")
    first = engine.send(slow, _holds(8), 2, tag=0)
    second = engine.send(DirectPayload("fast"), _holds(8), 2, tag=0)
    elsewhere = engine.send(DirectPayload("other peer"), _holds(8), 3, tag=0)
    # The ready send waits behind the one still being copied; another peer does not.
    assert data.data_sent() == ["other peer"]
    assert not second.Test()
    slow.arrived = True
    assert not first.Test()  # posted now; its answer has not come
    assert data.data_sent() == ["other peer", "slow", "fast"]
    # Every message is its header, then its data, to the same peer and tag.
    assert [(dest, tag) for dest, tag, _ in data.sent] == [(3, 0), (3, 0), (2, 0), (2, 0), (2, 0), (2, 0)]
    assert struct.unpack("<qqq", data.sent[2][2][0]) == (8, 0, FLOAT32)
    # The answers were awaited in issue order, so each pairs with its own send.
    assert [(source, tag) for source, tag, _ in verdict.awaited] == [(2, 0), (2, 0), (3, 0)]
    for index in range(3):
        verdict.answer(index, 8, 0, FLOAT32)
    assert first.Test() and second.Test() and elsewhere.Test()


@pytest.mark.parametrize(
    ("sent", "holds"),
    [((40, 10, FLOAT32), (16, 4, FLOAT32)), ((16, 4, FLOAT32), (16, 4, INT32))],
    ids=["size", "dtype"],
)
def test_a_mismatch_fails_both_sides_and_drains_the_message(
    sent: tuple[int, int, int], holds: tuple[int, int, int]
) -> None:
    engine, data, verdict = _engine()
    data.queue.append(Message(1, 9, *sent))
    recv = engine.recv(DirectPayload("the receiver's tensor"), holds, 1, tag=9)
    with pytest.raises(Mismatch) as info:
        recv.Test()
    assert (info.value.side, info.value.peer, info.value.sent, info.value.holds) == ("recv", 1, sent, holds)
    assert data.received == [(1, 9, [bytearray(0), "BYTE"])], "drained into no memory, not into the tensor"
    assert verdict.answers_sent == [(1, 9, *holds)]
    send = engine.send(DirectPayload("the sender's tensor"), sent, 1, tag=9)
    verdict.answer(0, *holds)
    with pytest.raises(Mismatch) as info:
        send.Test()
    value = info.value
    assert (value.side, value.sent, value.holds) == ("send", sent, holds)


def test_a_send_whose_bytes_have_left_is_let_go_and_one_not_posted_is_not() -> None:
    engine, data, verdict = _engine()
    left = engine.send(DirectPayload("small"), _holds(8), 1, tag=0)
    assert not left.Test()  # no answer yet
    assert left.let_go() and verdict.awaited[0][2].cancelled
    stuck = engine.send(LatePayload("still on the device"), _holds(8), 1, tag=1)
    assert not stuck.let_go(), "a send not posted yet (its tensor still being copied) is not let go"
