"""Bodies for what only the mpi backend does: its point-to-point protocol and its MPI subgroups.

Run under ``mpiexec`` by ``tests/distributed/test_mpi_backend.py`` through the
runner of ``mpi_bodies.py`` (``tests.distributed.mpi_feature_bodies:<body>``).
Each returns plain values; the test asserts on them.
"""

from __future__ import annotations

from typing import Any

import torch

import commlib
from commlib import CommError, CommTimeoutError, IProcessGroup, ReduceOp


def _error(call: Any) -> tuple[str, bool, str] | None:
    """Run ``call``; return (type name, is a ValueError, message) of the CommError it raises, or None."""
    try:
        call()
    except CommError as e:
        return type(e).__name__, isinstance(e, ValueError), str(e)
    return None


def p2p_sizes_sources_order(group: IProcessGroup, messages: int = 300) -> dict[str, Any]:
    """Size mismatches fail both sides; any-source receives name the sender; receives match in posting order.

    Ranks 0 and 1 exchange; every other rank also sends to rank 0 (any source),
    and on three ranks and more rank 2 sends to rank 1 on the order tag too.
    """
    rank, world = group.rank, group.world_size
    out: dict[str, Any] = {}
    # 1. A message larger, then smaller, than the receiver's 4 floats; then a good one on the same tag.
    if rank == 0:
        out["send"] = [_error(lambda n=n: group.send(torch.arange(float(n)), 1, tag=9)) for n in (10, 2)]
        group.send(torch.full((4,), 5.0), 1, tag=9)
    elif rank == 1:
        received = []
        for _ in range(2):
            t = torch.full((4,), 7.0)
            received.append((_error(lambda t=t: group.recv(t, 0, tag=9)), t.tolist()))
        t = torch.zeros(4)
        group.recv(t, 0, tag=9)
        out["recv"] = received
        out["after"] = t.tolist()
    # 2. Any source: rank 0 takes one message from every other rank, by recv and by irecv.
    if rank == 0:
        sources = []
        for i in range(world - 1):
            t = torch.zeros(2, dtype=torch.int64)
            if i % 2:
                work = group.irecv(t, tag=4)
                work.wait()
                source = work.source_rank()
            else:
                source = group.recv(t, tag=4)
            sources.append((source, t.tolist()))
        out["any_source"] = sorted(sources)
    else:
        group.send(torch.full((2,), rank * 10, dtype=torch.int64), 0, tag=4)
    # 3. Order: numbered messages from rank 0, received alternately from rank 0 and from any rank.
    #    On 3 ranks and more, rank 2's messages on the same tag go to the receives from rank 2 posted
    #    first: MPI gives a message to the earliest posted receive that accepts it.
    extra = 20 if world > 2 else 0
    if rank == 0:
        works = [group.isend(torch.tensor([i]), 1, tag=3) for i in range(messages)]
        for work in works:
            work.wait()
    elif rank == 1:
        early = [torch.full((1,), -1, dtype=torch.int64) for _ in range(extra)]
        early_works = [group.irecv(b, 2, tag=3) for b in early]
        buffers = [torch.full((1,), -1, dtype=torch.int64) for _ in range(messages)]
        works = [group.irecv(b, 0 if i % 2 else None, tag=3) for i, b in enumerate(buffers)]
        for work in reversed(early_works + works):
            work.wait()
        out["order"] = [b.item() for b in buffers] == list(range(messages))
        out["order_sources"] = sorted({w.source_rank() for w in works})
        out["early"] = [b.item() for b in early] == [1000 + i for i in range(extra)]
    elif rank == 2:
        for i in range(extra):
            group.send(torch.tensor([1000 + i]), 1, tag=3)
    group.barrier()
    return out


def p2p_timeouts(group: IProcessGroup, timeout_s: float = 1.5) -> dict[str, Any]:
    """On a subgroup with a short timeout: a receive and a send without their peers time out; the group lives.

    The receive is withdrawn; the send stays queued at its peer, which receives
    it afterwards (after a barrier), so nothing is left in flight at exit.
    """
    rank = group.rank
    fast = group.new_group(list(range(group.world_size)), timeout=timeout_s)
    assert fast is not None
    out: dict[str, Any] = {}
    if rank == 1:
        t = torch.full((3,), 2.0)
        try:
            fast.recv(t, 0, tag=11)
        except CommTimeoutError as e:
            out["recv"] = str(e)
        out["recv_tensor"] = t.tolist()
    elif rank == 0:
        try:
            fast.send(torch.full((3,), 8.0), 1, tag=12)
        except CommTimeoutError as e:
            out["send"] = str(e)
    # Both sides stay usable: a collective, then a message in each direction.
    total = torch.ones(1)
    fast.all_reduce(total, ReduceOp.SUM)
    out["all_reduce"] = total.item()
    if rank == 1:
        late = torch.zeros(3)
        out["late_source"] = fast.recv(late, 0, tag=12)
        out["late"] = late.tolist()
        fast.send(torch.ones(2), 0, tag=13)
    elif rank == 0:
        back = torch.zeros(2)
        fast.recv(back, 1, tag=13)
        out["back"] = back.tolist()
    fast.barrier()
    fast.close()
    out["left_in_flight"] = len(fast._pending)  # type: ignore[attr-defined]
    group.barrier()
    return out


def mpi_subgroups(group: IProcessGroup) -> dict[str, Any]:
    """new_group is ``Create_group`` over the members, split ``Comm.Split``; closing frees the communicators.

    Needs 3 ranks or more.
    """
    from mpi4py import MPI

    rank, world = group.rank, group.world_size
    world_group = MPI.COMM_WORLD.Get_group()

    def members(sub: IProcessGroup) -> list[int]:
        """The world ranks of ``sub``'s communicator, in its rank order."""
        mine = sub.comm.Get_group()  # type: ignore[attr-defined]
        try:
            return list(MPI.Group.Translate_ranks(mine, list(range(sub.world_size)), world_group))
        finally:
            mine.Free()

    out: dict[str, Any] = {}
    pair = group.new_group([world - 1, 0])
    if pair != commlib.GroupMember.NON_GROUP_MEMBER:
        out["pair"] = (pair.rank, pair.world_size, members(pair), list(pair.global_ranks))
    # Reversed by key: the last rank of each color comes first.
    halves = group.split(rank % 2, key=-rank)
    assert halves is not None
    out["halves"] = (halves.rank, halves.world_size, members(halves))
    none = group.split(None if rank == 0 else 0)
    out["split_none"] = none == commlib.GroupMember.NON_GROUP_MEMBER
    # A child of a group outlives it: close the parent, keep using the child.
    parent = group.new_group(list(range(world)))
    assert parent is not None
    child = parent.new_group(list(range(1, world)))
    parent.close()
    if child != commlib.GroupMember.NON_GROUP_MEMBER:
        t = torch.ones(3)
        child.all_reduce(t)
        out["child_after_parent_closed"] = t.tolist()
        comms = [child.comm, *child._messages.comms]  # type: ignore[attr-defined]
        child.close()
        out["child_comms_freed"] = all(c == MPI.COMM_NULL for c in comms)
    for sub in (pair, halves, none):
        if sub != commlib.GroupMember.NON_GROUP_MEMBER:
            sub.close()
    t = torch.ones(1)
    group.all_reduce(t)
    out["parent_after"] = t.item()
    world_group.Free()
    return out
