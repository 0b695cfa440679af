"""The ring's unrooted collectives over its two links: all-reduce, broadcast, all-gather, reduce-scatter.

All-reduce is a reduce-scatter followed by an all-gather around the ring
(``ring_all_reduce``); on two ranks each rank reduces one half and writes the
result straight back where the neighbour lent it (``pair_all_reduce``); small
tensors travel with the records (``small_all_reduce``). Broadcast passes the
tensor down the chain from the source (``chain_broadcast``). Every ring pass is
made of ``exchange`` steps: stream one tensor to the right while another
arrives from the left, chunk by chunk.

Each function takes the ``Ring`` (this rank's two links, ``send`` to the
right neighbour and ``recv`` from the left one, its rank, the world size, the
sizes and the group's records check) first; ``backends.ring.group`` builds the
record and calls them on the host tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from backends.common import kernels
from backends.common.cuda_staging import StagingPipeline
from backends.common.kernels import Reducer
from backends.ring.links import RecvLink, SendLink
from backends.ring.records import Meta
from backends.ring.shared_buffers import Span
from backends.ring.staging import View, publisher, waiter
from commlib.errors import CommError
from commlib.types import ReduceOp

__all__ = [
    "CheckRecords",
    "Lendable",
    "all_gather_host",
    "all_reduce_host",
    "broadcast_host",
    "chain_broadcast",
    "check_carrying",
    "exchange",
    "pair_all_reduce",
    "Ring",
    "reduce_scatter_host",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "segments",
    "small_all_reduce",
]


CheckRecords = Callable[..., dict[int, torch.Tensor]]
"""The group's records check, ``RingProcessGroup._check_meta(mine, payload=None, *, hold_last=False,
lent=None)``: it passes every rank's record (and small payload) round the ring, raises on every
rank if they disagree, and returns the payloads that travelled with the records, by source rank."""


Lendable = Callable[[torch.Tensor], Span | None]
"""Where a tensor lies in one of this rank's shared buffers (to lend it), or None."""


@dataclasses.dataclass(frozen=True, slots=True)
class Ring:
    """This rank's place in the ring: what every algorithm over the two links works with.

    The group makes it once its links are up, and replaces it with one without links when it closes.

    Attributes:
        send: The link to the right neighbour (None on one rank).
        recv: The link from the left neighbour (None on one rank).
        rank: This rank.
        world_size: Ranks in the ring.
        chunk_bytes: The most one message on a link carries.
        small_bytes: Tensors of up to this many bytes travel with the records instead.
        slots: Messages a link holds before its sender waits.
        check: The group's records check.
        lendable: Where a tensor lies in this rank's shared buffers.
    """

    send: SendLink | None
    recv: RecvLink | None
    rank: int
    world_size: int
    chunk_bytes: int
    small_bytes: int
    slots: int
    check: CheckRecords
    lendable: Lendable


def segments(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Split ``flat`` into ``parts`` near-equal contiguous pieces (some empty if it is short)."""
    n = flat.numel()
    bounds = [n * i // parts for i in range(parts + 1)]
    return [flat[bounds[i] : bounds[i + 1]] for i in range(parts)]


def exchange(
    ring: Ring,
    outgoing: torch.Tensor,
    incoming: torch.Tensor,
    reduce: Reducer | None,
    lent: Span | None = None,
    sent: int = 0,
    *,
    ready: View | None = None,
    done: View | None = None,
    write_back: bool = False,
) -> int:
    """One ring step: stream ``outgoing`` to the right while ``incoming`` arrives from the left.

    With ``lent`` (``outgoing`` lies in a shared buffer), the right
    neighbour reads ``outgoing`` in place instead of receiving a copy. The
    first ``sent`` elements (one chunk) already went with the metadata record.
    Staged tensors pass ``ready``, called with each chunk of this rank's data
    before it is read (a chunk sent, or one the neighbour's is reduced into),
    and ``done``, called with each incoming chunk once it has arrived. With
    ``write_back``, each reduced chunk that the left neighbour lent is also
    written back into its buffer (``RecvLink.recv_reduce_back``).

    Returns:
        How many chunks were written back.
    """
    send, recv = ring.send, ring.recv
    assert send is not None and recv is not None
    step = max(1, ring.chunk_bytes // outgoing.element_size())
    n_out, n_in = outgoing.numel(), incoming.numel()
    written_back = 0
    for start in range(0, max(n_out, n_in), step):
        if sent <= start < n_out:
            chunk = outgoing[start : start + step]
            if ready is not None:
                ready(chunk)
            if lent is None:
                send.send(chunk)
            else:
                send.lend(chunk, lent.region, lent.offset(chunk))
        if start < n_in:
            chunk = incoming[start : start + step]
            if reduce is None:
                recv.recv_into(chunk)
            else:
                if ready is not None:
                    ready(chunk)
                if write_back:
                    written_back += recv.recv_reduce_back(chunk, reduce)
                else:
                    recv.recv_reduce(chunk, reduce)
            if done is not None:
                done(chunk)
    return written_back


def check_carrying(
    ring: Ring, meta: Meta, outgoing: torch.Tensor, lent: Span | None, ready: View | None
) -> int:
    """Check the records; on two ranks they carry the first chunk of ``outgoing``. Return its size.

    ``outgoing`` is what the reduce-scatter's first step sends: the neighbour
    has checked the records (two ranks: one hop) before it reads the chunk,
    and one message is saved. ``ready`` is called with the chunk first when
    the tensor is staged.
    """
    check = ring.check
    first = outgoing[: max(1, ring.chunk_bytes // outgoing.element_size())]
    if ring.world_size != 2:
        check(meta)
        return 0
    if not first.numel():  # this rank's half is empty (one element): the neighbour's may still come along
        check(meta, hold_last=True)
        return 0
    if ready is not None:
        ready(first)
    lend_first = (lent.region, lent.offset(first)) if lent is not None else None
    check(meta, first, hold_last=True, lent=lend_first)
    return first.numel()


# ------------------------------------------------------------------ all-reduce
def all_reduce_host(
    ring: Ring, tensor: torch.Tensor, op: ReduceOp, meta: Meta, staged: StagingPipeline | None
) -> None:
    """All-reduce ``tensor`` (a flat host tensor); ``staged``: the pipeline whose host tensor it is."""
    if tensor.numel() * tensor.element_size() <= ring.small_bytes:
        if staged is not None:
            staged.wait_host()
        small_all_reduce(ring, meta, tensor, op)
    else:
        ring_all_reduce(ring, tensor, op, meta, staged)


def small_all_reduce(ring: Ring, meta: Meta, flat: torch.Tensor, op: ReduceOp) -> None:
    """Every rank's tensor travels with the records; each rank reduces them in rank order."""
    n = ring.world_size
    combine = kernels.combine(op, flat.dtype)
    payloads = ring.check(meta, flat, hold_last=True)
    if n == 2 and len(payloads) == 1:  # the neighbour's tensor waits in the link
        recv = ring.recv
        assert recv is not None
        if ring.rank == 0:
            recv.recv_reduce(flat, lambda mine, theirs: combine(mine, mine, theirs))
        else:
            recv.recv_reduce(flat, lambda mine, theirs: combine(mine, theirs, mine))
    else:
        result = torch.empty_like(flat)
        combine(result, payloads[0], payloads[1])
        for source in range(2, n):
            combine(result, result, payloads[source])
        kernels.copy(flat, result)
    if op is ReduceOp.AVG:
        kernels.divide(flat, n)


def ring_all_reduce(
    ring: Ring, flat: torch.Tensor, op: ReduceOp, meta: Meta, staged: StagingPipeline | None
) -> None:
    """Reduce-scatter, then all-gather, around the ring.

    With ``staged`` (``flat`` is its host tensor), each chunk is waited for
    before the reduce-scatter reads it, and each segment is published as
    soon as it is final: this rank's own once reduced (and averaged), the
    others chunk by chunk as the all-gather brings them.
    """
    n, r, send = ring.world_size, ring.rank, ring.send
    assert send is not None
    segs = segments(flat, n)
    reduce = kernels.reducer(op, flat.dtype)
    lent = ring.lendable(flat)
    ready, done = (waiter(staged), publisher(staged)) if staged is not None else (None, None)
    carried = check_carrying(ring, meta, segs[r], lent, ready)
    if n == 2:
        pair_all_reduce(ring, segs, op, reduce, lent, carried, ready, done)
        return
    for s in range(n - 1):
        exchange(
            ring,
            segs[(r - s) % n],
            segs[(r - s - 1) % n],
            reduce,
            lent,
            sent=carried if s == 0 else 0,
            ready=ready,
        )
    if op is ReduceOp.AVG:
        kernels.divide(segs[(r + 1) % n], n)
    if done is not None:
        done(segs[(r + 1) % n])
    send.flush()
    # With a lent buffer, the right neighbour reads segment (r - t) of it in reduce-scatter step t;
    # the all-gather overwrites that segment in its step t, but only with the segment's final
    # value, which exists only after the neighbour has read and passed it on: no wait is needed.
    for t in range(n - 1):
        exchange(ring, segs[(r + 1 - t) % n], segs[(r - t) % n], None, lent, done=done)
    send.flush()
    if lent is not None:  # done only when nobody reads this rank's buffer any more
        send.wait_returned()


def pair_all_reduce(
    ring: Ring,
    segs: list[torch.Tensor],
    op: ReduceOp,
    reduce: Reducer,
    lent: Span | None,
    carried: int,
    ready: View | None,
    done: View | None,
) -> None:
    """Two ranks: each reduces one half; where the neighbour lent its half, the result goes straight back.

    This rank sends (or lends) ``segs[r]`` and reduces the neighbour's
    ``segs[1 - r]`` into its own. A chunk the neighbour lent from its shared
    buffer gets the reduced chunk written back there while it is still in
    cache, so no all-gather pass reads it again. A lent chunk is always
    written back, so each rank knows without asking: if it lent its half,
    the neighbour writes the result into it (done once the neighbour's
    counter has passed every lent chunk); if not, the result comes back
    through the slots as in the ring.
    """
    r, send, recv = ring.rank, ring.send, ring.recv
    assert send is not None and recv is not None
    outgoing, incoming = segs[r], segs[1 - r]
    if op is ReduceOp.AVG:
        plain = reduce

        def reduce(dst: torch.Tensor, theirs: torch.Tensor) -> None:
            plain(dst, theirs)
            kernels.divide(dst, 2)

    written_back = exchange(
        ring, outgoing, incoming, reduce, lent, sent=carried, ready=ready, write_back=True
    )
    chunks_in = -(-incoming.numel() // max(1, ring.chunk_bytes // incoming.element_size()))
    if written_back not in (0, chunks_in):
        raise CommError(
            f"protocol error from {recv.describe}: {written_back} of the {chunks_in} chunks of its half "
            "were lent; a rank lends all of a tensor's chunks or none"
        )
    if done is not None:
        done(incoming)
    send.flush()
    # Only what did not go back in place travels again: this rank's result if the neighbour's
    # half came through the slots, the neighbour's result if this rank's half did.
    back_out = incoming if not written_back else incoming[:0]
    back_in = outgoing if lent is None else outgoing[:0]  # a lent half was written back
    if back_out.numel() or back_in.numel():
        exchange(ring, back_out, back_in, None, lent, done=done)
        send.flush()
    if lent is not None:  # done only when the neighbour no longer reads, or writes, this rank's buffer
        send.wait_returned()
    if lent is not None and done is not None:
        done(outgoing)


# ------------------------------------------------------------------- broadcast
def broadcast_host(
    ring: Ring, tensor: torch.Tensor, src: int, meta: Meta, staged: StagingPipeline | None
) -> None:
    """Broadcast ``tensor`` (a flat host tensor); ``staged``: the pipeline whose host tensor it is."""
    rank = ring.rank
    if tensor.numel() * tensor.element_size() <= ring.small_bytes:
        if staged is not None and rank == src:
            staged.wait_host()
        payloads = ring.check(meta, tensor if rank == src else None)
        if rank != src:
            kernels.copy(tensor, payloads[src])
    else:
        ring.check(meta)
        if staged is None:
            chain_broadcast(ring, tensor, src)
        else:
            chain_broadcast(ring, tensor, src, ready=waiter(staged), done=publisher(staged))


def chain_broadcast(
    ring: Ring,
    flat: torch.Tensor,
    src: int,
    *,
    ready: View | None = None,
    done: View | None = None,
) -> None:
    """Pass ``flat`` down the chain from ``src``, chunk by chunk.

    Staged tensors pass ``ready`` (the source calls it with each chunk before
    sending it) and ``done`` (the others call it with each chunk received).
    """
    send, recv, world_size = ring.send, ring.recv, ring.world_size
    assert send is not None and recv is not None
    distance = (ring.rank - src) % world_size
    step = max(1, ring.chunk_bytes // flat.element_size())
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step]
        if distance > 0:
            recv.recv_into(chunk)
            if done is not None:
                done(chunk)
        elif ready is not None:
            ready(chunk)
        if distance < world_size - 1:
            send.send(chunk)
    send.flush()


# ------------------------------------------------------------------ all-gather
def all_gather_host(
    ring: Ring, blocks: list[torch.Tensor], tensor: torch.Tensor, meta: Meta, done: list[View] | None
) -> None:
    """Gather every rank's ``tensor`` into ``blocks`` (flat host views, one per rank).

    With staged outputs, ``done[k]`` is called with each part of ``blocks[k]`` once it is final.
    """
    n, r, send, recv, check = ring.world_size, ring.rank, ring.send, ring.recv, ring.check
    if blocks[r].data_ptr() != tensor.data_ptr() or blocks[r].numel() == 0:
        kernels.copy(blocks[r].view(-1), tensor.view(-1))
    if done is not None:
        done[r](blocks[r])
    if n == 1:
        return
    if tensor.numel() * tensor.element_size() <= ring.small_bytes:
        payloads = check(meta, tensor, hold_last=True)
        for source, block in enumerate(blocks):
            if source == r:
                continue
            if source in payloads:
                kernels.copy(block.view(-1), payloads[source].view(-1))
            else:  # two ranks: the neighbour's tensor waits in the link, read straight into its block
                recv.recv_into(block.view(-1))  # type: ignore[union-attr]
            if done is not None:
                done[source](block)
        return
    check(meta)
    assert send is not None and recv is not None
    for s in range(n - 1):
        k = (r - s - 1) % n
        exchange(ring, blocks[(r - s) % n], blocks[k], None, done=done[k] if done is not None else None)
    send.flush()


# -------------------------------------------------------------- reduce-scatter
def reduce_scatter_host(
    ring: Ring,
    work: torch.Tensor,
    output: torch.Tensor,
    op: ReduceOp,
    meta: Meta,
    lent: Span | None,
    ready: View | None,
) -> None:
    """Reduce ``work`` (every rank's blocks, in rank order) and leave block ``rank`` in ``output``.

    ``work`` may be reduced in place. With a staged input, ``ready`` is called
    with each part of ``work`` before it is read.
    """
    n, r = ring.world_size, ring.rank
    blocks = segments(work, n)
    mine = blocks[r]
    if n > 1 and work.numel() * work.element_size() <= ring.small_bytes:
        if ready is not None:
            ready(work)
        payloads = ring.check(meta, work)
        combine = kernels.combine(op, work.dtype)
        mine = torch.empty_like(blocks[r])
        combine(mine, segments(payloads[0], n)[r], segments(payloads[1], n)[r])
        for source in range(2, n):
            combine(mine, mine, segments(payloads[source], n)[r])
    elif n > 1:
        ring_reduce_scatter(ring, blocks, op, meta, lent, ready)
    elif ready is not None:
        ready(work)
    if op is ReduceOp.AVG and n > 1:
        kernels.divide(mine, n)
    if mine.data_ptr() != output.data_ptr():
        kernels.copy(output, mine)


def ring_reduce_scatter(
    ring: Ring, blocks: list[torch.Tensor], op: ReduceOp, meta: Meta, lent: Span | None, ready: View | None
) -> None:
    """Reduce-scatter ``blocks`` (one per rank) in place: block ``rank`` ends up reduced.

    Step ``s`` sends block ``rank - s - 1`` and adds the left neighbour's
    partial sum into block ``rank - s - 2``: a block is written only before
    it is sent, so with ``lent`` the neighbour may read it in place. With a
    staged input, ``ready`` is called with each chunk before it is read.
    """
    n, r, send = ring.world_size, ring.rank, ring.send
    assert send is not None
    reduce = kernels.reducer(op, blocks[0].dtype)
    carried = check_carrying(ring, meta, blocks[(r - 1) % n], lent, ready)
    for s in range(n - 1):
        exchange(
            ring,
            blocks[(r - s - 1) % n],
            blocks[(r - s - 2) % n],
            reduce,
            lent,
            sent=carried if s == 0 else 0,
            ready=ready,
        )
    send.flush()
    if lent is not None:  # done only when nobody reads this rank's buffer any more
        send.wait_returned()
