"""The ``ring`` backend: ring collectives in pure Python (standard library + torch).

All-reduce is a reduce-scatter followed by an all-gather around the ring, so
each rank sends ``2 (n - 1) / n`` of the tensor; the tensor streams through
the ring in chunks (``COMMLIB_RING_CHUNK_BYTES``), so sending, receiving and
reducing overlap. Between ranks on one host the chunks move through shared
memory; across hosts over TCP (``backends.ring.link_setup``). A tensor from
``alloc_buffer`` lives in shared memory itself: the right neighbour reads its
chunks in place, so an all-reduce costs one add and one copy per byte.

Copies and reductions never start torch's intra-op thread team
(``backends.common.kernels``), so the ring runs as fast under torch's default thread
count as under one thread, and it never changes the caller's thread setting.

Every collective starts by passing a small record (operation, dtype, shape,
sequence number) around the ring (``backends.ring.records``), so ranks that
disagree all raise the same ``CollectiveMismatchError`` naming each rank's
tensor; this exchange is also the whole of ``barrier()``. Small tensors travel
with the records.

The rooted collectives run down the chain that starts or ends at the root:
``reduce`` passes partial results towards ``dst``, ``gather`` passes blocks
towards ``dst`` (each rank sends its own, then relays the ones before it),
``scatter`` passes them away from ``src`` (the farthest rank's first).
``all_to_all`` passes each rank's blocks along the ring, each hop keeping the
block meant for it; on two ranks that is one exchange.

Point-to-point runs over links of its own between any two ranks, opened on
first use (``backends.ring.p2p``), and never touches the ring's links or its
sequence of collectives. A subgroup forms a ring of its own
(``backends.ring.subgroups``).

``async_op=True`` runs the collective on one progress thread per group, in the
order issued (like a CUDA stream); a synchronous call runs on the caller's
thread when nothing is queued, and after the queued work otherwise.

CUDA tensors are staged through pinned host memory, chunk by chunk
(``backends.common.cuda_staging``): every device-to-host copy is queued on a side
stream when the collective is issued, the ring waits for a chunk's copy only
just before it sends or reduces that chunk (the segments it sends first are
copied first), and each part of the result is copied back to the device as
soon as it is final (a rank's own reduced segment, then every segment the
all-gather brings), so the copies overlap the ring's sends. The caller's stream
waits for the copies back; the host never waits for the caller's stream.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from backends.common import kernels
from backends.common.cuda_staging import StagingPipeline
from backends.common.kernels import Reducer
from backends.ring.capabilities import RING_ROWS
from backends.ring.config import RingConfig
from backends.ring.link_setup import LinkShape, connect_links
from backends.ring.links import RecvLink, SendLink
from backends.ring.ordered import chain_all_reduce
from backends.ring.p2p import PointToPoint
from backends.ring.records import (
    COMMON_BYTES,
    Meta,
    different_calls,
    mismatch,
    pack_counts,
    read_carried,
    read_counts,
    split_mismatch,
)
from backends.ring.rendezvous import RingSockets, rendezvous
from backends.ring.shared_buffers import SharedBuffers, Span
from backends.ring.shm import RegionId
from backends.ring.staging import Staged, View, first_chunks, on_host, publisher, waiter
from backends.ring.subgroups import Parent, new_subgroup
from commlib.capabilities import Row
from commlib.config import CommConfig
from commlib.diagnosis import history
from commlib.diagnosis.history import HISTORY_BYTES
from commlib.env import DistEnv
from commlib.errors import (
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    GroupClosedError,
    PeerFailureError,
)
from commlib.lanes import Lane
from commlib.p2p import P2PRequest
from commlib.process_group import IProcessGroup
from commlib.types import PremulSum, ReduceOp
from commlib.work import CollectiveLabel, CompletedWork, Work

__all__ = ["RingConfig", "RingProcessGroup", "BACKENDS"]


def _segments(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Split ``flat`` into ``parts`` near-equal contiguous pieces (some empty if it is short)."""
    n = flat.numel()
    bounds = [n * i // parts for i in range(parts + 1)]
    return [flat[bounds[i] : bounds[i + 1]] for i in range(parts)]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy flat ``src`` into ``dst`` unless they are the same memory."""
    if dst.data_ptr() != src.data_ptr() or dst.numel() == 0:
        kernels.copy(dst, src)


def _set_source(work: Work, source: int) -> None:
    work._set_source(source)  # noqa: SLF001 - a receive's work names its sender


# --------------------------------------------------------------- the group
class RingProcessGroup(IProcessGroup):
    """Process group whose collectives run around a ring of neighbour links.

    Args:
        env: Rank, world size and rendezvous address.
        config: Shared settings (timeout).
        ring_config: Ring settings; default from ``COMMLIB_RING_*``.

    Raises:
        RendezvousError: The ranks could not connect (see the message).
    """

    backend_name = "ring"
    supported_devices = frozenset({"cpu", "cuda"})

    def __init__(
        self,
        env: DistEnv,
        config: CommConfig | None = None,
        ring_config: RingConfig | None = None,
        *,
        connection: RingSockets | None = None,
    ) -> None:
        super().__init__(env, config)
        self._ring_config = ring_config if ring_config is not None else RingConfig.from_env()
        settings = {
            "chunk_bytes": self._ring_config.chunk_bytes,
            "slots": self._ring_config.shm_slots,
            "small_bytes": self._ring_config.small_bytes,
        }
        sockets = connection or rendezvous(env, self.timeout, settings, self.backend_name)
        shared = sockets.settings
        self._chunk_bytes = int(shared["chunk_bytes"])
        self._small_bytes = min(int(shared["small_bytes"]), self._chunk_bytes)
        shape = LinkShape(
            self._ring_config.transport,
            self._chunk_bytes,
            int(shared["slots"]),
            self._ring_config.shm_dir,
            self._ring_config.spin_us * 1e-6,
        )
        self._right: SendLink | None
        self._left: RecvLink | None
        try:
            self._right, self._left = connect_links(
                sockets,
                env.rank,
                env.world_size,
                transport=shape.transport,
                chunk_bytes=shape.chunk_bytes,
                slots=shape.slots,
                shm_dir=shape.shm_dir,
                prefix=self._prefix("rendezvous"),
                spin_s=shape.spin_s,
            )
        except BaseException:
            sockets.close()
            raise
        self._run_lock = threading.Lock()
        # Every step of a collective waits at most the group's timeout; the bound only
        # catches a progress thread that stopped.
        self._lane = Lane("ring-progress", bound_s=self.timeout * 2 + 30.0)
        self._buffers = (
            SharedBuffers(self._right.retire)  # type: ignore[attr-defined]
            if self._right is not None and self._right.can_lend
            else None
        )
        self._peers = sockets.peers
        self._session = sockets.session
        self._settings = shared
        self._listen_address = sockets.listener.getsockname()[0] if sockets.listener is not None else ""
        self._peer_links = (
            PointToPoint(
                rank=env.rank,
                peers=sockets.peers,
                listener=sockets.listener,
                session=sockets.session,
                shape=shape,
                timeout=self.timeout,
                prefix=self._prefix,
                early=sockets.early,
            )
            if sockets.listener is not None
            else None
        )

    # ----------------------------------------------------------- introspection
    @property
    def transports(self) -> tuple[str, str]:
        """Transport of the (send, receive) links: ``shm`` or ``tcp`` (``none`` at world size 1)."""
        return (
            self._right.transport if self._right is not None else "none",
            self._left.transport if self._left is not None else "none",
        )

    @property
    def chunk_bytes(self) -> int:
        """Pipeline chunk size in bytes, agreed by all ranks (rank 0's setting)."""
        return self._chunk_bytes

    @property
    def shares_buffers(self) -> bool:
        """True if ``alloc_buffer`` returns shared memory that the right neighbour reads in place."""
        return self._buffers is not None

    @property
    def mapped_peer_buffers(self) -> int:
        """How many of the left neighbour's shared buffers this rank has mapped to read in place."""
        return getattr(self._left, "lent_regions", 0)

    # ---------------------------------------------------------------- buffers
    def alloc_buffer(
        self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Return a zeroed flat tensor in shared memory that the ring all-reduces without a copy.

        On one host the right neighbour maps the buffer, so an ``all_reduce`` of
        the whole buffer, or of a contiguous view into it, moves no bytes
        through the links' slots: the reduce-scatter adds the left neighbour's
        part straight from its buffer, and the all-gather copies the reduced
        parts straight out of it (one add and one copy per byte). Such a
        collective completes only when the right neighbour has finished
        reading this rank's buffer, so the buffer may be written as soon as it
        returns (or its ``Work`` completes).

        Tensors from elsewhere, other devices, a world of one rank and links
        that cannot share memory (TCP) get ordinary memory (``torch.zeros``)
        and take the normal path. The buffer lives as long as the returned
        tensor or any view of it.

        Args:
            numel: Number of elements (>= 0).
            dtype: Element type.
            device: Where the buffer lives; only ``cpu`` buffers are shared.

        Raises:
            ValueError: ``numel`` is negative.
        """
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"{self._prefix('alloc_buffer')}numel must be a non-negative int, got {numel!r}")
        buffers = self._buffers
        if (
            buffers is None
            or self._closed
            or numel == 0
            or torch.device(device).type != "cpu"
            or dtype not in self.supported_dtypes
        ):
            return super().alloc_buffer(numel, dtype, device)
        try:
            return buffers.alloc(numel, dtype)
        except OSError:  # no memfd, or out of shared memory: ordinary memory works everywhere
            return super().alloc_buffer(numel, dtype, device)

    def _lendable(self, flat: torch.Tensor) -> Span | None:
        buffers = self._buffers
        return buffers.find(flat) if buffers is not None else None

    # ------------------------------------------------------------- execution
    def _reduction_rows(self) -> tuple[Row, ...]:
        """``RING_ROWS``: SUM, PRODUCT and AVG exact on two ranks, MAX and MIN propagate NaN."""
        return RING_ROWS

    def _submit(
        self, label: CollectiveLabel, body: Callable[[], Any], async_op: bool, keep_alive: object = None
    ) -> Work:
        def run() -> None:
            self._execute(label, body)

        return self._lane.submit(label, run, async_op, keep_alive)

    def _execute(self, describe: CollectiveLabel | str, body: Callable[[], Any]) -> None:
        with self._run_lock:
            if self._closed or self._broken is not None:
                reason = "closed" if self._closed else f"unusable after an earlier failure ({self._broken})"
                raise GroupClosedError(f"{describe}: the process group is {reason}")
            try:
                body()
            except CollectiveMismatchError as e:
                raise type(e)(f"{describe}: {e}") from None  # every rank saw it; links still in step
            except (CommError, OSError) as e:
                error = self._wrap(describe, e)
                self._mark_broken(error)
                for link in (self._right, self._left):
                    if link is not None:
                        link.abort(f"rank {self.rank} gave up: {error}")
                raise error from e

    @staticmethod
    def _wrap(describe: CollectiveLabel | str, e: BaseException) -> CommError:
        if isinstance(e, CommTimeoutError) or isinstance(e, TimeoutError):
            return CommTimeoutError(f"{describe}: {e}")
        if isinstance(e, PeerFailureError):
            return PeerFailureError(f"{describe}: {e}")
        return CommError(f"{describe}: {e}")

    def _next_meta(
        self,
        kind: str,
        tensor: torch.Tensor | None,
        op: ReduceOp | None = None,
        src: int = -1,
        shape: tuple[int, ...] | None = None,
    ) -> Meta:
        return Meta(
            seq=self._seq,
            kind=kind,
            dtype=tensor.dtype if tensor is not None else None,
            op=op,
            src=src,
            rank=self.rank,
            numel=tensor.numel() if tensor is not None else 0,
            shape=tuple(shape if shape is not None else (tensor.shape if tensor is not None else ())),
        )

    def _is_small(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() <= self._small_bytes

    def _check_meta(
        self,
        mine: Meta,
        payload: torch.Tensor | None = None,
        *,
        hold_last: bool = False,
        lent: tuple[RegionId, int] | None = None,
    ) -> dict[int, torch.Tensor]:
        """Pass every rank's record (and small payload) around the ring; raise on every rank if they disagree.

        Args:
            mine: This rank's record.
            payload: This rank's small payload, sent with the record.
            hold_last: With two ranks, leave the neighbour's payload in the link
                when its record agrees with ``mine``; the caller then reads it
                with ``recv_reduce`` / ``recv_into`` (straight out of shared memory).
            lent: Where ``payload`` lies in a shared buffer, to lend it rather than copy it.

        Returns:
            The payloads that travelled with the records and were read, by
            source rank (this rank's own included).
        """
        send, recv = self._right, self._left
        assert send is not None and recv is not None
        record = mine.pack(payload)
        common = record[:COMMON_BYTES]
        records = [record]
        payloads: dict[int, torch.Tensor] = {} if payload is None else {self.rank: payload}
        outgoing = payload
        hold = hold_last and self.world_size == 2
        for _ in range(self.world_size - 1):
            send.send_meta(record, outgoing, lent)
            lent = None  # only this rank's own payload lies in its buffer
            record = recv.recv_meta()
            records.append(record)
            outgoing = None
            if record[-4:] == b"\0\0\0\0":  # no payload
                continue
            if hold and record[:COMMON_BYTES] == common:
                continue  # agreed; the caller reads the payload
            meta = Meta.unpack(record)
            if meta.dtype is None or meta.payload_numel is None:
                raise CommError(
                    f"rank {meta.rank} sent a payload of unknown dtype; is it running another "
                    "commlib version?"
                )
            outgoing = torch.empty(meta.payload_numel, dtype=meta.dtype)
            recv.recv_into(outgoing)
            payloads[meta.rank] = outgoing
        send.flush()  # a queued payload may be a view of the caller's tensor, about to be overwritten
        if all(r[:COMMON_BYTES] == common for r in records):
            return payloads  # shapes may differ: the calls agree on the element count
        histories = self._swap_histories(mine.seq) if different_calls(records) else None
        raise mismatch(records, histories)

    def _swap_histories(self, seq: int) -> list[str]:
        """Pass every rank's count and last collectives round the ring (its records named different calls).

        Every rank holds the same records, so every rank makes this one pass, at the same point.
        """
        text = torch.frombuffer(bytearray(history.pack(self._parting_history())), dtype=torch.uint8)
        meta = Meta(seq, "barrier", torch.uint8, None, -1, self.rank, HISTORY_BYTES, (HISTORY_BYTES,))
        texts = self._check_meta(meta, text)
        return [history.unpack(texts[r].numpy().tobytes()) for r in range(self.world_size)]

    def _chunk_numel(self, tensor: torch.Tensor) -> int:
        """Elements of ``tensor``'s dtype in one chunk (at least one)."""
        return max(1, self._chunk_bytes // tensor.element_size())

    def _check_meta_carrying(
        self, meta: Meta, outgoing: torch.Tensor, lent: Span | None, ready: View | None
    ) -> int:
        """Check the records; on two ranks they carry the first chunk of ``outgoing``. Return its size.

        ``outgoing`` is what the reduce-scatter's first step sends: the neighbour
        has checked the records (two ranks: one hop) before it reads the chunk,
        and one message is saved. ``ready`` is called with the chunk first when
        the tensor is staged.
        """
        first = outgoing[: self._chunk_numel(outgoing)]
        if self.world_size != 2 or not first.numel():
            self._check_meta(meta)
            return 0
        if ready is not None:
            ready(first)
        lend_first = (lent.region, lent.offset(first)) if lent is not None else None
        self._check_meta(meta, first, hold_last=True, lent=lend_first)
        return first.numel()

    def _exchange(
        self,
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
        send, recv = self._right, self._left
        assert send is not None and recv is not None
        step = self._chunk_numel(outgoing)
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

    def _flush(self) -> None:
        if self._right is not None:
            self._right.flush()

    # ------------------------------------------------------------ collectives
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        meta = self._next_meta("all_reduce", tensor, op)
        describe = self._label("all_reduce", tensor)
        if self.world_size == 1:
            return CompletedWork(label=describe)

        def first() -> list[tuple[int, int]]:
            if self._is_small(tensor):
                return []
            n, r = self.world_size, self.rank
            return first_chunks(tensor, [(r - s) % n for s in range(n)], n, self._chunk_numel(tensor))

        def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
            self._all_reduce_host(hosts[0], op, meta, staged[0])

        return self._submit(
            describe, on_host(self.timeout, run, Staged(tensor, fetch_first=first)), async_op, tensor
        )

    def _all_reduce_host(
        self, flat: torch.Tensor, op: ReduceOp, meta: Meta, staged: StagingPipeline | None = None
    ) -> None:
        """All-reduce host tensor ``flat``; ``staged``: the pipeline whose host tensor it is."""
        if self._is_small(flat):
            if staged is not None:
                staged.wait_host()
            self._small_all_reduce(meta, flat, op)
        else:
            self._ring_all_reduce(flat, op, meta, staged)

    def _small_all_reduce(self, meta: Meta, flat: torch.Tensor, op: ReduceOp) -> None:
        """Every rank's tensor travels with the records; each rank reduces them in rank order."""
        n = self.world_size
        combine = kernels.combine(op, flat.dtype)
        payloads = self._check_meta(meta, flat, hold_last=True)
        if n == 2 and len(payloads) == 1:  # the neighbour's tensor waits in the link
            recv = self._left
            assert recv is not None
            if self.rank == 0:
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

    def _ring_all_reduce(
        self, flat: torch.Tensor, op: ReduceOp, meta: Meta, staged: StagingPipeline | None = None
    ) -> None:
        """Reduce-scatter, then all-gather, around the ring.

        With ``staged`` (``flat`` is its host tensor), each chunk is waited for
        before the reduce-scatter reads it, and each segment is published as
        soon as it is final: this rank's own once reduced (and averaged), the
        others chunk by chunk as the all-gather brings them.
        """
        n, r = self.world_size, self.rank
        segs = _segments(flat, n)
        reduce = kernels.reducer(op, flat.dtype)
        lent = self._lendable(flat)
        ready, done = (waiter(staged), publisher(staged)) if staged is not None else (None, None)
        carried = self._check_meta_carrying(meta, segs[r], lent, ready)
        if n == 2:
            self._pair_all_reduce(segs, op, reduce, lent, carried, ready, done)
            return
        for s in range(n - 1):
            self._exchange(
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
        self._flush()
        # With a lent buffer, the right neighbour reads segment (r - t) of it in reduce-scatter step t;
        # the all-gather overwrites that segment in its step t, but only with the segment's final
        # value, which exists only after the neighbour has read and passed it on: no wait is needed.
        for t in range(n - 1):
            self._exchange(segs[(r + 1 - t) % n], segs[(r - t) % n], None, lent, done=done)
        self._flush()
        if lent is not None:  # done only when nobody reads this rank's buffer any more
            assert self._right is not None
            self._right.wait_returned()

    def _pair_all_reduce(
        self,
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
        send, recv = self._right, self._left
        assert send is not None and recv is not None
        r = self.rank
        outgoing, incoming = segs[r], segs[1 - r]
        if op is ReduceOp.AVG:
            plain = reduce

            def reduce(dst: torch.Tensor, theirs: torch.Tensor) -> None:
                plain(dst, theirs)
                kernels.divide(dst, 2)

        written_back = self._exchange(
            outgoing, incoming, reduce, lent, sent=carried, ready=ready, write_back=True
        )
        chunks_in = -(-incoming.numel() // self._chunk_numel(incoming))
        if written_back not in (0, chunks_in):
            raise CommError(
                f"protocol error from {recv.describe}: {written_back} of the {chunks_in} chunks of its half "
                "were lent; a rank lends all of a tensor's chunks or none"
            )
        if done is not None:
            done(incoming)
        self._flush()
        # Only what did not go back in place travels again: this rank's result if the neighbour's
        # half came through the slots, the neighbour's result if this rank's half did.
        back_out = incoming if not written_back else incoming[:0]
        back_in = outgoing if lent is None else outgoing[:0]  # a lent half was written back
        if back_out.numel() or back_in.numel():
            self._exchange(back_out, back_in, None, lent, done=done)
            self._flush()
        if lent is not None:  # done only when the neighbour no longer reads, or writes, this rank's buffer
            send.wait_returned()
        if lent is not None and done is not None:
            done(outgoing)

    def _ordered_all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp | PremulSum
    ) -> Callable[[bool], Work] | None:
        """float32 and float64 CPU tensors: small ones travel with the records, large ones fold down a chain.

        float16 and bfloat16 keep the interface's fold: their partial sums would travel in
        float32, more bytes than its exchange of shards. CUDA tensors keep it too.
        """
        if tensor.dtype not in (torch.float32, torch.float64) or not tensor.is_cpu:
            return None
        return functools.partial(self._fold_all_reduce, tensor, op)

    def _fold_all_reduce(self, tensor: torch.Tensor, op: ReduceOp | PremulSum, async_op: bool) -> Work:
        """``_small_all_reduce`` (it combines in rank order) or ``chain_all_reduce``, after the records."""
        premul = isinstance(op, PremulSum)
        factor, base = (op.scalar(), ReduceOp.SUM) if premul else (None, op)
        meta = self._next_meta("deterministic_all_reduce", tensor, ReduceOp.PREMUL_SUM if premul else base)
        flat = tensor.view(-1)

        def run() -> None:
            if self._is_small(flat):
                if factor is not None:
                    flat.mul_(factor)
                self._small_all_reduce(meta, flat, base)
                return
            send, recv = self._right, self._left
            assert send is not None and recv is not None
            self._check_meta(meta)
            step, slots, lent = self._chunk_numel(flat), int(self._settings["slots"]), self._lendable(flat)
            chain_all_reduce(send, recv, flat, self.rank, self.world_size, base, factor, step, slots, lent)

        return self._submit(self._label("all_reduce", tensor), run, async_op, tensor)

    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        meta = self._next_meta("broadcast", tensor, src=src)
        describe = self._label("broadcast", tensor)
        if self.world_size == 1:
            return CompletedWork(label=describe)
        sender = self.rank == src

        def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
            self._broadcast_host(hosts[0], src, meta, staged[0])

        body = on_host(self.timeout, run, Staged(tensor, copy_in=sender, copy_out=not sender))
        return self._submit(describe, body, async_op, tensor)

    def _broadcast_host(
        self, flat: torch.Tensor, src: int, meta: Meta, staged: StagingPipeline | None = None
    ) -> None:
        """Broadcast host tensor ``flat``; ``staged``: the pipeline whose host tensor it is."""
        if self._is_small(flat):
            if staged is not None and self.rank == src:
                staged.wait_host()
            payloads = self._check_meta(meta, flat if self.rank == src else None)
            if self.rank != src:
                kernels.copy(flat, payloads[src])
        else:
            self._check_meta(meta)
            if staged is None:
                self._chain_broadcast(flat, src)
            else:
                self._chain_broadcast(flat, src, ready=waiter(staged), done=publisher(staged))

    def _chain_broadcast(
        self, flat: torch.Tensor, src: int, *, ready: View | None = None, done: View | None = None
    ) -> None:
        """Pass ``flat`` down the chain from ``src``, chunk by chunk.

        Staged tensors pass ``ready`` (the source calls it with each chunk before
        sending it) and ``done`` (the others call it with each chunk received).
        """
        send, recv = self._right, self._left
        assert send is not None and recv is not None
        distance = (self.rank - src) % self.world_size
        step = self._chunk_numel(flat)
        for start in range(0, flat.numel(), step):
            chunk = flat[start : start + step]
            if distance > 0:
                recv.recv_into(chunk)
                if done is not None:
                    done(chunk)
            elif ready is not None:
                ready(chunk)
            if distance < self.world_size - 1:
                send.send(chunk)
        self._flush()

    def _all_gather(
        self,
        flat_output: torch.Tensor | None,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
    ) -> Work:
        n = self.world_size
        meta = self._next_meta("all_gather", tensor)
        describe = self._label("all_gather", tensor)
        # Staged, the input has a buffer of its own, even when it lies in the output.
        specs = [Staged(tensor, copy_out=False)] + [
            Staged(t, copy_in=False) for t in ([flat_output] if flat_output is not None else outputs)
        ]

        def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
            blocks = _segments(hosts[1], n) if flat_output is not None else hosts[1:]
            done = None
            if staged[0] is not None:
                staged[0].wait_host()
                owners = staged[1:] * n if flat_output is not None else staged[1:]  # each block's pipeline
                done = [publisher(pipeline) for pipeline in owners]  # type: ignore[arg-type]
            self._all_gather_host(blocks, hosts[0], meta, done)

        return self._submit(describe, on_host(self.timeout, run, *specs), async_op, (outputs, tensor))

    def _all_gather_host(
        self, blocks: list[torch.Tensor], tensor: torch.Tensor, meta: Meta, done: list[View] | None = None
    ) -> None:
        """Gather every rank's ``tensor`` into ``blocks`` (flat host views, one per rank).

        With staged outputs, ``done[k]`` is called with each part of ``blocks[k]`` once it is final.
        """
        n, r = self.world_size, self.rank
        if blocks[r].data_ptr() != tensor.data_ptr() or blocks[r].numel() == 0:
            kernels.copy(blocks[r].view(-1), tensor.view(-1))
        if done is not None:
            done[r](blocks[r])
        if n == 1:
            return
        if self._is_small(tensor):
            payloads = self._check_meta(meta, tensor, hold_last=True)
            for source, block in enumerate(blocks):
                if source == r:
                    continue
                if source in payloads:
                    kernels.copy(block.view(-1), payloads[source].view(-1))
                else:  # two ranks: the neighbour's tensor waits in the link, read straight into its block
                    self._left.recv_into(block.view(-1))  # type: ignore[union-attr]
                if done is not None:
                    done[source](block)
            return
        self._check_meta(meta)
        for s in range(n - 1):
            k = (r - s - 1) % n
            self._exchange(blocks[(r - s) % n], blocks[k], None, done=done[k] if done is not None else None)
        self._flush()

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
    ) -> Work:
        n, r = self.world_size, self.rank
        meta = self._next_meta("reduce_scatter", output, op)
        describe = self._label("reduce_scatter", output)
        if output.device.type == "cpu":
            # Reduce in the caller's buffer when the output is its block (lending it when shared).
            in_place = self._is_rank_block(output, flat_input)

            def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
                if in_place:
                    assert flat_input is not None
                    work, lent = flat_input, self._lendable(flat_input)
                else:
                    work, lent = torch.empty(n * output.numel(), dtype=output.dtype), None
                    for block, source in zip(_segments(work, n), inputs, strict=True):
                        kernels.copy(block, source)
                self._reduce_scatter_host(work, hosts[0], op, meta, lent)

            return self._submit(
                describe, on_host(self.timeout, run, Staged(output)), async_op, (output, inputs)
            )
        # A list's blocks are joined on the device (on the caller's stream, before the copies out).
        source = self._whole(flat_input, inputs)

        def first() -> list[tuple[int, int]]:
            if n == 1 or self._is_small(source):
                return []
            return first_chunks(source, [(r - 1 - s) % n for s in range(n)], n, self._chunk_numel(source))

        def run_staged(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
            self._reduce_scatter_host(hosts[0], hosts[1], op, meta, None, waiter(staged[0]))  # type: ignore[arg-type]

        body = on_host(
            self.timeout,
            run_staged,
            Staged(source, copy_out=False, fetch_first=first),
            Staged(output, copy_in=False),
        )
        return self._submit(describe, body, async_op, (output, inputs))

    def _reduce_scatter_host(
        self,
        work: torch.Tensor,
        output: torch.Tensor,
        op: ReduceOp,
        meta: Meta,
        lent: Span | None,
        ready: View | None = None,
    ) -> None:
        """Reduce ``work`` (every rank's blocks, in rank order) and leave block ``rank`` in ``output``.

        ``work`` may be reduced in place. With a staged input, ``ready`` is called
        with each part of ``work`` before it is read.
        """
        n, r = self.world_size, self.rank
        blocks = _segments(work, n)
        mine = blocks[r]
        if n > 1 and self._is_small(work):
            if ready is not None:
                ready(work)
            payloads = self._check_meta(meta, work)
            combine = kernels.combine(op, work.dtype)
            mine = torch.empty_like(blocks[r])
            combine(mine, _segments(payloads[0], n)[r], _segments(payloads[1], n)[r])
            for source in range(2, n):
                combine(mine, mine, _segments(payloads[source], n)[r])
        elif n > 1:
            self._ring_reduce_scatter(blocks, op, meta, lent, ready)
        elif ready is not None:
            ready(work)
        if op is ReduceOp.AVG and n > 1:
            kernels.divide(mine, n)
        if mine.data_ptr() != output.data_ptr():
            kernels.copy(output, mine)

    def _ring_reduce_scatter(
        self,
        blocks: list[torch.Tensor],
        op: ReduceOp,
        meta: Meta,
        lent: Span | None,
        ready: View | None = None,
    ) -> None:
        """Reduce-scatter ``blocks`` (one per rank) in place: block ``rank`` ends up reduced.

        Step ``s`` sends block ``rank - s - 1`` and adds the left neighbour's
        partial sum into block ``rank - s - 2``: a block is written only before
        it is sent, so with ``lent`` the neighbour may read it in place. With a
        staged input, ``ready`` is called with each chunk before it is read.
        """
        n, r = self.world_size, self.rank
        reduce = kernels.reducer(op, blocks[0].dtype)
        carried = self._check_meta_carrying(meta, blocks[(r - 1) % n], lent, ready)
        for s in range(n - 1):
            self._exchange(
                blocks[(r - s - 1) % n],
                blocks[(r - s - 2) % n],
                reduce,
                lent,
                sent=carried if s == 0 else 0,
                ready=ready,
            )
        self._flush()
        if lent is not None:  # done only when nobody reads this rank's buffer any more
            assert self._right is not None
            self._right.wait_returned()

    # ------------------------------------------------------- rooted collectives
    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, async_op: bool) -> Work:
        meta = self._next_meta("reduce", tensor, op, src=dst)
        describe = self._label("reduce", tensor)
        if self.world_size == 1:
            return CompletedWork(label=describe)

        def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
            if staged[0] is not None:
                staged[0].wait_host()
            self._reduce_host(hosts[0], dst, op, meta)

        body = on_host(self.timeout, run, Staged(tensor, copy_out=self.rank == dst))
        return self._submit(describe, body, async_op, tensor)

    def _reduce_host(self, flat: torch.Tensor, dst: int, op: ReduceOp, meta: Meta) -> None:
        """Reduce into ``flat`` on ``dst``; small tensors travel with the records, large ones down a chain."""
        n = self.world_size
        if self._is_small(flat):
            payloads = self._check_meta(meta, flat)
            if self.rank == dst:
                combine = kernels.combine(op, flat.dtype)
                result = torch.empty_like(flat)
                combine(result, payloads[0], payloads[1])
                for source in range(2, n):
                    combine(result, result, payloads[source])
                kernels.copy(flat, result)
        else:
            self._check_meta(meta)
            self._chain_reduce(flat, dst, op)
        if op is ReduceOp.AVG and self.rank == dst:
            kernels.divide(flat, n)

    def _chain_reduce(self, flat: torch.Tensor, dst: int, op: ReduceOp) -> None:
        """Partial results flow down the chain that starts right of ``dst`` and ends at it, chunk by chunk.

        Each rank between adds its own chunk to the partial result into a
        scratch tensor (its input stays as it was) and passes it on; ``dst``
        adds the last partial result into its tensor.
        """
        send, recv = self._right, self._left
        assert send is not None and recv is not None
        n = self.world_size
        position = (self.rank - dst - 1) % n  # 0 starts the chain, n - 1 is dst
        step = self._chunk_numel(flat)
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
        self._flush()

    def _gather(
        self, tensor: torch.Tensor, outputs: list[torch.Tensor] | None, dst: int, async_op: bool
    ) -> Work:
        meta = self._next_meta("gather", tensor, src=dst)
        describe = self._label("gather", tensor)
        specs = [Staged(tensor, copy_out=False)] + [Staged(t, copy_in=False) for t in outputs or ()]

        def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
            if staged[0] is not None:
                staged[0].wait_host()
            self._gather_host(hosts[0], hosts[1:] if outputs is not None else None, dst, meta)

        return self._submit(describe, on_host(self.timeout, run, *specs), async_op, (outputs, tensor))

    def _gather_host(
        self, flat: torch.Tensor, blocks: list[torch.Tensor] | None, dst: int, meta: Meta
    ) -> None:
        """Every rank's ``flat`` into ``blocks`` on ``dst`` (None elsewhere).

        Small tensors travel with the records. Large ones flow down the chain
        that ends at ``dst``: each rank sends its own block, then passes on
        those of the ranks before it, so ``dst`` receives the nearest first.
        """
        n, r = self.world_size, self.rank
        if blocks is not None:
            _copy(blocks[r], flat)
        if n == 1:
            return
        if self._is_small(flat):
            payloads = self._check_meta(meta, flat)
            if blocks is not None:
                for source, block in enumerate(blocks):
                    if source != r:
                        kernels.copy(block, payloads[source])
            return
        self._check_meta(meta)
        send, recv = self._right, self._left
        assert send is not None and recv is not None
        step = self._chunk_numel(flat)
        position = (r - dst - 1) % n
        if blocks is not None:
            for k in range(1, n):
                block = blocks[(dst - k) % n]
                for start in range(0, block.numel(), step):
                    recv.recv_into(block[start : start + step])
        else:
            for start in range(0, flat.numel(), step):
                send.send(flat[start : start + step])
            self._relay(flat, position)
        self._flush()

    def _scatter(
        self, tensor: torch.Tensor, inputs: list[torch.Tensor] | None, src: int, async_op: bool
    ) -> Work:
        meta = self._next_meta("scatter", tensor, src=src)
        describe = self._label("scatter", tensor)
        specs = [Staged(tensor, copy_in=False)] + [Staged(t, copy_out=False) for t in inputs or ()]

        def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
            for pipeline in staged[1:]:
                if pipeline is not None:
                    pipeline.wait_host()
            self._scatter_host(hosts[0], hosts[1:] if inputs is not None else None, src, meta)

        return self._submit(describe, on_host(self.timeout, run, *specs), async_op, (inputs, tensor))

    def _scatter_host(
        self, flat: torch.Tensor, blocks: list[torch.Tensor] | None, src: int, meta: Meta
    ) -> None:
        """Block ``rank`` of ``blocks`` (on ``src``; None elsewhere) into every rank's ``flat``.

        Small blocks travel with the records (the source's, joined). Large ones
        flow down the chain from ``src``, the farthest rank's first: each rank
        passes on the blocks for the ranks after it and keeps the last.
        """
        n, r = self.world_size, self.rank
        if blocks is not None:
            _copy(flat, blocks[r])
        if n == 1:
            return
        if self._is_small(flat) and flat.numel() * flat.element_size() * n <= self._small_bytes:
            payloads = self._check_meta(meta, torch.cat(blocks) if blocks is not None else None)
            if blocks is None:
                kernels.copy(flat, _segments(payloads[src], n)[r])
            return
        self._check_meta(meta)
        send, recv = self._right, self._left
        assert send is not None and recv is not None
        step = self._chunk_numel(flat)
        distance = (r - src) % n
        if blocks is not None:
            for k in range(n - 1, 0, -1):
                block = blocks[(src + k) % n]
                for start in range(0, block.numel(), step):
                    send.send(block[start : start + step])
        else:
            self._relay(flat, n - 1 - distance)
            for start in range(0, flat.numel(), step):
                recv.recv_into(flat[start : start + step])
        self._flush()

    def _relay(self, like: torch.Tensor, count: int) -> None:
        """Pass ``count`` blocks of ``like``'s size from the left neighbour on to the right one."""
        if not count:
            return
        send, recv = self._right, self._left
        assert send is not None and recv is not None
        step = self._chunk_numel(like)
        for _ in range(count):
            for start in range(0, like.numel(), step):
                recv.forward(like[start : start + step], send)

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], async_op: bool) -> Work:
        n = self.world_size
        dtype = inputs[0].dtype
        meta = Meta(self._seq, "all_to_all", dtype, None, -1, self.rank, 0, (sum(t.numel() for t in inputs),))
        describe = self._label("all_to_all", inputs[0])
        specs = [Staged(t, copy_out=False) for t in inputs] + [Staged(t, copy_in=False) for t in outputs]

        def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
            for pipeline in staged[:n]:
                if pipeline is not None:
                    pipeline.wait_host()
            self._all_to_all_host(hosts[n:], hosts[:n], meta)

        return self._submit(describe, on_host(self.timeout, run, *specs), async_op, (outputs, inputs))

    def _all_to_all_host(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], meta: Meta) -> None:
        """Block ``inputs[j]`` of every rank i into ``outputs[i]`` of rank j, passed along the ring.

        The records carry every rank's split sizes, so every rank checks the
        whole matrix (a mismatch raises on all). Step ``s`` (1 .. n-1) sends the
        right neighbour the blocks that rank ``r - s + 1`` has for the ranks
        after this one; the neighbour keeps the first and passes the rest on
        in the next step. On two ranks that is one exchange, and a block of up
        to ``small_bytes`` travels with the record itself.
        """
        n, r = self.world_size, self.rank
        if n == 1:
            error = split_mismatch([[inputs[0].numel()]], [[outputs[0].numel()]])
            if error is not None:
                raise error
            _copy(outputs[0], inputs[0])
            return
        # Two ranks: a small block for the neighbour travels with the record (one message each way).
        carry = inputs[1 - r] if n == 2 and inputs[1 - r].nbytes <= self._small_bytes else None
        counts = [t.numel() for t in inputs] + [t.numel() for t in outputs] + [carry is not None]
        k = len(counts)
        payloads = self._check_meta(meta, pack_counts(counts, carry).view(meta.dtype))  # type: ignore[arg-type]
        try:
            rows = {rank: counts if rank == r else read_counts(p, k, rank) for rank, p in payloads.items()}
        except ValueError as e:  # only a peer running other code sends a short record
            raise CommError(f"{self._label('all_to_all')}: {e}") from None
        sent = [rows[i][:n] for i in range(n)]
        error = split_mismatch(sent, [rows[j][n : 2 * n] for j in range(n)])
        if error is not None:
            raise error
        _copy(outputs[r], inputs[r])
        if n == 2:
            left = 1 - r
            theirs = outputs[left]
            if rows[left][2 * n]:  # the neighbour's block came with its record
                try:
                    read_carried(payloads[left], k, theirs, left)
                except ValueError as e:
                    raise CommError(f"{self._label('all_to_all')}: {e}") from None
            self._stream(
                [] if carry is not None else [inputs[left]], [] if rows[left][2 * n] else [theirs], lend=True
            )
            self._flush()
            return
        carried: list[torch.Tensor] = []
        for s in range(1, n):
            origin = (r - s) % n  # whose blocks arrive in this step
            ahead = [(r + k) % n for k in range(1, n - s)]  # the ranks they are for, after this one
            outgoing = [inputs[(r + k) % n] for k in range(1, n)] if s == 1 else carried
            incoming = [outputs[origin]] + [torch.empty(sent[origin][d], dtype=meta.dtype) for d in ahead]
            self._stream(outgoing, incoming, lend=s == 1)  # the caller's inputs; later steps relay copies
            self._flush()
            carried = incoming[1:]

    def _stream(
        self, outgoing: list[torch.Tensor], incoming: list[torch.Tensor], *, lend: bool = False
    ) -> None:
        """Send ``outgoing`` to the right while ``incoming`` arrives from the left, one chunk each in turn.

        With ``lend``, a tensor of ``outgoing`` that lies in a shared buffer is lent: the right
        neighbour copies its chunks straight out of it (one copy instead of two), and this returns
        once the neighbour has read them all.
        """
        send, recv = self._right, self._left
        assert send is not None and recv is not None
        if not outgoing and not incoming:
            return
        step = self._chunk_numel(incoming[0] if incoming else outgoing[0])
        spans = [self._lendable(t) if lend and send.can_lend else None for t in outgoing]
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

    # --------------------------------------------------------- point-to-point
    def _p2p_now(self, request: P2PRequest) -> int:
        """A host tensor's send or receive runs on this thread (behind its lane's queue), with no work."""
        if not request.tensor.is_cpu:
            return super()._p2p_now(request)
        return self._peer_links_for(request.kind).run(request, self._request_label)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, async_op: bool) -> Work:
        p2p = self._peer_links_for("send")
        label = self._p2p_label("send", tensor, dst, tag)
        if tensor.is_cpu:  # the links read it in place
            body: Callable[[], Any] = functools.partial(p2p.send, tensor, dst, tag, label)
        else:

            def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
                if staged[0] is not None:
                    staged[0].wait_host()
                p2p.send(hosts[0], dst, tag, label)

            body = on_host(self.timeout, run, Staged(tensor, copy_out=False))
        return p2p.send_lane(dst).submit(label, body, async_op, tensor)

    def _recv(self, tensor: torch.Tensor, src: int | None, tag: int, async_op: bool) -> Work:
        p2p = self._peer_links_for("recv")
        label = self._p2p_label("recv", tensor, src, tag)
        if tensor.is_cpu:  # the links write it in place
            body: Callable[[], Any] = functools.partial(p2p.recv, tensor, src, tag, label)
        else:

            def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> int:
                return p2p.recv(hosts[0], src, tag, label)

            body = on_host(self.timeout, run, Staged(tensor, copy_in=False))
        return p2p.recv_lane(src).submit(label, body, async_op, tensor, _set_source)

    # --------------------------------------------------------------- subgroups
    def _new_group(self, ranks: list[int], config: CommConfig, name: str) -> IProcessGroup | None:
        """Members form a ring of their own (``backends.ring.subgroups``); the others get None."""
        parent = Parent(self, self._peers, self._session, self._settings, self._listen_address, name)

        def make(config: CommConfig, sockets: RingSockets) -> IProcessGroup:
            return RingProcessGroup(self._subgroup_env(ranks), config, self._ring_config, connection=sockets)

        return new_subgroup(parent, ranks, config, make)

    def _peer_links_for(self, op: str) -> PointToPoint:
        if self._peer_links is None:
            raise CommError(f"{self._prefix(op)}this group has no other rank to talk to")
        return self._peer_links

    def _barrier(self, async_op: bool) -> Work:
        meta = self._next_meta("barrier", None)
        describe = self._label("barrier")
        if self.world_size == 1:
            return CompletedWork(label=describe)
        return self._submit(describe, lambda: self._check_meta(meta), async_op)

    def _close(self) -> None:
        # Sends in flight get the group's timeout to be taken; what the links linger for their
        # neighbours' end-of-file comes out of the same time, so close ends within it (plus 1 s).
        deadline = time.monotonic() + self.timeout
        if self._peer_links is not None:
            self._peer_links.close()
        self._lane.close()
        linger = min(self.timeout, 10.0, max(1.0, deadline - time.monotonic()))
        with self._run_lock:
            links = [link for link in (self._right, self._left) if link is not None]
            for link in links:
                link.shutdown()
            for link in links:
                link.close(linger)
            self._right = self._left = None


def _create(env: DistEnv, config: CommConfig) -> IProcessGroup:
    return RingProcessGroup(env, config)


BACKENDS = {"ring": _create}
