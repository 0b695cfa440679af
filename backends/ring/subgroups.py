"""Subgroups of a ring group: each forms a ring of its own among its members.

Every rank of the parent takes part (``new_subgroup``), members or not:

1. Each member opens a data listener of its own on an ephemeral port (the
   address its parent's listener has: nothing for the user to pick).
2. The parent all-gathers every rank's port (0: not a member), one number per
   rank: the hosts and addresses are in the parent's peer table already.
3. The subgroup's session key is derived from the parent's (which only ranks
   holding the job token have), the subgroup's name (unique in the job, the
   same on every rank), its ranks and the ports; the members' link hellos are
   signed with it, so a stranger, or a rank of another subgroup, cannot join.
4. The members link to their neighbours (``backends.ring.rendezvous.link_neighbours``)
   and build a ``RingProcessGroup`` on those connections, with the parent's
   ring settings. Its point-to-point links open on its own listener.

The subgroup owns its links: closing the parent leaves it working, and closing
it leaves the parent working.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from backends.common.jobtoken import sign_with
from backends.ring.rendezvous import EarlyLink, Peer, RingSockets, link_neighbours, open_listener
from commlib.config import CommConfig
from commlib.process_group import IProcessGroup

__all__ = ["Parent", "new_subgroup"]


@dataclasses.dataclass(frozen=True)
class Parent:
    """What a subgroup takes from its parent ring group."""

    group: IProcessGroup
    """The parent, for the all-gather of the ports."""
    peers: list[Peer]
    session: bytes
    settings: dict[str, Any]
    """The ring settings its ranks agreed on."""
    listen_address: str
    """The address this rank's listener has in the parent."""
    name: str
    """The subgroup's name: the same on every rank of the parent, unique in the job."""


def new_subgroup(
    parent: Parent,
    ranks: list[int],
    config: CommConfig,
    make: Callable[[CommConfig, RingSockets], IProcessGroup],
) -> IProcessGroup | None:
    """Form the subgroup of the parent's ranks ``ranks`` (checked); every parent rank calls it.

    Args:
        parent: The parent group and what the subgroup takes from it.
        ranks: The members, as parent ranks, in the subgroup's rank order.
        config: The subgroup's settings (its timeout bounds the linking).
        make: Builds the ring group on the members' connections.

    Returns:
        The subgroup on its members, None elsewhere.

    Raises:
        RendezvousError: The members could not link up within the timeout.
    """
    group = parent.group
    me = group.rank
    member = me in ranks
    listener = open_listener(parent.listen_address) if member and len(ranks) > 1 else None
    try:
        port = listener.getsockname()[1] if listener is not None else 0
        ports = torch.zeros(group.world_size, dtype=torch.int64)
        group.all_gather(ports, torch.tensor([port], dtype=torch.int64))
        if not member:
            return None
        table = parent.peers
        peers = [
            Peer(i, table[g].host, table[g].addr, int(ports[g]), table[g].pid) for i, g in enumerate(ranks)
        ]
        rank = ranks.index(me)
        session = bytes.fromhex(sign_with(parent.session, "subgroup", parent.name, ranks, ports.tolist()))
        sockets = RingSockets(peers=peers, settings=parent.settings, right=None, left=None)
        if listener is not None:
            prefix = f"[rank {rank}/{len(ranks)}] ring.new_group: "
            early: list[EarlyLink] = []
            sockets.right, sockets.left, sockets.left_reader = link_neighbours(
                rank,
                peers,
                listener,
                session,
                prefix,
                time.monotonic() + config.timeout,
                config.timeout,
                early,
            )
            sockets.listener, sockets.session, sockets.early = listener, session, early
            listener = None  # the group owns it now
        return make(config, sockets)
    finally:
        if listener is not None:
            listener.close()
