"""The point-to-point front end: checks, counts and issues a group's sends, receives and batches.

``PointToPoint`` is a base of ``IProcessGroup``: ``send``, ``recv``, ``isend``,
``irecv`` and ``batch_isend_irecv``, and the hooks a backend implements them with
(``_send``, ``_recv``, ``_p2p_now``, ``_batch_p2p``). Point-to-point operations
never advance the group's collective count: they are counted per (kind, peer, tag).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import increment_version

from commlib.diagnosis import Diagnostics
from commlib.env import DistEnv
from commlib.p2p import P2POp, P2PRequest
from commlib.work import CollectiveLabel, Work

__all__ = ["PointToPoint", "checked_request", "issue", "run"]


class PointToPoint:
    """The point-to-point operations of ``IProcessGroup`` and their backend hooks."""

    rank: int
    world_size: int
    backend: str
    backend_name: str
    max_tag: int
    _env: DistEnv
    _diagnostics: Diagnostics | None
    _named_ranks: tuple[int, ...] | None

    if TYPE_CHECKING:  # IProcessGroup's

        def _prefix(self, op: str) -> str: ...
        def _not_implemented(self, op: str) -> NotImplementedError: ...
        def _check_usable(self, op: str) -> None: ...
        def _check_tensor(self, op: str, tensor: object, arg: str) -> None: ...
        def _check_peer(self, name: str, kind: str, peer: object) -> None: ...
        def _check_tag(self, name: str, tag: object) -> None: ...
        def _group_rank_of(self, op: str, global_rank: object, arg: str) -> int: ...

    def _init_point_to_point(self) -> None:
        self._p2p_counts: dict[tuple[str, int | None, int], int] = {}
        """Point-to-point operations issued so far, per (``send``/``recv``, peer, tag)."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst``; return once it can be reused.

        The matching ``recv`` must name this rank (or any rank) and ``tag`` and
        pass a tensor of as many bytes. Messages from one rank to another with
        one tag arrive in the order sent.

        Args:
            tensor: Contiguous tensor to send.
            dst: The receiving rank (not this one).
            tag: Matches the receive (``0..max_tag``).

        Raises:
            CommError: The receiver's tensor has a different size (raised on both
                sides), or the peer failed.
            CommTimeoutError: No matching receive within the group's timeout.
        """
        self._check_usable("send")
        run(self, checked_request(self, "send", "send", tensor, dst, tag))

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> int:
        """Receive a message from rank ``src`` (None: any rank) into ``tensor``; return the sender's rank.

        Args:
            tensor: Contiguous tensor with as many bytes as the message.
            src: The sending rank, or None for whichever sends first.
            tag: Matches the send.

        Raises:
            CommError: The message has a different size than ``tensor`` (raised on
                both sides), or the peer failed.
            CommTimeoutError: No message within the group's timeout.
        """
        self._check_usable("recv")
        return run(self, checked_request(self, "recv", "recv", tensor, src, tag))

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Start ``send``; return its ``Work`` (do not touch ``tensor`` until it completes)."""
        self._check_usable("isend")
        request = checked_request(self, "isend", "send", tensor, dst, tag)
        (work,) = issue(self, [request], self._start_p2p, request, True)
        return work

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        """Start ``recv``; return its ``Work`` (``work.source_rank()`` names the sender once it completed)."""
        self._check_usable("irecv")
        request = checked_request(self, "irecv", "recv", tensor, src, tag)
        (work,) = issue(self, [request], self._start_p2p, request, True)
        return work

    def batch_isend_irecv(self, p2p_op_list: Sequence[P2POp]) -> list[Work]:
        """Start every send and receive of ``p2p_op_list`` at once; return their works, in order.

        Sends and receives in one batch never wait for each other, so two ranks may
        send to each other in one batch each. Every op must belong to this group
        (``P2POp(..., group=group)``, or ``group.isend`` / ``group.irecv`` as ``op``).

        Raises:
            ValueError: The list is empty, or an op names another group, a bad peer or tag.
        """
        name = "batch_isend_irecv"
        self._check_usable(name)
        if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
            raise ValueError(
                f"{self._prefix(name)}expected a non-empty list of commlib.P2POp, got {p2p_op_list!r}"
            )
        requests = []
        for i, p2p in enumerate(p2p_op_list):
            if not isinstance(p2p, P2POp):
                raise TypeError(
                    f"{self._prefix(name)}p2p_op_list[{i}] is {type(p2p).__name__}, not a commlib.P2POp"
                )
            if p2p.group is not None and p2p.group is not self:
                raise ValueError(
                    f"{self._prefix(name)}p2p_op_list[{i}] belongs to another group ({p2p.group!r}); "
                    "every op of one batch must belong to the group it is issued on"
                )
            peer = _peer_of(self, name, p2p, f"p2p_op_list[{i}]")
            requests.append(checked_request(self, name, p2p.kind, p2p.tensor, peer, p2p.tag))
        return issue(self, requests, self._batch_p2p, requests, True)

    def _start_p2p(self, request: P2PRequest, async_op: bool) -> list[Work]:
        start = self._send if request.kind == "send" else self._recv
        return [start(request, async_op)]

    def _reserved_p2p(self, kind: str, tensor: torch.Tensor, peer: int) -> Work:
        """Start a send or receive of the interface's own on the reserved tag ``max_tag + 1``.

        No user's send or receive can name that tag, so these never match one. ``tensor`` is
        the interface's own: flat, on the host, never seen by autograd. The diagnosis does not
        watch them: the operation they serve reports its own failures, and a stall warning
        about a tag the user never used would only mislead.
        """
        key = (kind, peer, self.max_tag + 1)
        self._p2p_counts[key] = seq = self._p2p_counts.get(key, 0) + 1
        own = P2PRequest(kind, tensor, peer, self.max_tag + 1, seq)
        (work,) = issue(self, [own], self._start_p2p, own, True, watched=False)
        return work

    def _request_label(self, request: P2PRequest) -> CollectiveLabel:
        """Name a checked send or receive for messages, by its own number (``mpi.send #2 to rank 1 ...``)."""
        kind, tensor, peer, tag, seq = request
        env = self._env
        return CollectiveLabel(
            env.rank, env.world_size, self.backend_name, kind, seq, tensor, peer, tag, self._named_ranks
        )

    # --------------------------------------------------- backend implementation
    def _p2p_now(self, request: P2PRequest) -> int:
        """Run one send or receive on this thread, to its end; return the peer (a receive's source).

        The default starts it with ``_send`` / ``_recv`` (``async_op=False``) and
        waits for its work; a backend that can run it without a work overrides it.
        """
        (work,) = self._start_p2p(request, False)
        work.wait()
        if request.peer is not None:
            return request.peer
        work._is_recv = True  # noqa: SLF001
        return work.source_rank()

    def _send(self, request: P2PRequest, async_op: bool) -> Work:
        """Start ``request``: a send of flat ``request.tensor`` to ``request.peer`` (never this rank).

        The work fails on both sides if the receiver's tensor has a different
        size, and with ``CommTimeoutError`` naming peer and tag if no receive
        comes within the group's timeout. It must not advance ``_seq``. Its
        messages name it by ``_request_label(request)``.
        """
        raise self._not_implemented("send")

    def _recv(self, request: P2PRequest, async_op: bool) -> Work:
        """Start ``request``: a receive into flat ``request.tensor`` from ``request.peer``.

        ``request.peer`` None: from any rank (``work._set_source(r)``).
        """
        raise self._not_implemented("recv")

    def _batch_p2p(self, requests: list[P2PRequest], async_op: bool) -> list[Work]:
        """Start every request at once, in order; return their works.

        The default calls ``_send`` / ``_recv`` with ``async_op=True`` for each. A
        backend overrides it only if those could block each other (two ranks
        sending to each other in one batch must not deadlock).
        """
        return [(self._send if r.kind == "send" else self._recv)(r, True) for r in requests]


def issue(
    group: PointToPoint,
    requests: list[P2PRequest],
    start: Callable[[Any, bool], list[Work]],
    what: Any,
    async_op: bool,
    *,
    watched: bool = True,
) -> list[Work]:
    """Issue point-to-point operations (they never advance ``_seq``); return their works.

    ``start(what, async_op)`` starts them; with ``async_op=False`` it may run them to the end first.
    The diagnosis, when it is on, watches them (unless ``watched`` is False).
    """
    diagnostics = group._diagnostics if watched else None
    works = (
        diagnostics.issue_p2p(group, requests, start, what, async_op)
        if diagnostics is not None
        else start(what, async_op)
    )
    for request, work in zip(requests, works, strict=True):
        work._set_value([request.tensor])  # noqa: SLF001
        if request.kind == "recv":
            work._is_recv = True  # noqa: SLF001
            if request.peer is not None:
                work._source = request.peer  # noqa: SLF001
    return works


def run(group: PointToPoint, request: P2PRequest) -> int:
    """Run one ``send`` or ``recv`` to its end, followed by the diagnosis; return the peer (source)."""
    diagnostics = group._diagnostics
    if diagnostics is None:
        return group._p2p_now(request)
    return diagnostics.run_p2p(request, group._p2p_now)


def checked_request(
    group: PointToPoint, name: str, kind: str, tensor: torch.Tensor, peer: int | None, tag: int
) -> P2PRequest:
    """Check one send or receive and count it; return what the backend gets."""
    group._check_tensor(name, tensor, "tensor")
    env = group._env
    # The common case costs two comparisons each; anything else gets the full checks.
    if peer.__class__ is not int or not 0 <= peer < env.world_size or peer == env.rank:
        group._check_peer(name, kind, peer)
    if tag.__class__ is not int or not 0 <= tag <= group.max_tag:
        group._check_tag(name, tag)
    flat = tensor if tensor.dim() == 1 and not tensor.requires_grad else tensor.detach().view(-1)
    if kind == "recv":
        increment_version(flat)
    key = (kind, peer, tag)
    seq = group._p2p_counts.get(key, 0) + 1
    group._p2p_counts[key] = seq
    return P2PRequest(kind, flat, peer, tag, seq)


def _peer_of(group: PointToPoint, name: str, p2p: P2POp, what: str) -> int | None:
    """The group rank a ``P2POp`` names (``peer`` is global, ``group_peer`` a rank of this group)."""
    if (p2p.peer is None) == (p2p.group_peer is None):
        if p2p.kind == "recv" and p2p.peer is None:
            return None
        raise ValueError(f"{group._prefix(name)}{what}: give exactly one of peer (global) and group_peer")
    if p2p.group_peer is not None:
        return p2p.group_peer
    return group._group_rank_of(name, p2p.peer, f"{what}.peer")
