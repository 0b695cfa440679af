"""Point-to-point requests: ``P2POp`` for ``batch_isend_irecv``, and what a backend receives for one.

``P2POp`` follows torch.distributed's: ``op`` is ``commlib.isend`` or
``commlib.irecv`` (a group's own ``isend`` / ``irecv`` work too), ``peer`` is a
global rank and ``group_peer`` a rank of ``group``; give exactly one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from commlib.errors import MessageMismatchError, MessageSizeError
from commlib.types import dtype_name

__all__ = ["MessageLayout", "P2POp", "P2PRequest", "describe_message", "message_mismatch"]

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


MessageLayout = tuple[int, int, torch.dtype | None]
"""``(bytes, elements, dtype)`` of a message or of a receive's tensor (dtype None: unknown here)."""


def describe_message(layout: MessageLayout) -> str:
    """``400 bytes (100 x float32)``."""
    nbytes, numel, dtype = layout
    return f"{nbytes} bytes ({numel} x {dtype_name(dtype) if dtype is not None else 'unknown dtype'})"


def message_mismatch(
    label: object, side: str, peer: int, sent: MessageLayout, holds: MessageLayout, *, peer_told: bool = True
) -> MessageMismatchError:
    """The error a send or a receive raises when the message does not fit the receive's tensor.

    A message fits when its dtype and its size in bytes are the receive's; every backend
    decides this on the receiver before any byte lands in its tensor, and tells the sender.

    Args:
        label: This side's operation (``[rank 0/2] ring.send #1 to rank 1 tag 0 (float32, 100 elements)``).
        side: ``send`` or ``recv``: which end raises.
        peer: The other end's rank.
        sent: The sender's message.
        holds: The receive's tensor.
        peer_told: The other end raises too (False: the message was set aside before its
            receive was posted, and only the receiver learns of it).

    Returns:
        ``MessageSizeError`` when the sizes in bytes differ, else ``MessageMismatchError``.
    """
    other = (
        f"rank {peer} raises too"
        if peer_told
        else f"rank {peer} was not told: the message came before a recv with its tag, and its send completed"
    )
    if side == "send":
        what = (
            f"rank {peer}'s matching recv holds {describe_message(holds)}, but this send has "
            f"{describe_message(sent)}; nothing was received ({other})"
        )
    else:
        what = (
            f"rank {peer} sends {describe_message(sent)}, but this recv's tensor holds "
            f"{describe_message(holds)}; nothing was written into it ({other})"
        )
    sizes_differ = sent[0] != holds[0]
    dtypes_differ = sent[2] != holds[2]
    if dtypes_differ and sent[2] is not None and holds[2] is not None:
        want, has = dtype_name(sent[2]), dtype_name(holds[2])
        fix = (
            f"A send and its recv must have the same dtype and number of elements: receive into a {want} "
            f"tensor (convert it after with .to(torch.{has})), or send tensor.to(torch.{has})"
        )
    elif dtypes_differ:
        fix = "A send and its recv must have the same dtype and number of elements"
    else:
        fix = "A send and its recv must have tensors of the same dtype and size"
    text = f"{label}: {what}. {fix}; the pair stays usable"
    return MessageSizeError(text) if sizes_differ else MessageMismatchError(text)
