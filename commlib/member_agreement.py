"""Agreement on a new group's members before any backend sets it up.

``new_group`` and ``split_group`` take their rank lists from each rank's own
arguments. If the ranks pass different lists, a backend would link up
different groups on different ranks and wait for peers that never come. So
every rank first all-gathers a digest of the lists it passed (one ``int64``
per rank over the parent group); when the digests differ, every rank
all-gathers the lists themselves and raises ``CollectiveMismatchError``
naming what each rank passed. The ranks agree or all raise, at once.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

import torch

from commlib.errors import CollectiveMismatchError

__all__ = ["agree_on_members"]

_MAX_SHOWN = 8
"""Distinct rank lists named in the error; the rest are counted."""


class _Parent(Protocol):
    rank: int
    world_size: int

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Any: ...

    def preferred_device(self) -> torch.device: ...


def agree_on_members(parent: _Parent, prefix: str, op: str, groups: list[list[int]]) -> None:
    """Raise on every rank unless every rank of ``parent`` passed the same ``groups`` to ``op``.

    Every rank of ``parent`` calls it, before any set-up of the groups.

    Args:
        parent: The group the new groups are made from.
        prefix: The ``[rank R/N] backend.op: `` prefix of the error.
        op: What was called (``new_group``, ``split_group``), for the message.
        groups: The groups this rank asks for, as ranks of ``parent``, each in its rank order.

    Raises:
        CollectiveMismatchError: The ranks passed different lists; the message names each
            rank's lists.
    """
    size = parent.world_size
    if size == 1:
        return
    device = parent.preferred_device()
    mine = _encode(groups, size)
    digest = int.from_bytes(
        hashlib.blake2b(mine.numpy().tobytes(), digest_size=8).digest(), "little", signed=True
    )
    digests = torch.empty(size, dtype=torch.int64, device=device)
    parent.all_gather(digests, torch.tensor([digest], dtype=torch.int64, device=device))
    if len(set(digests.tolist())) == 1:
        return
    everyone = torch.empty(size * mine.numel(), dtype=torch.int64, device=device)
    parent.all_gather(everyone, mine.to(device))
    passed = [_decode(row) for row in everyone.view(size, -1).tolist()]
    raise CollectiveMismatchError(f"{prefix}{_mismatch_message(op, passed)}")


def _encode(groups: list[list[int]], size: int) -> torch.Tensor:
    """``[count, len(g0), *g0, len(g1), *g1, ...]``, padded with -1 to ``2 * size + 1`` numbers.

    The groups are disjoint lists of ranks below ``size`` (checked before), so they fit.
    """
    flat = [len(groups)]
    for members in groups:
        flat += [len(members), *members]
    return torch.tensor(flat + [-1] * (2 * size + 1 - len(flat)), dtype=torch.int64)


def _decode(row: list[int]) -> list[list[int]]:
    groups, at = [], 1
    for _ in range(row[0]):
        length = row[at]
        groups.append(row[at + 1 : at + 1 + length])
        at += 1 + length
    return groups


def _mismatch_message(op: str, passed: list[list[list[int]]]) -> str:
    """``the ranks passed different rank lists to new_group: ranks 0, 1 passed [0, 1]; rank 2 ...``."""
    single = op == "new_group"
    by_lists: dict[str, list[int]] = {}
    for rank, groups in enumerate(passed):
        text = str(groups[0] if single and len(groups) == 1 else groups)
        by_lists.setdefault(text if len(text) <= 300 else f"{text[:300]}...", []).append(rank)
    parts = []
    for text, ranks in list(by_lists.items())[:_MAX_SHOWN]:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"
        parts.append(f"{who} passed {text}")
    if len(by_lists) > _MAX_SHOWN:
        parts.append(f"and {len(by_lists) - _MAX_SHOWN} more different lists")
    return (
        f"the ranks passed different rank lists to {op}: {'; '.join(parts)}. Every rank of the group "
        f"must call {op} with the same ranks, in the same order relative to its other new_group / "
        "split / split_group calls; no group was made"
    )


def _ranks(ranks: list[int]) -> str:
    """``0, 1, 2`` or ``0-511`` for a run of consecutive ranks, or the first ones and a count."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) > 8:
        return f"{', '.join(map(str, ranks[:6]))}, ... ({len(ranks)} ranks)"
    return ", ".join(map(str, ranks))
