"""The ``ring`` backend: ring collectives in pure Python (standard library + torch).

All-reduce is a reduce-scatter followed by an all-gather around the ring, so
each rank sends ``2 (n - 1) / n`` of the tensor; the tensor streams through
the ring in chunks (``COMMLIB_RING_CHUNK_BYTES``), so sending, receiving and
reducing overlap. Between ranks on one host the chunks move through shared
memory; across hosts over TCP (``backends._links``).

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

from backends._links import META_BYTES, RecvLink, Reducer, SendLink, connect_links
from backends._rendezvous import rendezvous
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
    """Chunks in flight per shared-memory link. ``COMMLIB_RING_SHM_SLOTS``."""

    shm_dir: str | None = None
    """Where shared-memory files are created (default ``/dev/shm``); they are
    unlinked as soon as both ends have mapped them. ``COMMLIB_RING_SHM_DIR``."""

    small_bytes: int = 64 * 1024
    """Tensors up to this size skip the ring: every rank's data travels with the
    metadata records (one pass round the ring) and each rank reduces locally,
    in rank order, so results stay identical on every rank. Capped at
    ``chunk_bytes``; 0 disables it. ``COMMLIB_RING_SMALL_BYTES``."""

    spin_us: float = 50.0
    """Microseconds a rank polls its socket before it sleeps in the kernel while
    waiting for a neighbour; polling keeps the core across the short waits
    inside a collective. ``COMMLIB_RING_SPIN_US``."""

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
_META = struct.Struct(f"!QBBBBiiQ{_MAX_DIMS}qI")  # ..., payload elements + 1 (0: none)
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
            len(self.shape),
            self.src,
            self.rank,
            self.numel,
            *dims,
            0 if payload is None else payload.numel() + 1,
        )

    @classmethod
    def unpack(cls, data: bytes) -> _Meta:
        seq, kind, dtype, op, ndim, src, rank, numel, *dims, payload = _META.unpack(data)
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


# ---------------------------------------------------------------- reducers
def _sum(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.add_(src)


def _product(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.mul_(src)


def _min(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.minimum(dst, src, out=dst)


def _max(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.maximum(dst, src, out=dst)


_REDUCERS: dict[ReduceOp, Reducer] = {
    ReduceOp.SUM: _sum,
    ReduceOp.AVG: _sum,
    ReduceOp.PRODUCT: _product,
    ReduceOp.MIN: _min,
    ReduceOp.MAX: _max,
}


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

    def _check_meta(self, mine: _Meta, payload: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """Pass every rank's record (and small payload) around the ring; raise on every rank if they disagree.

        Returns:
            The payloads that travelled with the records, by source rank
            (this rank's own included).
        """
        send, recv = self._send, self._recv
        assert send is not None and recv is not None
        metas: dict[int, _Meta] = {self.rank: mine}
        payloads: dict[int, torch.Tensor] = {} if payload is None else {self.rank: payload}
        record, outgoing = mine.pack(payload), payload
        for _ in range(self.world_size - 1):
            send.send_meta(record, outgoing)
            record = recv.recv_meta()
            meta = _Meta.unpack(record)
            metas[meta.rank] = meta
            outgoing = None
            if meta.payload_numel is not None:
                if meta.dtype is None:
                    raise CommError(
                        f"rank {meta.rank} sent a payload of unknown dtype; is it running another "
                        "commlib version?"
                    )
                outgoing = torch.empty(meta.payload_numel, dtype=meta.dtype)
                recv.recv_into(outgoing)
                payloads[meta.rank] = outgoing
        send.flush()  # a queued payload may be a view of the caller's tensor, about to be overwritten
        ordered = [metas[r] for r in sorted(metas)]
        if len({(m.kind, m.seq) for m in ordered}) > 1:
            raise CollectiveMismatchError(
                "ranks called different collectives: "
                + _group_ranks(ordered, lambda m: f"{m.kind} #{m.seq}")
                + ". Every rank must issue the same collectives in the same order"
            )
        if len({(m.dtype, m.numel) for m in ordered}) > 1:
            raise CollectiveMismatchError(
                "ranks passed tensors of different sizes or dtypes: "
                + _group_ranks(ordered, _Meta.tensor_text)
                + ". Every rank must pass a tensor of the same size and dtype"
            )
        if len({(m.op, m.src) for m in ordered}) > 1:
            detail = _group_ranks(ordered, lambda m: f"op={m.op.name if m.op else None} src={m.src}")
            raise CollectiveMismatchError(f"ranks disagree on the op or source rank: {detail}")
        return payloads

    def _exchange(self, outgoing: torch.Tensor, incoming: torch.Tensor, reduce: Reducer | None) -> None:
        """One ring step: stream ``outgoing`` to the right while ``incoming`` arrives from the left."""
        send, recv = self._send, self._recv
        assert send is not None and recv is not None
        step = max(1, self._chunk_bytes // outgoing.element_size())
        n_out, n_in = outgoing.numel(), incoming.numel()
        for start in range(0, max(n_out, n_in), step):
            if start < n_out:
                send.send(outgoing[start : start + step])
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
            with _staged(tensor) as host:
                flat = host.view(-1)
                if self._is_small(flat):
                    payloads = self._check_meta(meta, flat)
                    result = payloads[0].clone()
                    for source in range(1, self.world_size):
                        _REDUCERS[op](result, payloads[source])
                    if op is ReduceOp.AVG:
                        result.div_(self.world_size)
                    flat.copy_(result)
                else:
                    self._check_meta(meta)
                    self._ring_all_reduce(flat, op)

        return self._submit(describe, body, async_op, tensor)

    def _ring_all_reduce(self, flat: torch.Tensor, op: ReduceOp) -> None:
        n, r = self.world_size, self.rank
        segs = _segments(flat, n)
        reduce = _REDUCERS[op]
        for s in range(n - 1):
            self._exchange(segs[(r - s) % n], segs[(r - s - 1) % n], reduce)
        if op is ReduceOp.AVG:
            segs[(r + 1) % n].div_(n)
        self._flush()
        for t in range(n - 1):
            self._exchange(segs[(r + 1 - t) % n], segs[(r - t) % n], None)
        self._flush()

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
                        flat.copy_(payloads[src])
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
                    blocks[r].copy_(host_tensor)
                if n == 1:
                    return
                if self._is_small(host_tensor):
                    payloads = self._check_meta(meta, host_tensor)
                    for source, block in enumerate(blocks):
                        if source != r:
                            block.copy_(payloads[source])
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

        def body() -> None:
            work = torch.cat([t.to("cpu") for t in inputs]) if inputs else output.new_empty(0)
            blocks = _segments(work, n)
            if n > 1 and self._is_small(work):
                payloads = self._check_meta(meta, work)
                mine = _segments(payloads[0], n)[r].clone()
                for source in range(1, n):
                    _REDUCERS[op](mine, _segments(payloads[source], n)[r])
            elif n > 1:
                self._check_meta(meta)
                reduce = _REDUCERS[op]
                for s in range(n - 1):
                    self._exchange(blocks[(r - s - 1) % n], blocks[(r - s - 2) % n], reduce)
                self._flush()
                mine = blocks[r]
            else:
                mine = blocks[r]
            if op is ReduceOp.AVG and n > 1:
                mine.div_(n)
            output.copy_(mine)

        return self._submit(describe, body, async_op, (output, inputs))

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
