"""The ring's rooted collectives and all-to-all over its two links.

``reduce`` passes partial results down the chain that ends at ``dst``
(``chain_reduce``), ``gather`` passes blocks towards ``dst`` (each rank sends
its own, then relays the ones before it), ``scatter`` passes them away from
``src`` (the farthest rank's first); ``relay`` forwards blocks from the left
neighbour to the right one. ``all_to_all`` passes each rank's blocks along the
ring, each hop keeping the block meant for it (``stream`` sends and receives
lists of tensors in turn); on two ranks that is one exchange. Small tensors
travel with the records.

Each function takes the ``Ring`` (``backends.ring.algorithms.Ring``: this
rank's two links, its rank, the world size, the sizes and the group's records
check) first; ``backends.ring.group`` builds the record and calls them on the
host tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backends.common import kernels
from backends.ring.algorithms import Ring, segments
from backends.ring.records import Meta, pack_counts, read_carried, read_counts, split_mismatch
from commlib.errors import CommError
from commlib.types import ReduceOp

__all__ = [
    "all_to_all_host",
    "chain_reduce",
    "copy_unless_same",
    "gather_host",
    "reduce_host",
    "relay",
    "scatter_host",
    "stream",
]


def copy_unless_same(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy flat ``src`` into ``dst`` unless they are the same memory."""
    if dst.data_ptr() != src.data_ptr() or dst.numel() == 0:
        kernels.copy(dst, src)


# ---------------------------------------------------------------------- reduce
def reduce_host(ring: Ring, flat: torch.Tensor, dst: int, op: ReduceOp, meta: Meta) -> None:
    """Reduce into ``flat`` on ``dst``; small tensors travel with the records, large ones down a chain."""
    n, rank = ring.world_size, ring.rank
    if flat.numel() * flat.element_size() <= ring.small_bytes:
        payloads = ring.check(meta, flat)
        if rank == dst:
            combine = kernels.combine(op, flat.dtype)
            result = torch.empty_like(flat)
            combine(result, payloads[0], payloads[1])
            for source in range(2, n):
                combine(result, result, payloads[source])
            kernels.copy(flat, result)
    else:
        ring.check(meta)
        chain_reduce(ring, flat, dst, op)
    if op is ReduceOp.AVG and rank == dst:
        kernels.divide(flat, n)


def chain_reduce(ring: Ring, flat: torch.Tensor, dst: int, op: ReduceOp) -> None:
    """Partial results flow down the chain that starts right of ``dst`` and ends at it, chunk by chunk.

    Each rank between adds its own chunk to the partial result into a
    scratch tensor (its input stays as it was) and passes it on; ``dst``
    adds the last partial result into its tensor.
    """
    n, send, recv = ring.world_size, ring.send, ring.recv
    assert send is not None and recv is not None
    position = (ring.rank - dst - 1) % n  # 0 starts the chain, n - 1 is dst
    step = max(1, ring.chunk_bytes // flat.element_size())
    starts = range(0, flat.numel(), step)
    if position == 0:
        for start in starts:
            send.send(flat[start : start + step])
    elif position == n - 1:
        reduce = kernels.reducer(op, flat.dtype)
        for start in starts:
            recv.recv_reduce(flat[start : start + step], reduce)
    else:
        combine = kernels.combine(op, flat.dtype)
        partial = torch.empty_like(flat)
        for start in starts:
            mine, out = flat[start : start + step], partial[start : start + step]
            recv.recv_reduce(out, lambda o, theirs, mine=mine: combine(o, theirs, mine))
            send.send(out)
    send.flush()


# ---------------------------------------------------------------------- gather
def gather_host(
    ring: Ring, flat: torch.Tensor, blocks: list[torch.Tensor] | None, dst: int, meta: Meta
) -> None:
    """Every rank's ``flat`` into ``blocks`` on ``dst`` (None elsewhere).

    Small tensors travel with the records. Large ones flow down the chain
    that ends at ``dst``: each rank sends its own block, then passes on
    those of the ranks before it, so ``dst`` receives the nearest first.
    """
    n, r, send, recv = ring.world_size, ring.rank, ring.send, ring.recv
    if blocks is not None:
        copy_unless_same(blocks[r], flat)
    if n == 1:
        return
    if flat.numel() * flat.element_size() <= ring.small_bytes:
        payloads = ring.check(meta, flat)
        if blocks is not None:
            for source, block in enumerate(blocks):
                if source != r:
                    kernels.copy(block, payloads[source])
        return
    ring.check(meta)
    assert send is not None and recv is not None
    step = max(1, ring.chunk_bytes // flat.element_size())
    position = (r - dst - 1) % n
    if blocks is not None:
        for k in range(1, n):
            block = blocks[(dst - k) % n]
            for start in range(0, block.numel(), step):
                recv.recv_into(block[start : start + step])
    else:
        for start in range(0, flat.numel(), step):
            send.send(flat[start : start + step])
        relay(ring, flat, position)
    send.flush()


# --------------------------------------------------------------------- scatter
def scatter_host(
    ring: Ring, flat: torch.Tensor, blocks: list[torch.Tensor] | None, src: int, meta: Meta
) -> None:
    """Block ``rank`` of ``blocks`` (on ``src``; None elsewhere) into every rank's ``flat``.

    Small blocks travel with the records (the source's, joined). Large ones
    flow down the chain from ``src``, the farthest rank's first: each rank
    passes on the blocks for the ranks after it and keeps the last.
    """
    n, r, send, recv = ring.world_size, ring.rank, ring.send, ring.recv
    if blocks is not None:
        copy_unless_same(flat, blocks[r])
    if n == 1:
        return
    nbytes, small_bytes = flat.numel() * flat.element_size(), ring.small_bytes
    if nbytes <= small_bytes and nbytes * n <= small_bytes:
        payloads = ring.check(meta, torch.cat(blocks) if blocks is not None else None)
        if blocks is None:
            kernels.copy(flat, segments(payloads[src], n)[r])
        return
    ring.check(meta)
    assert send is not None and recv is not None
    step = max(1, ring.chunk_bytes // flat.element_size())
    distance = (r - src) % n
    if blocks is not None:
        for k in range(n - 1, 0, -1):
            block = blocks[(src + k) % n]
            for start in range(0, block.numel(), step):
                send.send(block[start : start + step])
    else:
        relay(ring, flat, n - 1 - distance)
        for start in range(0, flat.numel(), step):
            recv.recv_into(flat[start : start + step])
    send.flush()


def relay(ring: Ring, like: torch.Tensor, count: int) -> None:
    """Pass ``count`` blocks of ``like``'s size from the left neighbour on to the right one."""
    if not count:
        return
    send, recv = ring.send, ring.recv
    assert send is not None and recv is not None
    step = max(1, ring.chunk_bytes // like.element_size())
    for _ in range(count):
        for start in range(0, like.numel(), step):
            recv.forward(like[start : start + step], send)


# ------------------------------------------------------------------ all-to-all
def all_to_all_host(
    ring: Ring,
    outputs: list[torch.Tensor],
    inputs: list[torch.Tensor],
    meta: Meta,
    label: Callable[[], object],
) -> None:
    """Block ``inputs[j]`` of every rank i into ``outputs[i]`` of rank j, passed along the ring.

    The records carry every rank's split sizes, so every rank checks the
    whole matrix (a mismatch raises on all). Step ``s`` (1 .. n-1) sends the
    right neighbour the blocks that rank ``r - s + 1`` has for the ranks
    after this one; the neighbour keeps the first and passes the rest on
    in the next step. On two ranks that is one exchange, and a block of up
    to ``small_bytes`` travels with the record itself. ``label()`` names the
    collective in the error a malformed record raises.
    """
    n, r, send = ring.world_size, ring.rank, ring.send
    if n == 1:
        error = split_mismatch([[inputs[0].numel()]], [[outputs[0].numel()]])
        if error is not None:
            raise error
        copy_unless_same(outputs[0], inputs[0])
        return
    # Two ranks: a small block for the neighbour travels with the record (one message each way).
    carry = inputs[1 - r] if n == 2 and inputs[1 - r].nbytes <= ring.small_bytes else None
    counts = [t.numel() for t in inputs] + [t.numel() for t in outputs] + [carry is not None]
    k = len(counts)
    payloads = ring.check(meta, pack_counts(counts, carry).view(meta.dtype))  # type: ignore[arg-type]
    try:
        rows = {rank: counts if rank == r else read_counts(p, k, rank) for rank, p in payloads.items()}
    except ValueError as e:  # only a peer running other code sends a short record
        raise CommError(f"{label()}: {e}") from None
    sent = [rows[i][:n] for i in range(n)]
    error = split_mismatch(sent, [rows[j][n : 2 * n] for j in range(n)])
    if error is not None:
        raise error
    copy_unless_same(outputs[r], inputs[r])
    assert send is not None
    if n == 2:
        left = 1 - r
        theirs = outputs[left]
        if rows[left][2 * n]:  # the neighbour's block came with its record
            try:
                read_carried(payloads[left], k, theirs, left)
            except ValueError as e:
                raise CommError(f"{label()}: {e}") from None
        stream(
            ring,
            [] if carry is not None else [inputs[left]],
            [] if rows[left][2 * n] else [theirs],
            lend=True,
        )
        send.flush()
        return
    carried: list[torch.Tensor] = []
    for s in range(1, n):
        origin = (r - s) % n  # whose blocks arrive in this step
        ahead = [(r + k) % n for k in range(1, n - s)]  # the ranks they are for, after this one
        outgoing = [inputs[(r + k) % n] for k in range(1, n)] if s == 1 else carried
        incoming = [outputs[origin]] + [torch.empty(sent[origin][d], dtype=meta.dtype) for d in ahead]
        # The caller's inputs are lent; later steps relay copies.
        stream(ring, outgoing, incoming, lend=s == 1)
        send.flush()
        carried = incoming[1:]


def stream(
    ring: Ring, outgoing: list[torch.Tensor], incoming: list[torch.Tensor], *, lend: bool = False
) -> None:
    """Send ``outgoing`` to the right while ``incoming`` arrives from the left, one chunk each in turn.

    With ``lend``, a tensor of ``outgoing`` that lies in a shared buffer (``ring.lendable``) is lent: the
    right neighbour copies its chunks straight out of it (one copy instead of two), and this returns
    once the neighbour has read them all.
    """
    if not outgoing and not incoming:
        return
    send, recv = ring.send, ring.recv
    assert send is not None and recv is not None
    step = max(1, ring.chunk_bytes // (incoming[0] if incoming else outgoing[0]).element_size())
    spans = [ring.lendable(t) if lend and send.can_lend else None for t in outgoing]
    out = [
        (t[i : i + step], span)
        for t, span in zip(outgoing, spans, strict=True)
        for i in range(0, t.numel(), step)
    ]
    into = [t[i : i + step] for t in incoming for i in range(0, t.numel(), step)]
    lent = False
    for k in range(max(len(out), len(into))):
        if k < len(out):
            chunk, span = out[k]
            if span is None:
                send.send(chunk)
            else:
                send.lend(chunk, span.region, span.offset(chunk))
                lent = True
        if k < len(into):
            recv.recv_into(into[k])
    if lent:
        send.wait_returned()
