"""Point-to-point messages between any two ranks of a ring group: the protocol over tagged links.

The links (one each way between two ranks, opened by the first send, served by
an acceptor) are ``backends.ring.p2p_links``'s; this module drives
``backends.common.p2p_protocol`` over them.

Messages:

- A message is a header (message number, tag, size, dtype, piece size)
  carrying the first piece of the data, then the other pieces: a quarter of
  the message, between ``chunk_bytes / slots`` and ``chunk_bytes``, so the
  receiver copies one piece out while the sender copies the next in, and a
  long message costs few hand-offs.
- The receiver gives its verdict before it takes the message's last piece
  (``RecvLink.post_verdict``): taken, refused because its dtype or size is not
  the receive's (the receiver's bytes, elements and dtype ride along), or set
  aside. The sender's operation completes when the receiver has taken the
  whole message and reads the verdict then, so a dtype or size mismatch raises
  on both sides, before any byte lands in the receive's tensor, and the
  success path costs no round trip beyond the receiver's own progress.
- Matching is the protocol's (``PostedReceives``): a receive is posted when
  issued, and each message goes to the earliest posted receive that accepts it
  (its tag; its source, or any source), whoever reads it off its link, so
  messages between one pair with one tag arrive in order, receives from any
  source included. A link is read by the receive from its source that runs on
  that source's lane (receives from one source run in the order issued), or,
  when that lane is idle, by a receive from any source, which looks at such
  links a fraction of a millisecond apart once idle, and wakes at once when
  another reader lands its message. A message no receive takes yet is copied
  aside for a later one; its send completes then (as MPI's eager sends do), and
  a dtype or size mismatch found later raises on the receiver only.
- The verdict's decision, its codes and the errors of a refusal, and the
  set-aside queue's rule are ``backends.common.p2p_protocol``'s; the links
  carry them.

Progress: sends to one peer run in order on one lane, receives from one source
on another (``commlib.lanes``), so a send waiting for its receiver never
holds up a receive, and two ranks may ``isend`` and ``irecv`` to each other at
once. A blocking call runs on its caller's thread when its lane is idle, so
sends from several threads to one peer (or receives from one source) take turns
on a lock of the link, whole messages at a time. None of this touches the
ring's links or its collective sequence.

Failures: a send whose receiver never takes it raises ``CommTimeoutError``
naming the peer and the tag after the group's timeout; if the whole message
was posted the link stays usable (the message is not withdrawn: a later
receive still takes it). A failure in the middle of a message ends that link
(the other end raises on it from then on); the ring and the links between
other ranks go on.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from backends.common.p2p_protocol import (
    CODES,
    REFUSED,
    SET_ASIDE,
    TAKEN,
    Layout,
    PostedReceives,
    check_answer,
    fits,
    layout_of,
    mismatch,
    take_aside,
)
from backends.ring.link_setup import LinkShape
from backends.ring.links import RecvLink
from backends.ring.p2p_links import Incoming, Outgoing, PeerLinks
from commlib.errors import (
    CommError,
    CommTimeoutError,
    GroupClosedError,
    PeerFailureError,
)
from commlib.lanes import Lane
from commlib.p2p import P2PRequest

__all__ = ["PointToPoint"]

_MAGIC = b"p2p1"
_HEADER = struct.Struct("!4sQqQQQb")  # magic, message number, tag, bytes, elements, piece bytes, dtype code
_ANY_SLEEP_MAX_S = 1e-3  # longest nap of a receive from any source between looks at the links
_RECV_LANE_LINGER_S = 30.0
"""How long a receive lane's thread waits for more once idle: a lane per source and tag is made on
first use, and a program that uses many tags would otherwise keep a thread for each."""


class _Header(NamedTuple):
    """A message's header: its number on the link, tag, size, and how its data was cut."""

    msg: int
    tag: int
    nbytes: int
    numel: int
    piece: int
    dtype: int
    """The sender's dtype code (``p2p_protocol.CODES``)."""


class _Label(tuple):
    """A request's label, made only when a message needs it (a blocking call that succeeds needs none).

    ``_Label((label_of, request))``: a tuple, so making one runs no Python code.
    """

    __slots__ = ()

    def __str__(self) -> str:
        label_of, request = self
        return str(label_of(request))


@dataclasses.dataclass
class _Aside:
    """A message read off its link and kept: for a later receive, or for a staged one not running yet."""

    source: int
    tag: int
    header: _Header
    data: torch.Tensor


class _Receive:
    """An issued receive: what matching reads (``wanted``, ``tag``), and where its message lands.

    Whoever reads its message off a link lands it: writes the tensor (or ``kept``, or
    ``error``), then ``source``, last; its owner waits for ``source``.
    """

    __slots__ = ("data", "error", "kept", "label", "mine", "source", "tag", "wanted")

    def __init__(
        self, wanted: int | None, tag: int, data: torch.Tensor | None, mine: Layout, label: object
    ) -> None:
        self.wanted = wanted
        """The source asked for (None: any)."""
        self.tag = tag
        self.data = data
        """The flat host tensor the message lands in (None: a staged receive's, given when it runs)."""
        self.mine = mine
        """The layout the receive holds (``p2p_protocol.layout_of``)."""
        self.label = label
        self.kept: _Aside | None = None
        """Its message, kept to be copied in when the receive runs (and checked then if set aside)."""
        self.error: BaseException | None = None
        self.source: int | None = None
        """The message's source, once landed (or failed): set last."""


class PointToPoint:
    """The point-to-point side of one ring group: its lanes and the protocol over its links.

    Args:
        rank: This rank in the group.
        links: The group's point-to-point links (owned from now on: ``close`` closes them).
        shape: Chunk size and slots of every link (its messages' pieces follow them).
        timeout: Seconds any one wait may take.
    """

    def __init__(self, *, rank: int, links: PeerLinks, shape: LinkShape, timeout: float) -> None:
        self._rank = rank
        self._timeout = timeout
        self._peer_links = links
        self._piece = max(4096, shape.chunk_bytes // max(1, shape.slots) // 64 * 64)  # the smallest
        self._chunk_bytes = shape.chunk_bytes
        self._small_piece = self._piece_of(0)  # the piece of every message no larger than it
        self._outgoing = self._peer_links.outgoing
        """The link to each peer (``PeerLinks`` writes it; read here without a call)."""
        self._incoming = self._peer_links.incoming
        """The link from each peer (``PeerLinks`` writes it; read here without a call)."""
        self._lanes = threading.Lock()  # guards the creation of lanes
        self._send_lanes: dict[int, Lane] = {}
        self._recv_lanes: dict[tuple[int | None, int], Lane] = {}
        """One lane per source (None: any) and tag: a receive waiting for its message never holds up
        one with another tag, which may be matched first."""
        self._scratch: torch.Tensor | None = None
        self._matching = threading.Lock()
        """Guards the matching: ``_posted``, ``_aside``, and which receive a message goes to."""
        self._matched = threading.Condition(self._matching)
        """Notified when a message lands in a receive other than its reader."""
        self._posted: PostedReceives[_Receive] = PostedReceives()
        """The receives issued and not matched yet, in the order issued."""
        self._aside: list[_Aside] = []
        """Messages no receive took yet, oldest first."""

    # --------------------------------------------------------------- lanes
    def send_lane(self, dst: int) -> Lane:
        """The lane every send to ``dst`` runs on, in order."""
        lane = self._send_lanes.get(dst)
        if lane is None:
            with self._lanes:
                lane = self._send_lanes.setdefault(dst, Lane(f"ring-send-{dst}", self._timeout * 3 + 30.0))
        return lane

    def recv_lane(self, src: int | None, tag: int) -> Lane:
        """The lane every receive from ``src`` (None: any source) with ``tag`` runs on, in order.

        Its thread ends after ``_RECV_LANE_LINGER_S`` idle: a program may use many tags.
        """
        lane = self._recv_lanes.get((src, tag))
        if lane is None:
            with self._lanes:
                name = f"ring-recv-{src if src is not None else 'any'}-{tag}"
                lane = Lane(name, self._timeout * 3 + 30.0, linger=_RECV_LANE_LINGER_S)
                lane = self._recv_lanes.setdefault((src, tag), lane)
        return lane

    def run(self, request: P2PRequest, label_of: Callable[[P2PRequest], object]) -> int:
        """Run a checked send or receive of a flat host tensor to its end, behind its lane's queue.

        Its label, ``label_of(request)``, is made only if a message needs it.

        Returns:
            The peer: a send's destination, a receive's source.
        """
        kind, data, peer, tag, _ = request
        label = _Label((label_of, request))
        if kind == "send":
            lane = self._send_lanes.get(peer) or self.send_lane(peer)  # type: ignore[arg-type]
            lane.call(label, self.send, data, peer, tag, label)
            return peer  # type: ignore[return-value]
        lane = self._recv_lanes.get((peer, tag)) or self.recv_lane(peer, tag)
        mine = (data.nbytes, data.numel(), CODES.get(data.dtype, -1))  # layout_of, inline: the hot path
        receive = _Receive(peer, tag, data, mine, label)
        try:
            return lane.call(label, self.finish, receive, issue=self.post_receive)
        except GroupClosedError:
            self.withdraw(receive)
            raise

    # ---------------------------------------------------------------- send
    def send(self, data: torch.Tensor, dst: int, tag: int, label: object) -> None:
        """Send the flat host tensor ``data`` to ``dst``; return once ``dst`` has taken it.

        ``label`` names the operation in errors (``[rank 0/2] ring.send #1 to rank 1 tag 0 ...``).

        Raises:
            MessageMismatchError: The receive's tensor had another dtype or size (``MessageSizeError``).
            CommTimeoutError: ``dst`` did not take the message within the timeout.
            PeerFailureError: The link to ``dst`` failed (now or earlier).
        """
        out = self._outgoing.get(dst) or self._peer_links.outgoing_to(dst, label)
        with out.lock:
            self._send_on(out, data, dst, tag, label)

    def _send_on(self, out: Outgoing, data: torch.Tensor, dst: int, tag: int, label: object) -> None:
        if out.failed is not None:
            raise PeerFailureError(
                f"{label}: the link to rank {dst} failed earlier ({out.failed}); point-to-point with "
                "the other ranks still works"
            )
        link = out.link
        nbytes, numel, dtype = mine = layout_of(data)
        # Four pieces or more, each between a slot's share and a whole slot: copies overlap, and a
        # long message costs few hand-offs.
        piece = self._small_piece if nbytes <= self._small_piece else self._piece_of(nbytes)
        msg = out.next_msg
        out.next_msg = msg + 1
        fields = (_MAGIC, msg, tag, nbytes, numel, piece, dtype)
        posted = False
        try:
            if nbytes <= piece:
                link.send_record(_HEADER, fields, data)
            else:
                data = data.view(torch.uint8)
                link.send_record(_HEADER, fields, data[:piece])
                for start in range(piece, nbytes, piece):
                    link.send(data[start : start + piece])
            link.flush()  # over TCP, until the whole message is with the kernel (shared memory: at once)
            posted = True
            answer = link.await_verdict(msg, out.taking)
        except (CommError, OSError) as e:
            links = self._peer_links
            if links.closing or (links.flushing and isinstance(e, CommTimeoutError)):
                raise links.closed_during_send(label, dst) from e
            if isinstance(e, CommTimeoutError) and posted:
                raise CommTimeoutError(
                    f"{label}: rank {dst} did not receive the message within {self._timeout:g} s: it "
                    "posted no matching recv, or is stuck. The message stays queued for a later recv"
                ) from e
            self._fail(out, f"rank {self._rank} gave up sending to rank {dst} (tag {tag}): {e}")
            if isinstance(e, CommTimeoutError):
                raise CommTimeoutError(
                    f"{label}: rank {dst} did not receive the message within {self._timeout:g} s ({e}). "
                    f"The link to rank {dst} is closed; the other ranks are still reachable"
                ) from e
            raise PeerFailureError(f"{label}: sending to rank {dst} failed: {e}") from e
        if answer[0] != TAKEN:
            check_answer(answer, label, dst, mine)

    def _piece_of(self, nbytes: int) -> int:
        return min(self._chunk_bytes, max(self._piece, nbytes // 4 // 64 * 64))

    def _fail(self, out: Outgoing, reason: str) -> None:
        """End a link whose message was cut off: the receiver learns it, later sends raise."""
        out.failed = CommError(reason)
        out.link.abort(reason)
        try:
            out.link.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ---------------------------------------------------------------- recv
    def post(self, data: torch.Tensor, src: int | None, tag: int, label: object) -> _Receive:
        """Issue a receive of ``tag`` from ``src`` (None: any source) into ``data``; ``finish`` runs it.

        ``receive`` then ``post_receive``. ``data``: a flat host tensor, or a device tensor
        whose host staging ``finish`` gets.
        """
        receive = self.receive(data, src, tag, label)
        self.post_receive(receive)
        return receive

    @staticmethod
    def receive(data: torch.Tensor, src: int | None, tag: int, label: object) -> _Receive:
        """A receive of ``tag`` from ``src`` (None: any source) into ``data``, not issued yet."""
        return _Receive(src, tag, data if data.is_cpu else None, layout_of(data), label)

    def post_receive(self, receive: _Receive) -> None:
        """Issue ``receive``: from now on it is matched in the order issued (``PostedReceives``).

        A message goes to the earliest issued receive that accepts it, whoever reads it off its
        link; a message set aside before (no receive took it) is taken now. A receive that runs
        on a lane is issued as it takes its place there (``Lane.submit``'s ``on_issue``), so
        receives from one source are issued in the order their lane runs them.
        """
        with self._matching:
            kept = take_aside(self._aside, receive.tag, receive.wanted) if self._aside else None
            if kept is None:
                self._posted.pending.append(receive)  # PostedReceives.post, inline: the hot path
            else:
                receive.kept, receive.source = kept, kept.source

    def withdraw(self, receive: _Receive) -> None:
        """Forget an issued receive that will not run (its lane refused it)."""
        with self._matching:
            self._posted.withdraw(receive)

    def recv(self, data: torch.Tensor, src: int | None, tag: int, label: object) -> int:
        """Receive the next message with ``tag`` from ``src`` (None: any source) into host tensor ``data``.

        ``post`` and ``finish`` in one.

        Returns:
            The source rank.
        """
        return self.finish(self.post(data, src, tag, label))

    def finish(self, receive: _Receive, host: torch.Tensor | None = None) -> int:
        """Wait until an issued receive has its message; ``host``: a staged receive's host tensor.

        Returns:
            The source rank.

        Raises:
            MessageMismatchError: The message has another dtype or size than the receive's tensor
                (``MessageSizeError``); it is dropped, the tensor is untouched, and its sender is
                told (unless it was set aside before the receive was issued).
            CommTimeoutError: No such message came within the timeout.
            PeerFailureError: The link from the source failed (now or earlier).
        """
        if self._peer_links.acceptor is None:
            self._peer_links.start_acceptor()
        if host is not None:
            with self._matching:
                if receive.data is None:
                    receive.data = host
        src = receive.source
        if src is None:
            try:
                if receive.wanted is None:
                    self._recv_any(receive)
                else:
                    self._recv_from(receive, receive.wanted)
            except BaseException:
                self.withdraw(receive)
                raise
            src = receive.source
        if receive.kept is not None:
            self._deliver(receive.kept, receive)
        elif receive.error is not None:
            raise receive.error
        return src  # type: ignore[return-value]

    def _recv_from(self, receive: _Receive, src: int) -> None:
        """Read the link from ``src`` until a message lands in ``receive``.

        Another receive may hold the link, reading for itself: it hands over the message that
        goes to this one, so this one waits for the link only while it has none.
        """
        incoming = self._incoming.get(src) or self._peer_links.incoming_from(src, receive.label)
        lock = incoming.lock
        if not lock.acquire(blocking=False):
            deadline = time.monotonic() + self._timeout
            nap = 1e-5
            while not lock.acquire(timeout=nap):
                if receive.source is not None:
                    return
                if time.monotonic() >= deadline:
                    with self._matching:
                        if self._posted.withdraw(receive):
                            raise CommTimeoutError(
                                f"{receive.label}: no message from rank {src} within {self._timeout:g} s: "
                                f"rank {src} never sent it, or is stuck (another receive from rank {src} "
                                "held the link)"
                            )
                nap = min(_ANY_SLEEP_MAX_S, nap * 2)
        try:
            if receive.source is None:
                self._take(incoming, src, receive, wait=True)
        except BaseException:
            self.withdraw(receive)  # before the link is free: its next reader must not hand it a message
            raise
        finally:
            lock.release()

    @staticmethod
    def _deliver(aside: _Aside, receive: _Receive) -> None:
        header = aside.header
        sent, mine = (header.nbytes, header.numel, header.dtype), receive.mine
        if not fits(sent, mine):
            # It came before a recv with its tag and was kept aside: its sender was not told.
            raise mismatch(receive.label, "recv", aside.source, sent, mine, peer_told=False)
        if mine[0]:
            receive.data.view(torch.uint8).copy_(aside.data)  # type: ignore[union-attr]

    def _take(self, incoming: Incoming, src: int, reader: _Receive, *, wait: bool) -> None:
        """Read messages from ``src``, each for the receive it goes to, until ``reader`` has one.

        Each message goes to the earliest issued receive that accepts it (``match``), which
        may be another than ``reader``, or aside when none does. The caller holds the link's
        lock. ``wait`` off: stop when no message waits. When the link fails, ``reader`` fails
        with it, unless it is a receive from any source that another link's reader has already
        matched: it returns then, and that reader lands the message (``_landing_elsewhere``).
        """
        label = reader.label
        if incoming.failed is not None:
            raise PeerFailureError(
                f"{label}: the link from rank {src} failed earlier ({incoming.failed}); point-to-point "
                "with the other ranks still works"
            )
        link = incoming.link
        while reader.source is None and (wait or link.ready()):
            try:
                fields = link.recv_record(_HEADER)
            except CommTimeoutError as e:
                raise CommTimeoutError(
                    f"{label}: no message from rank {src} within {self._timeout:g} s: rank {src} never sent "
                    f"it, or is stuck ({e})"
                ) from None
            except (CommError, OSError) as e:
                error = self._broken(incoming, src, reader, e)
                if self._landing_elsewhere(reader):
                    return
                raise error from e
            taker = None
            try:
                if fields[0] != _MAGIC or fields[5] <= 0:
                    raise CommError(
                        f"protocol error from {link.describe}: not a point-to-point message header"
                    )
                _, msg, their_tag, nbytes, numel, piece, dtype = fields
                with self._matching:
                    pending = self._posted.pending
                    if pending and pending[0] is reader and reader.tag == their_tag:
                        del pending[0]  # the earliest issued receive is this one, and takes it: most are
                        taker = reader
                    else:
                        taker = self._posted.match(src, their_tag)
                    into = None if taker is None else taker.data
                if taker is not None:
                    mine = taker.mine
                    if nbytes == mine[0] and dtype == mine[2] and nbytes <= piece and into is not None:
                        link.take_into(msg, (TAKEN, *mine), into)  # the message is one piece: most are
                        if taker is reader:
                            reader.source = src
                        else:
                            self._landed(taker, src)
                        continue
                header = _Header(msg, their_tag, nbytes, numel, piece, dtype)
                self._land(link, src, header, taker, reader)
            except (CommError, OSError) as e:
                error = self._broken(incoming, src, reader, e, taker)
                if taker is not reader and self._landing_elsewhere(reader):
                    return
                raise error from e

    def _landing_elsewhere(self, reader: _Receive) -> bool:
        """After the link under it failed: True if another link's reader matched ``reader``.

        Only a receive from any source can be matched elsewhere; its message lands from
        there. Otherwise ``reader`` is withdrawn, so that none can match it once it failed.
        """
        if reader.wanted is not None:
            return False
        with self._matching:
            return reader.source is not None or not self._posted.withdraw(reader)

    def _land(
        self, link: RecvLink, src: int, header: _Header, taker: _Receive | None, reader: _Receive
    ) -> None:
        """Land a message not landed at once (many pieces, refused, staged, or aside) in ``taker``.

        ``reader``: the receive whose thread reads the link; it needs no waking.
        """
        sent = (header.nbytes, header.numel, header.dtype)
        if taker is None:
            link.post_verdict(header.msg, (SET_ASIDE, *sent))
            kept = torch.empty(header.nbytes, dtype=torch.uint8)
            self._read_body(link, header, kept)
            self._set_aside(_Aside(src, header.tag, header, kept))
            return
        mine = taker.mine
        answer = TAKEN if fits(sent, mine) else REFUSED
        link.post_verdict(header.msg, (answer, *mine))
        if answer != TAKEN:
            self._read_body(link, header, None)
            taker.error = mismatch(taker.label, "recv", src, sent, mine)
        elif taker.data is None:  # a staged receive not running yet: its host tensor comes then
            kept = torch.empty(header.nbytes, dtype=torch.uint8)
            self._read_body(link, header, kept)
            taker.kept = _Aside(src, header.tag, header, kept)
        else:
            self._read_body(link, header, taker.data)
        if taker is reader:
            reader.source = src
        else:
            self._landed(taker, src)

    def _landed(self, receive: _Receive, src: int) -> None:
        """``receive`` has its message (or its error): wake its owner."""
        with self._matched:
            receive.source = src
            self._matched.notify_all()

    def _set_aside(self, aside: _Aside) -> None:
        """Keep a message no receive took, for a later one; or give it to one issued while it was read."""
        with self._matching:
            taker = self._posted.match(aside.source, aside.tag)
            if taker is None:
                self._aside.append(aside)
                return
            taker.kept = aside
        self._landed(taker, aside.source)

    def _read_body(self, link: RecvLink, header: _Header, into: torch.Tensor | None) -> None:
        """Read the message's pieces (the first came with the header) into ``into``, or drop them."""
        piece = header.piece
        if into is not None and header.nbytes <= piece:
            link.recv_into(into)
            return
        if into is not None:
            into = into.view(torch.uint8)
        for start in range(0, max(header.nbytes, 1), piece):
            size = min(piece, header.nbytes - start)
            if into is not None:
                link.recv_into(into[start : start + size])
            else:
                link.recv_into(self._scratch_bytes(size))

    def _scratch_bytes(self, size: int) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.empty(max(size, self._piece), dtype=torch.uint8)
        return self._scratch[:size]

    def _broken(
        self, incoming: Incoming, src: int, reader: _Receive, e: BaseException, taker: _Receive | None = None
    ) -> CommError:
        """The link from ``src`` failed under ``reader``: its error; ``taker``, if another, fails alike."""
        if not self._peer_links.closing:
            incoming.failed = e
        if taker is not None and taker is not reader and taker.source is None:
            taker.error = self._failure(taker.label, src, e)
            self._landed(taker, src)
        return self._failure(reader.label, src, e)

    def _failure(self, label: object, src: int, e: BaseException) -> CommError:
        if self._peer_links.closing:
            return GroupClosedError(f"{label}: the group was closed during the recv")
        return PeerFailureError(f"{label}: receiving from rank {src} failed: {e}")

    def _recv_any(self, receive: _Receive) -> None:
        """Read every source whose own receive lane is idle until a message lands in ``receive``.

        A busy lane's receive reads its link itself, and hands over the messages that go to
        ``receive``; a message landed by another reader wakes this one at once.
        """
        label = receive.label
        deadline = time.monotonic() + self._timeout
        nap = 0.0
        while True:
            self._peer_links.check_open(label)
            busy = {src for (src, _), lane in list(self._recv_lanes.items()) if not lane.idle}
            for src, incoming in list(self._incoming.items()):
                if src in busy:
                    continue  # its receive reads the link
                if incoming.failed is not None or not incoming.lock.acquire(blocking=False):
                    continue
                try:
                    self._take(incoming, src, receive, wait=False)
                finally:
                    incoming.lock.release()
                if receive.source is not None:
                    return
            with self._matched:
                if receive.source is not None:
                    return
                if time.monotonic() >= deadline and self._posted.withdraw(receive):
                    raise CommTimeoutError(f"{label}: no message from any rank within {self._timeout:g} s")
                nap = min(_ANY_SLEEP_MAX_S, nap * 2 or 1e-5)
                self._matched.wait(nap)

    @property
    def links(self) -> tuple[dict[int, str], dict[int, str]]:
        """Transport of each open link: (to each peer, from each peer)."""
        return self._peer_links.transports

    def close(self) -> None:
        """Finish the sends issued (within the timeout), then wake every waiting operation and close.

        A send issued with ``isend`` is delivered if its receiver takes it within the group's
        timeout; one still waiting then fails with ``GroupClosedError``, which says so. Receives
        still waiting fail at once. Then the lanes and the acceptor stop and the links close.
        """
        deadline = time.monotonic() + self._timeout
        self._peer_links.flush()
        with self._lanes:
            send_lanes = list(self._send_lanes.values())
        flushed = all(lane.wait_idle(deadline - time.monotonic()) for lane in send_lanes)
        self._peer_links.stop(unsent=not flushed)
        with self._lanes:
            lanes = list(self._send_lanes.values()) + list(self._recv_lanes.values())
        for lane in lanes:
            lane.close()
        self._peer_links.close()
