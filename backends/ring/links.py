"""The two one-way links of a ring rank, and links over TCP.

Each rank sends to its right neighbour (``SendLink``) and receives from its
left (``RecvLink``). A link carries, in order, metadata records (with a
payload: a small tensor, or the first chunk of a reduce-scatter), data chunks
and aborts. Between ranks on one host the links use shared memory
(``backends.ring.shm_links``); across hosts, TCP (here): ``M`` + record, ``P`` +
length + payload frames; a sender thread writes them so that a rank sending
to its right never blocks the receive from its left (all ranks send at once in
a ring step; blocking sends would deadlock once chunks outgrow the kernel's
socket buffers). ``backends.ring.link_setup`` chooses and builds the two links.

The same links carry point-to-point messages between any two ranks
(``backends.ring.p2p``): there the receiver also returns a verdict on each
message (taken, or refused for its size) that its sender waits for; over TCP
as a ``V`` frame on the same connection, in shared memory in the inbox's
control words.
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import struct
import threading
import time
from typing import Any

import torch

from backends.common.kernels import Reducer
from backends.ring.doorbell import ABORT, abort_frame
from backends.ring.shm import RegionId
from backends.ring.wire import SocketReader
from commlib.errors import CommError, CommTimeoutError, PeerFailureError

__all__ = ["SendLink", "RecvLink", "TcpSendLink", "TcpRecvLink", "META_BYTES", "Reducer", "byte_view"]

META_BYTES = 96
_FRAME_PAYLOAD = ord("P")
_FRAME_META = ord("M")
_FRAME_ABORT = ABORT
_FRAME_VERDICT = ord("V")
_U64 = struct.Struct("!Q")
_U32 = struct.Struct("!I")
_VERDICT = struct.Struct(
    "!QQQQQ"
)  # message number, then the verdict: code, the receiver's bytes, elements, dtype


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
            reason = self._abort_reason(what)
            raise PeerFailureError(f"{self.describe} aborted the collective ({what}): {reason}")
        raise CommError(
            f"protocol error from {self.describe} ({what}): expected frame {chr(expected)!r}, got {kind!r}. "
            "The ranks disagree on the sequence of collectives; every rank must issue the same ones in "
            "the same order"
        )

    def _abort_reason(self, what: str) -> str:
        """The reason an abort frame carries (its kind byte read already)."""
        (length,) = _U32.unpack(self.reader.read_exact(_U32.size, what))
        return self.reader.read_exact(length, what).decode(errors="replace")

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
    copies_at_once = False
    """True if ``send`` has copied the chunk when it returns (the chunk may change at once)."""

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

    def send_record(self, layout: struct.Struct, fields: tuple[Any, ...], payload: torch.Tensor) -> None:
        """``send_meta`` of the record ``layout`` packs from ``fields``, with ``payload`` (one chunk)."""
        self.send_meta(layout.pack(*fields).ljust(META_BYTES, b"\0"), payload)

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

    def await_verdict(self, msg: int, what: str) -> tuple[int, ...]:
        """Wait until the receiver has taken everything sent so far; return its verdict on message ``msg``.

        Returns:
            The receiver's code for the message and what its buffer holds: bytes,
            elements, dtype code (``backends.ring.p2p`` gives them meaning).

        Raises:
            CommTimeoutError: The receiver did not take it within the link's timeout.
            PeerFailureError: The receiver aborted or left.
        """
        raise NotImplementedError


class RecvLink(_Link):
    """The link from the left neighbour: this rank reads data from it."""

    chunk_bytes: int

    def recv_meta(self) -> bytes:
        """Receive one metadata record."""
        kind = self.reader.read_byte("metadata")
        self._check_frame(kind, _FRAME_META, "metadata")
        return self.reader.read_exact(META_BYTES, "metadata")

    def recv_record(self, layout: struct.Struct) -> tuple[Any, ...]:
        """Receive one metadata record and unpack it with ``layout`` (what ``send_record`` sent)."""
        return layout.unpack_from(self.recv_meta())

    def recv_into(self, dst: torch.Tensor) -> None:
        """Receive the next chunk into ``dst`` (flat, contiguous, exactly the chunk's size)."""
        raise NotImplementedError

    def recv_reduce(self, dst: torch.Tensor, reduce: Reducer) -> None:
        """Receive the next chunk and combine it into ``dst`` with ``reduce``."""
        raise NotImplementedError

    def recv_reduce_back(self, dst: torch.Tensor, reduce: Reducer) -> bool:
        """``recv_reduce``; where the chunk was lent, also write the result back into the sender's buffer.

        Returns:
            True if the result was written back (the chunk was lent); a link
            that cannot read lent chunks returns False.
        """
        self.recv_reduce(dst, reduce)
        return False

    def forward(self, like: torch.Tensor, send: SendLink) -> None:
        """Pass the next chunk (``like``'s size and dtype) on through ``send`` unchanged."""
        chunk = torch.empty_like(like)  # a TCP send holds it until written
        self.recv_into(chunk)
        send.send(chunk)

    def post_verdict(self, msg: int, verdict: tuple[int, int, int, int]) -> None:
        """Give the sender the verdict on message ``msg``; call it before taking the message's last chunk."""
        raise NotImplementedError

    def take_into(self, msg: int, verdict: tuple[int, int, int, int], dst: torch.Tensor) -> None:
        """``post_verdict`` on message ``msg``, then ``recv_into(dst)`` its one chunk (its last)."""
        self.post_verdict(msg, verdict)
        self.recv_into(dst)

    def ready(self) -> bool:
        """True if a message (or an abort, or the end of the connection) waits to be read; never blocks."""
        raise NotImplementedError


# ---------------------------------------------------------------------- TCP
_ABORT_WAIT_S = 1.0
"""How long ``abort`` waits for the abort frame to be written (after the frame in flight)."""
_ABORT_READ_S = 0.2
"""How long a link whose send failed looks for the reason its peer wrote before it went away."""


class TcpSendLink(SendLink):
    """Frames written by a dedicated thread, in order.

    Only that thread writes to the socket, so a frame is never cut by another: an abort
    goes through it too, after the frame in hand, and the frames queued behind it are
    dropped.
    """

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
        self._abort: bytes | None = None  # the abort frame to write next, once set (``abort``)
        self._aborted = False  # written
        self._thread = threading.Thread(target=self._run, name=f"commlib-ring-send-{peer}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if self._error is None and self._abort is None:
                    for part in item:
                        self.sock.sendall(part)
                if self._abort is not None and not self._aborted and self._error is None:
                    self._aborted = True
                    self.sock.sendall(self._abort)
            except OSError as e:
                self._error = e
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def abort(self, reason: str) -> None:
        """Tell the peer this rank gave up, after the frame in flight (best effort, never raises).

        Waits up to ``_ABORT_WAIT_S`` for the frame to be written: a peer that reads gets
        the frame in flight whole, then the reason.
        """
        frame = abort_frame(reason)
        with self._idle:
            if self._abort is not None:
                return
            self._abort = frame
            if not self._thread.is_alive():  # shut down: nothing else writes
                self._aborted = True
                super().abort(reason)
                return
            self._pending += 1
        self._queue.put(())  # wakes an idle sender thread
        deadline = time.monotonic() + _ABORT_WAIT_S
        with self._idle:
            while self._pending and self._error is None and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)

    def _raise_if_failed(self, what: str) -> None:
        if self._error is not None:
            error = self._error
            if isinstance(error, TimeoutError):
                raise CommTimeoutError(
                    f"timed out sending to {self.describe} ({what}): it stopped reading"
                ) from error
            reason = self._reason_left_by_peer()
            if reason is not None:
                raise PeerFailureError(
                    f"{self.describe} aborted the collective ({what}): {reason}"
                ) from error
            raise PeerFailureError(f"sending to {self.describe} failed ({what}): {error}") from error

    def _reason_left_by_peer(self) -> str | None:
        """The reason in an abort frame the peer wrote back before it went away, if one waits unread.

        A rank that gives up writes the reason on both its links, then its process often
        ends: this rank's send then fails (a broken pipe), though the reason is there to read.
        """
        timeout, deadline = self.sock.gettimeout(), time.monotonic() + _ABORT_READ_S
        try:
            self.sock.settimeout(_ABORT_READ_S)
            while time.monotonic() < deadline:  # verdicts may come before it, but not for ever
                kind = self.reader.read_byte("abort")
                if kind == _FRAME_VERDICT:
                    self.reader.read_exact(_VERDICT.size, "abort")
                    continue
                return self._abort_reason("abort") if kind == _FRAME_ABORT else None
            return None
        except (CommError, OSError):
            return None
        finally:
            with contextlib.suppress(OSError):
                self.sock.settimeout(timeout)

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

    def await_verdict(self, msg: int, what: str) -> tuple[int, ...]:
        """Hand everything to the kernel, then read verdicts up to the one on ``msg`` (older: stale)."""
        self.flush()
        while True:
            kind = self.reader.read_byte(what)
            self._check_frame(kind, _FRAME_VERDICT, what)
            number, *verdict = _VERDICT.unpack(self.reader.read_exact(_VERDICT.size, what))
            if number == msg:
                return tuple(verdict)

    def flush(self) -> None:
        """Wait until the sender thread has handed every queued chunk to the kernel.

        The socket's timeout bounds each wait for progress (a chunk written), not the whole
        transfer: a receiver that starts reading within it gets a message of any length.
        """
        timeout = self.sock.gettimeout()
        with self._idle:
            pending, progressed = self._pending, time.monotonic()
            while self._pending and self._error is None:
                if self._pending < pending:  # a chunk went out: the receiver reads
                    pending, progressed = self._pending, time.monotonic()
                left = None if timeout is None else timeout - (time.monotonic() - progressed)
                if left is not None and left <= 0:
                    raise CommTimeoutError(
                        f"timed out after {timeout:.1f} s sending to {self.describe}: it stopped reading "
                        "(stuck, or in a different collective)"
                    )
                self._idle.wait(left)
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

    def post_verdict(self, msg: int, verdict: tuple[int, int, int, int]) -> None:
        """Send the verdict back on the same connection (a few bytes: never blocks for long)."""
        try:
            self.sock.sendall(bytes([_FRAME_VERDICT]) + _VERDICT.pack(msg, *verdict))
        except OSError as e:
            raise PeerFailureError(f"cannot answer {self.describe}: {e}") from e

    def ready(self) -> bool:
        """True if bytes wait in the reader or the socket."""
        if self.reader.buffered():
            return True
        readable, _, _ = select.select([self.sock], [], [], 0)
        return bool(readable)
