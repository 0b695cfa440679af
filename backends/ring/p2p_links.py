"""The one-way links that carry a ring group's point-to-point messages, opened on first use.

- Each direction between two ranks is a one-way link of its own, built as the
  ring's are (``backends.ring.link_setup``: shared memory on one host, TCP
  across hosts). Its sender opens it the first time it sends to that peer: it
  connects to the peer's data listener (whose address every rank learnt at the
  rendezvous) and sends a hello signed with the group's session key, which
  only ranks holding the job token have; a nonce makes each hello good for one
  link. Two ranks that send to each other at once open two links, so there is
  nothing to settle between them.
- The receiver's acceptor thread serves its listener from its first receive
  on, reading every connection frame by frame at once
  (``backends.ring.lobby``): a link's set-up is three frames from its sender
  (hello, proposal, confirmation) and one answer, each with a deadline and a
  size limit, so a stranger, or a peer that stalls, costs only its own
  connection.
- ``close`` happens in two steps: ``stop`` refuses new links and wakes every
  wait on a socket, ``close`` then closes the links and the listener.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from backends.ring.link_setup import LinkShape, finish_recv_link, offer_recv_link, open_send_link
from backends.ring.links import RecvLink, SendLink
from backends.ring.lobby import Lobby, Visitor
from backends.ring.rendezvous import EarlyLink, Peer, p2p_hello, p2p_hello_source
from backends.ring.wire import SocketReader, connect_with_retry, send_json, tune_socket
from commlib.errors import CommError, CommTimeoutError, GroupClosedError, PeerFailureError

__all__ = ["Incoming", "Outgoing", "PeerLinks"]

logger = logging.getLogger("commlib")

_HELLO_BYTES = 64 * 1024
_ACCEPT_PERIOD_S = 1.0  # the acceptor looks at its stop flag at least this often


@dataclasses.dataclass
class Outgoing:
    """The link to one peer, and what the sends on it keep."""

    link: SendLink
    taking: str
    """What a send waits for, in a timeout's message."""
    next_msg: int = 1
    failed: BaseException | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    """Held by the send on the link: sends from several threads take turns."""


@dataclasses.dataclass
class Incoming:
    """The link from one peer, and what its readers keep."""

    link: RecvLink
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    """Held by the one reading the link: its source's receive, or a receive from any source."""
    failed: BaseException | None = None


class PeerLinks:
    """A ring group's point-to-point links: to each peer, opened on first send; from each, by the acceptor.

    Only this class writes ``outgoing``, ``incoming`` and the closing flags; its users read them.

    Args:
        rank: This rank in the group.
        peers: Every rank's data listener, by rank.
        listener: This rank's data listener (owned from now on).
        session: The group's session key, which signs link hellos.
        shape: Chunk size, slots and transport wish of every link.
        timeout: Seconds any one wait may take.
        prefix: Returns the ``[rank R/N] ring.<op>: `` prefix of messages.
        early: Hellos that reached the listener during the ring's own set-up.
    """

    def __init__(
        self,
        *,
        rank: int,
        peers: list[Peer],
        listener: socket.socket,
        session: bytes,
        shape: LinkShape,
        timeout: float,
        prefix: Callable[[str], str],
        early: list[EarlyLink],
    ) -> None:
        self._rank = rank
        self._peers = peers
        self._listener = listener
        self._session = session
        self._shape = shape
        self._timeout = timeout
        self._prefix = prefix
        self._early = list(early)
        self.outgoing: dict[int, Outgoing] = {}
        """The link to each peer, once a send opened it."""
        self.incoming: dict[int, Incoming] = {}
        """The link from each peer, once the acceptor set it up."""
        self._links = threading.Condition()  # guards both dicts, the flags and the acceptor
        self._nonces: set[str] = {e.nonce for e in early}
        self._connecting: set[socket.socket] = set()  # links being set up by a send
        self._opening: dict[int, threading.Lock] = {}  # held by the send opening the link to a rank
        self.acceptor: threading.Thread | None = None
        """The thread serving the listener, once ``start_acceptor`` started it."""
        self.closing = False
        """``stop`` ran: no link opens any more, and every wait on one ends."""
        self.flushing = False
        """``close`` is waiting for the sends in flight: a send that times out now ends as unsent at close."""
        self.unsent = False
        """True once ``close`` gave up waiting for the sends in flight: they fail, saying so."""

    # ----------------------------------------------------------- outgoing
    def outgoing_to(self, dst: int, label: object) -> Outgoing:
        """The link to ``dst`` when a send found none: opened now, by one thread, the others waiting."""
        with self._links:
            opening = self._opening.setdefault(dst, threading.Lock())
        with opening:
            return self.outgoing.get(dst) or self._open_link(dst, label)

    def _open_link(self, dst: int, label: object) -> Outgoing:
        self.check_open(label)
        peer, name = self._peers[dst], f"rank {dst}"
        deadline = time.monotonic() + self._timeout
        sock = self._connect(peer, name, deadline, label)
        link: SendLink | None = None
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            send_json(sock, p2p_hello(self._session, self._rank, dst))
            link = open_send_link(sock, SocketReader(sock, name), dst, name, self._shape, f"{label}: ")
        except (CommError, OSError) as e:
            if self.closing or (self.flushing and isinstance(e, CommTimeoutError)):
                raise self.closed_during_send(label, dst) from e
            if isinstance(e, CommTimeoutError):
                raise CommTimeoutError(
                    f"{label}: rank {dst} did not receive the message within {self._timeout:g} s: it posted "
                    f"no recv from this rank (its first opens the link), or is stuck ({e})"
                ) from None
            if isinstance(e, CommError) and str(e).startswith(str(label)):
                raise
            raise PeerFailureError(f"{label}: opening the link to rank {dst} failed: {e}") from e
        finally:
            with self._links:
                self._connecting.discard(sock)
            if link is None:
                sock.close()
        sock.settimeout(self._timeout)
        out = Outgoing(link, f"rank {dst} to take the message")
        with self._links:
            if self.closing:
                link.shutdown()
                link.close(0)
                raise self.closed_during_send(label, dst)
            self.outgoing[dst] = out
        return out

    def _connect(self, peer: Peer, name: str, deadline: float, label: object) -> socket.socket:
        """Connect to ``peer``'s listener, retrying until ``deadline``; ``stop`` cuts the wait short."""
        while True:
            self.check_open(label)
            try:
                sock = connect_with_retry(peer.addr, peer.port, min(deadline, time.monotonic() + 1.0), name)
            except (TimeoutError, OSError) as e:
                if time.monotonic() < deadline and isinstance(e, TimeoutError):
                    continue
                raise CommTimeoutError(
                    f"{label}: cannot connect to {name} at {peer.addr}:{peer.port}: {e}"
                ) from None
            with self._links:
                if self.closing:
                    sock.close()
                    raise self.closed_during_send(label, peer.rank)
                self._connecting.add(sock)  # stop() shuts it, waking the set-up's waits
            return sock

    def closed_during_send(self, label: object, dst: int) -> GroupClosedError:
        """The error of a send to ``dst`` that the group's close cut short."""
        if self.unsent or (self.flushing and not self.closing):  # its own timeout ran out first
            return GroupClosedError(
                f"{label}: the group was closed before rank {dst} took the message: close waited "
                f"the group's timeout ({self._timeout:g} s) for it. Rank {dst} posted no matching recv, "
                "or is stuck"
            )
        return GroupClosedError(f"{label}: the group was closed during the send")

    # ----------------------------------------------------------- incoming
    def incoming_from(self, src: int, label: object) -> Incoming:
        """The link from ``src``, waiting for ``src`` to open it (its first send does)."""
        deadline = time.monotonic() + self._timeout
        with self._links:
            while src not in self.incoming:
                self.check_open(label)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(
                        f"{label}: no message from rank {src} within {self._timeout:g} s: rank {src} never "
                        "sent to this rank, or is stuck"
                    )
                self._links.wait(left)
            return self.incoming[src]

    def start_acceptor(self) -> None:
        """Start serving the listener (once; not after ``stop``)."""
        if self.acceptor is not None:
            return
        with self._links:
            if self.acceptor is None and not self.closing:
                self.acceptor = threading.Thread(
                    target=self._accept_loop, name=f"commlib-ring-accept-{self._rank}", daemon=True
                )
                self.acceptor.start()

    def _accept_loop(self) -> None:
        """Serve the listener: every connection is read frame by frame in one lobby, none blocks the others.

        A link's set-up takes three frames from its sender (signed hello,
        proposal, confirmation) and one answer (the offer); each frame has the
        lobby's deadline, so a peer that stalls, or a stranger, costs only its
        own connection.
        """
        lobby = Lobby(self._listener, f"{self._prefix('p2p')}data listener", _HELLO_BYTES)
        try:
            early, self._early = self._early, []
            for link in early:
                visitor = lobby.adopt(link.sock, f"rank {link.source}", "hello", link.leftover)
                visitor.data["source"] = link.source
            while not self.closing:
                arrival = lobby.next_frame(time.monotonic() + _ACCEPT_PERIOD_S)
                if arrival is not None and not self.closing:
                    self._on_frame(lobby, *arrival)
        except Exception:  # noqa: BLE001 - the acceptor must never take the process down
            if not self.closing:
                logger.exception("%sthe point-to-point acceptor stopped", self._prefix("p2p"))
        finally:
            lobby.close()

    def _on_frame(self, lobby: Lobby, visitor: Visitor, frame: Any) -> None:
        """One step of a link's set-up (see ``_accept_loop``)."""
        prefix = self._prefix("p2p")
        if visitor.state == "new":
            claim = p2p_hello_source(self._session, frame, self._rank)
            if claim is None or claim[1] in self._nonces or not 0 <= claim[0] < len(self._peers):
                lobby.drop(visitor, f"not a point-to-point link of this group (it sent {frame!r:.80})")
                return
            self._nonces.add(claim[1])
            visitor.state, visitor.data["source"] = "hello", claim[0]
        elif visitor.state == "hello":
            source = visitor.data["source"]
            try:
                offer = offer_recv_link(frame, self._shape, f"rank {source}", prefix)
            except CommError as e:
                lobby.drop(visitor, str(e))
                return
            visitor.on_drop = offer.discard
            visitor.data.update(offer=offer, proposal=frame)
            if lobby.reply(visitor, offer.message):
                visitor.state = "offered"
        elif visitor.state == "offered":
            source, offer = visitor.data["source"], visitor.data["offer"]
            leftover = visitor.leftover()
            sock = lobby.keep(visitor)
            name = f"rank {source}"
            try:
                tune_socket(sock)
                sock.settimeout(self._timeout)
                reader = SocketReader(sock, name, initial=leftover)
                link = finish_recv_link(
                    sock, reader, source, name, offer, visitor.data["proposal"], frame, self._shape, prefix
                )
            except (CommError, OSError) as e:
                logger.debug("%slink from rank %d not set up: %s", prefix, source, e)
                sock.close()
                return
            with self._links:
                if self.closing or source in self.incoming:
                    logger.debug("%sa second link from rank %d was refused", prefix, source)
                    link.close(0)
                    return
                self.incoming[source] = Incoming(link)
                self._links.notify_all()

    # -------------------------------------------------------------- close
    def check_open(self, label: object) -> None:
        """Raise ``GroupClosedError`` once ``stop`` ran."""
        if self.closing:
            raise GroupClosedError(f"{label}: the process group was closed")

    @property
    def transports(self) -> tuple[dict[int, str], dict[int, str]]:
        """Transport of each open link: (to each peer, from each peer)."""
        return (
            {dst: out.link.transport for dst, out in self.outgoing.items()},
            {src: inc.link.transport for src, inc in self.incoming.items()},
        )

    def flush(self) -> None:
        """``close`` waits for the sends in flight from now on: one that times out ends as unsent."""
        with self._links:
            self.flushing = True

    def stop(self, *, unsent: bool) -> None:
        """Refuse new links, shut every socket (waking whatever waits on one), and stop the acceptor.

        ``unsent``: ``close`` gave up waiting for the sends in flight.
        """
        with self._links:
            self.closing = True
            self.unsent = unsent
            self._links.notify_all()
            links = self._all_links()
            connecting = list(self._connecting)
        for sock in connecting:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for link in links:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)  # a lane waiting on it wakes with an error
            except OSError:
                pass
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the acceptor
        except OSError:
            pass
        acceptor = self.acceptor
        if acceptor is not None:
            acceptor.join(timeout=_ACCEPT_PERIOD_S + 5.0)

    def close(self) -> None:
        """Close every link and the listener (after ``stop``, once nothing uses the links)."""
        with self._links:
            links = self._all_links()
        for link in links:
            link.shutdown()
            link.close(0)
        for early in self._early:
            early.sock.close()
        self._listener.close()

    def _all_links(self) -> list[SendLink | RecvLink]:
        links: list[SendLink | RecvLink] = [o.link for o in self.outgoing.values()]
        links += [i.link for i in self.incoming.values()]
        return links
