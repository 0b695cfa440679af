"""The ring's deterministic all-reduce: the left fold in rank order, down a chain and back round the ring.

Partial results run down the chain ``0 -> 1 -> ... -> n-1``, chunk by chunk: rank 0 sends
its chunk, each rank after it adds its own chunk to the partial result it receives (the
partial result first, as ``commlib.deterministic.fold_rows`` adds) and passes the sum on,
so rank ``n-1`` holds ``((x0 + x1) + ...) + x(n-1)`` of each chunk, divides it once for AVG
and sends it on at once round the ring, ``n-1 -> 0 -> 1 -> ... -> n-2``, each rank keeping a
copy. The two flows overlap: the links ``k -> k+1`` (``k < n-2``) carry both, in one fixed
order that every rank follows (step ``t``: partial chunk ``t``, then result chunk
``t - lag``), so rank 0 sends chunk ``t`` before it waits for result ``t - lag``. With
``lag`` at most the link's slots, rank ``n-1`` never finds the link to rank 0 full of results
that rank 0 has yet to read while rank 0 waits on it to send: no deadlock.

Bytes: each link carries the tensor twice (once, ``n-1 -> 0`` and ``n-2 -> n-1``), about
``2 S`` against the ring all-reduce's ``2 (n-1)/n S``. Work per element on each rank: one add
(none on rank 0) and up to three copies (into the link, out of it, into the next), where the
ring all-reduce adds ``(n-1)/n`` and copies about twice; a chunk's adds run one rank after
another, so its latency grows with ``n``. Results are received in place: a chunk's result
arrives only after its partial sum has left this rank (or, lent from a shared buffer, been read
by the right neighbour). From a shared buffer each rank's chunks are read in place, which saves
a copy per element and hop.
"""

from __future__ import annotations

import torch

from backends.common import kernels
from backends.ring.algorithms import Ring
from backends.ring.shared_buffers import Span
from commlib.types import ReduceOp

__all__ = ["chain_all_reduce"]


def chain_all_reduce(
    ring: Ring, flat: torch.Tensor, op: ReduceOp, factor: float | None, lent: Span | None = None
) -> None:
    """All-reduce host tensor ``flat`` as the left fold in rank order (see the module docstring).

    Chunks are ``ring.chunk_bytes`` long; rank 0 sends ``ring.slots`` of them before it
    reads the first result (the lag).

    Args:
        ring: This rank's place in the ring (at least 2 ranks).
        flat: This rank's flat contiguous tensor; it receives the result.
        op: SUM, AVG or PRODUCT (PREMUL_SUM: SUM with ``factor``).
        factor: PREMUL_SUM's factor: each rank multiplies its chunk by it first, in the tensor's
            dtype (``commlib.deterministic.left_fold``); None otherwise.
        lent: Where ``flat`` lies in a shared buffer: the right neighbour then reads each chunk
            this rank sends in place (it returns once the neighbour has read them all).
    """
    n, rank, send, recv = ring.world_size, ring.rank, ring.send, ring.recv
    assert send is not None and recv is not None
    step, lag = max(1, ring.chunk_bytes // flat.element_size()), ring.slots
    combine = kernels.combine(ReduceOp.PRODUCT if op is ReduceOp.PRODUCT else ReduceOp.SUM, flat.dtype)

    def add_mine(mine: torch.Tensor, partial: torch.Tensor) -> None:
        combine(mine, partial, mine)

    def put(chunk: torch.Tensor) -> None:
        if lent is None:
            send.send(chunk)
        else:
            send.lend(chunk, lent.region, lent.offset(chunk))

    chunks = [flat[start : start + step] for start in range(0, flat.numel(), step)]
    if rank == n - 1:  # the chain's end: fold, divide, start the results round the ring
        for chunk in chunks:
            if factor is not None:
                chunk.mul_(factor)
            recv.recv_reduce(chunk, add_mine)
            if op is ReduceOp.AVG:
                kernels.divide(chunk, n)
            put(chunk)
    else:
        forwards = rank < n - 2  # rank n-2 ends the results' way round
        for t in range(len(chunks) + lag):
            if t < len(chunks):
                chunk = chunks[t]
                if factor is not None:
                    chunk.mul_(factor)
                if rank > 0:
                    recv.recv_reduce(chunk, add_mine)
                put(chunk)
            if t >= lag:
                result = chunks[t - lag]
                # Safe in place: the result of a chunk arrives only after its partial sum left this rank.
                recv.recv_into(result)
                if forwards:
                    put(result)
    send.flush()
    if lent is not None:
        send.wait_returned()
