"""Accept connections on a listener and read control frames from all of them at once.

Used by the ring rendezvous wherever anyone may connect: rank 0's rendezvous
port and every rank's data listener. Whoever connects is a stranger until its
frames prove otherwise, so nothing it does may hold or crash the listening
rank:

- every connection is read without blocking, in one ``selectors`` loop, so a
  silent one costs nothing while the others go on;
- each has its own short deadline (``STRANGER_DEADLINE_S``) for its next frame;
- a frame header announcing more than ``frame_limit`` bytes is refused at once,
  before any body is read;
- what cannot be decoded, a reset, or a close ends that connection alone.

Each connection dropped is logged at DEBUG on the ``commlib`` logger, with
its address and the reason.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import selectors
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from backends.ring.wire import encode_json, tune_socket

__all__ = ["Lobby", "Visitor", "STRANGER_DEADLINE_S", "MAX_PENDING"]

logger = logging.getLogger("commlib")

STRANGER_DEADLINE_S = 10.0
"""Seconds a connection may take to send its next frame. A rank sends at once; a stranger may idle."""

MAX_PENDING = 256
"""Connections read at once; past it the oldest is dropped (a scanner cannot exhaust file descriptors)."""

_HEADER = struct.Struct("!I")


@dataclasses.dataclass(eq=False)
class Visitor:
    """One accepted connection and what the lobby knows of it.

    Attributes:
        sock: The connection (non-blocking while in the lobby).
        address: ``host:port`` of the other end, for messages.
        state: Free for the caller: where this visitor is in its handshake.
        data: Free for the caller: what it has said so far.
    """

    sock: socket.socket
    address: str
    deadline: float
    state: str = "new"
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    on_drop: Callable[[], None] | None = None
    """Called when the lobby drops the visitor (what it was given must be released)."""
    _buffer: bytearray = dataclasses.field(default_factory=bytearray)

    def leftover(self) -> bytes:
        """Bytes received after the last frame handed out (the start of the next one)."""
        return bytes(self._buffer)


class Lobby:
    """Connections on ``listener`` read frame by frame, concurrently; see the module docstring.

    Args:
        listener: A listening socket (left open on ``close``; its owner closes it).
        what: Names the port in log lines, e.g. ``"rank 0's rendezvous port"``.
        frame_limit: Largest frame body accepted, in bytes.
    """

    def __init__(self, listener: socket.socket, what: str, frame_limit: int) -> None:
        self._listener = listener
        self._what = what
        self._limit = frame_limit
        self._selector = selectors.DefaultSelector()
        self._visitors: dict[socket.socket, Visitor] = {}
        self.shut = False
        """True once the listener was found shut down."""
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)

    def next_frame(self, deadline: float) -> tuple[Visitor, Any] | None:
        """Wait for the next complete frame from any visitor.

        Returns:
            The visitor and its decoded frame (the visitor stays in the lobby:
            answer it with ``reply``, then ``keep`` or ``drop`` it), or None at
            ``deadline``, or at once when the listener turns out to be shut down
            (``shut``; the lobby then serves the visitors it has, until their deadlines).
        """
        while True:
            for visitor in list(self._visitors.values()):  # a frame that arrived with the previous one
                if len(visitor._buffer) >= _HEADER.size:
                    frame = self._frame(visitor)
                    if frame is not _NOTHING:
                        return visitor, frame
            now = time.monotonic()
            self._expire(now)
            if now >= deadline:
                return None
            wake = min([deadline] + [v.deadline for v in self._visitors.values()])
            for key, _ in self._selector.select(timeout=max(0.0, wake - now)):
                if key.fileobj is self._listener:
                    if not self._accept():
                        return None
                    continue
                visitor = self._visitors.get(key.fileobj)  # type: ignore[call-overload]
                if visitor is None:
                    continue
                frame = self._read(visitor)
                if frame is not _NOTHING:
                    return visitor, frame

    def reply(self, visitor: Visitor, obj: Any) -> bool:
        """Send one frame to ``visitor`` (a few hundred bytes: fits the socket buffer); False if it failed."""
        try:
            visitor.sock.setblocking(True)
            visitor.sock.settimeout(1.0)
            visitor.sock.sendall(encode_json(obj))
        except OSError as e:
            self.drop(visitor, f"could not answer it: {e}")
            return False
        finally:
            if visitor.sock in self._visitors:
                visitor.sock.setblocking(False)
        visitor.deadline = time.monotonic() + STRANGER_DEADLINE_S
        return True

    def keep(self, visitor: Visitor) -> socket.socket:
        """Take ``visitor`` out of the lobby: its socket, blocking again (unread bytes: ``leftover()``)."""
        self._selector.unregister(visitor.sock)
        del self._visitors[visitor.sock]
        visitor.sock.setblocking(True)
        visitor.on_drop = None
        return visitor.sock

    def drop(self, visitor: Visitor, reason: str, level: int = logging.DEBUG) -> None:
        """Close ``visitor``'s connection and log why (at DEBUG unless told otherwise)."""
        if visitor.sock in self._visitors:
            self._selector.unregister(visitor.sock)
            del self._visitors[visitor.sock]
        visitor.sock.close()
        if visitor.on_drop is not None:
            on_drop, visitor.on_drop = visitor.on_drop, None
            on_drop()
        logger.log(level, "%s: dropped a connection from %s: %s", self._what, visitor.address, reason)

    def adopt(self, sock: socket.socket, address: str, state: str, leftover: bytes = b"") -> Visitor:
        """Read ``sock``, taken from another lobby, frame by frame here (``leftover``: bytes already read)."""
        sock.setblocking(False)
        visitor = Visitor(sock, address, time.monotonic() + STRANGER_DEADLINE_S, state)
        visitor._buffer += leftover
        self._visitors[sock] = visitor
        self._selector.register(sock, selectors.EVENT_READ)
        return visitor

    def close(self) -> None:
        """Drop every visitor still in the lobby (the listener stays open)."""
        for visitor in list(self._visitors.values()):
            self.drop(visitor, f"still {visitor.state} when the rendezvous was over")
        self._selector.close()

    # ------------------------------------------------------------- internals
    def _accept(self) -> bool:
        """Take one connection in; False if the listener was shut down (it is watched no more)."""
        try:
            sock, addr = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as e:
            if e.errno == errno.EINVAL:  # shut down (the owner is closing): readable for ever
                self._selector.unregister(self._listener)
                self.shut = True
                return False
            logger.debug("%s: accept failed: %s", self._what, e)  # e.g. ECONNABORTED: it left first
            return True
        address = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        try:
            sock.setblocking(False)
            tune_socket(sock)
        except OSError as e:
            sock.close()
            logger.debug("%s: dropped a connection from %s: %s", self._what, address, e)
            return True
        visitor = Visitor(sock, address, time.monotonic() + STRANGER_DEADLINE_S)
        self._visitors[sock] = visitor
        self._selector.register(sock, selectors.EVENT_READ)
        if len(self._visitors) > MAX_PENDING:
            oldest = next(iter(self._visitors.values()))
            self.drop(oldest, f"more than {MAX_PENDING} connections at once; the oldest goes")
        return True

    def _read(self, visitor: Visitor) -> Any:
        try:
            data = visitor.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return _NOTHING
        except OSError as e:
            self.drop(visitor, f"connection error: {e}")
            return _NOTHING
        if not data:
            self.drop(visitor, f"closed the connection after {len(visitor._buffer)} bytes")
            return _NOTHING
        visitor._buffer += data
        return self._frame(visitor)

    def _frame(self, visitor: Visitor) -> Any:
        buffer = visitor._buffer
        if len(buffer) < _HEADER.size:
            return _NOTHING
        (length,) = _HEADER.unpack_from(buffer)
        if length > self._limit:
            self.drop(
                visitor,
                f"its frame header announces {length} bytes, more than the {self._limit} a commlib "
                f"rank sends here (first bytes: {bytes(buffer[:16])!r})",
            )
            return _NOTHING
        if len(buffer) < _HEADER.size + length:
            return _NOTHING
        body = bytes(buffer[_HEADER.size : _HEADER.size + length])
        del buffer[: _HEADER.size + length]
        try:
            return json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
            self.drop(visitor, f"sent {length} bytes that are not a JSON frame ({body[:32]!r})")
            return _NOTHING

    def _expire(self, now: float) -> None:
        for visitor in [v for v in self._visitors.values() if v.deadline <= now]:
            self.drop(
                visitor,
                f"sent no complete frame within {STRANGER_DEADLINE_S:g} s "
                f"({len(visitor._buffer)} bytes received; state {visitor.state})",
            )


_NOTHING = object()
