"""Point-to-point messages over MPI: ``backends.common.p2p_protocol`` driven by MPI's requests.

The protocol (the header, the verdict and its errors, matching in posting
order) is the common one; this module carries it over MPI. Each group keeps
two communicators of its own for point-to-point traffic, duplicates of its
collective one (so no message ever matches a collective's):

- **data**: the sender ``Isend``s a 24-byte header (its ``Layout`` as
  ``LAYOUT``: bytes, elements and dtype code), then the tensor's bytes, both to
  ``(peer, tag)``; MPI keeps them in that order.
- **verdict**: the receiver answers every message it matches with what its
  buffer holds (bytes, elements, dtype code). The sender posts the receive for
  that answer when it sends, and its send completes only when the data has
  left and the answer has come. Same dtype and bytes: both succeed. Otherwise
  both raise, naming both. On success this costs the header and the answer,
  each sent the moment it can be, so both travel while the data does.

A receive is matched by a matched probe (``Improbe``) of the header, before any
byte of the data lands: a message of another dtype or size is drained
(received into an empty buffer, which MPI truncates) and the receiver's tensor
is left untouched. The data is received from the header's source with its
tag, so it is that header's. Matching keeps MPI's order: the group's unmatched
receives (``PostedReceives``) are probed in the order they were posted, and a
header found is handed to the **earliest** posted receive that accepts it (same tag; same
source, or any source), which is exactly the receive MPI itself would have
matched it with. Messages between one pair with one tag therefore arrive in
the order they were sent.

Sends to one ``(peer, tag)`` are posted in the order they were issued, even
when an earlier one still waits for its data (a CUDA tensor being copied to
the host): a later send waits behind it.

An unmatched receive holds no MPI state, so it can be withdrawn at a timeout
and the group stays clean. A send cannot be withdrawn (MPI cannot reliably
cancel a send): at a timeout its message stays queued at the peer, and its
answer, if it ever comes, lands in the abandoned request, so later sends to
the same peer and tag still pair with their own answers.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Protocol

from backends.common.p2p_protocol import LAYOUT, Layout, Mismatch, PostedReceives, fits

__all__ = [
    "DirectPayload",
    "Layout",
    "Mismatch",
    "P2PEngine",
    "Payload",
    "RecvRequest",
    "SendRequest",
    "fits",
]


class Payload(Protocol):
    """The bytes of one message: a host tensor, a device tensor, or a device tensor staged on the host."""

    def ready(self) -> bool:
        """Return True once ``buffer()`` may be handed to MPI (a staged send's data is on the host)."""

    def buffer(self) -> Any:
        """Return MPI's buffer specification of the message's bytes (``[memory, MPI.BYTE]``)."""

    def finish(self) -> None:
        """The message has moved: copy a staged result back, release staging buffers."""

    def abort(self) -> None:
        """The message failed or was drained: release staging buffers, copy nothing back."""


class DirectPayload:
    """Memory MPI reads or writes as it is: a host tensor, or a device tensor for a CUDA-aware MPI."""

    __slots__ = ("_buffer",)

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer

    def ready(self) -> bool:
        """Always ready."""
        return True

    def buffer(self) -> Any:
        """The buffer specification given at construction."""
        return self._buffer

    def finish(self) -> None:
        """Nothing to do."""

    def abort(self) -> None:
        """Nothing to do."""


class SendRequest:
    """One send: the header's and the data's ``Isend`` and the answer's receive, with a request's ``Test``."""

    def __init__(self, engine: P2PEngine, payload: Payload, layout: Layout, peer: int, tag: int) -> None:
        self.peer = peer
        self.tag = tag
        self.layout = layout
        self._engine = engine
        self._payload = payload
        self._header = LAYOUT.pack(*layout)
        self._answer = bytearray(LAYOUT.size)
        self._verdict = engine._verdict_comm.Irecv([self._answer, engine._MPI.BYTE], source=peer, tag=tag)
        self._sent_header: Any = None
        self._data: Any = None
        self._data_done = False
        self._verdict_done = False
        self._done = False

    @property
    def posted(self) -> bool:
        """True once the data's ``Isend`` is posted."""
        return self._data is not None

    def let_go(self, bound_s: float = 1.0) -> bool:
        """Stop waiting for the answer (the group closes); return True if MPI holds nothing of this send.

        Only once the data has left: the answer's receive is then cancelled
        (receives cancel reliably), and a message still queued at the peer is
        the peer's. A send whose data has not left cannot be let go.
        """
        if self._data is None or not (self._data_done or self._data.Test()):
            return False
        if not self._sent_header.Test():
            return False
        if not self._verdict_done:
            self._verdict.Cancel()
            deadline = time.monotonic() + bound_s
            while not self._verdict.Test():
                if time.monotonic() > deadline:
                    return False
        self._done = True
        self._payload.abort()
        return True

    def _post(self) -> None:
        comm, byte = self._engine._data_comm, self._engine._MPI.BYTE
        self._sent_header = comm.Isend([self._header, byte], dest=self.peer, tag=self.tag)
        self._data = comm.Isend(self._payload.buffer(), dest=self.peer, tag=self.tag)

    def Test(self) -> bool:  # noqa: N802 - mpi4py's request method name
        """Advance without blocking; True once the data has left and the answer has come.

        Raises:
            Mismatch: The receiver's buffer has another dtype or size (the message was drained there).
        """
        if self._done:
            return True
        try:
            return self._advance()
        except BaseException:
            self._done = True
            self._payload.abort()
            raise

    def _advance(self) -> bool:
        if self._data is None:
            self._engine._post_sends(self.peer, self.tag)
            if self._data is None:
                return False
        if not self._data_done:
            self._data_done = bool(self._data.Test()) and bool(self._sent_header.Test())
        if not self._verdict_done:
            self._verdict_done = bool(self._verdict.Test())
        if not (self._data_done and self._verdict_done):
            return False
        self._done = True
        holds = LAYOUT.unpack(self._answer)
        if not fits(self.layout, holds):
            raise Mismatch("send", self.peer, self.tag, self.layout, holds)
        self._payload.finish()
        return True


class RecvRequest:
    """One receive: matched in posting order, then received (or drained) and answered.

    ``source`` is the sender's rank once matched (None before).
    """

    def __init__(
        self, engine: P2PEngine, payload: Payload, holds: Layout, source: int | None, tag: int
    ) -> None:
        self.wanted = source
        """The source asked for (None: any)."""
        self.tag = tag
        self.holds = holds
        """Bytes, elements and dtype code of the buffer."""
        self.source: int | None = None
        self.sent: Layout | None = None
        """The matched message's header."""
        self.cancelled = False
        self._engine = engine
        self._payload = payload
        self._reply = LAYOUT.pack(*holds)
        self._fits = False
        self._requests: list[Any] | None = None
        """The data receive (or drain) and the answer's send, once matched."""
        self._done = False

    @property
    def matched(self) -> bool:
        """True once a message was handed to this receive."""
        return self._requests is not None

    def _match(self, header: Any, source: int) -> None:
        """Take the message whose ``header`` was probed (by the engine, under its lock): receive or drain it.

        The header is 24 bytes, already matched, so receiving it does not wait; the data
        that follows it from ``source`` with this tag is its message's.
        """
        engine = self._engine
        MPI = engine._MPI
        layout = bytearray(LAYOUT.size)
        header.Recv([layout, MPI.BYTE])
        self.source, self.sent = source, LAYOUT.unpack(layout)
        self._fits = fits(self.sent, self.holds)
        # A message that does not fit is drained into no memory (MPI truncates; the message is consumed).
        buffer = self._payload.buffer() if self._fits else [bytearray(0), MPI.BYTE]
        data = engine._data_comm.Irecv(buffer, source=source, tag=self.tag)
        answer = engine._verdict_comm.Isend([self._reply, MPI.BYTE], dest=source, tag=self.tag)
        self._requests = [data, answer]

    def Test(self) -> bool:  # noqa: N802 - mpi4py's request method name
        """Advance without blocking; True once the message is in the buffer and answered.

        Raises:
            Mismatch: The message had another dtype or size than this receive's buffer (it was drained).
        """
        if self._done:
            return True
        try:
            return self._advance()
        except BaseException:
            self._done = True
            self._payload.abort()
            raise

    def _advance(self) -> bool:
        if self._requests is None:
            self._engine.match()
            if self._requests is None:
                return False
        data, answer = self._requests
        if data is not None:
            try:
                finished = bool(data.Test())
            except self._engine._MPI.Exception as e:
                if e.Get_error_class() != self._engine._MPI.ERR_TRUNCATE or self._fits:
                    raise
                finished = True  # the drain of a message that does not fit
            if not finished:
                return False
            self._requests[0] = None
        if not answer.Test():
            return False
        self._done = True
        if not self._fits:
            raise Mismatch("recv", self.source, self.tag, self.sent, self.holds)  # type: ignore[arg-type]
        self._payload.finish()
        return True


class P2PEngine:
    """The point-to-point traffic of one group: ordered matching, sends in order, the verdict.

    Args:
        mpi: The ``mpi4py.MPI`` module.
        data_comm: Communicator of the messages (the group's own duplicate).
        verdict_comm: Communicator of the receivers' answers (another duplicate).
    """

    def __init__(self, mpi: Any, data_comm: Any, verdict_comm: Any) -> None:
        self._MPI = mpi
        self._data_comm = data_comm
        self._verdict_comm = verdict_comm
        self._lock = threading.Lock()
        self._posted: PostedReceives[RecvRequest] = PostedReceives()
        """Receives not yet matched, in the order they were posted."""
        self._unposted: dict[tuple[int, int], collections.deque[SendRequest]] = {}
        """Sends whose data is not posted yet, per (peer, tag), in the order they were issued."""
        self._status = mpi.Status()

    @property
    def waiting(self) -> bool:
        """True if some receive waits to be matched (a lock-free read, for hot paths)."""
        return bool(self._posted.pending)

    @property
    def comms(self) -> tuple[Any, Any]:
        """The data and verdict communicators (the group frees them when it closes)."""
        return self._data_comm, self._verdict_comm

    def send(self, payload: Payload, layout: Layout, peer: int, tag: int) -> SendRequest:
        """Send a message of ``layout`` (bytes, elements, dtype code) to ``peer`` with ``tag``.

        It is posted now if the payload is ready, else once it is (behind earlier sends to ``peer``, ``tag``).
        """
        with self._lock:
            request = SendRequest(self, payload, layout, peer, tag)
            queue = self._unposted.setdefault((peer, tag), collections.deque())
            queue.append(request)
            self._post_ready(queue, peer, tag)
        return request

    def recv(self, payload: Payload, holds: Layout, source: int | None, tag: int) -> RecvRequest:
        """Receive from ``source`` (None: any) with ``tag``; matched at once if a message waits.

        ``holds`` (bytes, elements, dtype code of the buffer) is what a message must match,
        and what its sender is told.
        """
        request = RecvRequest(self, payload, holds, source, tag)
        with self._lock:
            self._posted.post(request)
        self.match()
        return request

    def cancel(self, request: RecvRequest) -> bool:
        """Withdraw ``request`` if it is still unmatched (it holds no MPI state then); return True if so."""
        with self._lock:
            if request.matched or not self._posted.withdraw(request):
                return False
            request.cancelled = True
            return True

    def cancel_all(self) -> list[RecvRequest]:
        """Withdraw every unmatched receive (the group is closing); return them."""
        with self._lock:
            withdrawn = self._posted.withdraw_all()
        for request in withdrawn:
            request.cancelled = True
        return withdrawn

    def match(self) -> None:
        """Probe for the unmatched receives in posting order; hand each message to its earliest taker."""
        posted = self._posted
        if not posted.pending:
            return
        MPI, status = self._MPI, self._status
        with self._lock:
            pending, index = posted.pending, 0
            while index < len(pending):
                request = pending[index]
                source = MPI.ANY_SOURCE if request.wanted is None else request.wanted
                message = self._data_comm.Improbe(source, request.tag, status)
                if message is None:
                    index += 1
                    continue
                found = status.Get_source()
                taker, index = posted.take(index, found)
                taker._match(message, found)

    def _post_sends(self, peer: int, tag: int) -> None:
        with self._lock:
            queue = self._unposted.get((peer, tag))
            if queue:
                self._post_ready(queue, peer, tag)

    def _post_ready(self, queue: collections.deque[SendRequest], peer: int, tag: int) -> None:
        while queue and queue[0]._payload.ready():
            queue.popleft()._post()
        if not queue:
            del self._unposted[(peer, tag)]
