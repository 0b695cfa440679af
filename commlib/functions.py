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

from commlib.p2p import P2POp
from commlib.process_group import IProcessGroup, TensorList
from commlib.types import PremulSum, ReduceOp
from commlib.work import Work
from commlib.world import get_default_group

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "irecv",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
]


def _group(group: IProcessGroup | None) -> IProcessGroup:
    return group if group is not None else get_default_group()


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
    return _group(group).all_reduce(tensor, op, async_op=async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: ReduceOp | PremulSum = ReduceOp.SUM,
    group: IProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """``IProcessGroup.reduce`` on ``group``; ``dst`` is a global rank, ``group_dst`` a group rank."""
    g = _group(group)
    return g.reduce(tensor, _root(g, "reduce", dst, group_dst, ("dst", "group_dst")), op, async_op=async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: IProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """``IProcessGroup.broadcast`` on ``group``; ``src`` is a global rank, ``group_src`` a group rank."""
    g = _group(group)
    return g.broadcast(tensor, _root(g, "broadcast", src, group_src, ("src", "group_src")), async_op=async_op)


def all_gather(
    output: torch.Tensor | TensorList,
    tensor: torch.Tensor,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.all_gather`` on ``group`` (default group if None)."""
    return _group(group).all_gather(output, tensor, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.all_gather_into_tensor`` on ``group`` (default group if None)."""
    return _group(group).all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor | TensorList,  # noqa: A002
    op: ReduceOp | PremulSum = ReduceOp.SUM,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.reduce_scatter`` on ``group`` (default group if None)."""
    return _group(group).reduce_scatter(output, input, op, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002
    op: ReduceOp | PremulSum = ReduceOp.SUM,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.reduce_scatter_tensor`` on ``group`` (default group if None)."""
    return _group(group).reduce_scatter_tensor(output, input, op, async_op=async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: TensorList | None = None,
    dst: int | None = None,
    group: IProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """``IProcessGroup.gather`` on ``group``; ``dst`` is a global rank, ``group_dst`` a group rank."""
    g = _group(group)
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
    g = _group(group)
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
    return _group(group).all_to_all(output_tensor_list, input_tensor_list, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.all_to_all_single`` on ``group`` (default group if None)."""
    return _group(group).all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, async_op=async_op
    )


def barrier(group: IProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """``IProcessGroup.barrier`` on ``group`` (default group if None)."""
    return _group(group).barrier(async_op=async_op)


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
    g = _group(group)
    g.send(tensor, _peer(g, "send", dst, group_dst, ("dst", "group_dst")), tag)


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: IProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    """``IProcessGroup.recv`` on ``group`` (``src`` None: any rank); return the sender's global rank."""
    g = _group(group)
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
    g = _group(group)
    return g.isend(tensor, _peer(g, "isend", dst, group_dst, ("dst", "group_dst")), tag)


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: IProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> Work:
    """``IProcessGroup.irecv`` on ``group`` (``src`` None: any rank; ``source_rank()`` is a group rank)."""
    g = _group(group)
    return g.irecv(tensor, _rank_in(g, "irecv", src, group_src, ("src", "group_src")), tag)


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Start every ``P2POp`` at once on their group (all must share one; None: the default group)."""
    groups = {id(p.group): p.group for p in p2p_op_list if isinstance(p, P2POp) and p.group is not None}
    if len(groups) > 1:
        raise ValueError("batch_isend_irecv: every P2POp of one batch must belong to the same group")
    group = next(iter(groups.values())) if groups else get_default_group()
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
    g = _group(group)
    g.broadcast_object_list(
        object_list, _root(g, "broadcast_object_list", src, group_src, ("src", "group_src"))
    )


def all_gather_object(object_list: list[Any], obj: Any, group: IProcessGroup | None = None) -> None:
    """``IProcessGroup.all_gather_object`` on ``group`` (default group if None)."""
    _group(group).all_gather_object(object_list, obj)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: IProcessGroup | None = None,
    group_dst: int | None = None,
) -> None:
    """``IProcessGroup.gather_object`` on ``group``; ``dst`` is a global rank, ``group_dst`` a group rank."""
    g = _group(group)
    g.gather_object(obj, object_gather_list, _root(g, "gather_object", dst, group_dst, ("dst", "group_dst")))


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: IProcessGroup | None = None,
    group_src: int | None = None,
) -> None:
    """``IProcessGroup.scatter_object_list`` on ``group``; ``src`` global, ``group_src`` a group rank."""
    g = _group(group)
    g.scatter_object_list(
        scatter_object_output_list,
        scatter_object_input_list,
        _root(g, "scatter_object_list", src, group_src, ("src", "group_src")),
    )


# ---------------------------------------------------------------- subgroups
def new_group(
    ranks: Sequence[int] | None = None, timeout: float | datetime.timedelta | None = None
) -> IProcessGroup | None:
    """Make a subgroup of the default group from its global ``ranks`` (None: all); every rank calls it.

    Returns:
        The new group on its members; None elsewhere.
    """
    group = get_default_group()
    return group.new_group(range(group.world_size) if ranks is None else ranks, timeout=timeout)


def get_group_rank(group: IProcessGroup, global_rank: int) -> int:
    """Return the rank in ``group`` of global rank ``global_rank`` (ValueError if it is not a member)."""
    return group.get_group_rank(global_rank)


def get_global_rank(group: IProcessGroup, group_rank: int) -> int:
    """Return the global rank of ``group``'s rank ``group_rank``."""
    return group.get_global_rank(group_rank)


def get_process_group_ranks(group: IProcessGroup | None = None) -> list[int]:
    """Return the global ranks of ``group``'s members, in group-rank order."""
    return list(_group(group).global_ranks)
