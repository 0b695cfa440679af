"""Subgroups as MPI communicators: the ranks agree on the members, then ``Create_group`` or ``Split``.

MPI's communicator constructors block without a deadline, so the ranks of the
parent first all-gather a digest of the groups they ask for, within the
timeout; after that every rank is about to call the same constructor.
"""

from __future__ import annotations

import hashlib
from typing import Any

from commlib.errors import CommError

__all__ = ["check_agreement", "digest", "members_comm", "split_comm"]


def digest(groups: list[list[int]]) -> list[int]:
    """What each rank all-gathers: how many groups, and a 56-bit digest of them (equal for equal lists)."""
    hashed = hashlib.blake2b(repr(groups).encode(), digest_size=7).digest()
    return [len(groups), int.from_bytes(hashed, "little")]


def check_agreement(
    prefix: str, op: str, groups: list[list[int]], digests: list[tuple[int, ...]], rank: int
) -> None:
    """Raise ``CommError`` naming the ranks whose digest differs from ``rank``'s (other groups)."""
    different = [other for other, theirs in enumerate(digests) if theirs != digests[rank]]
    if different:
        raise CommError(
            f"{prefix}ranks {different} asked for other groups than this rank ({groups}); "
            f"every rank of the group must call {op} with the same arguments, in the same order of calls"
        )


def members_comm(comm: Any, ranks: list[int]) -> Any:
    """``comm.Create_group`` over ``ranks``, in their order (only the members call it)."""
    everyone = comm.Get_group()
    try:
        chosen = everyone.Incl(ranks)
    finally:
        everyone.Free()
    try:
        return comm.Create_group(chosen)
    finally:
        chosen.Free()


def split_comm(comm: Any, MPI: Any, groups: list[list[int]], rank: int) -> tuple[Any, list[int]] | None:  # noqa: N803
    """One ``comm.Split`` (every rank calls it): this rank's communicator and members, or None if in no group.

    Color is the index of the group holding this rank, key its place there.
    """
    color, key = MPI.UNDEFINED, 0
    for index, ranks in enumerate(groups):
        if rank in ranks:
            color, key = index, ranks.index(rank)
    split = comm.Split(color, key)
    if split == MPI.COMM_NULL:
        return None
    return split, groups[color]
