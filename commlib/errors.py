"""The commlib error hierarchy and the helpers that format its messages."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "CommError",
    "CommTimeoutError",
    "PeerFailureError",
    "CollectiveMismatchError",
    "RendezvousError",
    "RendezvousTimeoutError",
    "BackendUnavailableError",
    "NotInitializedError",
    "GroupClosedError",
    "MessageMismatchError",
    "MessageSizeError",
    "NotGroupMemberError",
    "ReduceOpTypeError",
    "error_prefix",
]


class CommError(RuntimeError):
    """A collective or the set-up of a process group failed."""


class CommTimeoutError(CommError, TimeoutError):
    """A blocking wait ran past its timeout (the peer is slow, stuck or gone)."""


class PeerFailureError(CommError):
    """A peer process closed its connection, exited, or reported that it failed.

    Attributes:
        exited: Ranks whose processes were seen gone (exited or killed), as the group
            numbers them; empty when the failure says nothing about the processes.
    """

    def __init__(self, message: str, *, exited: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.exited = exited


class CollectiveMismatchError(CommError, ValueError):
    """Ranks called different collectives, or the same one with different tensors."""


class RendezvousError(CommError):
    """The ranks could not find each other (wrong address, port in use, bad world size)."""


class RendezvousTimeoutError(RendezvousError, CommTimeoutError):
    """Some ranks never arrived at the rendezvous point within the timeout."""


class BackendUnavailableError(CommError, ImportError):
    """The chosen backend needs a package that is not installed, or is not registered."""


class NotInitializedError(CommError):
    """A collective was called before ``commlib.init_process_group()``."""


class GroupClosedError(CommError):
    """A collective was called on a process group after ``close()``, or after it broke."""


class MessageMismatchError(CommError, ValueError):
    """A send and its receive disagree on the message: its dtype or its size.

    Both sides raise it before any byte lands in the receive's tensor, and the pair stays usable.
    """


class MessageSizeError(MessageMismatchError):
    """A send and its receive disagree on the message's size in bytes (a ``MessageMismatchError``)."""


class NotGroupMemberError(CommError, ValueError):
    """A rank called an operation on a group it is not a member of (``GroupMember.NON_GROUP_MEMBER``)."""


class ReduceOpTypeError(TypeError, ValueError):
    """A reduce op does not apply to the dtype (BAND on floats, AVG on integers), or lacks its argument.

    It is both a ``TypeError`` and a ``ValueError``, so code that caught either keeps working.
    """


def ranks_by_value(items: Iterable[Any], key: Callable[[Any], str]) -> str:
    """``rank 0: SUM; ranks 1, 2: MAX``: the items' ``rank``s grouped by ``key``'s text, first seen first."""
    groups: dict[str, list[int]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item.rank)
    return "; ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {value}"
        for value, ranks in groups.items()
    )


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 2, 5]``; ``[0-511]`` for a run of consecutive ranks; past 8 ranks, the first ones and a count."""
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}-{ranks[-1]}]"
    if len(ranks) > 8:
        return f"[{', '.join(map(str, ranks[:6]))}, ...] ({len(ranks)} ranks)"
    return f"[{', '.join(map(str, ranks))}]"


def in_group(global_ranks: Sequence[int] | None) -> str:
    """`` in group [0, 2] (global ranks)``: where a subgroup's operation ran; "" for a root group (None)."""
    return f" in group {format_ranks(global_ranks)} (global ranks)" if global_ranks is not None else ""


def error_prefix(
    rank: int, world_size: int, backend: str, op: str, group: Sequence[int] | None = None
) -> str:
    """Return the ``[rank 1/4] ring.all_reduce: `` prefix every message starts with.

    Args:
        rank: This process's rank.
        world_size: Number of ranks in the group.
        backend: Backend name (``ring``, ``mpi``, ``nccl``, ``gloo``).
        op: The operation that failed (``all_reduce``, ``rendezvous``, ...).
        group: A subgroup's global ranks, named after the op (its ranks are numbered within it).
    """
    return f"[rank {rank}/{world_size}] {backend}.{op}{in_group(group)}: "
