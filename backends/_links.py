"""The two one-way links of a ring rank: shared memory on one host, TCP across hosts.

A link carries, in order, metadata records (``M``), data chunks and aborts (``X``).

- TCP: ``P`` + length + payload frames; a sender thread writes them so that a
  rank sending to its right never blocks the receive from its left (all ranks
  send at once in a ring step; blocking sends would deadlock once chunks
  outgrow the kernel's socket buffers).
- Shared memory: the receiver owns an mmap'd inbox of ``slots`` chunk-sized
  slots. The sender copies a chunk into the next free slot and sends a 1-byte
  ``D`` token over the TCP socket; the receiver reduces straight out of the
  slot and answers with an ``A`` token that frees it. Waiting happens in the
  kernel (a blocking ``recv``), so an idle rank burns no CPU, and a peer that
  dies closes its socket, which wakes its neighbours with an error.
"""

from __future__ import annotations

import mmap
import os
import queue
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch

from backends._rendezvous import RingSockets, host_id
from backends._wire import SocketReader, recv_json, send_json
from commlib.errors import CommError, PeerFailureError, RendezvousError

__all__ = ["SendLink", "RecvLink", "connect_links", "META_BYTES", "Reducer"]

Reducer = Callable[[torch.Tensor, torch.Tensor], None]
"""``reduce(dst, incoming)``: combine ``incoming`` into ``dst`` in place."""

META_BYTES = 96
_TOKEN_DATA = ord("D")
_TOKEN_ACK = ord("A")
_FRAME_PAYLOAD = ord("P")
_FRAME_META = ord("M")
_FRAME_ABORT = ord("X")
_U64 = struct.Struct("!Q")
_U32 = struct.Struct("!I")
_SHM_HEADER_BYTES = 4096
_SHM_MAGIC = b"commlib-ring-v1\0"


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
        payload = reason.encode()[:4000]
        try:
            self.sock.settimeout(1.0)
            self.sock.sendall(bytes([_FRAME_ABORT]) + _U32.pack(len(payload)) + payload)
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

    def send_meta(self, record: bytes, payload: torch.Tensor | None = None) -> None:
        """Send one metadata record (``META_BYTES`` long), optionally followed by a small payload chunk."""
        raise NotImplementedError

    def send(self, chunk: torch.Tensor) -> None:
        """Send a flat contiguous chunk of at most ``chunk_bytes``; returns before the peer reads it."""
        raise NotImplementedError

    def flush(self) -> None:
        """Block until every chunk sent so far has left this rank's tensors (they may be modified after)."""


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

    def send_meta(self, record: bytes, payload: torch.Tensor | None = None) -> None:
        """Queue one metadata record (and payload frame) as a single write."""
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
class _Inbox:
    """A receiver-owned shared-memory file of ``slots`` chunk-sized slots."""

    def __init__(self, path: str, slots: int, chunk_bytes: int, *, create: bool, token: bytes = b"") -> None:
        self.path = path
        size = _SHM_HEADER_BYTES + slots * chunk_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise OSError(f"shared-memory file {path} has {os.fstat(fd).st_size} bytes, expected {size}")
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.base = torch.frombuffer(self.map, dtype=torch.uint8)
        if create:
            self.token = secrets.token_bytes(16)
            self.base.zero_()  # touch every page now, not during the first collective
            self.map[: len(_SHM_MAGIC) + 16] = _SHM_MAGIC + self.token
        elif bytes(self.map[: len(_SHM_MAGIC) + 16]) != _SHM_MAGIC + token:
            raise OSError(
                f"shared-memory file {path} does not hold the expected token (another host's /dev/shm?)"
            )
        else:
            self.token = token
        self.slots = slots
        self.chunk_bytes = chunk_bytes

    def slot(self, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start = _SHM_HEADER_BYTES + (index % self.slots) * self.chunk_bytes
        return self.base[start : start + numel * dtype.itemsize].view(dtype)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        del self.base
        try:
            self.map.close()
        except BufferError:  # a tensor view is still alive; the mapping goes when it does
            pass


class ShmSendLink(SendLink):
    """Copies chunks into the right neighbour's inbox."""

    def __init__(
        self, sock: socket.socket, reader: SocketReader, peer: int, describe: str, inbox: _Inbox
    ) -> None:
        super().__init__(sock, reader, peer, describe)
        self.transport = "shm"
        self.inbox = inbox
        self.chunk_bytes = inbox.chunk_bytes
        self._sent = 0
        self._acked = 0

    def send_meta(self, record: bytes, payload: torch.Tensor | None = None) -> None:
        """Send one metadata record over the socket; a payload goes into a slot, announced in one write."""
        if payload is None:
            self._send_token(bytes([_FRAME_META]) + record)
        else:
            self._fill_slot(payload)
            self._send_token(bytes([_FRAME_META]) + record + b"D")

    def _send_token(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as e:
            raise PeerFailureError(f"{self.describe} closed the connection ({e}); its process ended?") from e

    def _fill_slot(self, chunk: torch.Tensor) -> None:
        while self._sent - self._acked >= self.inbox.slots:
            kind = self.reader.read_byte("a free slot")
            self._check_frame(kind, _TOKEN_ACK, "a free slot")
            self._acked += 1
        self.inbox.slot(self._sent, chunk.dtype, chunk.numel()).copy_(chunk)
        self._sent += 1

    def send(self, chunk: torch.Tensor) -> None:
        """Copy ``chunk`` into the next free slot and ring the peer's doorbell."""
        self._fill_slot(chunk)
        self._send_token(b"D")

    def close(self, linger: float) -> None:
        """Unmap the inbox and close the connection."""
        self.inbox.close()
        super().close(linger)


class ShmRecvLink(RecvLink):
    """Reads chunks out of this rank's own inbox."""

    def __init__(
        self, sock: socket.socket, reader: SocketReader, peer: int, describe: str, inbox: _Inbox
    ) -> None:
        super().__init__(sock, reader, peer, describe)
        self.transport = "shm"
        self.inbox = inbox
        self.chunk_bytes = inbox.chunk_bytes
        self._received = 0

    def _next_slot(self, dst: torch.Tensor) -> torch.Tensor:
        kind = self.reader.read_byte("data")
        self._check_frame(kind, _TOKEN_DATA, "data")
        return self.inbox.slot(self._received, dst.dtype, dst.numel())

    def _release_slot(self) -> None:
        self._received += 1
        try:
            self.sock.send(b"A")
        except OSError:
            pass  # the sender is gone; its absence surfaces on the next wait

    def recv_into(self, dst: torch.Tensor) -> None:
        """Copy the next chunk out of the inbox into ``dst``."""
        dst.copy_(self._next_slot(dst))
        self._release_slot()

    def recv_reduce(self, dst: torch.Tensor, reduce: Reducer) -> None:
        """Reduce the next chunk straight out of the inbox into ``dst``."""
        reduce(dst, self._next_slot(dst))
        self._release_slot()

    def close(self, linger: float) -> None:
        """Unmap the inbox and close the connection."""
        self.inbox.close()
        super().close(linger)


# ------------------------------------------------------------------ set-up
def _shm_dir(preferred: str | None) -> str:
    for candidate in (preferred, "/dev/shm"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    import tempfile

    return tempfile.gettempdir()


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
    use shared memory an error rather than a fallback.
    """
    if world_size == 1 or sockets.right is None or sockets.left is None or sockets.left_reader is None:
        return None, None
    right_rank, left_rank = (rank + 1) % world_size, (rank - 1) % world_size
    right_name = f"rank {right_rank} (right neighbour)"
    left_name = f"rank {left_rank} (left neighbour)"
    right, left = sockets.right, sockets.left
    right_reader, left_reader = SocketReader(right, right_name), sockets.left_reader
    me = host_id()

    send_json(right, {"transport": transport, "host": me})
    proposal = recv_json(left_reader, "link set-up")
    forced = "shm" in (transport, proposal["transport"])
    inbox: _Inbox | None = None
    why_not = ""
    if "tcp" in (transport, proposal["transport"]):
        why_not = "COMMLIB_RING_TRANSPORT=tcp on one end"
    elif proposal["host"] != me:
        why_not = f"rank {left_rank} runs on another host ({proposal['host'].split('/')[0]})"
    else:
        path = os.path.join(_shm_dir(shm_dir), f"commlib-ring-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            inbox = _Inbox(path, slots, chunk_bytes, create=True)
        except OSError as e:
            why_not = f"cannot create shared memory at {path}: {e}"
    if inbox is None and forced and "tcp" not in (transport, proposal["transport"]):
        message = (
            f"{prefix}COMMLIB_RING_TRANSPORT=shm, but the link from rank {left_rank} cannot use "
            f"shared memory: {why_not}"
        )
        send_json(left, {"transport": "error", "why": message})
        raise RendezvousError(message)
    if inbox is not None:
        send_json(left, {"transport": "shm", "path": inbox.path, "token": inbox.token.hex()})
    else:
        send_json(left, {"transport": "tcp", "why": why_not})

    offer = recv_json(right_reader, "link set-up")
    if offer["transport"] == "error":
        raise RendezvousError(f"{prefix}{offer['why']}")
    remote: _Inbox | None = None
    problem = ""
    if offer["transport"] == "shm":
        try:
            remote = _Inbox(
                offer["path"], slots, chunk_bytes, create=False, token=bytes.fromhex(offer["token"])
            )
        except OSError as e:
            problem = f"cannot open rank {right_rank}'s shared memory: {e}"
    send_json(right, {"ok": remote is not None, "why": problem})
    reply = recv_json(left_reader, "link set-up")
    if inbox is not None:
        inbox.unlink()  # both ends have it mapped; nothing is left behind if a rank crashes
    if forced and (problem or (inbox is not None and not reply["ok"])):
        raise RendezvousError(
            f"{prefix}COMMLIB_RING_TRANSPORT=shm, but a link cannot use shared memory: "
            f"{problem or reply['why']}"
        )

    right_reader.spin_s = left_reader.spin_s = spin_s
    send_link: SendLink
    if remote is not None:
        send_link = ShmSendLink(right, right_reader, right_rank, right_name, remote)
    else:
        send_link = TcpSendLink(right, right_reader, right_rank, right_name, chunk_bytes)
    recv_link: RecvLink
    if inbox is not None and reply["ok"]:
        recv_link = ShmRecvLink(left, left_reader, left_rank, left_name, inbox)
    else:
        if inbox is not None:
            inbox.close()
        recv_link = TcpRecvLink(left, left_reader, left_rank, left_name, chunk_bytes)
    return send_link, recv_link
