"""What a rank outside a new group gets instead of the group: ``GroupMember.NON_GROUP_MEMBER``.

The module functions take ``group=None`` for the default group, so a rank that
made a subgroup without being in it must not hold None: passing that to a
collective would pair it with the members' next collective of the default group.
As in torch, ``new_group`` (and ``split``, ``split_group``, ``new_subgroups``,
``new_subgroups_by_enumeration``) gives such a rank a placeholder that equals
``GroupMember.NON_GROUP_MEMBER``. Unlike torch, which warns and skips the call,
every operation on it raises ``NotGroupMemberError``, naming the group's global
ranks and this rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from commlib.errors import NotGroupMemberError, error_prefix

__all__ = ["GroupMember", "NonGroupMember", "is_non_member"]


class NonGroupMember:
    """The placeholder a rank gets for a group it is not in; it equals ``GroupMember.NON_GROUP_MEMBER``.

    It is not a process group: reading any of a group's attributes on it (a collective,
    ``rank``, ``new_group``...) raises ``NotGroupMemberError``. Test membership with
    ``group != commlib.GroupMember.NON_GROUP_MEMBER`` (torch's spelling).

    Args:
        made_by: The call that made the group (``new_group``, ``split``...); empty for the bare sentinel.
        groups: The global ranks of each group that call made, none with this rank.
        names: The groups' names (``ring#0.1``).
        rank: This rank in the parent group.
        world_size: The parent group's size.
        backend: The parent group's backend.
        global_rank: This rank in the root group.
    """

    __slots__ = ("_made_by", "_groups", "_names", "_rank", "_world_size", "_backend", "_global_rank")

    def __init__(
        self,
        made_by: str = "",
        groups: Sequence[Sequence[int]] = (),
        names: Sequence[str] = (),
        *,
        rank: int = -1,
        world_size: int = -1,
        backend: str = "",
        global_rank: int = -1,
    ) -> None:
        self._made_by = made_by
        self._groups = tuple(tuple(g) for g in groups)
        self._names = tuple(names)
        self._rank = rank
        self._world_size = world_size
        self._backend = backend
        self._global_rank = global_rank

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NonGroupMember)

    def __hash__(self) -> int:
        return hash(NonGroupMember)

    def __repr__(self) -> str:
        if not self._made_by:
            return "GroupMember.NON_GROUP_MEMBER"
        return f"<GroupMember.NON_GROUP_MEMBER: global rank {self._global_rank} is not in {self._which()}>"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self.refuse(name)

    @classmethod
    def of_all(cls, placeholders: Sequence[NonGroupMember]) -> NonGroupMember:
        """One placeholder for every group of ``placeholders`` (made by one call, none with this rank)."""
        first = placeholders[0]
        return cls(
            first._made_by,
            [g for p in placeholders for g in p._groups],
            [n for p in placeholders for n in p._names],
            rank=first._rank,
            world_size=first._world_size,
            backend=first._backend,
            global_rank=first._global_rank,
        )

    def _which(self) -> str:
        if not self._groups:
            return "any group (every rank passed color=None)"
        groups = "; ".join(
            f"{name} (global ranks {list(g)})" for name, g in zip(self._names, self._groups, strict=True)
        )
        return f"the group {groups}" if len(self._groups) == 1 else f"any of the groups {groups}"

    def refuse(self, op: str) -> NoReturn:
        """Raise the ``NotGroupMemberError`` of a call of ``op`` on this placeholder.

        Raises:
            NotGroupMemberError: Always.
        """
        fix = (
            "Only a group's members may call its operations; on the other ranks skip the call "
            "(if group != commlib.GroupMember.NON_GROUP_MEMBER: ...), or pass a group this rank is in. "
            "It is never the default group: pass group=None for that"
        )
        if not self._made_by:
            raise NotGroupMemberError(
                f"{op}: the group passed is commlib.GroupMember.NON_GROUP_MEMBER, what new_group gives a "
                f"rank outside the group. {fix}"
            )
        prefix = error_prefix(self._rank, self._world_size, self._backend, op)
        raise NotGroupMemberError(
            f"{prefix}this rank (global rank {self._global_rank}) is not a member of the group it called "
            f"{op} on: {self._made_by} made {self._which()} without it, and gave it "
            f"commlib.GroupMember.NON_GROUP_MEMBER. {fix}"
        )


class GroupMember:
    """torch's ``GroupMember``: ``NON_GROUP_MEMBER`` is what a rank outside a new group gets."""

    NON_GROUP_MEMBER = NonGroupMember()
    """Equals every placeholder ``new_group`` and its kin hand to the ranks outside the groups they make."""


def is_non_member(group: object) -> bool:
    """True if ``group`` is a placeholder for a group this rank is not in (not None: None is the default)."""
    return group.__class__ is NonGroupMember
