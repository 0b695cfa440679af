"""The two one-way links of a ring rank: shared memory on one host, TCP across hosts.

A link carries, in order, metadata records (with small payloads), data chunks
and aborts.

- TCP: ``M`` + record, ``P`` + length + payload frames; a sender thread writes
  them so that a rank sending to its right never blocks the receive from its
  left (all ranks send at once in a ring step; blocking sends would deadlock
  once chunks outgrow the kernel's socket buffers).
- Shared memory: the receiver owns an inbox of ``slots`` message slots, each a
  192-byte header (kind, sizes, the metadata record) followed by up to
  ``chunk_bytes`` of payload, and a control block with two doorbells
  (``backends._doorbell``): the sender's count of messages posted and the
  receiver's count of messages consumed. The sender writes a message into the
  next free slot and advances its count; the receiver polls that count briefly,
  then sleeps in the kernel, reads (or reduces) straight out of the slot and
  advances its own count, which frees the slot. A sleeping end is woken
  through its wake pipe (a FIFO next to the inbox, opened by both ends); the
  TCP connection between them carries aborts and the end-of-file of a peer
  that died, which wakes a sleeping neighbour with an error.
- Lent chunks: a sender whose tensor lives in a shared buffer
  (``backends._shared_buffers``) posts only a header naming the buffer and the
  chunk's offset, and the receiver reads the chunk straight from the sender's
  memory. The sender must not write that memory again until the receiver's
  count shows it has read it (``ShmSendLink.wait_returned``). A buffer that is
  gone is announced in the header of a later metadata message (one per
  message: a separate message could fill the slots of two ranks that both
  announce, each waiting for the other to free one), and the receiver unmaps
  it.
"""

from __future__ import annotations

import collections
import os
import queue
import secrets
import socket
import struct
import threading
from typing import Any

import torch

from backends import _kernels
from backends._doorbell import ABORT, Doorbell, abort_frame
from backends._kernels import Reducer
from backends._rendezvous import RingSockets, host_id
from backends._shm import HEADER_BYTES, Region, RegionId, can_share_descriptors
from backends._wire import SocketReader, recv_json, send_json
from commlib.errors import CommError, PeerFailureError, RendezvousError

__all__ = ["SendLink", "RecvLink", "connect_links", "META_BYTES", "Reducer"]

META_BYTES = 96
_FRAME_PAYLOAD = ord("P")
_FRAME_META = ord("M")
_FRAME_ABORT = ABORT
_U64 = struct.Struct("!Q")
_U32 = struct.Struct("!I")


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview of a flat contiguous CPU tensor (any dtype, bf16 included)."""
    if t.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(t.view(torch.uint8).numpy())


class _Link:
    def __init__(self, sock: socket.socket, reader: SocketReader, peer: int, describe: str) -> None:
        self.sock = sock
        self.reader = reader
        self.peer = peer
        self.describe = describe
        self.transport = "?"

    def _check_frame(self, kind: int, expected: int, what: str) -> None:
        if kind == expected:
            return
        if kind == _FRAME_ABORT:
            (length,) = _U32.unpack(self.reader.read_exact(_U32.size, what))
            reason = self.reader.read_exact(length, what).decode(errors="replace")
            raise PeerFailureError(f"{self.describe} aborted the collective ({what}): {reason}")
        raise CommError(
            f"protocol error from {self.describe} ({what}): expected frame {chr(expected)!r}, got {kind!r}. "
            "The ranks disagree on the sequence of collectives; every rank must issue the same ones in "
            "the same order"
        )

    def abort(self, reason: str) -> None:
        """Tell the peer this rank gave up, with the reason (best effort, never raises)."""
        try:
            self.sock.settimeout(1.0)
            self.sock.sendall(abort_frame(reason))
        except OSError:
            pass

    def shutdown(self) -> None:
        """Stop writing: the peer reads end-of-file once it has read everything sent before."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self, linger: float) -> None:
        """Wait up to ``linger`` seconds for the peer's end-of-file, then close.

        Call ``shutdown()`` on every link first: waiting on one link before the
        other is shut would make two ranks wait on each other.
        """
        try:
            self.sock.settimeout(linger)
            while self.sock.recv(65536):
                pass
        except OSError:
            pass
        self.sock.close()


class SendLink(_Link):
    """The link to the right neighbour: this rank writes data into it."""

    chunk_bytes: int
    can_lend = False
    """True if the receiver can read chunks straight from this rank's shared buffers (``lend``)."""

    def send_meta(
        self, record: bytes, payload: torch.Tensor | None = None, lent: tuple[RegionId, int] | None = None
    ) -> None:
        """Send one metadata record (``META_BYTES`` long), optionally followed by a payload chunk.

        Args:
            record: The record.
            payload: A chunk that travels with the record; the receiver reads it
                with its next ``recv_into`` / ``recv_reduce``.
            lent: Where ``payload`` lies in a shared buffer (region, data byte
                offset), if the link may lend it instead of copying it.
        """
        raise NotImplementedError

    def send(self, chunk: torch.Tensor) -> None:
        """Send a flat contiguous chunk of at most ``chunk_bytes``; returns before the peer reads it."""
        raise NotImplementedError

    def flush(self) -> None:
        """Block until every chunk sent so far has left this rank's tensors (they may be modified after)."""

    def lend(self, chunk: torch.Tensor, region: RegionId, offset: int) -> None:
        """Let the receiver read ``chunk`` in place: it lies at data byte ``offset`` of ``region``."""
        raise CommError(f"the link to {self.describe} cannot lend buffers")

    def wait_returned(self) -> None:
        """Block until the receiver has read every chunk lent so far."""


class RecvLink(_Link):
    """The link from the left neighbour: this rank reads data from it."""

    chunk_bytes: int

    def recv_meta(self) -> bytes:
        """Receive one metadata record."""
        kind = self.reader.read_byte("metadata")
        self._check_frame(kind, _FRAME_META, "metadata")
        return self.reader.read_exact(META_BYTES, "metadata")

    def recv_into(self, dst: torch.Tensor) -> None:
        """Receive the next chunk into ``dst`` (flat, contiguous, exactly the chunk's size)."""
        raise NotImplementedError

    def recv_reduce(self, dst: torch.Tensor, reduce: Reducer) -> None:
        """Receive the next chunk and combine it into ``dst`` with ``reduce``."""
        raise NotImplementedError


# ---------------------------------------------------------------------- TCP
class TcpSendLink(SendLink):
    """Frames written by a dedicated thread, in order."""

    def __init__(
        self, sock: socket.socket, reader: SocketReader, peer: int, describe: str, chunk_bytes: int
    ) -> None:
        super().__init__(sock, reader, peer, describe)
        self.transport = "tcp"
        self.chunk_bytes = chunk_bytes
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name=f"commlib-ring-send-{peer}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if self._error is None:
                    for part in item:
                        self.sock.sendall(part)
            except OSError as e:
                self._error = e
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _raise_if_failed(self, what: str) -> None:
        if self._error is not None:
            error = self._error
            if isinstance(error, TimeoutError):
                raise CommError(
                    f"timed out sending to {self.describe} ({what}): it stopped reading"
                ) from error
            raise PeerFailureError(f"sending to {self.describe} failed ({what}): {error}") from error

    def _enqueue(self, parts: tuple[Any, ...]) -> None:
        self._raise_if_failed("send")
        with self._idle:
            self._pending += 1
        self._queue.put(parts)

    def send_meta(
        self, record: bytes, payload: torch.Tensor | None = None, lent: tuple[RegionId, int] | None = None
    ) -> None:
        """Queue one metadata record (and payload frame) as a single write; nothing is lent over TCP."""
        if payload is None:
            self._enqueue((bytes([_FRAME_META]) + record,))
        else:
            view = byte_view(payload)
            self._enqueue(
                (bytes([_FRAME_META]) + record + bytes([_FRAME_PAYLOAD]) + _U64.pack(len(view)), view)
            )

    def send(self, chunk: torch.Tensor) -> None:
        """Queue a chunk for the sender thread; it must not change until ``flush``."""
        view = byte_view(chunk)
        self._enqueue((bytes([_FRAME_PAYLOAD]) + _U64.pack(len(view)), view))

    def flush(self) -> None:
        """Wait until the sender thread has handed every queued chunk to the kernel."""
        timeout = self.sock.gettimeout()
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, timeout=timeout):
                raise CommError(
                    f"timed out after {timeout:.1f} s sending to {self.describe}: it stopped reading "
                    "(stuck, or in a different collective)"
                )
        self._raise_if_failed("flush")

    def shutdown(self) -> None:
        """Stop the sender thread, then stop writing."""
        self._queue.put(None)
        self._thread.join(timeout=10.0)
        super().shutdown()


class TcpRecvLink(RecvLink):
    """Reads frames; reductions go through a scratch buffer allocated once."""

    def __init__(
        self, sock: socket.socket, reader: SocketReader, peer: int, describe: str, chunk_bytes: int
    ) -> None:
        super().__init__(sock, reader, peer, describe)
        self.transport = "tcp"
        self.chunk_bytes = chunk_bytes
        self._scratch = torch.empty(chunk_bytes, dtype=torch.uint8)

    def _read_header(self, nbytes: int) -> None:
        kind = self.reader.read_byte("data")
        self._check_frame(kind, _FRAME_PAYLOAD, "data")
        (length,) = _U64.unpack(self.reader.read_exact(_U64.size, "data"))
        if length != nbytes:
            raise CommError(
                f"{self.describe} sent a {length}-byte chunk where this rank expected {nbytes} bytes; "
                "the ranks disagree on the collective's tensor sizes"
            )

    def recv_into(self, dst: torch.Tensor) -> None:
        """Receive the next chunk straight into ``dst``."""
        view = byte_view(dst)
        self._read_header(len(view))
        self.reader.readinto_exact(view, "data")

    def recv_reduce(self, dst: torch.Tensor, reduce: Reducer) -> None:
        """Receive into the scratch buffer, then reduce into ``dst``."""
        nbytes = dst.numel() * dst.element_size()
        self._read_header(nbytes)
        incoming = self._scratch[:nbytes]
        self.reader.readinto_exact(byte_view(incoming), "data")
        reduce(dst, incoming.view(dst.dtype))


# ------------------------------------------------------------ shared memory
# Control words of an inbox (indices of 64-bit words in its region's header),
# each on its own cache line.
_POSTED = 8  # messages the sender has posted
_RECV_SLEEPING = 16  # the receiver sleeps, waiting for _POSTED
_CONSUMED = 24  # messages the receiver has finished with (their slots are free)
_SEND_SLEEPING = 32  # the sender sleeps, waiting for _CONSUMED

# A slot: a header, then (metadata messages) the record and a retired region, then the payload.
# Header: kind, where a metadata message's payload is (_NO_PAYLOAD, _KIND_DATA: in the slot,
# _KIND_LENT: lent), payload bytes, and for a lent chunk its offset and region (fd, size, token).
_SLOT_HEADER = struct.Struct("=IIQQqQ16s")
_RECORD_AT = 64
_RETIRED = struct.Struct("=q16s")  # a lent region that is gone (fd -1: none)
_RETIRED_AT = _RECORD_AT + META_BYTES
_PAYLOAD_AT = 192
_KIND_META = 1  # a metadata record, maybe with a payload
_KIND_DATA = 2  # a chunk in the slot
_KIND_LENT = 3  # a chunk at `offset` of the sender's region (fd, size, token)
_NO_PAYLOAD = 0
_KIND_NAMES = {_KIND_META: "metadata", _KIND_DATA: "data", _KIND_LENT: "lent data"}
assert _RETIRED_AT + _RETIRED.size <= _PAYLOAD_AT


class _Inbox:
    """A receiver-owned region of ``slots`` message slots, and the control words of the link."""

    def __init__(self, region: Region, slots: int, chunk_bytes: int) -> None:
        self.region = region
        self.slots = slots
        self.chunk_bytes = chunk_bytes
        stride = _PAYLOAD_AT + chunk_bytes
        self._starts = [i * stride for i in range(slots)]
        self.payloads = [region.data[s + _PAYLOAD_AT : s + stride] for s in self._starts]

    @staticmethod
    def region_bytes(slots: int, chunk_bytes: int) -> int:
        """Data bytes of the region an inbox of this shape needs."""
        return slots * (_PAYLOAD_AT + chunk_bytes)

    def header_at(self, index: int) -> int:
        """Offset of slot ``index``'s header in the region's mapping."""
        return HEADER_BYTES + self._starts[index % self.slots]

    def payload(self, index: int, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of slot ``index``'s payload, as ``dtype``."""
        return self.payloads[index % self.slots][:nbytes].view(dtype)

    def close(self) -> None:
        self.payloads = []
        self.region.close()


class _WakePipes:
    """The two FIFOs of a shared-memory link: one wakes the receiver, one the sender.

    Both ends open both for reading and writing (never blocking), so neither
    ever sees end-of-file or a broken pipe; the creator unlinks them once the
    other end has opened them.
    """

    def __init__(self, paths: tuple[str, str], *, create: bool) -> None:
        self.paths = paths
        self.fds: list[int] = []
        try:
            for path in paths:
                if create:
                    os.mkfifo(path, 0o600)
                self.fds.append(os.open(path, os.O_RDWR | os.O_NONBLOCK))
        except OSError:
            self.close()
            if create:
                self.unlink()
            raise

    @property
    def receiver(self) -> int:
        """The pipe that wakes the receiver (written by the sender)."""
        return self.fds[0]

    @property
    def sender(self) -> int:
        """The pipe that wakes the sender (written by the receiver)."""
        return self.fds[1]

    def unlink(self) -> None:
        for path in self.paths:
            try:
                os.unlink(path)
            except OSError:
                pass

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class ShmSendLink(SendLink):
    """Writes messages into the right neighbour's inbox, or lends it chunks of a shared buffer."""

    def __init__(
        self,
        sock: socket.socket,
        reader: SocketReader,
        peer: int,
        describe: str,
        inbox: _Inbox,
        *,
        spin_s: float = 0.0,
        can_lend: bool = False,
        wake: _WakePipes | None = None,
    ) -> None:
        super().__init__(sock, reader, peer, describe)
        self.transport = "shm"
        self.inbox = inbox
        self.chunk_bytes = inbox.chunk_bytes
        self.can_lend = can_lend
        self.wake = wake
        self.bell = Doorbell(
            inbox.region.words,
            mine=_POSTED,
            theirs=_CONSUMED,
            my_flag=_SEND_SLEEPING,
            their_flag=_RECV_SLEEPING,
            reader=reader,
            spin_s=spin_s,
            wake_in=wake.sender if wake is not None else -1,
            wake_out=wake.receiver if wake is not None else -1,
        )
        self._lent_until = 0
        self._retired: collections.deque[tuple[int, bytes]] = collections.deque()

    def _claim(
        self,
        kind: int,
        nbytes: int,
        offset: int = 0,
        region: RegionId | None = None,
        *,
        payload: int = _NO_PAYLOAD,
    ) -> int:
        """Wait for a free slot, write its header, and return its index (the message's number)."""
        bell, inbox = self.bell, self.inbox
        if nbytes > inbox.chunk_bytes and _KIND_LENT not in (kind, payload):
            raise CommError(
                f"a {nbytes}-byte message does not fit a {inbox.chunk_bytes}-byte slot of {self.describe}"
            )
        index = bell.count
        bell.wait_for(index + 1 - inbox.slots, "a free slot")
        fd, size, token = (region.fd, region.size, region.token) if region is not None else (-1, 0, b"")
        _SLOT_HEADER.pack_into(
            inbox.region.map, inbox.header_at(index), kind, payload, nbytes, offset, fd, size, token
        )
        return index

    def send_meta(
        self, record: bytes, payload: torch.Tensor | None = None, lent: tuple[RegionId, int] | None = None
    ) -> None:
        """Post one metadata record with its payload in the same message: copied into the slot, or lent.

        The header also names one retired region, if any is waiting to be announced.
        """
        inbox = self.inbox
        nbytes = 0 if payload is None else payload.numel() * payload.element_size()
        if payload is None:
            index = self._claim(_KIND_META, 0)
        elif lent is not None and self.can_lend:
            index = self._claim(_KIND_META, nbytes, lent[1], lent[0], payload=_KIND_LENT)
        else:
            index = self._claim(_KIND_META, nbytes, payload=_KIND_DATA)
            if nbytes:
                _kernels.copy(inbox.payload(index, payload.dtype, nbytes), payload)  # type: ignore[union-attr]
        start = inbox.header_at(index)
        inbox.region.map[start + _RECORD_AT : start + _RECORD_AT + META_BYTES] = record
        fd, token = self._retired.popleft() if self._retired else (-1, b"")
        _RETIRED.pack_into(inbox.region.map, start + _RETIRED_AT, fd, token)
        self.bell.advance()
        if lent is not None and self.can_lend:
            self._lent_until = self.bell.count

    def send(self, chunk: torch.Tensor) -> None:
        """Copy ``chunk`` into the next free slot and post it."""
        nbytes = chunk.numel() * chunk.element_size()
        index = self._claim(_KIND_DATA, nbytes)
        if nbytes:
            _kernels.copy(self.inbox.payload(index, chunk.dtype, nbytes), chunk)
        self.bell.advance()

    def lend(self, chunk: torch.Tensor, region: RegionId, offset: int) -> None:
        """Post where ``chunk`` lies in ``region``; the receiver reads it from there."""
        if not self.can_lend:
            super().lend(chunk, region, offset)
        self._claim(_KIND_LENT, chunk.numel() * chunk.element_size(), offset, region)
        self.bell.advance()
        self._lent_until = self.bell.count

    def wait_returned(self) -> None:
        """Wait until the receiver has consumed every message up to the last lent chunk."""
        self.bell.wait_for(self._lent_until, f"{self.describe} to finish reading this rank's buffer")

    def retire(self, fd: int, token: bytes) -> None:
        """Tell the receiver, in a coming metadata record, that a lent region is gone (any thread)."""
        self._retired.append((fd, token))

    def close(self, linger: float) -> None:
        """Unmap the inbox and close the connection."""
        self.inbox.close()
        if self.wake is not None:
            self.wake.close()
        super().close(linger)


class ShmRecvLink(RecvLink):
    """Reads messages out of this rank's own inbox, and lent chunks out of the sender's buffers."""

    def __init__(
        self,
        sock: socket.socket,
        reader: SocketReader,
        peer: int,
        describe: str,
        inbox: _Inbox,
        *,
        spin_s: float = 0.0,
        peer_pid: int = 0,
        wake: _WakePipes | None = None,
    ) -> None:
        super().__init__(sock, reader, peer, describe)
        self.transport = "shm"
        self.inbox = inbox
        self.chunk_bytes = inbox.chunk_bytes
        self.peer_pid = peer_pid
        self.wake = wake
        self.bell = Doorbell(
            inbox.region.words,
            mine=_CONSUMED,
            theirs=_POSTED,
            my_flag=_RECV_SLEEPING,
            their_flag=_SEND_SLEEPING,
            reader=reader,
            spin_s=spin_s,
            wake_in=wake.receiver if wake is not None else -1,
            wake_out=wake.sender if wake is not None else -1,
        )
        self._held: tuple[int, int, int, int, int, bytes] | None = None  # a metadata message's payload
        self._lent: dict[tuple[int, bytes], Region] = {}

    @property
    def lent_regions(self) -> int:
        """How many of the sender's regions this rank has mapped."""
        return len(self._lent)

    def _next(self, what: str) -> tuple[int, int, int, int, int, int, bytes]:
        """Wait for the next message and return its header (see ``_SLOT_HEADER``)."""
        bell = self.bell
        bell.wait_for(bell.count + 1, what)
        return _SLOT_HEADER.unpack_from(self.inbox.region.map, self.inbox.header_at(bell.count))

    def _unexpected(self, kind: int, what: str) -> CommError:
        return CommError(
            f"protocol error from {self.describe} ({what}): got a {_KIND_NAMES.get(kind, repr(kind))} "
            "message. The ranks disagree on the sequence of collectives; every rank must issue the same "
            "ones in the same order"
        )

    def recv_meta(self) -> bytes:
        """Receive one metadata record; a payload that came with it is read by the next ``recv_*``."""
        kind, payload, nbytes, offset, fd, size, token = self._next("metadata")
        if kind != _KIND_META:
            raise self._unexpected(kind, "metadata")
        start = self.inbox.header_at(self.bell.count)
        record = bytes(self.inbox.region.map[start + _RECORD_AT : start + _RECORD_AT + META_BYTES])
        gone_fd, gone_token = _RETIRED.unpack_from(self.inbox.region.map, start + _RETIRED_AT)
        if gone_fd >= 0:  # a region of the sender's is gone
            region = self._lent.pop((gone_fd, gone_token), None)
            if region is not None:
                region.close()
        if payload == _NO_PAYLOAD:
            self.bell.advance()
        else:
            self._held = (payload, nbytes, offset, fd, size, token)
        return record

    def _incoming(self, dst: torch.Tensor) -> torch.Tensor:
        """A view of the next chunk, which must have ``dst``'s size and dtype."""
        expected = dst.numel() * dst.element_size()
        if self._held is not None:
            (kind, nbytes, offset, fd, size, token), self._held = self._held, None
        else:
            kind, _, nbytes, offset, fd, size, token = self._next("data")
        if nbytes != expected:
            raise CommError(
                f"{self.describe} sent a {nbytes}-byte chunk where this rank expected {expected} bytes; "
                "the ranks disagree on the collective's tensor sizes"
            )
        if kind == _KIND_DATA:
            return self.inbox.payload(self.bell.count, dst.dtype, nbytes)
        if kind == _KIND_LENT:
            return self._lent_region(fd, size, token).data[offset : offset + nbytes].view(dst.dtype)
        raise self._unexpected(kind, "data")

    def _lent_region(self, fd: int, size: int, token: bytes) -> Region:
        region = self._lent.get((fd, token))
        if region is None:
            try:
                region = Region.open_descriptor(self.peer_pid, fd, size, token)
            except OSError as e:
                raise PeerFailureError(
                    f"cannot map the shared buffer of {self.describe} ({e}); its process ended?"
                ) from e
            self._lent[(fd, token)] = region
        return region

    def recv_into(self, dst: torch.Tensor) -> None:
        """Copy the next chunk into ``dst``."""
        _kernels.copy(dst, self._incoming(dst))
        self.bell.advance()

    def recv_reduce(self, dst: torch.Tensor, reduce: Reducer) -> None:
        """Reduce the next chunk straight out of the slot (or the sender's buffer) into ``dst``."""
        reduce(dst, self._incoming(dst))
        self.bell.advance()

    def close(self, linger: float) -> None:
        """Unmap the inbox and the sender's buffers, and close the connection."""
        self.inbox.close()
        for region in self._lent.values():
            region.close()
        self._lent.clear()
        if self.wake is not None:
            self.wake.close()
        super().close(linger)


# ------------------------------------------------------------------ set-up
def _shm_dir(preferred: str | None) -> str:
    for candidate in (preferred, "/dev/shm"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    import tempfile

    return tempfile.gettempdir()


def _probe_region() -> Region | None:
    """A tiny ``memfd`` region the right neighbour tries to open, to learn whether buffers can be lent."""
    if not can_share_descriptors():
        return None
    try:
        return Region.create_anonymous(0, "commlib-ring-probe")
    except OSError:
        return None


def _can_open(proposal: dict[str, Any]) -> bool:
    probe = proposal.get("probe")
    if not probe:
        return False
    try:
        Region.open_descriptor(
            int(proposal["pid"]), int(probe["fd"]), 0, bytes.fromhex(probe["token"])
        ).close()
    except (OSError, ValueError, KeyError):
        return False
    return True


def connect_links(
    sockets: RingSockets,
    rank: int,
    world_size: int,
    *,
    transport: str,
    chunk_bytes: int,
    slots: int,
    shm_dir: str | None,
    prefix: str,
    spin_s: float = 0.0,
) -> tuple[SendLink | None, RecvLink | None]:
    """Agree with both neighbours on each link's transport and build the two links.

    A link uses shared memory when both ends are on one host and neither end
    asked for TCP; ``transport="shm"`` on either end makes a link that cannot
    use shared memory an error rather than a fallback. A shared-memory link can
    also lend buffers when the receiver can open the sender's ``memfd``
    descriptors (a probe region is tried here).
    """
    if world_size == 1 or sockets.right is None or sockets.left is None or sockets.left_reader is None:
        return None, None
    right_rank, left_rank = (rank + 1) % world_size, (rank - 1) % world_size
    right_name = f"rank {right_rank} (right neighbour)"
    left_name = f"rank {left_rank} (left neighbour)"
    right, left = sockets.right, sockets.left
    right_reader, left_reader = SocketReader(right, right_name), sockets.left_reader
    me = host_id()

    probe = _probe_region() if transport != "tcp" else None
    send_json(
        right,
        {
            "transport": transport,
            "host": me,
            "pid": os.getpid(),
            "probe": {"fd": probe.fd, "token": probe.token.hex()} if probe is not None else None,
        },
    )
    proposal = recv_json(left_reader, "link set-up")
    forced = "shm" in (transport, proposal["transport"])
    inbox: _Inbox | None = None
    my_wake: _WakePipes | None = None
    why_not = ""
    if "tcp" in (transport, proposal["transport"]):
        why_not = "COMMLIB_RING_TRANSPORT=tcp on one end"
    elif proposal["host"] != me:
        why_not = f"rank {left_rank} runs on another host ({proposal['host'].split('/')[0]})"
    else:
        path = os.path.join(_shm_dir(shm_dir), f"commlib-ring-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            inbox = _Inbox(
                Region.create_file(path, _Inbox.region_bytes(slots, chunk_bytes)), slots, chunk_bytes
            )
        except OSError as e:
            why_not = f"cannot create shared memory at {path}: {e}"
        else:
            try:
                my_wake = _WakePipes((f"{path}.wake-recv", f"{path}.wake-send"), create=True)
            except OSError:
                my_wake = None  # wake-ups go over the socket
    if inbox is None and forced and "tcp" not in (transport, proposal["transport"]):
        message = (
            f"{prefix}COMMLIB_RING_TRANSPORT=shm, but the link from rank {left_rank} cannot use "
            f"shared memory: {why_not}"
        )
        send_json(left, {"transport": "error", "why": message})
        if probe is not None:
            probe.close()
        raise RendezvousError(message)
    if inbox is not None:
        send_json(
            left,
            {
                "transport": "shm",
                "path": inbox.region.path,
                "token": inbox.region.token.hex(),
                "lend": _can_open(proposal),
                "wake": list(my_wake.paths) if my_wake is not None else None,
            },
        )
    else:
        send_json(left, {"transport": "tcp", "why": why_not})

    offer = recv_json(right_reader, "link set-up")
    if probe is not None:
        probe.close()  # the right neighbour has tried it by now
    if offer["transport"] == "error":
        raise RendezvousError(f"{prefix}{offer['why']}")
    remote: _Inbox | None = None
    their_wake: _WakePipes | None = None
    problem = ""
    if offer["transport"] == "shm":
        try:
            region = Region.open_path(
                offer["path"], _Inbox.region_bytes(slots, chunk_bytes), bytes.fromhex(offer["token"])
            )
            remote = _Inbox(region, slots, chunk_bytes)
        except OSError as e:
            problem = f"cannot open rank {right_rank}'s shared memory: {e}"
        if remote is not None and offer.get("wake"):
            try:
                their_wake = _WakePipes(tuple(offer["wake"]), create=False)  # type: ignore[arg-type]
            except OSError:
                their_wake = None
    send_json(right, {"ok": remote is not None, "wake": their_wake is not None, "why": problem})
    reply = recv_json(left_reader, "link set-up")
    if inbox is not None:
        inbox.region.unlink()  # both ends have it mapped; nothing is left behind if a rank crashes
    if my_wake is not None:
        my_wake.unlink()
        if not reply.get("wake"):
            my_wake.close()  # the sender could not open them: both ends wake over the socket
            my_wake = None
    if forced and (problem or (inbox is not None and not reply["ok"])):
        for opened in (inbox, remote, my_wake, their_wake):
            if opened is not None:
                opened.close()
        raise RendezvousError(
            f"{prefix}COMMLIB_RING_TRANSPORT=shm, but a link cannot use shared memory: "
            f"{problem or reply['why']}"
        )

    right_reader.spin_s = left_reader.spin_s = spin_s
    send_link: SendLink
    if remote is not None:
        send_link = ShmSendLink(
            right,
            right_reader,
            right_rank,
            right_name,
            remote,
            spin_s=spin_s,
            can_lend=bool(offer.get("lend")),
            wake=their_wake,
        )
    else:
        send_link = TcpSendLink(right, right_reader, right_rank, right_name, chunk_bytes)
    recv_link: RecvLink
    if inbox is not None and reply["ok"]:
        recv_link = ShmRecvLink(
            left,
            left_reader,
            left_rank,
            left_name,
            inbox,
            spin_s=spin_s,
            peer_pid=int(proposal["pid"]),
            wake=my_wake,
        )
    else:
        if inbox is not None:
            inbox.close()
        if my_wake is not None:
            my_wake.close()
        recv_link = TcpRecvLink(left, left_reader, left_rank, left_name, chunk_bytes)
    return send_link, recv_link
