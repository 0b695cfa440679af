"""Point-to-point requests: ``P2POp`` for ``batch_isend_irecv``, and what a backend receives for one.

``P2POp`` follows torch.distributed's: ``op`` is ``commlib.isend`` or
``commlib.irecv`` (a group's own ``isend`` / ``irecv`` work too), ``peer`` is a
global rank and ``group_peer`` a rank of ``group``; give exactly one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["P2POp", "P2PRequest"]

_KINDS = {"isend": "send", "irecv": "recv"}


class P2POp:
    """One send or receive of ``batch_isend_irecv``.

    Args:
        op: ``commlib.isend`` or ``commlib.irecv`` (or a group's bound ``isend`` / ``irecv``).
        tensor: The tensor to send, or to receive into.
        peer: The other rank, as a global rank.
        group: The group (default: the bound method's group, else the default group).
        tag: Matches a send with a receive (0 by default).
        group_peer: The other rank, as a rank of ``group`` (instead of ``peer``).

    Raises:
        TypeError: ``op`` is neither isend nor irecv.

    Example::

        >>> ops = [commlib.P2POp(commlib.isend, out, peer=(rank + 1) % n),
        ...        commlib.P2POp(commlib.irecv, inp, peer=(rank - 1) % n)]
        >>> for work in commlib.batch_isend_irecv(ops):
        ...     work.wait()
    """

    __slots__ = ("op", "tensor", "peer", "group", "tag", "group_peer", "kind")

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: torch.Tensor,
        peer: int | None = None,
        group: Any = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        kind = _KINDS.get(getattr(op, "__name__", ""))
        if kind is None:
            raise TypeError(
                f"P2POp: op must be commlib.isend or commlib.irecv (or a group's isend / irecv), got {op!r}"
            )
        bound = getattr(op, "__self__", None)
        if bound is not None and hasattr(bound, "batch_isend_irecv"):
            if group is not None and group is not bound:
                raise ValueError(f"P2POp: op is bound to {bound!r} but group is {group!r}")
            group = bound
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer
        self.kind = kind
        """``send`` or ``recv``."""

    def __repr__(self) -> str:
        where = f"group_peer={self.group_peer}" if self.group_peer is not None else f"peer={self.peer}"
        return f"P2POp({self.kind}, {where}, tag={self.tag})"


class P2PRequest(NamedTuple):
    """A checked send or receive, as ``IProcessGroup._batch_p2p`` receives it."""

    kind: str
    """``send`` or ``recv``."""
    tensor: torch.Tensor
    """Flat view of the caller's tensor."""
    peer: int | None
    """The other rank, as a rank of this group (None: a receive from any rank)."""
    tag: int
    """The tag."""
    seq: int
    """Its number among this rank's operations of this kind with this peer and tag (1 for the first)."""
