"""Link set-up: agree with both neighbours on each link's transport and build the two links.

Over the TCP connections of the rendezvous (``backends.ring.rendezvous``), each rank
sends its right neighbour its host, its wish (``COMMLIB_RING_TRANSPORT``) and a
probe ``memfd``. Each rank then offers its left neighbour either an inbox in
shared memory (with wake pipes, and whether it could open the probe, which
tells the neighbour whether it can lend buffers) or TCP, and both ends confirm.
The inbox and pipe files are unlinked as soon as both ends have opened them.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from backends.ring.links import RecvLink, SendLink, TcpRecvLink, TcpSendLink
from backends.ring.rendezvous import RingSockets, host_id
from backends.ring.shm import Region, can_share_descriptors
from backends.ring.shm_links import Inbox, ShmRecvLink, ShmSendLink, WakePipes
from backends.ring.wire import SocketReader, recv_json, send_json
from commlib.errors import RendezvousError

__all__ = ["connect_links"]


def _shm_dir(preferred: str | None) -> str:
    for candidate in (preferred, "/dev/shm"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    import tempfile

    return tempfile.gettempdir()


def _probe_region() -> Region | None:
    """A tiny ``memfd`` region the right neighbour tries to open, to learn whether buffers can be lent."""
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
    except (OSError, ValueError, KeyError):
        return False
    return True


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
    right_rank, left_rank = (rank + 1) % world_size, (rank - 1) % world_size
    right_name = f"rank {right_rank} (right neighbour)"
    left_name = f"rank {left_rank} (left neighbour)"
    right, left = sockets.right, sockets.left
    right_reader, left_reader = SocketReader(right, right_name), sockets.left_reader
    me = host_id()

    probe = _probe_region() if transport != "tcp" else None
    send_json(
        right,
        {
            "transport": transport,
            "host": me,
            "pid": os.getpid(),
            "probe": {"fd": probe.fd, "token": probe.token.hex()} if probe is not None else None,
        },
    )
    proposal = recv_json(left_reader, "link set-up")
    forced = "shm" in (transport, proposal["transport"])
    inbox: Inbox | None = None
    my_wake: WakePipes | None = None
    why_not = ""
    if "tcp" in (transport, proposal["transport"]):
        why_not = "COMMLIB_RING_TRANSPORT=tcp on one end"
    elif proposal["host"] != me:
        why_not = f"rank {left_rank} runs on another host ({proposal['host'].split('/')[0]})"
    else:
        path = os.path.join(_shm_dir(shm_dir), f"commlib-ring-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            inbox = Inbox(
                Region.create_file(path, Inbox.region_bytes(slots, chunk_bytes)), slots, chunk_bytes
            )
        except OSError as e:
            why_not = f"cannot create shared memory at {path}: {e}"
        else:
            try:
                my_wake = WakePipes((f"{path}.wake-recv", f"{path}.wake-send"), create=True)
            except OSError:
                my_wake = None  # wake-ups go over the socket
    try:
        if inbox is None and forced and "tcp" not in (transport, proposal["transport"]):
            message = (
                f"{prefix}COMMLIB_RING_TRANSPORT=shm, but the link from rank {left_rank} cannot use "
                f"shared memory: {why_not}"
            )
            send_json(left, {"transport": "error", "why": message})
            if probe is not None:
                probe.close()
            raise RendezvousError(message)
        if inbox is not None:
            send_json(
                left,
                {
                    "transport": "shm",
                    "path": inbox.region.path,
                    "token": inbox.region.token.hex(),
                    "lend": _can_open(proposal),
                    "wake": list(my_wake.paths) if my_wake is not None else None,
                },
            )
        else:
            send_json(left, {"transport": "tcp", "why": why_not})

        offer = recv_json(right_reader, "link set-up")
        if probe is not None:
            probe.close()  # the right neighbour has tried it by now
        if offer["transport"] == "error":
            raise RendezvousError(f"{prefix}{offer['why']}")
        remote: Inbox | None = None
        their_wake: WakePipes | None = None
        problem = ""
        if offer["transport"] == "shm":
            try:
                region = Region.open_path(
                    offer["path"], Inbox.region_bytes(slots, chunk_bytes), bytes.fromhex(offer["token"])
                )
                remote = Inbox(region, slots, chunk_bytes)
            except OSError as e:
                problem = f"cannot open rank {right_rank}'s shared memory: {e}"
            if remote is not None and offer.get("wake"):
                try:
                    their_wake = WakePipes(tuple(offer["wake"]), create=False)  # type: ignore[arg-type]
                except OSError:
                    their_wake = None
        send_json(right, {"ok": remote is not None, "wake": their_wake is not None, "why": problem})
        reply = recv_json(left_reader, "link set-up")
    except BaseException:
        # A neighbour that dies during set-up must not leave our files in /dev/shm.
        if inbox is not None:
            inbox.region.unlink()
        if my_wake is not None:
            my_wake.unlink()
        raise
    if inbox is not None:
        inbox.region.unlink()  # both ends have it mapped; nothing is left behind if a rank crashes
    if my_wake is not None:
        my_wake.unlink()
        if not reply.get("wake"):
            my_wake.close()  # the sender could not open them: both ends wake over the socket
            my_wake = None
    if forced and (problem or (inbox is not None and not reply["ok"])):
        for opened in (inbox, remote, my_wake, their_wake):
            if opened is not None:
                opened.close()
        raise RendezvousError(
            f"{prefix}COMMLIB_RING_TRANSPORT=shm, but a link cannot use shared memory: "
            f"{problem or reply['why']}"
        )

    right_reader.spin_s = left_reader.spin_s = spin_s
    send_link: SendLink
    if remote is not None:
        send_link = ShmSendLink(
            right,
            right_reader,
            right_rank,
            right_name,
            remote,
            spin_s=spin_s,
            can_lend=bool(offer.get("lend")),
            wake=their_wake,
        )
    else:
        send_link = TcpSendLink(right, right_reader, right_rank, right_name, chunk_bytes)
    recv_link: RecvLink
    if inbox is not None and reply["ok"]:
        recv_link = ShmRecvLink(
            left,
            left_reader,
            left_rank,
            left_name,
            inbox,
            spin_s=spin_s,
            peer_pid=int(proposal["pid"]),
            wake=my_wake,
        )
    else:
        if inbox is not None:
            inbox.close()
        if my_wake is not None:
            my_wake.close()
        recv_link = TcpRecvLink(left, left_reader, left_rank, left_name, chunk_bytes)
    return send_link, recv_link
