"""Bodies of the ring's own point-to-point and subgroup tests (run on spawned ranks)."""

from __future__ import annotations

import hashlib

import torch

import commlib
from commlib import CommTimeoutError, IProcessGroup, P2POp


def _pattern(numel: int, source: int, dest: int, tag: int = 0) -> torch.Tensor:
    """What ``source`` sends ``dest``: exact in float32, different for every pair and tag."""
    return (
        (torch.arange(numel, dtype=torch.int64) * 7 + 1000 * source + 100 * dest + tag)
        .remainder(1 << 20)
        .to(torch.float32)
    )


def body_p2p_patterns(group: IProcessGroup, numel: int) -> str:
    """Ring exchange both ways in one batch, pairs that skip a rank, many small messages in order."""
    r, n = group.rank, group.world_size
    right, left = (r + 1) % n, (r - 1) % n
    from_left, from_right = torch.empty(numel), torch.empty(numel)
    works = group.batch_isend_irecv(
        [
            P2POp(group.isend, _pattern(numel, r, right), group_peer=right),
            P2POp(group.isend, _pattern(numel, r, left, 1), group_peer=left, tag=1),
            P2POp(group.irecv, from_left, group_peer=left),
            P2POp(group.irecv, from_right, group_peer=right, tag=1),
        ]
    )
    for work in works:
        work.wait()
    assert torch.equal(from_left, _pattern(numel, left, r)), "ring exchange, from the left"
    assert torch.equal(from_right, _pattern(numel, right, r, 1)), "ring exchange, from the right"
    assert works[2].source_rank() == left
    if n >= 3:  # pairs two apart, both sending first
        far = (r + 2) % n
        back = (r - 2) % n
        got = torch.empty(numel)
        send = group.isend(_pattern(numel, r, far, 2), far, tag=2)
        assert group.recv(got, back, tag=2) == back
        send.wait()
        assert torch.equal(got, _pattern(numel, back, r, 2)), "a pair that skips a rank"
    # Many small messages with one tag, in order; a recv from any rank names each sender.
    count = 40
    if r == 0:
        seen = []
        for _ in range(count * (n - 1)):
            x = torch.empty(2, dtype=torch.int64)
            source = group.recv(x, None, tag=3)
            assert x[0].item() == source
            seen.append((source, x[1].item()))
        for source in range(1, n):
            assert [i for s, i in seen if s == source] == list(range(count)), f"rank {source} out of order"
    else:
        sends = [group.isend(torch.tensor([r, i]), 0, tag=3) for i in range(count)]
        for work in sends:
            work.wait()
    group.barrier()
    return hashlib.sha256(from_left.numpy().tobytes()).hexdigest()[:8]


def body_size_mismatch(group: IProcessGroup) -> str:
    """A send into a smaller recv raises on both sides; the next message goes through."""
    r = group.rank
    message = ""
    try:
        if r == 0:
            group.send(torch.ones(10), 1, tag=4)
        elif r == 1:
            group.recv(torch.empty(8), 0, tag=4)
    except commlib.CommError as e:
        assert isinstance(e, ValueError)
        message = str(e)
    if r in (0, 1):
        assert "tag 4" in message and "40 bytes" in message and "32 bytes" in message, message
    if r == 0:
        group.send(torch.full((3,), 2.0), 1, tag=4)
    elif r == 1:
        x = torch.empty(3)
        group.recv(x, 0, tag=4)
        assert x.tolist() == [2.0] * 3
    return message


def body_send_nobody_receives(group: IProcessGroup) -> list[str]:
    """Rank 0's sends to ranks 1 and 2 are never received: each times out naming peer and tag; the rest works.

    To rank 1 the link is open (the message waits in it, and a later recv still
    takes it); to rank 2 it is not (rank 2 never received, so nothing answers).
    The sends run on a subgroup of every rank with a short timeout, so that the
    parent's collectives wait long enough for rank 0's timeouts.
    """
    r, n = group.rank, group.world_size
    fast = group.new_group(list(range(n)), timeout=1.0)
    assert fast is not None
    if r == 0:
        fast.send(torch.zeros(1), 1)
    elif r == 1:
        fast.recv(torch.empty(1), 0)
    messages = []
    if r == 0:
        for peer in (1, 2):
            try:
                fast.send(torch.ones(4), peer, tag=9)
            except CommTimeoutError as e:
                messages.append(str(e))
            else:
                raise AssertionError(f"a send to rank {peer} that nobody receives did not time out")
        assert all(f"rank {peer} did not receive" in m for peer, m in zip((1, 2), messages, strict=True)), (
            messages
        )
        assert all("tag 9" in m for m in messages), messages
    group.barrier()  # ranks 1 and 2 wait here for rank 0's timeouts
    t = torch.tensor([float(r)])
    fast.all_reduce(t)  # the subgroup's ring is fine
    assert t.item() == n * (n - 1) / 2
    if r == 0:  # point-to-point with both still works
        fast.send(torch.full((2,), 5.0), 2, tag=1)
        fast.send(torch.full((2,), 6.0), 1, tag=1)
    elif r in (1, 2):
        x = torch.empty(2)
        fast.recv(x, 0, tag=1)
        assert x.tolist() == [7.0 - r] * 2
    if r == 1:  # the message that timed out in an open link was not withdrawn
        y = torch.empty(4)
        fast.recv(y, 0, tag=9)
        assert y.tolist() == [1.0] * 4
    group.barrier()
    fast.close()
    return messages


def body_big_message(group: IProcessGroup, numel: int) -> str:
    """One message of ``numel`` float32 each way at once between ranks 0 and 1."""
    r = group.rank
    peer = 1 - r
    mine = torch.arange(numel, dtype=torch.float32) * (r + 1)
    got = torch.empty(numel)
    works = group.batch_isend_irecv(
        [P2POp(group.isend, mine, group_peer=peer), P2POp(group.irecv, got, group_peer=peer)]
    )
    for work in works:
        work.wait()
    assert torch.equal(got, torch.arange(numel, dtype=torch.float32) * (peer + 1))
    return hashlib.sha256(got.numpy().tobytes()).hexdigest()[:8]


def body_subgroup_links(group: IProcessGroup) -> tuple[str, str, list[float]]:
    """A subgroup's ring uses the parent's transport; it works after the parent closes, and vice versa."""
    r, n = group.rank, group.world_size
    evens = group.new_group([q for q in range(n) if q % 2 == 0])
    odds = group.new_group([q for q in range(n) if q % 2 == 1])
    mine = evens if r % 2 == 0 else odds
    other = odds if r % 2 == 0 else evens
    assert other is None and mine is not None
    transports = mine.transports if mine.world_size > 1 else ("none", "none")  # type: ignore[attr-defined]
    results = []
    t = torch.tensor([float(r)])
    mine.all_reduce(t)
    results.append(t.item())
    if mine.world_size > 1:  # point-to-point inside the subgroup, on its own listener
        x = torch.empty(1)
        peer = 1 - mine.rank if mine.rank < 2 else None
        if peer is not None:
            work = mine.isend(torch.tensor([float(r)]), peer)
            mine.recv(x, peer)
            work.wait()
            results.append(x.item())
    survivor = group.new_group(list(range(n)))
    assert survivor is not None
    mine.close()  # closing a subgroup leaves the parent working
    t = torch.ones(1)
    group.all_reduce(t)
    results.append(t.item())
    group.close()
    t = torch.ones(1)  # the parent is closed: its subgroup goes on
    survivor.all_reduce(t)
    results.append(t.item())
    survivor.close()
    return transports[0], transports[1], results
