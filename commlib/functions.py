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
    tensor_list: TensorList | torch.Tensor,
    tensor: torch.Tensor,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.all_gather`` on ``group`` (default group if None); torch's argument names.

    ``tensor_list`` may also be one tensor of ``world_size`` blocks (``all_gather_into_tensor``).
    """
    return _group(group).all_gather(tensor_list, tensor, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.all_gather_into_tensor`` on ``group`` (default group if None)."""
    return _group(group).all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op)


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
    return _group(group).reduce_scatter(output, input_list, op, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002
    op: ReduceOp | PremulSum = ReduceOp.SUM,
    group: IProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``IProcessGroup.reduce_scatter_tensor`` on ``group`` (default group if None)."""
    return _group(group).reduce_scatter_tensor(output, input, op, async_op=async_op)


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
    g = _group(group)
    if device_ids is not None and (
        not isinstance(device_ids, (list, tuple))
        or any(isinstance(d, bool) or not isinstance(d, int) for d in device_ids)
    ):
        raise TypeError(f"{g._prefix('barrier')}device_ids must be a list of ints, got {device_ids!r}")
    if timeout is None or async_op:
        return g.barrier(async_op=async_op)
    seconds = g._sub_config("barrier", timeout).timeout  # checked as any group timeout is
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
    _group(group).monitored_barrier(timeout, wait_all_ranks)


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
) -> IProcessGroup | None:
    """Make a subgroup of the default group from its global ``ranks`` (None: all); every rank calls it.

    torch's other arguments: ``backend`` may name the default group's own backend (a subgroup
    always runs on it); ``sort_ranks=False`` keeps the order of ``ranks`` for the new group's
    ranks; ``group_desc`` and ``device_id`` are accepted and not used (a group knows its device).
    ``pg_options`` and ``use_local_synchronization=True`` are refused: commlib's backends take no
    options object, and every rank of the default group takes part in making a group.

    Returns:
        The new group on its members; None elsewhere.

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
    return group.new_group(members, timeout=timeout, sort_ranks=sort_ranks)


def split_group(
    parent_pg: IProcessGroup | None = None,
    split_ranks: Sequence[Sequence[int]] | None = None,
    timeout: float | datetime.timedelta | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
    backend: str | None = None,
) -> IProcessGroup | None:
    """``IProcessGroup.split_group`` on ``parent_pg`` (default group if None); ranks are its group ranks.

    ``backend``, ``pg_options`` and ``group_desc`` as for ``new_group``.
    """
    del group_desc
    parent = _group(parent_pg)
    _check_group_options(parent, "split_group", backend, pg_options)
    if split_ranks is None:
        raise ValueError(f"{parent._prefix('split_group')}split_ranks is required: disjoint lists of ranks")
    return parent.split_group(split_ranks, timeout=timeout)


def new_subgroups(
    group_size: int | None = None,
    group: IProcessGroup | None = None,
    timeout: float | datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[IProcessGroup, list[IProcessGroup | None]]:
    """Cut ``group`` (default group if None) into groups of ``group_size`` consecutive ranks.

    Every rank calls it. ``group_size`` None means the CUDA devices of this machine, as in torch
    (on CPU, pass it). ``backend``, ``pg_options`` and ``group_desc`` as for ``new_group``.

    Returns:
        This rank's group, and every group in order: the ones this rank is not in are None
        (torch hands out placeholders there; a rank here holds only its own groups).

    Raises:
        ValueError: ``group_size`` is not positive or does not divide the group's size.
    """
    del group_desc
    parent = _group(group)
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
    mine = parent.split_group(lists, timeout=timeout)
    assert mine is not None  # every rank is in one list
    return mine, [mine if parent.rank in ranks else None for ranks in lists]


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: float | datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[IProcessGroup | None, list[IProcessGroup | None]]:
    """Groups of the default group from disjoint lists of global ranks; every rank calls it.

    ``backend``, ``pg_options`` and ``group_desc`` as for ``new_group``.

    Returns:
        This rank's group (None if it is in no list), and every group in order (None where this
        rank is not a member).
    """
    del group_desc
    parent = get_default_group()
    _check_group_options(parent, "new_subgroups_by_enumeration", backend, pg_options)
    mine = parent.split_group(ranks_per_subgroup_list, timeout=timeout)
    return mine, [mine if parent.rank in ranks else None for ranks in ranks_per_subgroup_list]


def get_backend(group: IProcessGroup | None = None) -> str:
    """The name of ``group``'s backend (default group if None): ``ring``, ``gloo``, ``nccl``, ``mpi``."""
    return _group(group).backend


def get_group_rank(group: IProcessGroup, global_rank: int) -> int:
    """Return the rank in ``group`` of global rank ``global_rank`` (ValueError if it is not a member)."""
    return group.get_group_rank(global_rank)


def get_global_rank(group: IProcessGroup, group_rank: int) -> int:
    """Return the global rank of ``group``'s rank ``group_rank``."""
    return group.get_global_rank(group_rank)


def get_process_group_ranks(group: IProcessGroup | None = None) -> list[int]:
    """Return the global ranks of ``group``'s members, in group-rank order."""
    return list(_group(group).global_ranks)
