"""The diagnosis side channel: a small TCP hub on rank 0 that every rank of a group joins.

It carries what the ranks say about their collectives (fingerprints, progress),
never the collectives' data, so it stays in step when the data path does not.
Rank 0 serves it on a thread of its own; its address and a random token travel
once, at group creation, with one broadcast over the backend.

Wire protocol. Every message is a frame: ``!BI`` (type, payload length), then
the payload (at most ``MAX_PAYLOAD`` bytes). A rank opens a connection per role
and starts it with a hello frame (``H``): ``!4sB16siiB`` = magic ``CLDG``,
protocol version, the group's 16-byte token, rank, world size, role (``0``:
calls, used by the thread that issues collectives; ``1``: control, served by the
rank's watchdog thread). The hub answers ``W`` (welcome), or closes the
connection. Anything else (garbage, a wrong token or rank, a rank that joined
already, silence for ``HELLO_DEADLINE_S``, a huge length) is dropped on its own
and logged at DEBUG; it never disturbs the ranks that joined.

Calls connection:

- ``F`` rank -> hub: the fingerprint of the rank's next collective. Once every
  rank has sent its next one, the hub sends each rank ``V``: all of them, in rank order.
- ``X`` hub -> rank: a rank left the channel while this rank waits for a verdict (text).

Control connection:

- ``Q`` rank -> hub: "where is everybody?". The hub sends every rank ``S``; each
  answers ``P`` (its progress, JSON). Once all have answered, or after
  ``answer_s``, every rank that asked gets ``R``: JSON ``{rank: progress}``,
  with ``{"absent": reason}`` for the ranks that did not answer.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import selectors
import socket
import struct
import threading
import time
from collections import deque
from typing import Any

from commlib.errors import CommError, CommTimeoutError, PeerFailureError

__all__ = [
    "FrameReader",
    "HELLO_DEADLINE_S",
    "SideChannelClient",
    "SideChannelHub",
    "hub_host",
    "read_frame",
    "send_frame",
]

logger = logging.getLogger("commlib")

MAGIC = b"CLDG"
VERSION = 1
HELLO = struct.Struct("!4sB16siiB")
FRAME = struct.Struct("!BI")
MAX_PAYLOAD = 1 << 20
HELLO_DEADLINE_S = 2.0
"""Seconds a new connection has to say who it is before the hub drops it."""

ROLE_CALLS = 0
ROLE_CONTROL = 1
_ROLE_NAMES = {ROLE_CALLS: "calls", ROLE_CONTROL: "control"}

T_HELLO = ord("H")
T_WELCOME = ord("W")
T_FINGERPRINT = ord("F")
T_VERDICT = ord("V")
T_LEFT = ord("X")
T_QUERY = ord("Q")
T_STATUS = ord("S")
T_PROGRESS = ord("P")
T_REPORT = ord("R")

_SEND_TIMEOUT_S = 5.0
"""Bound on one send from the hub: a rank that stops reading is treated as gone."""


def send_frame(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    """Send one frame (the caller serialises writers of ``sock``)."""
    sock.sendall(FRAME.pack(kind, len(payload)) + payload)


class FrameReader:
    """Cut a byte stream into frames, as the bytes arrive."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Add ``data``; return the frames it completed.

        Raises:
            ValueError: A frame announces more than ``MAX_PAYLOAD`` bytes.
        """
        self._buffer += data
        frames = []
        while len(self._buffer) >= FRAME.size:
            kind, length = FRAME.unpack_from(self._buffer)
            if length > MAX_PAYLOAD:
                raise ValueError(f"frame of {length} bytes announced (at most {MAX_PAYLOAD})")
            end = FRAME.size + length
            if len(self._buffer) < end:
                break
            frames.append((kind, bytes(self._buffer[FRAME.size : end])))
            del self._buffer[:end]
        return frames


def _recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{got}/{size} bytes before the deadline")
        sock.settimeout(remaining)
        chunk = sock.recv(size - got)
        if not chunk:
            raise ConnectionError(f"connection closed after {got}/{size} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, deadline: float) -> tuple[int, bytes]:
    """Read one frame, waiting until ``deadline`` (``time.monotonic()``).

    Raises:
        TimeoutError: The deadline passed first.
        ConnectionError: The connection closed.
        ValueError: The frame is larger than ``MAX_PAYLOAD``.
    """
    kind, length = FRAME.unpack(_recv_exact(sock, FRAME.size, deadline))
    if length > MAX_PAYLOAD:
        raise ValueError(f"frame of {length} bytes announced (at most {MAX_PAYLOAD})")
    return kind, _recv_exact(sock, length, deadline) if length else b""


def hub_host(master_addr: str, single_host: bool) -> str:
    """Return the address rank 0 serves the hub on, as the other ranks will reach it.

    ``master_addr`` when it is not a loopback address: every rank reached rank 0
    there for the rendezvous, wherever it runs (ranks given explicitly carry no
    placement, so "one host" cannot be told from them). A loopback
    ``master_addr`` on one host: loopback. A loopback ``master_addr`` across
    hosts: the address of this host's name.
    """
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(master_addr)).is_loopback
    except (OSError, ValueError):
        loopback = master_addr == "localhost"
    if not loopback:
        return master_addr
    if single_host:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return master_addr


class _Query:
    """One round of "where is everybody?": who asked, who answered, until when."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.askers: set[int] = set()
        self.answers: dict[int, Any] = {}


class SideChannelHub:
    """The hub, served by rank 0 on a daemon thread.

    Args:
        world_size: Ranks in the group.
        host: Address to listen on (``hub_host``); the port is chosen by the system.
        token: The group's 16-byte secret; a connection must present it.
        answer_s: How long the hub waits for the ranks' progress answers.
        name: Names the thread and the log lines.
    """

    def __init__(
        self, world_size: int, host: str, token: bytes, *, answer_s: float = 2.0, name: str = "group"
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=max(16, 2 * world_size))
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._world = world_size
        self._token = token
        self._answer_s = answer_s
        self._name = name
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._listener, selectors.EVENT_READ, ("listener", None))
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._strangers: dict[socket.socket, tuple[float, FrameReader, str]] = {}
        self._calls: list[socket.socket | None] = [None] * world_size
        self._controls: list[socket.socket | None] = [None] * world_size
        self._readers: dict[socket.socket, FrameReader] = {}
        self._joined: set[tuple[int, int]] = set()
        self._queued: list[deque[bytes]] = [deque() for _ in range(world_size)]
        self._left: dict[int, str] = {}
        self._query: _Query | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=f"commlib-hub-{name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close every connection (the ranks see them close)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5.0)
        for sock in [*self._strangers, *filter(None, self._calls), *filter(None, self._controls)]:
            with contextlib.suppress(OSError):
                sock.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        self._selector.close()

    # ---------------------------------------------------------------- the loop
    def _serve(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._selector.select(self._next_timeout()):
                    what, rank = key.data
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if what == "listener":
                        self._accept()
                    elif what == "wake":
                        return
                    elif what == "stranger":
                        self._from_stranger(sock)
                    else:
                        self._from_rank(sock, what, rank)
                self._expire(time.monotonic())
        except Exception:  # noqa: BLE001 - a diagnosis aid must never take the job down
            logger.exception("commlib side-channel hub (%s) stopped", self._name)

    def _next_timeout(self) -> float:
        deadlines = [d for d, _, _ in self._strangers.values()]
        if self._query is not None:
            deadlines.append(self._query.deadline)
        if not deadlines:
            return 1.0
        return max(0.0, min(min(deadlines) - time.monotonic(), 1.0))

    def _expire(self, now: float) -> None:
        for sock, (deadline, _, peer) in list(self._strangers.items()):
            if now >= deadline:
                self._drop(sock, peer, f"said nothing valid within {HELLO_DEADLINE_S:g} s")
        if self._query is not None and now >= self._query.deadline:
            self._answer_query()

    def _accept(self) -> None:
        try:
            sock, address = self._listener.accept()
        except OSError:
            return
        sock.settimeout(_SEND_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = f"{address[0]}:{address[1]}"
        self._strangers[sock] = (time.monotonic() + HELLO_DEADLINE_S, FrameReader(), peer)
        self._selector.register(sock, selectors.EVENT_READ, ("stranger", None))

    def _drop(self, sock: socket.socket, peer: str, why: str) -> None:
        logger.debug("commlib side-channel hub (%s): dropped connection from %s: %s", self._name, peer, why)
        self._strangers.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _from_stranger(self, sock: socket.socket) -> None:
        _, reader, peer = self._strangers[sock]
        try:
            data = sock.recv(4096)
        except OSError as e:
            self._drop(sock, peer, f"{type(e).__name__}: {e}")
            return
        if not data:
            self._drop(sock, peer, "closed before saying who it is")
            return
        try:
            frames = reader.feed(data)
        except ValueError as e:
            self._drop(sock, peer, str(e))
            return
        if not frames:
            return
        kind, payload = frames[0]
        problem = self._check_hello(kind, payload)
        if problem is not None:
            self._drop(sock, peer, problem)
            return
        _, _, _, rank, _, role = HELLO.unpack(payload)
        del self._strangers[sock]
        self._joined.add((rank, role))
        self._readers[sock] = reader
        slots = self._calls if role == ROLE_CALLS else self._controls
        slots[rank] = sock
        self._selector.modify(sock, selectors.EVENT_READ, (_ROLE_NAMES[role], rank))
        self._send(rank, sock, T_WELCOME)

    def _check_hello(self, kind: int, payload: bytes) -> str | None:
        if kind != T_HELLO or len(payload) != HELLO.size:
            return f"first frame is type {kind} with {len(payload)} bytes, not a hello"
        magic, version, token, rank, world, role = HELLO.unpack(payload)
        if magic != MAGIC:
            return f"wrong magic {magic!r}"
        if version != VERSION:
            return f"protocol version {version}, this hub speaks {VERSION}"
        if not hmac.compare_digest(token, self._token):
            return "wrong token (another job or group)"
        if world != self._world or not 0 <= rank < world or role not in _ROLE_NAMES:
            return f"rank {rank} of {world}, role {role}: not a rank of this group of {self._world}"
        if (rank, role) in self._joined:
            return f"rank {rank} joined as {_ROLE_NAMES[role]} already"
        return None

    def _send(self, rank: int, sock: socket.socket, kind: int, payload: bytes = b"") -> bool:
        try:
            send_frame(sock, kind, payload)
        except OSError as e:
            self._lost(sock, rank, f"sending to it failed ({type(e).__name__}: {e})")
            return False
        return True

    def _from_rank(self, sock: socket.socket, role: str, rank: int) -> None:
        try:
            data = sock.recv(65536)
        except OSError as e:
            self._lost(sock, rank, f"its connection failed ({type(e).__name__}: {e})")
            return
        if not data:
            self._lost(sock, rank, "it closed its connection (exited, crashed or closed the group)")
            return
        try:
            frames = self._readers[sock].feed(data)
        except ValueError as e:
            self._lost(sock, rank, f"it sent a bad frame ({e})")
            return
        for kind, payload in frames:
            if role == "calls" and kind == T_FINGERPRINT:
                self._queued[rank].append(payload)
                self._match()
            elif role == "control" and kind == T_QUERY:
                self._ask(rank)
            elif role == "control" and kind == T_PROGRESS and self._query is not None:
                try:
                    self._query.answers[rank] = json.loads(payload)
                except ValueError:
                    self._query.answers[rank] = {"absent": "sent a progress report that is not JSON"}
                if len(self._query.answers) == self._world:
                    self._answer_query()

    def _lost(self, sock: socket.socket, rank: int, why: str) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()
        self._readers.pop(sock, None)
        if self._calls[rank] is sock:
            self._calls[rank] = None
            self._left.setdefault(rank, why)
            self._match()
        if self._controls[rank] is sock:
            self._controls[rank] = None
            if self._query is not None and rank not in self._query.answers:
                self._query.answers[rank] = {"absent": why}
                if len(self._query.answers) == self._world:
                    self._answer_query()

    # ---------------------------------------------------------- fingerprints
    def _match(self) -> None:
        queued = self._queued
        while all(queued):
            verdict = b"".join(q.popleft() for q in queued)
            for rank, sock in enumerate(self._calls):
                if sock is not None:
                    self._send(rank, sock, T_VERDICT, verdict)
        if self._left:
            text = "; ".join(f"rank {r}: {why}" for r, why in sorted(self._left.items()))
            message = f"ranks left the group's side channel: {text}".encode()
            for rank, sock in enumerate(self._calls):
                if sock is not None and queued[rank]:
                    queued[rank].clear()
                    self._send(rank, sock, T_LEFT, message)

    # -------------------------------------------------------------- progress
    def _ask(self, rank: int) -> None:
        if self._query is None:
            self._query = _Query(time.monotonic() + self._answer_s)
            for r, sock in enumerate(self._controls):
                if sock is None:
                    self._query.answers[r] = {"absent": self._why_silent(r)}
                else:
                    self._send(r, sock, T_STATUS)
        self._query.askers.add(rank)
        if self._query is not None and len(self._query.answers) == self._world:
            self._answer_query()

    def _why_silent(self, rank: int) -> str:
        if rank in self._left:
            return self._left[rank]
        if (rank, ROLE_CALLS) in self._joined:
            return "it runs without stall reports (COMMLIB_STALL_S=0)"
        return "it never joined the side channel"

    def _answer_query(self) -> None:
        query, self._query = self._query, None
        if query is None:
            return
        for r in range(self._world):
            query.answers.setdefault(
                r,
                {
                    "absent": f"no answer within {self._answer_s:g} s (unreachable, hung, or busy in "
                    "native code that holds Python's GIL)"
                },
            )
        report = json.dumps({str(r): v for r, v in query.answers.items()}).encode()
        for r in sorted(query.askers):
            sock = self._controls[r]
            if sock is not None:
                self._send(r, sock, T_REPORT, report)


class SideChannelClient:
    """One rank's connections to the hub.

    Args:
        host: The hub's address.
        port: The hub's port.
        token: The group's token.
        rank: This rank.
        world_size: Ranks in the group.
        control: Also open the control connection (for stall reports).
        timeout: Seconds to connect and be welcomed.
        prefix: ``[rank R/N] backend.op: `` for messages.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: bytes,
        rank: int,
        world_size: int,
        *,
        control: bool,
        timeout: float,
        prefix: str,
    ) -> None:
        self._address = (host, port)
        self._token = token
        self._rank = rank
        self._world = world_size
        self._prefix = prefix
        self._lock = threading.Lock()
        self._broken: str | None = None
        self.calls = self._join(ROLE_CALLS, timeout)
        self.control: socket.socket | None = None
        try:
            if control:
                self.control = self._join(ROLE_CONTROL, timeout)
        except BaseException:
            self.calls.close()
            raise

    def _join(self, role: int, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        where = f"{self._address[0]}:{self._address[1]}"
        try:
            sock = socket.create_connection(self._address, timeout=timeout)
        except OSError as e:
            raise CommError(
                f"{self._prefix}cannot reach rank 0's diagnosis side channel at {where}: {e}"
            ) from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = HELLO.pack(MAGIC, VERSION, self._token, self._rank, self._world, role)
            send_frame(sock, T_HELLO, hello)
            kind, _ = read_frame(sock, deadline)
            if kind != T_WELCOME:
                raise ValueError(f"answered with frame type {kind}")
        except (OSError, ValueError) as e:
            sock.close()
            raise CommError(
                f"{self._prefix}rank 0's diagnosis side channel at {where} did not welcome this rank "
                f"({_ROLE_NAMES[role]} connection): {type(e).__name__}: {e}"
            ) from e
        sock.settimeout(None)
        return sock

    def exchange(self, fingerprint: bytes, timeout: float, label: object, background: bool = False) -> bytes:
        """Send this rank's fingerprint; return every rank's, concatenated in rank order.

        Args:
            fingerprint: This rank's packed fingerprint.
            timeout: Seconds to wait for the other ranks' fingerprints.
            label: The collective, for messages.
            background: Unused: the wait sleeps in the kernel either way.

        Raises:
            CommTimeoutError: Not every rank sent its fingerprint within ``timeout``.
            PeerFailureError: A rank left the channel, or the hub went away.
        """
        with self._lock:
            if self._broken is not None:
                raise CommError(f"{label}: the diagnosis side channel is unusable: {self._broken}")
            try:
                self.calls.settimeout(timeout)
                send_frame(self.calls, T_FINGERPRINT, fingerprint)
                kind, payload = read_frame(self.calls, time.monotonic() + timeout)
            except TimeoutError as e:
                self._broken = f"a fingerprint exchange timed out after {timeout:g} s"
                raise CommTimeoutError(
                    f"{label}: not every rank reached this collective within {timeout:g} s "
                    "(the stall warnings on the 'commlib' logger name the ranks missing); a rank is "
                    "stuck, dead, or issued fewer collectives. Raise COMMLIB_TIMEOUT if the peers are "
                    "just slow."
                ) from e
            except (OSError, ValueError) as e:
                self._broken = f"{type(e).__name__}: {e}"
                raise PeerFailureError(
                    f"{label}: lost the diagnosis side channel to rank 0 ({type(e).__name__}: {e}); "
                    "rank 0 exited, crashed or closed the group"
                ) from e
            if kind == T_LEFT:
                self._broken = payload.decode(errors="replace")
                raise PeerFailureError(f"{label}: {self._broken}; every rank must create a new group")
            if kind != T_VERDICT:
                self._broken = f"unexpected frame type {kind} from the hub"
                raise CommError(f"{label}: {self._broken}")
            return payload

    def close(self) -> None:
        """Close both connections."""
        for sock in (self.calls, self.control):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
