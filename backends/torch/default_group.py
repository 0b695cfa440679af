"""torch's default group: its store, its ranks of a group's members, and the commlib groups that own it."""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

from commlib.errors import CommError

__all__ = ["add_owner", "default_store", "is_last_owner", "join_owners", "release_owner", "torch_ranks_of"]

_owner_lock = threading.Lock()
_owner_count = 0
"""Open commlib groups over the torch default group that commlib itself created."""


def add_owner() -> None:
    """Count one more open group over the default group commlib created."""
    global _owner_count
    with _owner_lock:
        _owner_count += 1


def join_owners() -> bool:
    """Count one more open group if commlib created the default group; return whether it did."""
    global _owner_count
    with _owner_lock:
        owned = _owner_count > 0
        if owned:
            _owner_count += 1
    return owned


def is_last_owner() -> bool:
    """True if one open group alone owns the default group."""
    with _owner_lock:
        return _owner_count == 1


def release_owner() -> bool:
    """Count one open owner fewer; return True if it was the last (the default group may go)."""
    global _owner_count
    with _owner_lock:
        _owner_count -= 1
        return _owner_count == 0


def torch_ranks_of(pg: Any, size: int) -> list[int]:
    """The ranks in torch's default group of ``pg``'s members, in ``pg``'s rank order."""
    if pg is None or pg is dist.GroupMember.WORLD:
        return list(range(size))
    return list(dist.get_process_group_ranks(pg))


def default_store(prefix: str) -> Any:
    """Return torch's default store, where a group commlib did not create finds its subgroups' peers."""
    try:
        return dist.distributed_c10d._get_default_store()  # noqa: SLF001 - no public accessor
    except Exception as e:  # noqa: BLE001
        raise CommError(f"{prefix}torch.distributed's default store is not available: {e}") from e
