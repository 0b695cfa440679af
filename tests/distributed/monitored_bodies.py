"""Test bodies for ``monitored_barrier``: run on spawned ranks (ring, gloo) and under mpiexec (mpi)."""

from __future__ import annotations

from typing import Any

import torch

import commlib
from commlib import CommError, IProcessGroup

DONE_TAG = 7
"""The user tag on which rank 0 tells the late ranks that the others' barrier has failed."""


def passes_beside_user_messages(group: IProcessGroup) -> dict[str, Any]:
    """Monitored barriers pass while user messages with the largest user tag are in flight.

    Neither takes the other's messages: the user's arrive intact after the barriers, and a
    collective afterwards is exact.
    """
    n, r = group.world_size, group.rank
    received = None
    if n > 1:
        left, right = (r - 1) % n, (r + 1) % n
        inbox = torch.zeros(5, dtype=torch.float64)
        recv = group.irecv(inbox, left, group.max_tag)
        send = group.isend(torch.full((5,), float(r), dtype=torch.float64), right, group.max_tag)
    for wait_all in (False, True, False):
        group.monitored_barrier(timeout=30, wait_all_ranks=wait_all)
    commlib.monitored_barrier(group, timeout=30)
    if n > 1:
        send.wait()
        recv.wait()
        assert torch.equal(inbox, torch.full((5,), float(left), dtype=torch.float64)), inbox
        received = recv.source_rank()
    total = torch.tensor([r + 1], dtype=torch.int64)
    group.all_reduce(total)
    assert int(total.item()) == n * (n + 1) // 2, total
    return {"calls": group._monitored_barriers, "received_from": received}


def late_ranks(group: IProcessGroup, late: list[int], wait_all: bool, timeout_s: float) -> dict[str, Any]:
    """Ranks ``late`` skip the second monitored barrier; every other rank's must fail naming them.

    The late ranks wait for rank 0's word (a user message) instead, so that they are alive, and
    not at the barrier, while the others wait.
    """
    from tests.distributed.diagnosis_bodies import CapturedWarnings

    r = group.rank
    group.monitored_barrier(timeout=30)
    if r in late:
        done = torch.zeros(1, dtype=torch.int64)
        group.recv(done, 0, DONE_TAG)
        return {"late": True}
    with CapturedWarnings() as warnings:
        try:
            group.monitored_barrier(timeout=timeout_s, wait_all_ranks=wait_all)
        except CommError as e:
            error = e
        else:
            raise AssertionError(f"rank {r}: monitored_barrier passed although ranks {late} never called it")
    if r == 0:
        for peer in late:
            group.send(torch.ones(1, dtype=torch.int64), peer, DONE_TAG)
    reserved = f"tag {group.max_tag + 1} "  # the barrier's own messages: it reports its failure itself
    return {
        "late": False,
        "error_type": type(error).__name__,
        "error": str(error),
        "warned_about_its_messages": [w for w in warnings.messages if reserved in w],
    }
