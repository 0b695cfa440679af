"""The point-to-point protocol every backend speaks, without any I/O: header, verdict, data.

A send and its receive meet in three steps, whatever carries them:

- **header**, sender -> receiver: the message's layout, ``(bytes, elements,
  dtype code)`` (``layout_of``), on the send's tag;
- **verdict**, receiver -> sender: what the receiver decided (``verdict``), with
  the layout of the receive's own tensor: ``TAKEN`` when the dtype and the
  size in bytes agree (``fits``), ``REFUSED`` when not, ``SET_ASIDE`` when the
  message has another tag and is kept for a later receive (a transport that
  matches tags itself never sees one). A transport may carry the receive's
  layout alone, as ``LAYOUT``: the sender then decides with ``fits`` alike;
- **data**: the tensor's bytes, written into the receive's tensor only when
  taken. A transport that may not send data unasked sends it after
  ``TAKEN``; one that sends it at once has the receiver drain it otherwise.

A refusal raises on both ranks with the same numbers (``mismatch``): the
receiver when it decides, the sender when it reads the verdict
(``check_answer``), and the pair stays in step.

Receives are matched to arrived messages in the order they were posted
(``PostedReceives``): a message goes to the earliest posted receive that
accepts it (same tag; same source, or any source), which keeps messages
between one pair with one tag in the order sent, any-source receives included.
An engine that reads messages as they come, rather than probing for one
receive, hands each to ``match``, the same rule. A message that came before
any receive that accepts it waits aside (``take_aside``) for the first later one.

A backend supplies only a tagged byte transport, and drives these from its
own engine (lanes, a progress thread, an acceptor).
"""

from __future__ import annotations

import struct
from typing import Any, Generic, Protocol, TypeVar

import torch

from commlib.errors import CommError, MessageMismatchError
from commlib.p2p import MessageLayout, message_mismatch
from commlib.types import WIRE_DTYPES

__all__ = [
    "CODES",
    "LAYOUT",
    "MAGIC",
    "REFUSED",
    "SET_ASIDE",
    "TAKEN",
    "Layout",
    "Mismatch",
    "PostedReceives",
    "check_answer",
    "check_header",
    "dtype_of",
    "fits",
    "layout_of",
    "message_layout",
    "mismatch",
    "take_aside",
    "verdict",
]

Layout = tuple[int, int, int]
"""``(bytes, elements, dtype code)`` of a message (its header) or of a receive's tensor."""

LAYOUT = struct.Struct("<qqq")
"""A ``Layout`` as bytes, for transports that carry bytes (24: three little-endian int64)."""

MAGIC = 0x434C5032
"""Opens a header on transports whose tags another program could use ("CLP2")."""

TAKEN, REFUSED, SET_ASIDE = 0, 1, 2
"""The receiver's verdicts on a message (REFUSED: its dtype or size is not the receive's)."""

CODES: dict[torch.dtype, int] = {dtype: code for code, dtype in enumerate(WIRE_DTYPES)}
"""A dtype's code in headers: its index in ``WIRE_DTYPES`` (-1 for any other dtype)."""


def layout_of(tensor: torch.Tensor) -> Layout:
    """The header of a send of ``tensor``, or what a receive into it holds."""
    return tensor.nbytes, tensor.numel(), CODES.get(tensor.dtype, -1)


def dtype_of(code: int) -> torch.dtype | None:
    """The dtype of header code ``code`` (None for an unknown code)."""
    return WIRE_DTYPES[code] if 0 <= code < len(WIRE_DTYPES) else None


def message_layout(layout: Layout) -> MessageLayout:
    """``layout`` with the dtype itself in place of its code (None for an unknown code)."""
    nbytes, numel, code = layout
    return nbytes, numel, dtype_of(code)


def fits(sent: Layout, holds: Layout) -> bool:
    """Whether a message fits a receive's tensor: the same bytes and dtype (both sides decide alike)."""
    return sent[0] == holds[0] and sent[2] == holds[2]


def verdict(sent_tag: int, sent: Layout, tag: int, holds: Layout) -> int:
    """The receiver's verdict on a message of ``sent`` with ``sent_tag``, for a receive on ``tag``."""
    if sent_tag != tag:
        return SET_ASIDE
    return TAKEN if fits(sent, holds) else REFUSED


def check_header(words: Any, label: object, source: int) -> Layout:
    """The layout of a header ``(MAGIC, bytes, elements, dtype code)`` from ``source``.

    Raises:
        CommError: The header does not start with ``MAGIC``: another program uses the group's tags.
    """
    magic, nbytes, numel, code = words
    if magic != MAGIC:
        raise CommError(
            f"{label}: rank {source} sent a header commlib does not know ({list(words)}); another "
            "program uses this group's tags"
        )
    return nbytes, numel, code


def check_answer(answer: Any, label: object, peer: int, sent: Layout) -> None:
    """The sender's side of a verdict ``(verdict, bytes, elements, dtype code)``: return if taken.

    Raises:
        MessageMismatchError: REFUSED: the receive's tensor holds another dtype or size
            (``MessageSizeError`` when the sizes differ).
        CommError: Not a verdict.
    """
    code, *holds = answer
    if code == TAKEN or code == SET_ASIDE:
        return
    if code == REFUSED:
        raise mismatch(label, "send", peer, sent, tuple(holds))  # type: ignore[arg-type]
    raise CommError(f"{label}: rank {peer} answered the header with garbage ({list(answer)})")


def mismatch(
    label: object, side: str, peer: int, sent: Layout, holds: Layout, *, peer_told: bool = True
) -> MessageMismatchError:
    """The error ``side`` (``send`` or ``recv``) raises for a message of ``sent`` refused by ``holds``.

    ``peer_told`` False: the message was set aside before its receive was posted, and only
    the receiver learns of it (see ``commlib.p2p.message_mismatch``).
    """
    return message_mismatch(
        label, side, peer, message_layout(sent), message_layout(holds), peer_told=peer_told
    )


class Mismatch(Exception):  # noqa: N818 - a fact reported to the group, which raises its own error
    """A refused message, before it has a label: both sides fail with these numbers."""

    def __init__(self, side: str, peer: int, tag: int, sent: Layout, holds: Layout) -> None:
        super().__init__(f"{side} with rank {peer}, tag {tag}: {sent} sent, {holds} expected")
        self.side = side
        """``send`` or ``recv``: which end reports it."""
        self.peer = peer
        """The other side: the destination of a send, the source of a receive."""
        self.tag = tag
        self.sent = sent
        """The sender's message."""
        self.holds = holds
        """The receiver's tensor."""

    def error(self, label: object) -> MessageMismatchError:
        """The error for people, ``label`` naming this side's operation."""
        return mismatch(label, self.side, self.peer, self.sent, self.holds)


class Receive(Protocol):
    """What ``PostedReceives`` reads of a posted receive."""

    wanted: int | None
    """The source asked for (None: any)."""
    tag: int


R = TypeVar("R", bound=Receive)


class PostedReceives(Generic[R]):
    """The receives posted and not matched yet, in posting order, and which one a message goes to.

    The engine looks for a message for each receive in ``pending`` in order (a
    probe of ``(wanted, tag)``, any source for None); a message found for the
    one at ``index`` goes to ``take(index, source)``: the earliest posted
    receive that accepts it, which may come before the one probed.
    """

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: list[R] = []
        """Unmatched receives, oldest first. The engine reads it; only these methods write it, except
        that an engine may append a receive itself (``post``), and remove the first when the
        message it found goes to it (the earliest posted receive accepts it): the common case,
        without a call."""

    def post(self, receive: R) -> None:
        """Add a receive, after every one posted before."""
        self.pending.append(receive)

    def take(self, index: int, source: int) -> tuple[R, int]:
        """Remove and return the receive that gets the message from ``source`` found for ``pending[index]``.

        Returns:
            That receive, and the index to look at next (the probed receive again if it
            shifted left, else the one after it).
        """
        pending = self.pending
        tag = pending[index].tag
        for i in range(index + 1):
            receive = pending[i]
            if receive.tag == tag and (receive.wanted is None or receive.wanted == source):
                del pending[i]
                return receive, index - 1 if i < index else index
        raise AssertionError("the probed receive accepts its own message")  # pragma: no cover

    def match(self, source: int, tag: int) -> R | None:
        """Remove and return the earliest posted receive that accepts a message from ``source`` with ``tag``.

        For an engine whose readers find messages rather than probe for a receive: None when no
        receive takes the message (it goes aside, ``take_aside``).
        """
        pending = self.pending
        for i, receive in enumerate(pending):
            if receive.tag == tag and (receive.wanted is None or receive.wanted == source):
                del pending[i]
                return receive
        return None

    def uncovered(self) -> list[R]:
        """The receives no earlier one covers (has their tag and accepts all their sources), oldest first.

        Only these can be the earliest posted receive that accepts the next message. A
        transport that matches by itself, and gives a message to a receive from its source
        before one from any source, matches by this rule when it is handed only these, in order.
        """
        anys: set[int] = set()
        sources: set[tuple[int, int]] = set()
        found = []
        for receive in self.pending:
            tag, wanted = receive.tag, receive.wanted
            if tag in anys:
                continue
            if wanted is None:
                anys.add(tag)
            elif (wanted, tag) in sources:
                continue
            else:
                sources.add((wanted, tag))
            found.append(receive)
        return found

    def withdraw(self, receive: R) -> bool:
        """Remove ``receive`` if still unmatched; return True if so."""
        try:
            self.pending.remove(receive)
        except ValueError:
            return False
        return True

    def withdraw_all(self) -> list[R]:
        """Remove and return every unmatched receive."""
        withdrawn, self.pending = self.pending, []
        return withdrawn


class Aside(Protocol):
    """A message kept aside: its tag, its source (read to match one source), and whatever else is kept."""

    tag: int
    source: int


A = TypeVar("A", bound=Aside)


def take_aside(queue: list[A], tag: int, source: int | None = None) -> A | None:
    """Remove and return the oldest message of ``queue`` with ``tag`` (None if there is none).

    ``source``: only a message from that source (None: from any source).
    """
    for i, aside in enumerate(queue):
        if aside.tag == tag and (source is None or aside.source == source):
            return queue.pop(i)
    return None
