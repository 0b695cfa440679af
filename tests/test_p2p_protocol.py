"""backends.common.p2p_protocol alone: no process, no socket, no thread.

Matching in posting order (any-source receives included), the receiver's
verdict, and the errors both sides raise for a refused message, word for word.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.common import p2p_protocol as p
from commlib.errors import CommError, MessageMismatchError, MessageSizeError

F32, I32 = p.CODES[torch.float32], p.CODES[torch.int32]
LABEL = "[rank 1/2] x.recv #1 from rank 0 tag 9"


@dataclasses.dataclass(eq=False)
class Recv:
    wanted: int | None
    tag: int
    name: str


def _posted(*receives: Recv) -> p.PostedReceives[Recv]:
    posted: p.PostedReceives[Recv] = p.PostedReceives()
    for receive in receives:
        posted.post(receive)
    return posted


def test_a_message_goes_to_the_probed_receive_when_it_is_the_earliest_taker() -> None:
    a, b = Recv(0, 5, "a"), Recv(1, 5, "b")
    posted = _posted(a, b)
    assert posted.take(1, 1) == (b, 1), "a wants rank 0: b takes it; the next to probe is the one after b"
    assert posted.pending == [a]


def test_an_earlier_any_source_receive_takes_the_message_found_for_a_later_one() -> None:
    any_, mine = Recv(None, 5, "any"), Recv(1, 5, "from 1")
    posted = _posted(any_, mine)
    taker, again = posted.take(1, 1)
    assert (taker, again) == (any_, 0), "the receive probed shifted left: probe it again"
    assert posted.pending == [mine]
    assert posted.take(0, 1) == (mine, 0)
    assert posted.pending == []


def test_receives_of_other_tags_or_sources_never_take_it() -> None:
    other_tag, other_source, any_ = Recv(None, 4, "t4"), Recv(2, 5, "from 2"), Recv(None, 5, "any")
    posted = _posted(other_tag, other_source, any_)
    assert posted.take(2, 1) == (any_, 2)
    assert posted.pending == [other_tag, other_source]


def test_messages_of_one_pair_and_tag_go_to_receives_in_posting_order() -> None:
    receives = [Recv(None if i % 2 else 0, 3, f"r{i}") for i in range(4)]
    posted = _posted(*receives)
    got = []
    while posted.pending:
        got.append(posted.take(len(posted.pending) - 1, 0)[0])
    assert got == receives


def test_a_message_read_off_its_link_goes_to_the_earliest_receive_that_accepts_it() -> None:
    other_tag, any_, mine = Recv(None, 4, "t4"), Recv(None, 5, "any"), Recv(1, 5, "from 1")
    posted = _posted(other_tag, mine, any_)
    assert posted.match(1, 5) is mine
    assert posted.match(2, 5) is any_
    assert posted.match(2, 5) is None, "no receive takes it: it goes aside"
    assert posted.pending == [other_tag]


def test_uncovered_receives_are_the_earliest_takers_of_each_source() -> None:
    any5, from1, from1_again, any5_again = (
        Recv(None, 5, "a"),
        Recv(1, 5, "b"),
        Recv(1, 5, "c"),
        Recv(None, 5, "d"),
    )
    first, second, other_tag = Recv(1, 6, "e"), Recv(2, 6, "f"), Recv(1, 6, "g")
    posted = _posted(any5, from1, from1_again, any5_again, first, second, other_tag)
    assert posted.uncovered() == [any5, first, second], "an earlier any-source or same-source receive covers"
    posted.withdraw(any5)
    assert posted.uncovered() == [from1, any5_again, first, second]


def test_withdraw_removes_only_an_unmatched_receive() -> None:
    a, b = Recv(0, 1, "a"), Recv(0, 1, "b")
    posted = _posted(a, b)
    assert posted.withdraw(a) and not posted.withdraw(a)
    assert posted.withdraw_all() == [b] and posted.pending == []


@dataclasses.dataclass
class Kept:
    """A message set aside (``p2p_protocol.Aside``): its tag, its source, and which one it is."""

    tag: int
    source: int
    n: int = 0


def test_take_aside_returns_the_oldest_message_with_the_tag() -> None:
    queue = [Kept(1, 0, n=0), Kept(2, 0, n=1), Kept(1, 0, n=2)]
    assert p.take_aside(queue, 1) == Kept(1, 0, n=0)
    assert p.take_aside(queue, 3) is None
    assert p.take_aside(queue, 1) == Kept(1, 0, n=2)
    assert queue == [Kept(2, 0, n=1)]


def test_take_aside_from_one_source() -> None:
    queue = [Kept(1, 0), Kept(1, 2), Kept(1, 0)]
    assert p.take_aside(queue, 1, source=2) == Kept(1, 2)
    assert p.take_aside(queue, 1, source=3) is None
    assert queue == [Kept(1, 0), Kept(1, 0)]


def test_layouts_and_codes() -> None:
    tensor = torch.zeros(2, 3, dtype=torch.float32)
    assert p.layout_of(tensor) == (24, 6, F32)
    assert p.message_layout((24, 6, F32)) == (24, 6, torch.float32)
    assert p.message_layout((24, 6, -1)) == (24, 6, None)
    assert p.message_layout((24, 6, 200)) == (24, 6, None)
    assert p.LAYOUT.unpack(p.LAYOUT.pack(24, 6, F32)) == (24, 6, F32) and p.LAYOUT.size == 24


@pytest.mark.parametrize(
    ("sent_tag", "sent", "holds", "expected"),
    [
        (9, (40, 10, F32), (40, 10, F32), p.TAKEN),
        (9, (40, 10, F32), (40, 20, F32), p.TAKEN),  # bytes and dtype decide
        (9, (40, 10, F32), (80, 20, F32), p.REFUSED),
        (9, (40, 10, F32), (40, 10, I32), p.REFUSED),
        (8, (40, 10, F32), (80, 20, I32), p.SET_ASIDE),
    ],
)
def test_the_receivers_verdict(sent_tag: int, sent: p.Layout, holds: p.Layout, expected: int) -> None:
    assert p.verdict(sent_tag, sent, 9, holds) == expected
    if sent_tag == 9:
        assert p.fits(sent, holds) == (expected == p.TAKEN)


def test_a_size_mismatch_names_both_sides_and_how_to_fix_it() -> None:
    recv = p.mismatch(LABEL, "recv", 0, (40, 10, F32), (16, 4, F32))
    assert type(recv) is MessageSizeError
    assert str(recv) == (
        f"{LABEL}: rank 0 sends 40 bytes (10 x float32), but this recv's tensor holds 16 bytes "
        "(4 x float32); nothing was written into it (rank 0 raises too). A send and its recv must have "
        "tensors of the same dtype and size; the pair stays usable"
    )
    send = p.mismatch("[rank 0/2] x.send #1 to rank 1 tag 9", "send", 1, (40, 10, F32), (16, 4, F32))
    assert str(send) == (
        "[rank 0/2] x.send #1 to rank 1 tag 9: rank 1's matching recv holds 16 bytes (4 x float32), but "
        "this send has 40 bytes (10 x float32); nothing was received (rank 1 raises too). A send and its "
        "recv must have tensors of the same dtype and size; the pair stays usable"
    )


def test_a_dtype_mismatch_says_which_dtype_to_use() -> None:
    error = p.mismatch(LABEL, "recv", 0, (16, 4, F32), (16, 4, I32), peer_told=False)
    assert type(error) is MessageMismatchError
    assert str(error) == (
        f"{LABEL}: rank 0 sends 16 bytes (4 x float32), but this recv's tensor holds 16 bytes (4 x int32); "
        "nothing was written into it (rank 0 was not told: the message came before a recv with its tag, "
        "and its send completed). A send and its recv must have the same dtype and number of elements: "
        "receive into a float32 tensor (convert it after with .to(torch.int32)), or send "
        "tensor.to(torch.int32); the pair stays usable"
    )


def test_the_sender_reads_the_verdict() -> None:
    mine = (40, 10, F32)
    p.check_answer((p.TAKEN, 40, 10, F32), "s", 1, mine)
    p.check_answer([p.SET_ASIDE, 40, 10, F32], "s", 1, mine)
    with pytest.raises(MessageSizeError) as refused:
        p.check_answer((p.REFUSED, 16, 4, F32), "s", 1, mine)
    assert str(refused.value) == str(p.mismatch("s", "send", 1, mine, (16, 4, F32)))
    with pytest.raises(CommError, match=r"^s: rank 1 answered the header with garbage \(\[7, 0, 0, 0\]\)$"):
        p.check_answer([7, 0, 0, 0], "s", 1, mine)


def test_the_receiver_reads_the_header() -> None:
    assert p.check_header([p.MAGIC, 40, 10, F32], "r", 0) == (40, 10, F32)
    with pytest.raises(CommError, match=r"^r: rank 0 sent a header commlib does not know \(\[1, 2, 3, 4\]\)"):
        p.check_header([1, 2, 3, 4], "r", 0)


def test_a_mismatch_reported_before_its_label_becomes_the_same_error() -> None:
    fact = p.Mismatch("recv", 0, 9, (40, 10, F32), (16, 4, F32))
    assert (fact.side, fact.peer, fact.tag) == ("recv", 0, 9)
    assert str(fact.error(LABEL)) == str(p.mismatch(LABEL, "recv", 0, (40, 10, F32), (16, 4, F32)))
