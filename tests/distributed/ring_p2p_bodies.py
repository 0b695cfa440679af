"""Bodies of the ring's own point-to-point and subgroup tests (run on spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch

import commlib
from commlib import CommTimeoutError, IProcessGroup


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


def body_subgroup_links(group: IProcessGroup) -> tuple[str, str, list[float]]:
    """A subgroup's ring uses the parent's transport; it works after the parent closes, and vice versa."""
    r, n = group.rank, group.world_size
    evens = group.new_group([q for q in range(n) if q % 2 == 0])
    odds = group.new_group([q for q in range(n) if q % 2 == 1])
    mine = evens if r % 2 == 0 else odds
    other = odds if r % 2 == 0 else evens
    assert other == commlib.GroupMember.NON_GROUP_MEMBER and mine is not None
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


def _on_close_flush(flushing: Any) -> None:
    """Set ``flushing`` when this process's ring group starts waiting for its sends in flight at close."""
    from commlib.lanes import Lane

    wait_idle = Lane.wait_idle

    def waiting(lane: Lane, timeout: float) -> bool:
        flushing.set()
        return wait_idle(lane, timeout)

    Lane.wait_idle = waiting  # type: ignore[method-assign]


def body_isend_then_destroy(flushing: Any, closed: Any, receives: bool) -> dict[str, Any]:
    """Rank 0 isends 1000 floats to rank 1 and closes its group at once; rank 1 receives only then.

    Rank 0 calls ``close()``, which closes its side alone (``destroy_process_group`` first runs a
    barrier with the other ranks, so rank 1 would have to be there already). Rank 1 posts its recv
    once rank 0's close waits for the send (``flushing``), or, when it does not receive, leaves its
    group once rank 0's close has returned (``closed``). Reports what arrived, and how rank 0's
    send ended.
    """
    import commlib

    group = commlib.init_process_group("ring")
    expected = torch.arange(1000, dtype=torch.float32) * 3 + 1
    if group.rank == 0:
        _on_close_flush(flushing)
        work = commlib.isend(expected.clone(), 1)
        group.close()
        commlib.destroy_process_group()  # the default group, closed already: forgotten
        done = work.is_completed()
        closed.set()
        try:
            work.wait()
        except commlib.CommError as e:
            return {"completed": done, "error_type": type(e).__name__, "error": str(e)}
        return {"completed": done, "error": None}
    if not (flushing if receives else closed).wait(120):
        raise TimeoutError("rank 0 never reached its close")
    try:
        if not receives:
            return {}
        got = torch.zeros(1000)
        commlib.recv(got, 0)
        return {"equal": torch.equal(got, expected)}
    finally:
        group.close()
