"""The ``ring`` backend: ring collectives in pure Python (standard library + torch).

This module holds the group: its links and buffers, the queue and error
handling every collective runs under, and the records check; each collective's
hook here builds its record and runs the algorithm on host tensors. The
algorithms are functions over the two links: the unrooted collectives in
``backends.ring.algorithms``, the rooted ones and all-to-all in
``backends.ring.rooted``, the deterministic chain in ``backends.ring.ordered``.

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
block meant for it; on two ranks that is one exchange (``backends.ring.rooted``).

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

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from backends.common import kernels
from backends.common.cuda_staging import StagingPipeline
from backends.ring.algorithms import (
    Ring,
    all_gather_host,
    all_reduce_host,
    broadcast_host,
    reduce_scatter_host,
    segments,
    small_all_reduce,
)
from backends.ring.capabilities import RING_ROWS
from backends.ring.config import RingConfig
from backends.ring.errors import translate_failure
from backends.ring.link_setup import LinkShape, connect_links
from backends.ring.links import RecvLink, SendLink
from backends.ring.ordered import chain_all_reduce
from backends.ring.p2p import PointToPoint
from backends.ring.p2p_links import PeerLinks
from backends.ring.records import (
    COMMON_BYTES,
    Meta,
    different_calls,
    mismatch,
)
from backends.ring.rendezvous import RingSockets, rendezvous
from backends.ring.rooted import all_to_all_host, gather_host, reduce_host, scatter_host
from backends.ring.shared_buffers import SharedBuffers, Span
from backends.ring.shm import RegionId
from backends.ring.staging import Staged, StagedBody, first_chunks, on_host, on_host_single, publisher, waiter
from backends.ring.subgroups import Parent, new_subgroup
from commlib.capabilities import Row
from commlib.config import CommConfig
from commlib.diagnosis import history
from commlib.diagnosis.history import HISTORY_BYTES
from commlib.env import DistEnv
from commlib.errors import (
    CollectiveMismatchError,
    CommError,
    GroupClosedError,
)
from commlib.lanes import Lane
from commlib.p2p import P2PRequest
from commlib.process_group import IProcessGroup
from commlib.types import PremulSum, ReduceOp
from commlib.work import CollectiveLabel, CompletedWork, Work

__all__ = ["RingConfig", "RingProcessGroup", "BACKENDS"]


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
        right: SendLink | None
        left: RecvLink | None
        try:
            right, left = connect_links(
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
            SharedBuffers(right.retire)  # type: ignore[attr-defined]
            if right is not None and right.can_lend
            else None
        )
        self._peers = sockets.peers
        self._session = sockets.session
        self._settings = shared
        self._ring = Ring(
            right,
            left,
            env.rank,
            env.world_size,
            self._chunk_bytes,
            self._small_bytes,
            shape.slots,
            self._check_meta,
            self._lendable,
        )
        """The links and what the algorithms (``backends.ring.algorithms``, ``rooted``, ``ordered``)
        work with; its links are None once the group is closed."""
        self._listen_address = sockets.listener.getsockname()[0] if sockets.listener is not None else ""
        self._peer_links = (
            PointToPoint(
                rank=env.rank,
                links=PeerLinks(
                    rank=env.rank,
                    peers=sockets.peers,
                    listener=sockets.listener,
                    session=sockets.session,
                    shape=shape,
                    timeout=self.timeout,
                    prefix=self._prefix,
                    early=sockets.early,
                ),
                shape=shape,
                timeout=self.timeout,
            )
            if sockets.listener is not None
            else None
        )

    # ----------------------------------------------------------- introspection
    @property
    def _right(self) -> SendLink | None:
        """The link to the right neighbour (None on one rank, or once closed)."""
        return self._ring.send

    @property
    def _left(self) -> RecvLink | None:
        """The link from the left neighbour (None on one rank, or once closed)."""
        return self._ring.recv

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
        return self._lane.submit(
            label,
            functools.partial(self._execute, label, body),
            async_op,
            keep_alive,
            settle_in=body.settle_in if isinstance(body, StagedBody) else None,
        )

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
                error = translate_failure(describe, e)
                self._mark_broken(error)
                for link in (self._right, self._left):
                    if link is not None:
                        link.abort(f"rank {self.rank} gave up: {error}")
                raise error from e

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
        ring = self._ring
        send, recv = ring.send, ring.recv
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

        run = functools.partial(all_reduce_host, self._ring, op=op, meta=meta)
        body = on_host_single(self.timeout, run, Staged(tensor, fetch_first=first))
        return self._submit(describe, body, async_op, tensor)

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
        """``small_all_reduce`` (it combines in rank order) or ``chain_all_reduce``, after the records."""
        premul = isinstance(op, PremulSum)
        factor, base = (op.scalar(), ReduceOp.SUM) if premul else (None, op)
        meta = self._next_meta("deterministic_all_reduce", tensor, ReduceOp.PREMUL_SUM if premul else base)
        flat = tensor.view(-1)

        def run() -> None:
            if self._is_small(flat):
                if factor is not None:
                    flat.mul_(factor)
                small_all_reduce(self._ring, meta, flat, base)
                return
            self._check_meta(meta)
            chain_all_reduce(self._ring, flat, base, factor, self._lendable(flat))

        return self._submit(self._label("all_reduce", tensor), run, async_op, tensor)

    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        meta = self._next_meta("broadcast", tensor, src=src)
        describe = self._label("broadcast", tensor)
        if self.world_size == 1:
            return CompletedWork(label=describe)
        sender = self.rank == src

        run = functools.partial(broadcast_host, self._ring, src=src, meta=meta)
        body = on_host_single(self.timeout, run, Staged(tensor, copy_in=sender, copy_out=not sender))
        return self._submit(describe, body, async_op, tensor)

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
            blocks = segments(hosts[1], n) if flat_output is not None else hosts[1:]
            done = None
            if staged[0] is not None:
                staged[0].wait_host()
                owners = staged[1:] * n if flat_output is not None else staged[1:]  # each block's pipeline
                done = [publisher(pipeline) for pipeline in owners]  # type: ignore[arg-type]
            all_gather_host(self._ring, blocks, hosts[0], meta, done)

        return self._submit(describe, on_host(self.timeout, run, *specs), async_op, (outputs, tensor))

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
                    for block, source in zip(segments(work, n), inputs, strict=True):
                        kernels.copy(block, source)
                reduce_scatter_host(self._ring, work, hosts[0], op, meta, lent, None)

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
            ready = waiter(staged[0])  # type: ignore[arg-type]
            reduce_scatter_host(self._ring, hosts[0], hosts[1], op, meta, None, ready)

        body = on_host(
            self.timeout,
            run_staged,
            Staged(source, copy_out=False, fetch_first=first),
            Staged(output, copy_in=False),
        )
        return self._submit(describe, body, async_op, (output, inputs))

    # ------------------------------------------------------- rooted collectives
    def _reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, async_op: bool) -> Work:
        meta = self._next_meta("reduce", tensor, op, src=dst)
        describe = self._label("reduce", tensor)
        if self.world_size == 1:
            return CompletedWork(label=describe)

        def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
            if staged[0] is not None:
                staged[0].wait_host()
            reduce_host(self._ring, hosts[0], dst, op, meta)

        body = on_host(self.timeout, run, Staged(tensor, copy_out=self.rank == dst))
        return self._submit(describe, body, async_op, tensor)

    def _gather(
        self, tensor: torch.Tensor, outputs: list[torch.Tensor] | None, dst: int, async_op: bool
    ) -> Work:
        meta = self._next_meta("gather", tensor, src=dst)
        describe = self._label("gather", tensor)
        specs = [Staged(tensor, copy_out=False)] + [Staged(t, copy_in=False) for t in outputs or ()]

        def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
            if staged[0] is not None:
                staged[0].wait_host()
            gather_host(self._ring, hosts[0], hosts[1:] if outputs is not None else None, dst, meta)

        return self._submit(describe, on_host(self.timeout, run, *specs), async_op, (outputs, tensor))

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
            scatter_host(self._ring, hosts[0], hosts[1:] if inputs is not None else None, src, meta)

        return self._submit(describe, on_host(self.timeout, run, *specs), async_op, (inputs, tensor))

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
            all_to_all_host(self._ring, hosts[n:], hosts[:n], meta, lambda: self._label("all_to_all"))

        return self._submit(describe, on_host(self.timeout, run, *specs), async_op, (outputs, inputs))

    # --------------------------------------------------------- point-to-point
    def _p2p_now(self, request: P2PRequest) -> int:
        """A host tensor's send or receive runs on this thread (behind its lane's queue), with no work."""
        if not request.tensor.is_cpu:
            return super()._p2p_now(request)
        return self._peer_links_for(request.kind).run(request, self._request_label)

    def _send(self, request: P2PRequest, async_op: bool) -> Work:
        p2p = self._peer_links_for("send")
        tensor, dst, tag = request.tensor, request.peer, request.tag
        label = self._request_label(request)
        if tensor.is_cpu:  # the links read it in place
            body: Callable[[], Any] = functools.partial(p2p.send, tensor, dst, tag, label)
        else:

            def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> None:
                if staged[0] is not None:
                    staged[0].wait_host()
                p2p.send(hosts[0], dst, tag, label)

            body = on_host(self.timeout, run, Staged(tensor, copy_out=False))
        return p2p.send_lane(dst).submit(label, body, async_op, tensor)

    def _recv(self, request: P2PRequest, async_op: bool) -> Work:
        p2p = self._peer_links_for("recv")
        tensor, src, tag = request.tensor, request.peer, request.tag
        label = self._request_label(request)
        receive = p2p.receive(tensor, src, tag, label)  # issued as it takes its place on the lane
        if tensor.is_cpu:  # the links write it in place
            body: Callable[[], Any] = functools.partial(p2p.finish, receive)
        else:

            def run(hosts: list[torch.Tensor], staged: list[StagingPipeline | None]) -> int:
                return p2p.finish(receive, hosts[0])

            staged_run = on_host(self.timeout, run, Staged(tensor, copy_in=False))

            def body() -> int:
                try:
                    return staged_run()
                except BaseException:
                    p2p.withdraw(receive)  # its staging failed on the lane, after it was issued
                    raise

        issue = functools.partial(p2p.post_receive, receive)
        try:
            return p2p.recv_lane(src, tag).submit(label, body, async_op, tensor, _set_source, issue)
        except BaseException:
            p2p.withdraw(receive)  # it never runs, or ran and failed
            raise

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
            end = time.monotonic() + linger  # one linger for both links, not one each
            for link in links:
                link.close(max(0.0, end - time.monotonic()))
            self._ring = dataclasses.replace(self._ring, send=None, recv=None)


def _create(env: DistEnv, config: CommConfig) -> IProcessGroup:
    return RingProcessGroup(env, config)


BACKENDS = {"ring": _create}
