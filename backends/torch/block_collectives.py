"""Collectives built from torch's block-moving calls, with the reduction folded here in rank order.

- NCCL has no BAND, BOR or BXOR: ``all_reduce`` and ``reduce`` all-gather every
  rank's tensor and fold them (``bitwise_by_all_gather``; ``n`` times the bytes of
  an all-reduce: for masks and flags); ``reduce_scatter`` sends the blocks with
  one all-to-all and folds the received ones (``bitwise_reduce_scatter``).
- Gloo's own reduce-scatter is an all-reduce inside; ``reduce_scatter_by_all_to_all``
  moves each byte once and reduces the received blocks on Gloo's thread.
- On two Gloo ranks, all-gather and reduce-scatter are one exchange of blocks
  straight into place (``exchange``, ``exchange_all_gather``).

Each builder returns what the group launches: the call that starts the torch
collective, what it keeps alive, and the step that finishes it (or None).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from backends.common import kernels
from backends.torch.calls import AllgatherOptions, AllToAllOptions, ScratchPool, async_options
from backends.torch.reductions import device_combine, fold_in_rank_order
from commlib.types import ReduceOp

__all__ = [
    "Launch",
    "bitwise_by_all_gather",
    "bitwise_reduce_scatter",
    "exchange",
    "exchange_all_gather",
    "reduce_scatter_by_all_to_all",
]

Launch = tuple[Callable[[], Any], Any, Callable[[], None] | None]
"""``(call, keep_alive, finish)``: starts the torch collective, what it needs alive, what runs after."""

Movable = Callable[[torch.Tensor], torch.Tensor]
"""A tensor, or a view of its bytes as a dtype the torch backend moves (the group's ``_movable``)."""


def bitwise_by_all_gather(
    pg: Any, tensor: torch.Tensor, op: ReduceOp, root: int | None, rank: int, world: int, movable: Movable
) -> Launch:
    """``all_reduce`` (``root`` None) or ``reduce`` to ``root`` with an op NCCL lacks.

    Every rank gathers every rank's tensor and folds them in rank order; on
    ``reduce`` only the root writes its tensor.
    """
    flat = tensor.view(-1)
    rows = flat.new_empty((world, flat.numel()))
    combine = device_combine(op)

    def fold_rows() -> None:
        if root is None or rank == root:
            fold_in_rank_order(combine, torch.Tensor.copy_, rows, flat)

    moved_rows, moved = movable(rows.view(-1)), movable(flat)
    return (
        lambda: pg._allgather_base(moved_rows, moved, async_options(AllgatherOptions)),  # noqa: SLF001
        (tensor, rows),
        fold_rows if world > 1 else None,
    )


def bitwise_reduce_scatter(
    pg: Any, output: torch.Tensor, source: torch.Tensor, op: ReduceOp, world: int, movable: Movable
) -> Launch:
    """``reduce_scatter`` of ``source`` with an op NCCL lacks: an all-to-all of the blocks, then a fold."""
    received = torch.empty_like(source)
    blocks = received.view(world, -1)
    splits = [output.numel()] * world
    combine = device_combine(op)

    def fold_blocks() -> None:
        fold_in_rank_order(combine, torch.Tensor.copy_, blocks, output.view(-1))

    moved_in, moved_out = movable(source), movable(received)
    opts = async_options(AllToAllOptions)
    return (
        lambda: pg.alltoall_base(moved_out, moved_in, splits, splits, opts),
        (output, source, received),
        fold_blocks,
    )


def exchange(pg: Any, received: torch.Tensor, sent: torch.Tensor, rank: int, movable: Movable) -> Any:
    """Start the two-rank exchange: ``sent`` goes to the other rank, whose block lands in ``received``."""
    splits = [0, 0]
    splits[1 - rank] = sent.numel()
    return pg.alltoall_base(movable(received), movable(sent), splits, splits, async_options(AllToAllOptions))


def exchange_all_gather(
    pg: Any, flat_output: torch.Tensor, tensor: torch.Tensor, rank: int, movable: Movable
) -> Launch:
    """Gloo, two ranks: each sends its block to the other, straight into place.

    Gloo's all-gather took 14 ms for 25 MiB on two ranks, this 7 ms.
    """
    b = tensor.numel()
    mine = flat_output[rank * b : (rank + 1) * b]
    if mine.data_ptr() != tensor.data_ptr():
        mine.copy_(tensor.view(-1))
    theirs = flat_output[(1 - rank) * b : (2 - rank) * b]
    return lambda: exchange(pg, theirs, mine, rank, movable), (flat_output, tensor), None


def reduce_scatter_by_all_to_all(
    pg: Any,
    output: torch.Tensor,
    source: torch.Tensor,
    op: ReduceOp,
    rank: int,
    world: int,
    pairwise: bool,
    scratch: ScratchPool,
    movable: Movable,
) -> Launch:
    """Gloo: an all-to-all of the blocks of ``source``, then each rank reduces the blocks it received.

    Gloo's own reduce-scatter is an all-reduce inside; this moves each byte
    once, (n-1)/n of the input per rank, and took 13 ms against Gloo's 28 ms
    (and 19 ms for its all-reduce) for 25 MiB on two ranks. Two ranks
    (``pairwise``) exchange just the block the other reduces. The blocks are
    reduced in rank order, by the finishing step (on Gloo's thread as soon as
    they have arrived, once the group arms the work's future); the received
    buffer comes from ``scratch`` and goes back there.
    """
    start: Callable[[], Any]
    if pairwise:
        b = output.numel()
        received = scratch.take(b, source.dtype)
        blocks = [source[:b], received] if rank == 0 else [received, source[b:]]
        sent = source[(1 - rank) * b : (2 - rank) * b]
        start = lambda: exchange(pg, received, sent, rank, movable)  # noqa: E731
    else:
        received = scratch.take(source.numel(), source.dtype)
        blocks = list(received.chunk(world))
        splits = [output.numel()] * world
        start = lambda: pg.alltoall_base(received, source, splits, splits, async_options(AllToAllOptions))  # noqa: E731
    combine = kernels.combine(op, output.dtype)

    def reduce_blocks() -> None:
        try:
            fold_in_rank_order(combine, kernels.copy, blocks, output)
        finally:
            scratch.give_back(received)

    return start, (output, source, received), reduce_blocks
