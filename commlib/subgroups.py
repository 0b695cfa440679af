"""Subgroups of a group: ``new_group``, ``split`` and ``split_group``, their agreement, names and settings.

``Subgroups`` is a base of ``IProcessGroup``: the subgroup calls, where a group sits in
the root group (``global_ranks``, ``group_name``) and the hooks a backend makes groups
with (``_new_group``, ``_split``). Its annotations name ``IProcessGroup``, the class it
is a base of, which this module cannot import (``commlib.process_group`` imports it).
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from commlib.config import CommConfig
from commlib.env import DistEnv
from commlib.errors import CommError
from commlib.member_agreement import agree_on_members
from commlib.membership import NonGroupMember
from commlib.net import host_address, is_loopback

__all__ = ["Subgroups", "split_groups", "sub_config", "this_ranks_group"]

_root_groups = itertools.count()
"""Root groups created in this process: names them (``gloo#0``) alike on every rank."""


class Subgroups:
    """The subgroup calls of ``IProcessGroup``, and where a group sits in the root group."""

    rank: int
    world_size: int
    backend: str
    deterministic: bool
    _env: DistEnv
    _config: CommConfig

    if TYPE_CHECKING:  # IProcessGroup's

        def _prefix(self, op: str) -> str: ...
        def _not_implemented(self, op: str) -> NotImplementedError: ...
        def _check_usable(self, op: str) -> None: ...
        def _check_rank(self, op: str, value: object, arg: str) -> None: ...
        def _check_members(self, op: str, ranks: object) -> list[int]: ...
        def _start_diagnostics(self) -> None: ...
        def preferred_device(self) -> torch.device: ...  # noqa: D102
        def all_gather(self, output: Any, tensor: torch.Tensor, *, async_op: bool = False) -> Any: ...  # noqa: D102
        def close(self) -> None: ...  # noqa: D102

    def _init_subgroups(self) -> None:
        """A root group's place: every rank of the job, named ``#n`` (``group_name`` adds the backend)."""
        self._global_ranks: tuple[int, ...] = tuple(range(self._env.world_size))
        self._named_ranks: tuple[int, ...] | None = None
        """A subgroup's global ranks, which its messages name; None for a root group."""
        self._group_name = f"#{next(_root_groups)}"
        self._subgroups_made = 0
        """``new_group`` / ``split`` calls on this group: numbers the groups they make."""
        self._lineage: weakref.WeakSet[Subgroups] = weakref.WeakSet()
        """Every group made from this one, or from those at any depth, that this rank is in (while
        anything holds it): a group stays reachable when the one it was made from is gone."""
        self._ancestry: tuple[weakref.WeakSet[Subgroups], ...] = ()
        """The ``_lineage`` of each group this one was made from, the root's first."""

    def _descendants(self) -> list[Subgroups]:
        """Every group made from this one (and from those, ...) on this rank, the deepest first."""
        return sorted(self._lineage, key=lambda g: -len(g._ancestry))

    def _place_in_parent(self, global_ranks: tuple[int, ...], name: str) -> None:
        """Make this group, just made by the backend, a subgroup: its members' global ranks and name."""
        self._global_ranks = self._named_ranks = global_ranks
        self._group_name = name

    def _place_in_job(self, global_ranks: tuple[int, ...] | None, name: str | None) -> None:
        """Place this group, made by someone else's ``new_group``, as its members know it.

        torch's groups reach commlib (through the adapter) as groups of their own: by default each
        would be named by this process's count of groups, which differs between ranks that are in
        different groups, and would know no global ranks.

        Args:
            global_ranks: The members' global ranks; None or empty for the job's default group.
            name: A name alike on every member (torch's group name), or None to keep the count's.
        """
        if global_ranks:
            self._place_in_parent(tuple(global_ranks), name or self._group_name)
        elif name:
            self._group_name = name

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The members' ranks in the root group (the one with no parent), in this group's rank order."""
        return self._global_ranks

    @property
    def group_name(self) -> str:
        """The group's name, alike on every member: ``gloo#0`` (a root group), ``gloo#0.2`` (a subgroup)."""
        name = self._group_name
        return f"{self.backend}{name}" if name.startswith("#") else name

    def new_group(
        self,
        ranks: Sequence[int],
        *,
        timeout: float | datetime.timedelta | None = None,
        sort_ranks: bool = True,
        deterministic: bool | None = None,
    ) -> IProcessGroup | NonGroupMember:  # noqa: F821
        """Make a group of some of this group's ranks; every rank of this group must call it.

        Call it on every rank, in the same order relative to other ``new_group``
        and ``split`` calls, with the same ``ranks``. The new group's ranks follow
        the sorted order of ``ranks``, as torch's (``sort_ranks=False``: their order as given).

        Args:
            ranks: Ranks of this group that join.
            timeout: The new group's timeout (seconds or a timedelta); default this group's.
            sort_ranks: Order the new group's ranks by their rank here (torch's default), or
                keep the order of ``ranks``.
            deterministic: The new group's deterministic mode (``IProcessGroup.deterministic``);
                default this group's.

        Returns:
            The new group on its members; on the other ranks ``commlib.GroupMember.NON_GROUP_MEMBER``
            (a placeholder naming the group, on which every operation raises ``NotGroupMemberError``).

        Raises:
            TypeError: A rank is not an int.
            ValueError: ``ranks`` is empty, holds a rank twice, or one out of range.

        Example::

            >>> dp = group.new_group([r for r in range(4) if r % 2 == group.rank % 2])
        """
        name = "new_group"
        self._check_usable(name)
        members = self._check_members(name, ranks)
        if sort_ranks:
            members.sort()
        config = sub_config(self, name, timeout, deterministic)
        agree_on_members(self, self._prefix(name), name, [members])
        names = [_next_name(self)]
        return this_ranks_group(self, name, _finish(self, name, [members], config, names))

    def split(self, color: int | None, key: int = 0) -> IProcessGroup | NonGroupMember:  # noqa: F821
        """Split this group into disjoint groups by ``color``, as MPI's ``Comm_split``; every rank calls it.

        Ranks that pass the same ``color`` form one group, ordered by ``(key, rank)``.

        Args:
            color: A non-negative int; None (or a negative int) joins no group.
            key: Orders the ranks within their group.

        Returns:
            This rank's group; for ``color=None``, ``commlib.GroupMember.NON_GROUP_MEMBER``.

        Example::

            >>> tp = group.split(color=group.rank // 2)   # ranks {0, 1} and {2, 3}
        """
        name = "split"
        self._check_usable(name)
        if color is not None and (isinstance(color, bool) or not isinstance(color, int)):
            raise TypeError(f"{self._prefix(name)}color must be an int or None, got {color!r}")
        if isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"{self._prefix(name)}key must be an int, got {key!r}")
        if color is not None and color < 0:
            color = None
        device = self.preferred_device()
        own = torch.tensor([-1 if color is None else color, key], dtype=torch.int64, device=device)
        everyone = torch.empty(2 * self.world_size, dtype=torch.int64, device=device)
        self.all_gather(everyone, own)
        pairs = everyone.view(-1, 2).tolist()
        colors = sorted({c for c, _ in pairs if c >= 0})
        groups = [
            sorted((r for r in range(self.world_size) if pairs[r][0] == c), key=lambda r: (pairs[r][1], r))
            for c in colors
        ]
        names = [_next_name(self) for _ in groups]
        config = sub_config(self, name, None)
        return this_ranks_group(self, name, _finish(self, name, groups, config, names))

    def split_group(
        self,
        split_ranks: Sequence[Sequence[int]],
        *,
        timeout: float | datetime.timedelta | None = None,
        deterministic: bool | None = None,
    ) -> IProcessGroup | NonGroupMember:  # noqa: F821
        """Split this group into the disjoint groups ``split_ranks`` names, as torch's ``split_group``.

        Every rank of this group calls it with the same lists (ranks of this
        group); a rank in none of them gets ``commlib.GroupMember.NON_GROUP_MEMBER``
        (torch's gives None, which commlib reads as the default group). One call
        makes every group, each ordered by rank.

        Args:
            split_ranks: Disjoint lists of ranks of this group.
            timeout: The new groups' timeout (seconds or a timedelta); default this group's.
            deterministic: The new groups' deterministic mode; default this group's.

        Returns:
            The group holding this rank, or ``commlib.GroupMember.NON_GROUP_MEMBER``.

        Raises:
            TypeError: ``split_ranks`` is not a list of lists of ints.
            ValueError: A list is empty, or a rank is out of range or in two lists.

        Example::

            >>> pair = group.split_group([[0, 1], [2, 3]])   # 4 ranks: two groups of two
        """
        name = "split_group"
        return this_ranks_group(self, name, split_groups(self, name, split_ranks, timeout, deterministic))

    def get_group_rank(self, global_rank: int) -> int:
        """Return the rank in this group of the member whose root-group rank is ``global_rank``."""
        return self._group_rank_of("get_group_rank", global_rank, "global_rank")

    def get_global_rank(self, group_rank: int) -> int:
        """Return the root-group rank of this group's rank ``group_rank``."""
        self._check_rank("get_global_rank", group_rank, "group_rank")
        return self._global_ranks[group_rank]

    def _group_rank_of(self, op: str, global_rank: object, arg: str) -> int:
        if isinstance(global_rank, bool) or not isinstance(global_rank, int):
            raise TypeError(f"{self._prefix(op)}{arg} must be an int rank, got {global_rank!r}")
        try:
            return self._global_ranks.index(global_rank)
        except ValueError:
            raise ValueError(
                f"{self._prefix(op)}{arg}={global_rank} is not a member of this group "
                f"(its global ranks: {list(self._global_ranks)})"
            ) from None

    def _subgroup_env(self, ranks: Sequence[int]) -> DistEnv:
        """The ``DistEnv`` of this rank in the subgroup of ``ranks`` (ranks of this group, in the new order).

        On one host, local rank and size are the subgroup's own. Across hosts they are
        unknown here (one process per host is assumed). Unless every rank reached rank 0
        over loopback (so all run on this host), ``master_addr`` becomes this host's
        address: the subgroup's rank 0, wherever it runs, serves its own diagnosis side
        channel there. Explicit ranks say nothing of their hosts, so a non-loopback
        ``MASTER_ADDR`` counts as "perhaps across hosts".
        """
        env = self._env
        single_host = env.local_world_size >= env.world_size
        rank = list(ranks).index(self.rank)
        on_loopback = single_host and is_loopback(env.master_addr)
        return dataclasses.replace(
            env,
            rank=rank,
            world_size=len(ranks),
            local_rank=rank if single_host else 0,
            local_world_size=len(ranks) if single_host else 1,
            master_addr=env.master_addr if on_loopback else host_address(env.master_addr),
            store=None,  # the parent's store is scoped to the parent
        )

    # --------------------------------------------------- backend implementation
    def _new_group(self, ranks: list[int], config: CommConfig, name: str) -> IProcessGroup | None:  # noqa: F821
        """Make the group of ``ranks`` (ranks of this group, in the new group's rank order).

        Every rank of this group calls it; members return the connected group
        (built with ``_subgroup_env(ranks)`` and ``config``), others None. ``name``
        is the same on every member and unique in the job (for rendezvous keys).
        The interface sets up the result's global ranks and diagnosis.
        """
        raise self._not_implemented("new_group")

    def _split(self, groups: list[list[int]], config: CommConfig, names: list[str]) -> IProcessGroup | None:  # noqa: F821
        """Make every group of ``groups`` (disjoint, each in rank order); return this rank's, or None.

        The default calls ``_new_group`` once per group, in order, on every rank.
        A backend with a native split (MPI's ``Comm_split``) overrides it.
        """
        mine = None
        for ranks, name in zip(groups, names, strict=True):
            child = self._new_group(ranks, config, name)
            if child is not None:
                mine = child
        return mine


def split_groups(
    parent: Subgroups,
    name: str,
    split_ranks: Sequence[Sequence[int]],
    timeout: float | datetime.timedelta | None,
    deterministic: bool | None = None,
) -> list[Any]:
    """``split_group``'s work: every group, in order (this rank's, and a placeholder for each other)."""
    parent._check_usable(name)
    if not isinstance(split_ranks, (list, tuple)) or not split_ranks:
        raise TypeError(
            f"{parent._prefix(name)}split_ranks must be a non-empty list of rank lists, got {split_ranks!r}"
        )
    groups = [sorted(parent._check_members(name, ranks)) for ranks in split_ranks]
    seen: dict[int, int] = {}
    for i, members in enumerate(groups):
        for r in members:
            if r in seen:
                raise ValueError(
                    f"{parent._prefix(name)}rank {r} is in split_ranks[{seen[r]}] and split_ranks[{i}]; "
                    "the groups must be disjoint"
                )
            seen[r] = i
    config = sub_config(parent, name, timeout, deterministic)
    agree_on_members(parent, parent._prefix(name), name, groups)
    names = [_next_name(parent) for _ in groups]
    return _finish(parent, name, groups, config, names)


def this_ranks_group(parent: Subgroups, op: str, every: list[Any]) -> Any:
    """This rank's group among ``every``, or one placeholder that names all of them."""
    for group in every:
        if not isinstance(group, NonGroupMember):
            return group
    if not every:  # split with every color None
        return _placeholder(parent, op, [], [])
    return NonGroupMember.of_all(every)


def sub_config(
    parent: Subgroups,
    op: str,
    timeout: float | datetime.timedelta | None,
    deterministic: bool | None = None,
) -> CommConfig:
    """A subgroup's settings: the parent's, with ``timeout`` where given, and its deterministic mode.

    The mode is ``deterministic`` where given, else the parent's as settled when it was made.
    Also checks a timeout given to one call (``barrier``, ``monitored_barrier``).
    """
    config = parent._config
    changes: dict[str, object] = {} if timeout is None else {"timeout": timeout}
    mode = parent.deterministic if deterministic is None else deterministic
    if mode != config.deterministic:
        changes["deterministic"] = mode
    if not changes:
        return config
    try:
        return dataclasses.replace(config, **changes)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise type(e)(f"{parent._prefix(op)}{e}") from None


def _finish(
    parent: Subgroups, op: str, groups: list[list[int]], config: CommConfig, names: list[str]
) -> list[Any]:
    """Have the backend make ``groups``; set up this rank's (global ranks, name, diagnosis).

    Returns:
        One entry per group, in order: this rank's group, and a placeholder for each group
        it is not in (``GroupMember.NON_GROUP_MEMBER``, naming that group).
    """
    child = parent._split(groups, config, names)
    index = next((i for i, g in enumerate(groups) if parent.rank in g), None)
    every: list[Any] = [
        _placeholder(parent, op, [ranks], [name]) for ranks, name in zip(groups, names, strict=True)
    ]
    if child is None:
        if index is not None:
            raise CommError(f"{parent._prefix(op)}the {parent.backend} backend made no group for a member")
        return every
    ranks = groups[index]  # type: ignore[index]
    if (child.rank, child.world_size) != (ranks.index(parent.rank), len(ranks)):
        child.close()
        raise CommError(
            f"{parent._prefix(op)}the {parent.backend} backend made a group where this rank is "
            f"{child.rank}/{child.world_size}, expected {ranks.index(parent.rank)}/{len(ranks)}"
        )
    child._place_in_parent(tuple(parent._global_ranks[r] for r in ranks), names[index])  # type: ignore[index]
    child._ancestry = (*parent._ancestry, parent._lineage)
    for lineage in child._ancestry:
        lineage.add(child)
    child._start_diagnostics()
    every[index] = child  # type: ignore[index]
    return every


def _placeholder(parent: Subgroups, op: str, groups: list[list[int]], names: list[str]) -> NonGroupMember:
    """What this rank gets for ``groups`` (ranks of ``parent``, named ``names``), none with it."""
    return NonGroupMember(
        op,
        [[parent._global_ranks[r] for r in g] for g in groups],
        names,
        rank=parent.rank,
        world_size=parent.world_size,
        backend=parent.backend,
        global_rank=parent._global_ranks[parent.rank],
    )


def _next_name(parent: Subgroups) -> str:
    name = f"{parent.group_name}.{parent._subgroups_made}"
    parent._subgroups_made += 1
    return name
