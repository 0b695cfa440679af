"""Doorbells: counters in shared memory that one rank advances and its neighbour waits on.

Two neighbours on one host share a control block (64-bit words, each on its
own cache line). Each end of a link owns one counter and one sleep flag:

- ``advance()`` stores the new count, then, if the other end has flagged that it
  sleeps, writes it one wake byte (``W``): into the other end's wake pipe (a
  FIFO both ends opened) where there is one, else over the TCP connection
  between them (a pipe write costs the poster a few microseconds, a TCP send
  several times that);
- ``wait_for(target)`` returns as soon as the other end's counter reaches
  ``target``. It polls the counter for up to the spin window, then raises its
  sleep flag, checks the counter once more and sleeps in the kernel (``poll``
  on its wake pipe and the socket) until a wake byte, an abort or end-of-file
  arrives.

Where stores can pass one another (not x86-64), ``advance`` fences the data a
count announces before the count. With a full fence between each side's store
and load (``backends.ring.shm.fence``), at least one of the two sees the other's
store, so a sleeper is always woken: the waiter either sees the new count or the
poster sees its flag. Sleeps are also cut into periods of at most
``_SLEEP_PERIOD_S``, after which the waiter looks at the counter again; that
bounds the cost of a lost wake-up on an architecture where the fence is weaker,
and an idle rank still wakes only a few times a second.

The socket stays the channel for failures: an abort frame (``X`` + length +
reason) or end-of-file (the peer's process ended) wakes the waiter with a
``PeerFailureError``, and the group's timeout bounds every wait.
"""

from __future__ import annotations

import os
import select
import struct
import time

from backends.ring.shm import STORES_NEED_FENCE, fence
from backends.ring.wire import SocketReader
from commlib.errors import CommError, CommTimeoutError, PeerFailureError

__all__ = ["Doorbell", "WAKE", "ABORT", "abort_frame"]

WAKE = ord("W")
ABORT = ord("X")
_U32 = struct.Struct("!I")
_SLEEP_PERIOD_S = 0.05
_WAKE_BYTE = bytes([WAKE])


def abort_frame(reason: str) -> bytes:
    """The bytes of an abort frame carrying ``reason``."""
    payload = reason.encode()[:4000]
    return bytes([ABORT]) + _U32.pack(len(payload)) + payload


class Doorbell:
    """One end of a link's pair of counters.

    Args:
        words: The control block, as native 64-bit words.
        mine: Index of the counter this end advances.
        theirs: Index of the counter the other end advances.
        my_flag: Index of this end's sleep flag.
        their_flag: Index of the other end's sleep flag.
        reader: Buffered reader of the socket to the other end (aborts and
            end-of-file arrive on it, and wake bytes without wake pipes; its
            timeout bounds every wait).
        spin_s: Seconds to poll before sleeping.
        wake_in: Non-blocking descriptor of this end's wake pipe (-1: none).
        wake_out: Non-blocking descriptor of the other end's wake pipe (-1: none).
    """

    def __init__(
        self,
        words: memoryview,
        *,
        mine: int,
        theirs: int,
        my_flag: int,
        their_flag: int,
        reader: SocketReader,
        spin_s: float,
        wake_in: int = -1,
        wake_out: int = -1,
    ) -> None:
        self._words = words
        self._mine, self._theirs = mine, theirs
        self._my_flag, self._their_flag = my_flag, their_flag
        self._reader = reader
        self._sock = reader.sock
        self.spin_s = spin_s
        self.count = int(words[mine])
        self.sleeps = 0
        """Waits that outlasted the spin window and slept in the kernel (a diagnostic)."""
        self._wake_in, self._wake_out = wake_in, wake_out
        self._socket_poller = select.poll()
        self._socket_poller.register(self._sock, select.POLLIN)
        self._poller = select.poll()
        self._poller.register(self._sock, select.POLLIN)
        if wake_in >= 0:
            self._poller.register(wake_in, select.POLLIN)

    @property
    def peer_count(self) -> int:
        """The other end's counter as last stored."""
        return int(self._words[self._theirs])

    def advance(self) -> None:
        """Add one to this end's counter and wake the other end if it sleeps."""
        self.count += 1
        words = self._words
        if STORES_NEED_FENCE:
            fence()  # the data this count announces is visible before the count
        words[self._mine] = self.count
        fence()  # the count is visible before the flag is read
        if words[self._their_flag]:
            try:
                if self._wake_out >= 0:
                    os.write(self._wake_out, _WAKE_BYTE)
                else:
                    self._sock.send(_WAKE_BYTE)
            except OSError:
                pass  # a full pipe already holds a wake byte; a closed socket: the other end is gone

    def wait_for(self, target: int, what: str) -> None:
        """Return once the other end's counter is at least ``target``.

        Raises:
            PeerFailureError: The other end aborted or closed the connection.
            CommTimeoutError: Nothing arrived within the socket's timeout.
        """
        words, theirs = self._words, self._theirs
        if words[theirs] >= target:
            return
        deadline = time.perf_counter() + self.spin_s
        while words[theirs] < target:
            if time.perf_counter() >= deadline:
                self._sleep_until(target, what)
                return

    def _sleep_until(self, target: int, what: str) -> None:
        words, theirs, flag = self._words, self._theirs, self._my_flag
        self.sleeps += 1
        timeout = self._sock.gettimeout()
        start = time.monotonic()
        try:
            while True:
                words[flag] = 1
                fence()  # the flag is visible before the counter is read
                if words[theirs] >= target:
                    return
                self._drain(target, timeout, start, what)
                if words[theirs] >= target:
                    return
        finally:
            words[flag] = 0

    def _drain(self, target: int, timeout: float | None, start: float, what: str) -> None:
        """Sleep until the socket has something (or a period passes), then consume wake bytes.

        The counter is checked before each byte is read: a peer that posts,
        then aborts or exits, has its message taken before its failure.
        """
        reader = self._reader
        if not reader.buffered():
            period = _SLEEP_PERIOD_S
            if timeout is not None:
                left = timeout - (time.monotonic() - start)
                if left <= 0:
                    raise CommTimeoutError(
                        f"timed out after {timeout:.1f} s waiting for {reader.describe} ({what}); "
                        "it may be stuck, slower, or calling a different collective"
                    )
                period = min(period, left)
            ready = self._poller.poll(period * 1000.0)
            if not ready:
                return
            if self._wake_in >= 0 and any(fd == self._wake_in for fd, _ in ready):
                self._empty_wake_pipe()
        # On the socket: wake bytes (without pipes), an abort, or end-of-file.
        words, theirs = self._words, self._theirs
        while words[theirs] < target and (reader.buffered() or self._readable()):
            kind = reader.read_byte(what)
            if kind == ABORT:
                (length,) = _U32.unpack(reader.read_exact(_U32.size, what))
                reason = reader.read_exact(length, what).decode(errors="replace")
                raise PeerFailureError(f"{reader.describe} aborted the collective ({what}): {reason}")
            if kind != WAKE:
                raise CommError(
                    f"protocol error from {reader.describe} ({what}): unexpected byte {kind!r} on a "
                    "shared-memory link"
                )

    def peer_left(self) -> bool:
        """True if an abort or the end of the connection waits on the socket; never blocks.

        The wait that reads it raises. Wake bytes before it are consumed: they wake no one now.
        """
        reader = self._reader
        if not (reader.buffered() or self._readable()):
            return False
        try:
            while True:  # what one read brought at most: a peer that keeps writing cannot hold it
                if reader.peek_byte("a look for a closed link") != WAKE:  # reads only if readable
                    return True
                reader.read_byte("a wake-up")
                if not reader.buffered():
                    return False
        except PeerFailureError:  # the end of the connection, or a reset
            return True

    def _empty_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_in, 4096):
                pass
        except BlockingIOError:
            pass

    def _readable(self) -> bool:
        return bool(self._socket_poller.poll(0))
