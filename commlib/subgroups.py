"""Subgroups of a group: ``new_group``, ``split`` and ``split_group``, their agreement, names and settings."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from commlib.config import CommConfig
from commlib.env import DistEnv
from commlib.errors import CommError
from commlib.member_agreement import agree_on_members
from commlib.membership import NonGroupMember
from commlib.net import host_address, is_loopback

__all__ = [
    "new_group",
    "split",
    "split_group",
    "split_groups",
    "sub_config",
    "subgroup_env",
    "this_ranks_group",
]


class ParentGroup(Protocol):
    """What making subgroups uses of the parent group (``IProcessGroup`` has it)."""

    rank: int
    world_size: int
    backend: str
    group_name: str
    deterministic: bool
    _env: DistEnv
    _config: CommConfig
    _global_ranks: tuple[int, ...]
    _subgroups_made: int

    def _prefix(self, op: str) -> str: ...
    def _check_usable(self, op: str) -> None: ...
    def _check_members(self, op: str, ranks: object) -> list[int]: ...
    def preferred_device(self) -> torch.device: ...  # noqa: D102
    def all_gather(self, output: Any, tensor: torch.Tensor, *, async_op: bool = False) -> Any: ...  # noqa: D102
    def _split(self, groups: list[list[int]], config: CommConfig, names: list[str]) -> Any: ...


def new_group(
    parent: ParentGroup,
    ranks: Sequence[int],
    *,
    timeout: float | datetime.timedelta | None = None,
    sort_ranks: bool = True,
    deterministic: bool | None = None,
) -> Any:
    """``IProcessGroup.new_group``: the group of ``ranks`` of ``parent``, or a placeholder on the others."""
    name = "new_group"
    parent._check_usable(name)
    members = parent._check_members(name, ranks)
    if sort_ranks:
        members.sort()
    config = sub_config(parent, name, timeout, deterministic)
    agree_on_members(parent, parent._prefix(name), name, [members])
    names = [_next_name(parent)]
    return this_ranks_group(parent, name, _finish(parent, name, [members], config, names))


def split(parent: ParentGroup, color: int | None, key: int = 0) -> Any:
    """``IProcessGroup.split``: this rank's group of the ranks that pass its ``color``, by ``(key, rank)``."""
    name = "split"
    parent._check_usable(name)
    if color is not None and (isinstance(color, bool) or not isinstance(color, int)):
        raise TypeError(f"{parent._prefix(name)}color must be an int or None, got {color!r}")
    if isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"{parent._prefix(name)}key must be an int, got {key!r}")
    if color is not None and color < 0:
        color = None
    device = parent.preferred_device()
    own = torch.tensor([-1 if color is None else color, key], dtype=torch.int64, device=device)
    everyone = torch.empty(2 * parent.world_size, dtype=torch.int64, device=device)
    parent.all_gather(everyone, own)
    pairs = everyone.view(-1, 2).tolist()
    colors = sorted({c for c, _ in pairs if c >= 0})
    groups = [
        sorted((r for r in range(parent.world_size) if pairs[r][0] == c), key=lambda r: (pairs[r][1], r))
        for c in colors
    ]
    names = [_next_name(parent) for _ in groups]
    config = sub_config(parent, name, None)
    return this_ranks_group(parent, name, _finish(parent, name, groups, config, names))


def split_group(
    parent: ParentGroup,
    split_ranks: Sequence[Sequence[int]],
    *,
    timeout: float | datetime.timedelta | None = None,
    deterministic: bool | None = None,
) -> Any:
    """``IProcessGroup.split_group``: the group of ``split_ranks`` holding this rank, or a placeholder."""
    name = "split_group"
    return this_ranks_group(parent, name, split_groups(parent, name, split_ranks, timeout, deterministic))


def split_groups(
    parent: ParentGroup,
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


def this_ranks_group(parent: ParentGroup, op: str, every: list[Any]) -> Any:
    """This rank's group among ``every``, or one placeholder that names all of them."""
    for group in every:
        if not isinstance(group, NonGroupMember):
            return group
    if not every:  # split with every color None
        return _placeholder(parent, op, [], [])
    return NonGroupMember.of_all(every)


def sub_config(
    parent: ParentGroup,
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


def subgroup_env(parent: ParentGroup, ranks: Sequence[int]) -> DistEnv:
    """The ``DistEnv`` of this rank in the subgroup of ``ranks`` (parent ranks, in the new order).

    On one host, local rank and size are the subgroup's own. Across hosts they are
    unknown here (one process per host is assumed). Unless every rank reached rank 0
    over loopback (so all run on this host), ``master_addr`` becomes this host's
    address: the subgroup's rank 0, wherever it runs, serves its own diagnosis side
    channel there. Explicit ranks say nothing of their hosts, so a non-loopback
    ``MASTER_ADDR`` counts as "perhaps across hosts".
    """
    env = parent._env
    single_host = env.local_world_size >= env.world_size
    rank = list(ranks).index(parent.rank)
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


def _finish(
    parent: ParentGroup, op: str, groups: list[list[int]], config: CommConfig, names: list[str]
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
    child._global_ranks = child._named_ranks = tuple(parent._global_ranks[r] for r in ranks)
    child._group_name = names[index]  # type: ignore[index]
    child._start_diagnostics()
    every[index] = child  # type: ignore[index]
    return every


def _placeholder(parent: ParentGroup, op: str, groups: list[list[int]], names: list[str]) -> NonGroupMember:
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


def _next_name(parent: ParentGroup) -> str:
    name = f"{parent.group_name}.{parent._subgroups_made}"
    parent._subgroups_made += 1
    return name
