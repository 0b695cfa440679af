"""The ``ring`` backend: ring collectives in pure Python (standard library + torch).

All-reduce is a reduce-scatter followed by an all-gather around the ring, so
each rank sends ``2 (n - 1) / n`` of the tensor; the tensor streams through
the ring in chunks (``COMMLIB_RING_CHUNK_BYTES``), so sending, receiving and
reducing overlap. Between ranks on one host the chunks move through shared
memory; across hosts over TCP (``backends._link_setup``). A tensor from
``alloc_buffer`` lives in shared memory itself: the right neighbour reads its
chunks in place, so an all-reduce costs one add and one copy per byte.

Copies and reductions never start torch's intra-op thread team
(``backends._kernels``), so the ring runs as fast under torch's default thread
count as under one thread, and it never changes the caller's thread setting.

Every collective starts by passing a small record (operation, dtype, shape,
sequence number) around the ring, so ranks that disagree all raise the same
``CollectiveMismatchError`` naming each rank's tensor; this exchange is also
the whole of ``barrier()``.

``async_op=True`` runs the collective on one progress thread per group, in the
order issued (like a CUDA stream); a synchronous call runs on the caller's
thread when nothing is queued, and after the queued work otherwise.

CUDA tensors are staged through host memory (copied to the CPU, reduced,
copied back).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import struct
import threading
from collections.abc import Callable, Mapping
from typing import Literal

import torch

from backends import _kernels
from backends._kernels import Reducer
from backends._link_setup import connect_links
from backends._links import META_BYTES, RecvLink, SendLink
from backends._rendezvous import rendezvous
from backends._shared_buffers import SharedBuffers, Span
from backends._shm import RegionId
from commlib.config import CommConfig
from commlib.env import DistEnv, read_env_var
from commlib.errors import (
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    GroupClosedError,
    PeerFailureError,
)
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp, dtype_name
from commlib.work import CollectiveLabel, CompletedWork, EventWork, Work

__all__ = ["RingConfig", "RingProcessGroup", "BACKENDS"]

Transport = Literal["auto", "shm", "tcp"]


def _transport(text: str) -> Transport:
    value = text.lower()
    if value not in ("auto", "shm", "tcp"):
        raise ValueError("expected auto, shm or tcp")
    return value  # type: ignore[return-value]


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise ValueError(f"must be >= {minimum}")
        return value

    return parse


def _spin(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1e6:
        raise ValueError("must be in 0..1e6")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingConfig:
    """Settings of the ring backend. Rank 0's chunk and slot settings apply to every rank."""

    transport: Transport = "auto"
    """``auto``: shared memory between ranks on one host, TCP otherwise; ``shm`` or
    ``tcp`` force one (``shm`` fails if a link cannot use it). ``COMMLIB_RING_TRANSPORT``."""

    chunk_bytes: int = 1 << 20
    """Pipeline unit in bytes: tensors move through the ring in chunks this size
    (also the size of one shared-memory slot). ``COMMLIB_RING_CHUNK_BYTES``."""

    shm_slots: int = 4
    """Messages (chunks or records) in flight per shared-memory link. ``COMMLIB_RING_SHM_SLOTS``."""

    shm_dir: str | None = None
    """Where shared-memory files are created (default ``/dev/shm``); they are
    unlinked as soon as both ends have mapped them. ``COMMLIB_RING_SHM_DIR``."""

    small_bytes: int = 64 * 1024
    """Tensors up to this size skip the ring: every rank's data travels with the
    metadata records (one pass round the ring) and each rank reduces locally,
    in rank order, so results stay identical on every rank. Capped at
    ``chunk_bytes``; 0 disables it. ``COMMLIB_RING_SMALL_BYTES``."""

    spin_us: float = 50.0
    """Microseconds a rank waiting for a neighbour polls (the shared-memory
    counter on one host, the socket across hosts) before it sleeps in the
    kernel; polling keeps the core across the short waits inside a collective.
    ``COMMLIB_RING_SPIN_US``."""

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "shm", "tcp"):
            raise ValueError(f"RingConfig.transport: expected 'auto', 'shm' or 'tcp', got {self.transport!r}")
        if self.chunk_bytes < 4096 or self.chunk_bytes % 64:
            raise ValueError(
                f"RingConfig.chunk_bytes: must be a multiple of 64 and at least 4096, got {self.chunk_bytes}"
            )
        if self.shm_slots < 1:
            raise ValueError(f"RingConfig.shm_slots: must be >= 1, got {self.shm_slots}")
        if self.small_bytes < 0:
            raise ValueError(f"RingConfig.small_bytes: must be >= 0, got {self.small_bytes}")
        if not 0 <= self.spin_us <= 1e6:
            raise ValueError(f"RingConfig.spin_us: must be in 0..1e6 microseconds, got {self.spin_us}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RingConfig:
        """Build the config from ``COMMLIB_RING_*`` variables (bad values warn and use the default)."""
        environ = os.environ if environ is None else environ
        default = cls()
        chunk = read_env_var("COMMLIB_RING_CHUNK_BYTES", _int_at_least(4096), default.chunk_bytes, environ)
        return cls(
            transport=read_env_var("COMMLIB_RING_TRANSPORT", _transport, default.transport, environ),
            chunk_bytes=chunk - chunk % 64,
            shm_slots=read_env_var("COMMLIB_RING_SHM_SLOTS", _int_at_least(1), default.shm_slots, environ),
            shm_dir=environ.get("COMMLIB_RING_SHM_DIR") or None,
            small_bytes=read_env_var(
                "COMMLIB_RING_SMALL_BYTES", _int_at_least(0), default.small_bytes, environ
            ),
            spin_us=read_env_var("COMMLIB_RING_SPIN_US", _spin, default.spin_us, environ),
        )


# --------------------------------------------------------- metadata records
_KINDS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)
_OPS = tuple(ReduceOp)
_MAX_DIMS = 8
# What every rank of one collective must agree on (seq, kind, dtype, op, src, numel), then what
# may differ: ndim, dims (a shape of the same element count), rank, payload elements + 1 (0: none).
_COMMON = struct.Struct("!QBBBiQ")
_META = struct.Struct(f"!QBBBiQB{_MAX_DIMS}qiI")
_COMMON_BYTES = _COMMON.size
assert _META.size == META_BYTES


@dataclasses.dataclass(frozen=True)
class _Meta:
    seq: int
    kind: str
    dtype: torch.dtype | None
    op: ReduceOp | None
    src: int
    rank: int
    numel: int
    shape: tuple[int, ...]
    payload_numel: int | None = None

    def pack(self, payload: torch.Tensor | None = None) -> bytes:
        dims = list(self.shape[:_MAX_DIMS]) + [0] * (_MAX_DIMS - min(len(self.shape), _MAX_DIMS))
        return _META.pack(
            self.seq,
            _KINDS.index(self.kind),
            _DTYPES.index(self.dtype) if self.dtype is not None else 255,
            _OPS.index(self.op) if self.op is not None else 255,
            self.src,
            self.numel,
            len(self.shape),
            *dims,
            self.rank,
            0 if payload is None else payload.numel() + 1,
        )

    @classmethod
    def unpack(cls, data: bytes) -> _Meta:
        seq, kind, dtype, op, src, numel, ndim, *values = _META.unpack(data)
        dims, rank, payload = values[:_MAX_DIMS], values[_MAX_DIMS], values[_MAX_DIMS + 1]
        return cls(
            seq=seq,
            kind=_KINDS[kind] if kind < len(_KINDS) else f"unknown({kind})",
            dtype=_DTYPES[dtype] if dtype < len(_DTYPES) else None,
            op=_OPS[op] if op < len(_OPS) else None,
            src=src,
            rank=rank,
            numel=numel,
            shape=tuple(dims[: min(ndim, _MAX_DIMS)]) + ((-1,) if ndim > _MAX_DIMS else ()),
            payload_numel=payload - 1 if payload else None,
        )

    def tensor_text(self) -> str:
        shape = (
            "("
            + ", ".join("..." if d < 0 else str(d) for d in self.shape)
            + ("," if len(self.shape) == 1 else "")
            + ")"
        )
        dtype = dtype_name(self.dtype) if self.dtype is not None else "?"
        return f"{dtype} {shape} [{self.numel} elements]"


def _group_ranks(metas: list[_Meta], key: Callable[[_Meta], str]) -> str:
    by_value: dict[str, list[int]] = {}
    for meta in metas:
        by_value.setdefault(key(meta), []).append(meta.rank)
    parts = []
    for value, ranks in by_value.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{label} {', '.join(map(str, ranks))}: {value}")
    return "; ".join(parts)


def _segments(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Split ``flat`` into ``parts`` near-equal contiguous pieces (some empty if it is short)."""
    n = flat.numel()
    bounds = [n * i // parts for i in range(parts + 1)]
    return [flat[bounds[i] : bounds[i + 1]] for i in range(parts)]


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
        self, env: DistEnv, config: CommConfig | None = None, ring_config: RingConfig | None = None
    ) -> None:
        super().__init__(env, config)
        self._ring_config = ring_config if ring_config is not None else RingConfig.from_env()
        settings = {
            "chunk_bytes": self._ring_config.chunk_bytes,
            "slots": self._ring_config.shm_slots,
            "small_bytes": self._ring_config.small_bytes,
        }
        sockets = rendezvous(env, self.timeout, settings, self.backend_name)
        shared = sockets.settings
        self._chunk_bytes = int(shared["chunk_bytes"])
        self._small_bytes = min(int(shared["small_bytes"]), self._chunk_bytes)
        self._send: SendLink | None
        self._recv: RecvLink | None
        try:
            self._send, self._recv = connect_links(
                sockets,
                env.rank,
                env.world_size,
                transport=self._ring_config.transport,
                chunk_bytes=self._chunk_bytes,
                slots=int(shared["slots"]),
                shm_dir=self._ring_config.shm_dir,
                prefix=self._prefix("rendezvous"),
                spin_s=self._ring_config.spin_us * 1e-6,
            )
        except BaseException:
            for sock in (sockets.left, sockets.right):
                if sock is not None:
                    sock.close()
            raise
        self._run_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._inflight = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._buffers = (
            SharedBuffers(self._send.retire)  # type: ignore[attr-defined]
            if self._send is not None and self._send.can_lend
            else None
        )

    # ----------------------------------------------------------- introspection
    @property
    def transports(self) -> tuple[str, str]:
        """Transport of the (send, receive) links: ``shm`` or ``tcp`` (``none`` at world size 1)."""
        return (
            self._send.transport if self._send is not None else "none",
            self._recv.transport if self._recv is not None else "none",
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
        return getattr(self._recv, "lent_regions", 0)

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
    def _native_avg(self, tensor: torch.Tensor) -> bool:
        """The ring averages itself: each rank divides its reduced segment before the all-gather."""
        return True

    def _propagates_nan(self, tensor: torch.Tensor) -> bool:
        """The ring reduces with ``torch.maximum`` / ``torch.minimum``, which propagate NaN."""
        return True

    def _submit(
        self, label: CollectiveLabel, body: Callable[[], None], async_op: bool, keep_alive: object = None
    ) -> Work:
        with self._state_lock:
            inline = not async_op and self._inflight == 0
            if not inline:
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="commlib-ring-progress"
                    )
                self._inflight += 1
        if inline:
            self._execute(label, body)
            return CompletedWork(label=label)
        # Every step of a collective waits at most the group's timeout; the bound only
        # catches a progress thread that stopped.
        work = EventWork(label, bound_s=self.timeout * 2 + 30.0, keep_alive=keep_alive)
        self._executor.submit(self._run_async, work, body)  # type: ignore[union-attr]
        return work

    def _run_async(self, work: EventWork, body: Callable[[], None]) -> None:
        error: BaseException | None = None
        try:
            self._execute(work.label, body)  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001 - handed to the work
            error = e
        finally:
            with self._state_lock:
                self._inflight -= 1
        work._settle(error)  # noqa: SLF001 - the progress thread completes its work

    def _execute(self, describe: CollectiveLabel | str, body: Callable[[], None]) -> None:
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
                for link in (self._send, self._recv):
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
    ) -> _Meta:
        return _Meta(
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
        mine: _Meta,
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
        send, recv = self._send, self._recv
        assert send is not None and recv is not None
        record = mine.pack(payload)
        common = record[:_COMMON_BYTES]
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
            if hold and record[:_COMMON_BYTES] == common:
                continue  # agreed; the caller reads the payload
            meta = _Meta.unpack(record)
            if meta.dtype is None or meta.payload_numel is None:
                raise CommError(
                    f"rank {meta.rank} sent a payload of unknown dtype; is it running another "
                    "commlib version?"
                )
            outgoing = torch.empty(meta.payload_numel, dtype=meta.dtype)
            recv.recv_into(outgoing)
            payloads[meta.rank] = outgoing
        send.flush()  # a queued payload may be a view of the caller's tensor, about to be overwritten
        if all(r[:_COMMON_BYTES] == common for r in records):
            return payloads  # shapes may differ: the calls agree on the element count
        metas = sorted((_Meta.unpack(r) for r in records), key=lambda m: m.rank)
        if len({(m.kind, m.seq) for m in metas}) > 1:
            raise CollectiveMismatchError(
                "ranks called different collectives: "
                + _group_ranks(metas, lambda m: f"{m.kind} #{m.seq}")
                + ". Every rank must issue the same collectives in the same order"
            )
        if len({(m.dtype, m.numel) for m in metas}) > 1:
            raise CollectiveMismatchError(
                "ranks passed tensors of different sizes or dtypes: "
                + _group_ranks(metas, _Meta.tensor_text)
                + ". Every rank must pass a tensor of the same size and dtype"
            )
        if len({m.op for m in metas}) > 1:
            raise CollectiveMismatchError(
                "ranks disagree on the reduce op: "
                + _group_ranks(metas, lambda m: m.op.name if m.op is not None else "none")
                + ". Every rank must pass the same op"
            )
        raise CollectiveMismatchError(
            "ranks disagree on the source rank: "
            + _group_ranks(metas, lambda m: f"src={m.src}")
            + ". Every rank must name the same src"
        )

    def _exchange(
        self,
        outgoing: torch.Tensor,
        incoming: torch.Tensor,
        reduce: Reducer | None,
        lent: Span | None = None,
        sent: int = 0,
    ) -> None:
        """One ring step: stream ``outgoing`` to the right while ``incoming`` arrives from the left.

        With ``lent`` (``outgoing`` lies in a shared buffer), the right
        neighbour reads ``outgoing`` in place instead of receiving a copy. The
        first ``sent`` elements (one chunk) already went with the metadata record.
        """
        send, recv = self._send, self._recv
        assert send is not None and recv is not None
        step = max(1, self._chunk_bytes // outgoing.element_size())
        n_out, n_in = outgoing.numel(), incoming.numel()
        for start in range(0, max(n_out, n_in), step):
            if sent <= start < n_out:
                chunk = outgoing[start : start + step]
                if lent is None:
                    send.send(chunk)
                else:
                    send.lend(chunk, lent.region, lent.offset(chunk))
            if start < n_in:
                if reduce is None:
                    recv.recv_into(incoming[start : start + step])
                else:
                    recv.recv_reduce(incoming[start : start + step], reduce)

    def _flush(self) -> None:
        if self._send is not None:
            self._send.flush()

    # ------------------------------------------------------------ collectives
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        meta = self._next_meta("all_reduce", tensor, op)
        describe = self._label("all_reduce", tensor)
        if self.world_size == 1:
            return CompletedWork(label=describe)

        def body() -> None:
            if tensor.device.type == "cpu":
                self._all_reduce_host(tensor.view(-1), op, meta)
            else:
                with _staged(tensor) as host:
                    self._all_reduce_host(host.view(-1), op, meta)

        return self._submit(describe, body, async_op, tensor)

    def _all_reduce_host(self, flat: torch.Tensor, op: ReduceOp, meta: _Meta) -> None:
        if self._is_small(flat):
            self._small_all_reduce(meta, flat, op)
        else:
            self._ring_all_reduce(flat, op, meta)

    def _small_all_reduce(self, meta: _Meta, flat: torch.Tensor, op: ReduceOp) -> None:
        """Every rank's tensor travels with the records; each rank reduces them in rank order."""
        n = self.world_size
        combine = _kernels.combine(op, flat.dtype)
        payloads = self._check_meta(meta, flat, hold_last=True)
        if n == 2 and len(payloads) == 1:  # the neighbour's tensor waits in the link
            recv = self._recv
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
            _kernels.copy(flat, result)
        if op is ReduceOp.AVG:
            _kernels.divide(flat, n)

    def _ring_all_reduce(self, flat: torch.Tensor, op: ReduceOp, meta: _Meta) -> None:
        n, r = self.world_size, self.rank
        segs = _segments(flat, n)
        reduce = _kernels.reducer(op, flat.dtype)
        lent = self._lendable(flat)
        first = segs[r][: max(1, self._chunk_bytes // flat.element_size())]
        carried = 0
        if n == 2 and first.numel():
            # The record carries the first chunk of the reduce-scatter: the neighbour has checked
            # the records (two ranks: one hop) before it reads the chunk, and one message is saved.
            lend_first = (lent.region, lent.offset(first)) if lent is not None else None
            self._check_meta(meta, first, hold_last=True, lent=lend_first)
            carried = first.numel()
        else:
            self._check_meta(meta)
        for s in range(n - 1):
            self._exchange(
                segs[(r - s) % n], segs[(r - s - 1) % n], reduce, lent, sent=carried if s == 0 else 0
            )
        if op is ReduceOp.AVG:
            _kernels.divide(segs[(r + 1) % n], n)
        self._flush()
        # With a lent buffer, the right neighbour reads segment (r - t) of it in reduce-scatter step t;
        # the all-gather overwrites that segment in its step t, but only with the segment's final
        # value, which exists only after the neighbour has read and passed it on: no wait is needed.
        for t in range(n - 1):
            self._exchange(segs[(r + 1 - t) % n], segs[(r - t) % n], None, lent)
        self._flush()
        if lent is not None:  # done only when nobody reads this rank's buffer any more
            assert self._send is not None
            self._send.wait_returned()

    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        meta = self._next_meta("broadcast", tensor, src=src)
        describe = self._label("broadcast", tensor)
        if self.world_size == 1:
            return CompletedWork(label=describe)

        def body() -> None:
            with _staged(tensor, copy_in=self.rank == src) as host:
                flat = host.view(-1)
                if self._is_small(flat):
                    payloads = self._check_meta(meta, flat if self.rank == src else None)
                    if self.rank != src:
                        _kernels.copy(flat, payloads[src])
                else:
                    self._check_meta(meta)
                    self._chain_broadcast(flat, src)

        return self._submit(describe, body, async_op, tensor)

    def _chain_broadcast(self, flat: torch.Tensor, src: int) -> None:
        send, recv = self._send, self._recv
        assert send is not None and recv is not None
        distance = (self.rank - src) % self.world_size
        step = max(1, self._chunk_bytes // flat.element_size())
        for start in range(0, flat.numel(), step):
            chunk = flat[start : start + step]
            if distance > 0:
                recv.recv_into(chunk)
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
        n, r = self.world_size, self.rank
        meta = self._next_meta("all_gather", tensor)
        describe = self._label("all_gather", tensor)

        def body() -> None:
            with _staged(*outputs, copy_in=False) as host_outputs, _staged(tensor) as host_tensor:
                blocks = list(host_outputs) if isinstance(host_outputs, tuple) else [host_outputs]
                if blocks[r].data_ptr() != host_tensor.data_ptr() or blocks[r].numel() == 0:
                    _kernels.copy(blocks[r].view(-1), host_tensor.view(-1))
                if n == 1:
                    return
                if self._is_small(host_tensor):
                    payloads = self._check_meta(meta, host_tensor)
                    for source, block in enumerate(blocks):
                        if source != r:
                            _kernels.copy(block.view(-1), payloads[source].view(-1))
                    return
                self._check_meta(meta)
                for s in range(n - 1):
                    self._exchange(blocks[(r - s) % n], blocks[(r - s - 1) % n], None)
                self._flush()

        return self._submit(describe, body, async_op, (outputs, tensor))

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

        in_place = (
            flat_input is not None
            and flat_input.device.type == "cpu"
            and self._is_rank_block(output, flat_input)
        )

        def body() -> None:
            if in_place:  # reduce in the caller's buffer, lending it when it is shared
                assert flat_input is not None
                work, lent = flat_input, self._lendable(flat_input)
            else:
                work, lent = torch.empty(n * output.numel(), dtype=output.dtype), None
                for block, source in zip(_segments(work, n), inputs, strict=True):
                    if source.device.type == "cpu":
                        _kernels.copy(block, source)
                    else:
                        block.copy_(source)
            blocks = _segments(work, n)
            mine = blocks[r]
            if n > 1 and self._is_small(work):
                payloads = self._check_meta(meta, work)
                combine = _kernels.combine(op, work.dtype)
                mine = torch.empty_like(blocks[r])
                combine(mine, _segments(payloads[0], n)[r], _segments(payloads[1], n)[r])
                for source in range(2, n):
                    combine(mine, mine, _segments(payloads[source], n)[r])
            elif n > 1:
                self._ring_reduce_scatter(blocks, op, meta, lent)
            if op is ReduceOp.AVG and n > 1:
                _kernels.divide(mine, n)
            if mine.data_ptr() == output.data_ptr():
                return
            if output.device.type == "cpu":
                _kernels.copy(output, mine)
            else:
                output.copy_(mine)

        return self._submit(describe, body, async_op, (output, inputs))

    def _ring_reduce_scatter(
        self, blocks: list[torch.Tensor], op: ReduceOp, meta: _Meta, lent: Span | None
    ) -> None:
        """Reduce-scatter ``blocks`` (one per rank) in place: block ``rank`` ends up reduced.

        Step ``s`` sends block ``rank - s - 1`` and adds the left neighbour's
        partial sum into block ``rank - s - 2``: a block is written only before
        it is sent, so with ``lent`` the neighbour may read it in place.
        """
        n, r = self.world_size, self.rank
        reduce = _kernels.reducer(op, blocks[0].dtype)
        carried = 0
        first = blocks[(r - 1) % n][: max(1, self._chunk_bytes // blocks[0].element_size())]
        if n == 2 and first.numel():  # as in the all-reduce: the record carries the first chunk
            lend_first = (lent.region, lent.offset(first)) if lent is not None else None
            self._check_meta(meta, first, hold_last=True, lent=lend_first)
            carried = first.numel()
        else:
            self._check_meta(meta)
        for s in range(n - 1):
            self._exchange(
                blocks[(r - s - 1) % n], blocks[(r - s - 2) % n], reduce, lent, sent=carried if s == 0 else 0
            )
        self._flush()
        if lent is not None:  # done only when nobody reads this rank's buffer any more
            assert self._send is not None
            self._send.wait_returned()

    def _barrier(self, async_op: bool) -> Work:
        meta = self._next_meta("barrier", None)
        describe = self._label("barrier")
        if self.world_size == 1:
            return CompletedWork(label=describe)
        return self._submit(describe, lambda: self._check_meta(meta), async_op)

    def _close(self) -> None:
        executor = self._executor
        if executor is not None:
            executor.shutdown(wait=True)
        linger = min(self.timeout, 10.0)
        with self._run_lock:
            links = [link for link in (self._send, self._recv) if link is not None]
            for link in links:
                link.shutdown()
            for link in links:
                link.close(linger)
            self._send = self._recv = None


class _staged:
    """Context manager: CUDA tensors are copied to host memory and back; CPU tensors pass through."""

    def __init__(self, *tensors: torch.Tensor, copy_in: bool = True) -> None:
        self._tensors = tensors
        self._copy_in = copy_in
        self._host: tuple[torch.Tensor, ...] = ()

    def __enter__(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        self._host = tuple(
            t
            if t.device.type == "cpu"
            else (t.to("cpu") if self._copy_in else torch.empty_like(t, device="cpu"))
            for t in self._tensors
        )
        return self._host[0] if len(self._host) == 1 else self._host

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            for original, host in zip(self._tensors, self._host, strict=False):
                if original is not host:
                    original.copy_(host)


def _create(env: DistEnv, config: CommConfig) -> IProcessGroup:
    return RingProcessGroup(env, config)


BACKENDS = {"ring": _create}
