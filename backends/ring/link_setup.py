"""Link set-up: agree with the other end of a one-way link on its transport, and build it.

Three control frames per link, over its TCP connection: the sender proposes
(its host, its wish, ``COMMLIB_RING_TRANSPORT``, and a probe ``memfd``); the
receiver offers an inbox in shared memory (with wake pipes, and whether it
could open the probe, which tells the sender whether it can lend buffers) or
TCP; the sender confirms. The inbox and pipe files are unlinked as soon as
both ends have opened them.

- ``connect_links``: the ring's two links, built at once over the connections
  of the rendezvous (each rank is the sender of one and the receiver of the
  other, so the frames of both interleave and cost one round trip).
- ``open_send_link`` / ``offer_recv_link`` + ``finish_recv_link``: one link
  between any two ranks, the halves run by its sender and its receiver
  (``backends.ring.p2p``, whose acceptor reads the frames of many connections
  at once and so takes the receiver's half in two steps).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

from backends.ring.links import RecvLink, SendLink, TcpRecvLink, TcpSendLink
from backends.ring.rendezvous import RingSockets, host_id
from backends.ring.shm import Region, can_share_descriptors
from backends.ring.shm_files import new_path, reap_stale
from backends.ring.shm_links import Inbox, ShmRecvLink, ShmSendLink, WakePipes
from backends.ring.wire import SocketReader, recv_json, send_json
from commlib.errors import RendezvousError

__all__ = ["LinkOffer", "LinkShape", "connect_links", "open_send_link", "offer_recv_link", "finish_recv_link"]


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """What both ends of a link must agree on, and this end's preferences."""

    transport: str
    """This end's wish: ``auto``, ``shm`` or ``tcp``."""
    chunk_bytes: int
    slots: int
    shm_dir: str | None = None
    spin_s: float = 0.0


def _shm_dir(preferred: str | None) -> str:
    for candidate in (preferred, "/dev/shm"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    import tempfile

    return tempfile.gettempdir()


def _probe_region() -> Region | None:
    """A tiny ``memfd`` region the receiver tries to open, to learn whether buffers can be lent."""
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
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


# ------------------------------------------------------------ the three steps
def _propose(shape: LinkShape) -> tuple[dict[str, Any], Region | None]:
    """The sender's proposal, and the probe region it names (closed once the receiver answered)."""
    probe = _probe_region() if shape.transport != "tcp" else None
    proposal = {
        "transport": shape.transport,
        "host": host_id(),
        "pid": os.getpid(),
        "probe": {"fd": probe.fd, "token": probe.token.hex()} if probe is not None else None,
    }
    return proposal, probe


@dataclasses.dataclass
class LinkOffer:
    """The receiver's half of a link while it is being set up."""

    message: dict[str, Any]
    inbox: Inbox | None = None
    wake: WakePipes | None = None
    forced: bool = False

    def discard(self) -> None:
        """The link set-up failed: remove the files and unmap (calling it again does nothing)."""
        inbox, wake, self.inbox, self.wake = self.inbox, self.wake, None, None
        if inbox is not None:
            inbox.region.unlink()
            inbox.close()
        if wake is not None:
            wake.unlink()
            wake.close()


def _offer(proposal: Any, shape: LinkShape, sender: str, prefix: str) -> LinkOffer:
    """The receiver's answer to ``proposal``: an inbox in shared memory, TCP, or an error.

    Raises:
        RendezvousError: The proposal is malformed (not from a commlib rank of this version).
    """
    if not isinstance(proposal, dict) or not isinstance(proposal.get("transport"), str):
        raise RendezvousError(f"{prefix}{sender} sent a malformed link proposal ({proposal!r:.80})")
    theirs = proposal["transport"]
    forced = "shm" in (shape.transport, theirs)
    if "tcp" in (shape.transport, theirs):
        return LinkOffer({"transport": "tcp", "why": "COMMLIB_RING_TRANSPORT=tcp on one end"})
    if proposal.get("host") != host_id():
        host = str(proposal.get("host", "?")).split("/")[0]
        why = f"{sender} runs on another host ({host})"
    else:
        path = new_path(_shm_dir(shape.shm_dir))
        try:
            region = Region.create_file(path, Inbox.region_bytes(shape.slots, shape.chunk_bytes))
        except OSError as e:
            why = f"cannot create shared memory at {path}: {e}"
        else:
            inbox = Inbox(region, shape.slots, shape.chunk_bytes)
            try:
                wake: WakePipes | None = WakePipes((f"{path}.wake-recv", f"{path}.wake-send"), create=True)
            except OSError:
                wake = None  # wake-ups go over the socket
            message = {
                "transport": "shm",
                "path": path,
                "token": region.token.hex(),
                "lend": _can_open(proposal),
                "wake": list(wake.paths) if wake is not None else None,
                "forced": forced,
            }
            return LinkOffer(message, inbox, wake, forced)
    if forced:
        message = (
            f"{prefix}COMMLIB_RING_TRANSPORT=shm, but the link from {sender} cannot use shared memory: {why}"
        )
        return LinkOffer({"transport": "error", "why": message}, forced=True)
    return LinkOffer({"transport": "tcp", "why": why})


@dataclasses.dataclass
class _Accepted:
    """The sender's half of a link once it has read the offer."""

    confirmation: dict[str, Any]
    remote: Inbox | None = None
    wake: WakePipes | None = None
    can_lend: bool = False
    forced: bool = False
    """Either end asked for shared memory: failing to open the inbox is an error, not a fallback."""

    def check(self, prefix: str) -> None:
        """Raise if shared memory was forced and the inbox could not be opened (after confirming).

        Raises:
            RendezvousError: It was, and it could not.
        """
        if self.forced and self.remote is None:
            raise RendezvousError(
                f"{prefix}COMMLIB_RING_TRANSPORT=shm, but a link cannot use shared memory: "
                f"{self.confirmation['why']}"
            )

    def discard(self) -> None:
        """The link set-up failed: unmap what was opened."""
        for opened in (self.remote, self.wake):
            if opened is not None:
                opened.close()


def _accept_offer(offer: Any, shape: LinkShape, receiver: str, prefix: str) -> _Accepted:
    """Open the inbox the receiver offers, if it offers one; say how that went.

    Raises:
        RendezvousError: The receiver refused the link (``transport=shm`` forced and impossible).
    """
    if not isinstance(offer, dict) or offer.get("transport") not in ("shm", "tcp", "error"):
        raise RendezvousError(f"{prefix}{receiver} sent a malformed link offer ({offer!r:.80})")
    if offer["transport"] == "error":
        raise RendezvousError(f"{prefix}{offer.get('why')}")
    if offer["transport"] == "tcp":
        return _Accepted({"ok": False, "wake": False, "why": ""})
    remote: Inbox | None = None
    wake: WakePipes | None = None
    problem = ""
    try:
        region = Region.open_path(
            offer["path"], Inbox.region_bytes(shape.slots, shape.chunk_bytes), bytes.fromhex(offer["token"])
        )
        remote = Inbox(region, shape.slots, shape.chunk_bytes)
    except (OSError, KeyError, TypeError, ValueError) as e:
        problem = f"cannot open {receiver}'s shared memory: {e}"
    if remote is not None and offer.get("wake"):
        try:
            wake = WakePipes(tuple(offer["wake"]), create=False)  # type: ignore[arg-type]
        except (OSError, TypeError, ValueError):
            wake = None
    return _Accepted(
        {"ok": remote is not None, "wake": wake is not None, "why": problem},
        remote,
        wake,
        bool(offer.get("lend")),
        bool(offer.get("forced")) or shape.transport == "shm",
    )


def _settle_offer(offer: LinkOffer, confirmation: Any, prefix: str) -> None:
    """The sender confirmed (or not): unlink the files; without shared memory, drop the inbox.

    Raises:
        RendezvousError: ``transport=shm`` was forced and the sender could not open the inbox.
    """
    if offer.inbox is not None:
        offer.inbox.region.unlink()  # both ends have it mapped; nothing is left if a rank crashes
    if offer.wake is not None:
        offer.wake.unlink()
    ok = isinstance(confirmation, dict) and bool(confirmation.get("ok"))
    if offer.wake is not None and not (ok and confirmation.get("wake")):
        offer.wake.close()  # the sender could not open them: both ends wake over the socket
        offer.wake = None
    if not ok and offer.inbox is not None:
        offer.inbox.close()
        offer.inbox = None
        if offer.forced:
            why = confirmation.get("why") if isinstance(confirmation, dict) else confirmation
            raise RendezvousError(
                f"{prefix}COMMLIB_RING_TRANSPORT=shm, but a link cannot use shared memory: {why}"
            )


def _send_link(
    sock: socket.socket, reader: SocketReader, peer: int, name: str, accepted: _Accepted, shape: LinkShape
) -> SendLink:
    reader.spin_s = shape.spin_s
    if accepted.remote is not None:
        return ShmSendLink(
            sock,
            reader,
            peer,
            name,
            accepted.remote,
            spin_s=shape.spin_s,
            can_lend=accepted.can_lend,
            wake=accepted.wake,
        )
    return TcpSendLink(sock, reader, peer, name, shape.chunk_bytes)


def _recv_link(
    sock: socket.socket,
    reader: SocketReader,
    peer: int,
    name: str,
    offer: LinkOffer,
    proposal: dict[str, Any],
    shape: LinkShape,
) -> RecvLink:
    reader.spin_s = shape.spin_s
    if offer.inbox is not None:
        return ShmRecvLink(
            sock,
            reader,
            peer,
            name,
            offer.inbox,
            spin_s=shape.spin_s,
            peer_pid=int(proposal["pid"]),
            wake=offer.wake,
        )
    return TcpRecvLink(sock, reader, peer, name, shape.chunk_bytes)


# ------------------------------------------------------------------ the ring
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
    shape = LinkShape(transport, chunk_bytes, slots, shm_dir, spin_s)
    if transport != "tcp":
        reap_stale(_shm_dir(shm_dir))  # files left by ranks killed inside an earlier group's set-up
    right_rank, left_rank = (rank + 1) % world_size, (rank - 1) % world_size
    right_name = f"rank {right_rank} (right neighbour)"
    left_name = f"rank {left_rank} (left neighbour)"
    right, left = sockets.right, sockets.left
    right_reader, left_reader = SocketReader(right, right_name), sockets.left_reader

    proposal, probe = _propose(shape)
    offer: LinkOffer | None = None
    accepted: _Accepted | None = None
    try:
        send_json(right, proposal)
        their_proposal = recv_json(left_reader, "link set-up")
        offer = _offer(their_proposal, shape, f"rank {left_rank}", prefix)
        send_json(left, offer.message)
        if offer.message["transport"] == "error":
            raise RendezvousError(offer.message["why"])
        their_offer = recv_json(right_reader, "link set-up")
        if probe is not None:
            probe.close()  # the right neighbour has tried it by now
            probe = None
        accepted = _accept_offer(their_offer, shape, f"rank {right_rank}", prefix)
        send_json(right, accepted.confirmation)
        confirmation = recv_json(left_reader, "link set-up")
        _settle_offer(offer, confirmation, prefix)
        accepted.check(prefix)
    except BaseException:
        # A neighbour that dies during set-up must not leave our files in /dev/shm.
        if probe is not None:
            probe.close()
        if offer is not None:
            offer.discard()
        if accepted is not None:
            accepted.discard()
        raise
    send_link = _send_link(right, right_reader, right_rank, right_name, accepted, shape)
    recv_link = _recv_link(left, left_reader, left_rank, left_name, offer, their_proposal, shape)
    return send_link, recv_link


# ------------------------------------------------------- one link, any pair
def open_send_link(
    sock: socket.socket, reader: SocketReader, peer: int, name: str, shape: LinkShape, prefix: str
) -> SendLink:
    """The sender's half of a link's set-up, over ``sock`` (connected to the receiver, hello sent).

    Every wait is bounded by ``sock``'s timeout.

    Raises:
        RendezvousError: The receiver refused the link, or it cannot use shared memory as forced.
        CommError: The receiver left or did not answer in time.
    """
    proposal, probe = _propose(shape)
    accepted: _Accepted | None = None
    try:
        send_json(sock, proposal)
        offer = recv_json(reader, "link set-up")
        accepted = _accept_offer(offer, shape, name, prefix)
        send_json(sock, accepted.confirmation)
        accepted.check(prefix)
    except BaseException:
        if accepted is not None:
            accepted.discard()
        raise
    finally:
        if probe is not None:
            probe.close()
    return _send_link(sock, reader, peer, name, accepted, shape)


def offer_recv_link(proposal: Any, shape: LinkShape, name: str, prefix: str) -> LinkOffer:
    """The receiver's answer to the sender's proposal: send ``offer.message`` back, then ``finish_recv_link``.

    Raises:
        RendezvousError: The proposal is malformed.
    """
    return _offer(proposal, shape, name, prefix)


def finish_recv_link(
    sock: socket.socket,
    reader: SocketReader,
    peer: int,
    name: str,
    offer: LinkOffer,
    proposal: dict[str, Any],
    confirmation: Any,
    shape: LinkShape,
    prefix: str,
) -> RecvLink:
    """Build the receiver's half once the sender confirmed ``offer`` (on failure the offer is discarded).

    Raises:
        RendezvousError: The link cannot be built as both ends asked.
    """
    try:
        if offer.message["transport"] == "error":
            raise RendezvousError(offer.message["why"])
        _settle_offer(offer, confirmation, prefix)
    except BaseException:
        offer.discard()
        raise
    return _recv_link(sock, reader, peer, name, offer, proposal, shape)
