"""torch.distributed-style module functions: every operation on ``group`` (None: the default group).

Rank arguments follow torch's convention: ``src``, ``dst`` and ``peer`` are
global ranks (ranks in the default group), and ``group_src``, ``group_dst`` and
``group_peer`` are ranks of ``group``; give at most one of each pair. Rooted
operations given neither use the group's rank 0.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch

from commlib import subgroups
from commlib.membership import NonGroupMember, is_non_member
from commlib.p2p import P2POp
from commlib.process_group import IProcessGroup, TensorList
from commlib.types import PremulSum, ReduceOp
from commlib.work import Work
from commlib.world import get_default_group

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "irecv",
    "isend",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "split_group",
]


def _group(group: IProcessGroup | NonGroupMember | None, op: str) -> IProcessGroup:
    """``group``, the default group for None; a placeholder of a group this rank is not in raises."""
    if group is None:
        return get_default_group()
    if is_non_member(group):
        group.refuse(op)  # type: ignore[union-attr]
    return group  # type: ignore[return-value]


def _rank_in(
    group: IProcessGroup, op: str, global_rank: int | None, group_rank: int | None, names: tuple[str, str]
) -> int | None:
    """The group rank that ``global_rank`` or ``group_rank`` names (None if neither is given)."""
    if global_rank is not None and group_rank is not None:
        raise ValueError(
            f"{group._prefix(op)}give {names[0]} (a global rank) or {names[1]} (a group rank), not both"
        )
    if group_rank is not None:
        return group_rank
    if global_rank is not None:
        return group._group_rank_of(op, global_rank, names[0])
    return None


def _root(
    group: IProcessGroup, op: str, global_rank: int | None, group_rank: int | None, names: tuple[str, str]
) -> int:
    rank = _rank_in(group, op, global_rank, group_rank, names)
    return 0 if rank is None else rank


# -------------------------------------------------------------- collectives
def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp | PremulSum = ReduceOp.SUM,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.all_reduce`` on ``group`` (default group if None)."""
    return _group(group, "all_reduce").all_reduce(tensor, op, async_op=async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: ReduceOp | PremulSum = ReduceOp.SUM,
    group: IProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """``IProcessGroup.reduce`` on ``group``; ``dst`` is a global rank, ``group_dst`` a group rank."""
    g = _group(group, "reduce")
    return g.reduce(tensor, _root(g, "reduce", dst, group_dst, ("dst", "group_dst")), op, async_op=async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: IProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """``IProcessGroup.broadcast`` on ``group``; ``src`` is a global rank, ``group_src`` a group rank."""
    g = _group(group, "broadcast")
    return g.broadcast(tensor, _root(g, "broadcast", src, group_src, ("src", "group_src")), async_op=async_op)


def all_gather(
    tensor_list: TensorList | torch.Tensor,
    tensor: torch.Tensor,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.all_gather`` on ``group`` (default group if None); torch's argument names.

    ``tensor_list`` may also be one tensor of ``world_size`` blocks (``all_gather_into_tensor``).
    """
    return _group(group, "all_gather").all_gather(tensor_list, tensor, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.all_gather_into_tensor`` on ``group`` (default group if None)."""
    return _group(group, "all_gather_into_tensor").all_gather_into_tensor(
        output_tensor, input_tensor, async_op=async_op
    )


all_gather_single = all_gather_into_tensor
"""torch 2.13's name for ``all_gather_into_tensor``."""


def reduce_scatter(
    output: torch.Tensor,
    input_list: TensorList | torch.Tensor,
    op: ReduceOp | PremulSum = ReduceOp.SUM,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.reduce_scatter`` on ``group`` (default group if None); torch's argument names.

    ``input_list`` may also be one tensor of ``world_size`` blocks (``reduce_scatter_tensor``).
    """
    return _group(group, "reduce_scatter").reduce_scatter(output, input_list, op, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002
    op: ReduceOp | PremulSum = ReduceOp.SUM,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.reduce_scatter_tensor`` on ``group`` (default group if None)."""
    return _group(group, "reduce_scatter_tensor").reduce_scatter_tensor(output, input, op, async_op=async_op)


reduce_scatter_single = reduce_scatter_tensor
"""torch 2.13's name for ``reduce_scatter_tensor``."""


def gather(
    tensor: torch.Tensor,
    gather_list: TensorList | None = None,
    dst: int | None = None,
    group: IProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """``IProcessGroup.gather`` on ``group``; ``dst`` is a global rank, ``group_dst`` a group rank."""
    g = _group(group, "gather")
    return g.gather(
        tensor, gather_list, _root(g, "gather", dst, group_dst, ("dst", "group_dst")), async_op=async_op
    )


def scatter(
    tensor: torch.Tensor,
    scatter_list: TensorList | None = None,
    src: int | None = None,
    group: IProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """``IProcessGroup.scatter`` on ``group``; ``src`` is a global rank, ``group_src`` a group rank."""
    g = _group(group, "scatter")
    return g.scatter(
        tensor, scatter_list, _root(g, "scatter", src, group_src, ("src", "group_src")), async_op=async_op
    )


def all_to_all(
    output_tensor_list: TensorList,
    input_tensor_list: TensorList,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.all_to_all`` on ``group`` (default group if None)."""
    return _group(group, "all_to_all").all_to_all(output_tensor_list, input_tensor_list, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.all_to_all_single`` on ``group`` (default group if None)."""
    return _group(group, "all_to_all_single").all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, async_op=async_op
    )


def barrier(
    group: IProcessGroup | None = None,
    async_op: bool = False,
    device_ids: Sequence[int] | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> Work | None:
    """``IProcessGroup.barrier`` on ``group`` (default group if None), with torch's arguments.

    Args:
        group: The group; None: the default group.
        async_op: Return a ``Work`` handle instead of waiting.
        device_ids: torch's GPUs for NCCL's barrier: checked to be ints, otherwise unused (a
            group knows its device).
        timeout: Seconds (or a timedelta) this synchronous wait may take, instead of the group's
            timeout; past it ``CommTimeoutError`` is raised and the barrier goes on.
    """
    g = _group(group, "barrier")
    if device_ids is not None and (
        not isinstance(device_ids, (list, tuple))
        or any(isinstance(d, bool) or not isinstance(d, int) for d in device_ids)
    ):
        raise TypeError(f"{g._prefix('barrier')}device_ids must be a list of ints, got {device_ids!r}")
    if timeout is None or async_op:
        return g.barrier(async_op=async_op)
    seconds = subgroups.sub_config(g, "barrier", timeout).timeout  # checked as any group timeout is
    work = g.barrier(async_op=True)
    assert work is not None
    work.wait(seconds)
    return None


def monitored_barrier(
    group: IProcessGroup | None = None,
    timeout: float | datetime.timedelta | None = None,
    wait_all_ranks: bool = False,
) -> None:
    """``IProcessGroup.monitored_barrier`` on ``group`` (default group if None), with torch's arguments.

    A barrier whose failure names the ranks that did not reach it.

    Args:
        group: The group; None: the default group.
        timeout: Seconds (or a timedelta) rank 0 waits for the others; None: the group's timeout.
        wait_all_ranks: Name every missing rank instead of stopping at the first.
    """
    _group(group, "monitored_barrier").monitored_barrier(timeout, wait_all_ranks)


# ----------------------------------------------------------- point-to-point
def _peer(
    group: IProcessGroup, op: str, peer: int | None, group_peer: int | None, names: tuple[str, str]
) -> int:
    rank = _rank_in(group, op, peer, group_peer, names)
    if rank is None:
        raise ValueError(f"{group._prefix(op)}give {names[0]} (a global rank) or {names[1]} (a group rank)")
    return rank


def send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: IProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    """``IProcessGroup.send`` on ``group``; ``dst`` is a global rank, ``group_dst`` a group rank."""
    g = _group(group, "send")
    g.send(tensor, _peer(g, "send", dst, group_dst, ("dst", "group_dst")), tag)


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: IProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    """``IProcessGroup.recv`` on ``group`` (``src`` None: any rank); return the sender's global rank."""
    g = _group(group, "recv")
    sender = g.recv(tensor, _rank_in(g, "recv", src, group_src, ("src", "group_src")), tag)
    return g.global_ranks[sender]


def isend(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: IProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> Work:
    """``IProcessGroup.isend`` on ``group``; ``dst`` is a global rank, ``group_dst`` a group rank."""
    g = _group(group, "isend")
    return g.isend(tensor, _peer(g, "isend", dst, group_dst, ("dst", "group_dst")), tag)


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: IProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> Work:
    """``IProcessGroup.irecv`` on ``group`` (``src`` None: any rank; ``source_rank()`` is a group rank)."""
    g = _group(group, "irecv")
    return g.irecv(tensor, _rank_in(g, "irecv", src, group_src, ("src", "group_src")), tag)


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Start every ``P2POp`` at once on their group (all must share one; None: the default group)."""
    groups = {id(p.group): p.group for p in p2p_op_list if isinstance(p, P2POp) and p.group is not None}
    if len(groups) > 1:
        raise ValueError("batch_isend_irecv: every P2POp of one batch must belong to the same group")
    group = _group(next(iter(groups.values())) if groups else None, "batch_isend_irecv")
    return group.batch_isend_irecv(p2p_op_list)


# ------------------------------------------------------------------ objects
def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: IProcessGroup | None = None,
    device: torch.device | None = None,
    group_src: int | None = None,
) -> None:
    """``IProcessGroup.broadcast_object_list`` on ``group`` (``device`` is accepted for torch's signature)."""
    g = _group(group, "broadcast_object_list")
    g.broadcast_object_list(
        object_list, _root(g, "broadcast_object_list", src, group_src, ("src", "group_src"))
    )


def all_gather_object(object_list: list[Any], obj: Any, group: IProcessGroup | None = None) -> None:
    """``IProcessGroup.all_gather_object`` on ``group`` (default group if None)."""
    _group(group, "all_gather_object").all_gather_object(object_list, obj)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: IProcessGroup | None = None,
    group_dst: int | None = None,
) -> None:
    """``IProcessGroup.gather_object`` on ``group``; ``dst`` is a global rank, ``group_dst`` a group rank."""
    g = _group(group, "gather_object")
    g.gather_object(obj, object_gather_list, _root(g, "gather_object", dst, group_dst, ("dst", "group_dst")))


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: IProcessGroup | None = None,
    group_src: int | None = None,
) -> None:
    """``IProcessGroup.scatter_object_list`` on ``group``; ``src`` global, ``group_src`` a group rank."""
    g = _group(group, "scatter_object_list")
    g.scatter_object_list(
        scatter_object_output_list,
        scatter_object_input_list,
        _root(g, "scatter_object_list", src, group_src, ("src", "group_src")),
    )


# ---------------------------------------------------------------- subgroups
def _check_group_options(parent: IProcessGroup, op: str, backend: str | None, pg_options: Any) -> None:
    """Refuse torch's group options commlib cannot honour (``backend`` may name the parent's own)."""
    if backend is not None and str(backend).lower() != parent.backend:
        raise ValueError(
            f"{parent._prefix(op)}backend={backend!r}: a subgroup runs on its parent's backend "
            f"({parent.backend}); leave backend out, or make a group of another backend with "
            "commlib.create_process_group"
        )
    if pg_options is not None:
        raise ValueError(f"{parent._prefix(op)}pg_options is torch's: commlib's backends take none")


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: float | datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: torch.device | None = None,
    sort_ranks: bool = True,
    *,
    deterministic: bool | None = None,
) -> IProcessGroup | NonGroupMember:
    """Make a subgroup of the default group from its global ``ranks`` (None: all); every rank calls it.

    torch's other arguments: ``backend`` may name the default group's own backend (a subgroup
    always runs on it); ``sort_ranks=False`` keeps the order of ``ranks`` for the new group's
    ranks; ``group_desc`` and ``device_id`` are accepted and not used (a group knows its device).
    ``deterministic`` (commlib's) sets the new group's deterministic mode; default the default group's.
    ``pg_options`` and ``use_local_synchronization=True`` are refused: commlib's backends take no
    options object, and every rank of the default group takes part in making a group.

    Returns:
        The new group on its members; elsewhere ``commlib.GroupMember.NON_GROUP_MEMBER`` (every
        operation on it raises ``NotGroupMemberError``; it is never the default group).

    Raises:
        ValueError: ``backend`` names another backend, or ``pg_options`` /
            ``use_local_synchronization`` is given.
    """
    del group_desc, device_id  # torch's; nothing to do with them here
    group = get_default_group()
    _check_group_options(group, "new_group", backend, pg_options)
    if use_local_synchronization:
        raise ValueError(
            f"{group._prefix('new_group')}use_local_synchronization=True is not supported: every rank of "
            "the default group calls new_group, members and others alike"
        )
    members = range(group.world_size) if ranks is None else ranks
    return group.new_group(members, timeout=timeout, sort_ranks=sort_ranks, deterministic=deterministic)


def split_group(
    parent_pg: IProcessGroup | None = None,
    split_ranks: Sequence[Sequence[int]] | None = None,
    timeout: float | datetime.timedelta | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
    backend: str | None = None,
    *,
    deterministic: bool | None = None,
) -> IProcessGroup | NonGroupMember:
    """``IProcessGroup.split_group`` on ``parent_pg`` (default group if None); ranks are its group ranks.

    ``backend``, ``pg_options`` and ``group_desc`` as for ``new_group``. A rank in none of
    the lists gets ``commlib.GroupMember.NON_GROUP_MEMBER`` (torch's gives None, which
    commlib would read as the default group).
    """
    del group_desc
    parent = _group(parent_pg, "split_group")
    _check_group_options(parent, "split_group", backend, pg_options)
    if split_ranks is None:
        raise ValueError(f"{parent._prefix('split_group')}split_ranks is required: disjoint lists of ranks")
    return parent.split_group(split_ranks, timeout=timeout, deterministic=deterministic)


def new_subgroups(
    group_size: int | None = None,
    group: IProcessGroup | None = None,
    timeout: float | datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[IProcessGroup, list[IProcessGroup | NonGroupMember]]:
    """Cut ``group`` (default group if None) into groups of ``group_size`` consecutive ranks.

    Every rank calls it. ``group_size`` None means the CUDA devices of this machine, as in torch
    (on CPU, pass it). ``backend``, ``pg_options`` and ``group_desc`` as for ``new_group``.

    Returns:
        This rank's group, and every group in order: the ones this rank is not in are
        ``commlib.GroupMember.NON_GROUP_MEMBER``, as in torch (each names its group).

    Raises:
        ValueError: ``group_size`` is not positive or does not divide the group's size.
    """
    del group_desc
    parent = _group(group, "new_subgroups")
    op = "new_subgroups"
    _check_group_options(parent, op, backend, pg_options)
    if group_size is None:
        group_size = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not group_size:
            raise ValueError(f"{parent._prefix(op)}no CUDA device to size the groups by; pass group_size")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"{parent._prefix(op)}group_size must be a positive int, got {group_size!r}")
    if parent.world_size % group_size:
        raise ValueError(
            f"{parent._prefix(op)}group_size {group_size} does not divide the group's size "
            f"({parent.world_size} ranks)"
        )
    lists = [list(range(start, start + group_size)) for start in range(0, parent.world_size, group_size)]
    every = subgroups.split_groups(parent, op, lists, timeout)
    mine = every[parent.rank // group_size]
    assert isinstance(mine, IProcessGroup)  # every rank is in one list
    return mine, every


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: float | datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[IProcessGroup | NonGroupMember, list[IProcessGroup | NonGroupMember]]:
    """Groups of the default group from disjoint lists of global ranks; every rank calls it.

    ``backend``, ``pg_options`` and ``group_desc`` as for ``new_group``.

    Returns:
        This rank's group, and every group in order; where this rank is not a member,
        ``commlib.GroupMember.NON_GROUP_MEMBER`` (for its own, when it is in no list: torch
        gives None there, which commlib would read as the default group).
    """
    del group_desc
    op = "new_subgroups_by_enumeration"
    parent = get_default_group()
    _check_group_options(parent, op, backend, pg_options)
    every = subgroups.split_groups(parent, op, ranks_per_subgroup_list, timeout)
    return subgroups.this_ranks_group(parent, op, every), every


def get_backend(group: IProcessGroup | None = None) -> str:
    """The name of ``group``'s backend (default group if None): ``ring``, ``gloo``, ``nccl``, ``mpi``."""
    return _group(group, "get_backend").backend


def get_group_rank(group: IProcessGroup, global_rank: int) -> int:
    """Return the rank in ``group`` of global rank ``global_rank`` (ValueError if it is not a member)."""
    return _group(group, "get_group_rank").get_group_rank(global_rank)


def get_global_rank(group: IProcessGroup, group_rank: int) -> int:
    """Return the global rank of ``group``'s rank ``group_rank``."""
    return _group(group, "get_global_rank").get_global_rank(group_rank)


def get_process_group_ranks(group: IProcessGroup | None = None) -> list[int]:
    """Return the global ranks of ``group``'s members, in group-rank order."""
    return list(_group(group, "get_process_group_ranks").global_ranks)
