"""Socket plumbing for the ring backend: buffered reads with deadlines, JSON control frames, connects.

Kept free of any collective logic so it can be tested over ``socket.socketpair``.
"""

from __future__ import annotations

import errno
import json
import select
import socket
import struct
import time
from typing import Any

from commlib.errors import CommTimeoutError, PeerFailureError

__all__ = [
    "SocketReader",
    "encode_json",
    "send_json",
    "recv_json",
    "connect_with_retry",
    "is_self_connected",
    "tune_socket",
    "PeerClosed",
]

_JSON_HEADER = struct.Struct("!I")
_MAX_JSON_BYTES = 16 * 1024 * 1024
_RETRY_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
    }
)


class PeerClosed(PeerFailureError):
    """The peer closed the connection (its process ended, or it closed the group)."""

    def __init__(self, message: str, received: int, expected: int) -> None:
        super().__init__(message)
        self.received = received
        self.expected = expected


def tune_socket(sock: socket.socket) -> None:
    """Disable Nagle's algorithm and ask for large buffers (bulk transfers, tiny tokens)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 1024 * 1024)
        except OSError:
            pass


class SocketReader:
    """Buffered reader over a blocking socket whose ``settimeout`` bounds every wait.

    Small reads (1-byte tokens, headers) come from an internal buffer filled
    with one ``recv`` of whatever is available; large reads go straight into
    the caller's memory with ``recv_into``.

    Args:
        sock: Connected socket with a timeout set.
        describe: Names the peer for messages, e.g. ``"rank 1 (left neighbour)"``.
        spin_s: Seconds to poll without blocking before each wait in the kernel.
        initial: Bytes already read from ``sock`` by its previous owner; they are read first.
    """

    def __init__(self, sock: socket.socket, describe: str, spin_s: float = 0.0, initial: bytes = b"") -> None:
        self.sock = sock
        self.describe = describe
        self.spin_s = spin_s
        self._buf = bytearray(initial)  # bytes read from ``sock`` before this reader took it over
        self._pos = 0
        self._poller: select.poll | None = None

    def _poll(self, size: int) -> bytes | None:
        """Try non-blocking reads for up to ``spin_s`` before the caller blocks in the kernel.

        A peer in the middle of the same collective answers within microseconds;
        blocking would hand the core to another process and wait a scheduler
        slice to get it back.
        """
        # A socket with a timeout waits for readability before any recv, MSG_DONTWAIT or not:
        # poll it instead, and read once something is there.
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.sock, select.POLLIN)
        poll = self._poller.poll
        deadline = time.perf_counter() + self.spin_s
        while not poll(0):
            if time.perf_counter() >= deadline:
                return None
        return self.sock.recv(size)

    def buffered(self) -> int:
        """Number of bytes already read from the socket but not consumed."""
        return len(self._buf) - self._pos

    def _fill(self, what: str, need: int) -> None:
        try:
            data = self._poll(max(65536, need)) if self.spin_s > 0 else None
            if data is None:
                data = self.sock.recv(max(65536, need))
        except TimeoutError:
            raise CommTimeoutError(
                f"timed out after {self.sock.gettimeout():.1f} s waiting for {self.describe} ({what}); "
                "it may be stuck, slower, or calling a different collective"
            ) from None
        except OSError as e:
            raise PeerClosed(
                f"{self.describe} reset the connection ({what}): {e}", self.buffered(), need
            ) from e
        if not data:
            raise PeerClosed(
                f"{self.describe} closed the connection ({what}; got {self.buffered()}/{need} bytes): "
                "its process ended or it closed the group",
                self.buffered(),
                need,
            )
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def read_exact(self, n: int, what: str) -> bytes:
        """Return exactly ``n`` bytes."""
        while self.buffered() < n:
            self._fill(what, n)
        start = self._pos
        self._pos += n
        out = bytes(self._buf[start : self._pos])
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        return out

    def peek_byte(self, what: str) -> int:
        """Return the next byte without consuming it (waits for it as ``read_byte`` does)."""
        if self._pos >= len(self._buf):
            self._fill(what, 1)
        return self._buf[self._pos]

    def read_byte(self, what: str) -> int:
        """Return one byte (a token)."""
        if self._pos >= len(self._buf):
            self._fill(what, 1)
        value = self._buf[self._pos]
        self._pos += 1
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        return value

    def readinto_exact(self, view: memoryview, what: str) -> None:
        """Fill ``view`` (a byte memoryview) completely."""
        total = len(view)
        got = min(self.buffered(), total)
        if got:
            view[:got] = self._buf[self._pos : self._pos + got]
            self._pos += got
            if self._pos == len(self._buf):
                self._buf.clear()
                self._pos = 0
        while got < total:
            try:
                n = self.sock.recv_into(view[got:], total - got)
            except TimeoutError:
                raise CommTimeoutError(
                    f"timed out after {self.sock.gettimeout():.1f} s waiting for {self.describe} "
                    f"({what}; got {got}/{total} bytes)"
                ) from None
            except OSError as e:
                raise PeerClosed(
                    f"{self.describe} reset the connection ({what}) after {got}/{total} bytes: {e}",
                    got,
                    total,
                ) from e
            if n == 0:
                raise PeerClosed(
                    f"{self.describe} closed the connection after {got}/{total} bytes ({what}): "
                    "its process ended or it closed the group",
                    got,
                    total,
                )
            got += n


def encode_json(obj: Any) -> bytes:
    """Return ``obj`` as one length-prefixed JSON control frame."""
    payload = json.dumps(obj, separators=(",", ":")).encode()
    return _JSON_HEADER.pack(len(payload)) + payload


def send_json(sock: socket.socket, obj: Any) -> None:
    """Send one length-prefixed JSON control frame."""
    sock.sendall(encode_json(obj))


def recv_json(reader: SocketReader, what: str, limit: int = _MAX_JSON_BYTES) -> Any:
    """Receive one control frame sent by ``send_json``.

    Raises:
        PeerFailureError: The frame is longer than ``limit`` bytes or is not JSON
            (the peer is not a commlib rank).
    """
    (length,) = _JSON_HEADER.unpack(reader.read_exact(_JSON_HEADER.size, what))
    if length > limit:
        raise PeerFailureError(
            f"{reader.describe} sent a {length}-byte control frame ({what}); expected a commlib peer. "
            "Is another program listening on this port?"
        )
    body = reader.read_exact(length, what)
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        raise PeerFailureError(
            f"{reader.describe} sent {length} bytes that are not a JSON control frame ({what}: "
            f"{body[:32]!r}); expected a commlib peer. Is another program listening on this port?"
        ) from None


def connect_with_retry(addr: str, port: int, deadline: float, what: str) -> socket.socket:
    """Connect to ``addr:port``, retrying while the listener is not up yet, until ``deadline``.

    Raises:
        TimeoutError: No connection by the deadline; the message names the last error.
    """
    last: OSError | None = None
    delay = 0.005
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = f"{last.strerror or last}" if last else "no answer"
            raise TimeoutError(f"could not connect to {what} at {addr}:{port}: {reason}")
        try:
            sock = socket.create_connection((addr, port), timeout=min(remaining, 5.0))
        except OSError as e:
            if isinstance(e, socket.gaierror):
                raise
            if e.errno not in _RETRY_ERRNOS and not isinstance(e, TimeoutError):
                raise
            last = e
        else:
            if not is_self_connected(sock):
                tune_socket(sock)
                return sock
            # Nothing listens yet and the kernel gave this connect the destination port as its
            # source: TCP's simultaneous open joined the socket to itself. Dropping it frees the
            # port for the listener.
            sock.close()
            last = ConnectionRefusedError(
                errno.ECONNREFUSED, f"connected to itself on port {port}; nothing listens there yet"
            )
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.2)


def is_self_connected(sock: socket.socket) -> bool:
    """True if ``sock`` is connected to itself (same address and port at both ends).

    Happens on loopback when a connect to a port nobody listens on is handed that
    same port as its source; the socket then talks to itself.
    """
    try:
        return bool(sock.getsockname() == sock.getpeername())
    except OSError:
        return False
