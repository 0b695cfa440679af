"""The point-to-point front end: checks, counts and issues a group's sends, receives and batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.autograd.graph import increment_version

from commlib.diagnosis import Diagnostics
from commlib.env import DistEnv
from commlib.p2p import P2POp, P2PRequest
from commlib.work import Work

__all__ = [
    "batch_isend_irecv",
    "checked_request",
    "issue",
    "point_to_point",
    "reserved",
    "run",
]


class P2PGroup(Protocol):
    """What the front end uses of its group (``IProcessGroup`` has it)."""

    rank: int
    max_tag: int
    _env: DistEnv
    _p2p_counts: dict[tuple[str, int | None, int], int]
    _diagnostics: Diagnostics | None

    def _prefix(self, op: str) -> str: ...
    def _check_usable(self, op: str) -> None: ...
    def _check_tensor(self, op: str, tensor: object, arg: str) -> None: ...
    def _check_peer(self, name: str, kind: str, peer: object) -> None: ...
    def _check_tag(self, name: str, tag: object) -> None: ...
    def _group_rank_of(self, op: str, global_rank: object, arg: str) -> int: ...
    def _p2p_now(self, request: P2PRequest) -> int: ...
    def _start_p2p(self, request: P2PRequest, async_op: bool) -> list[Work]: ...
    def _batch_p2p(self, requests: list[P2PRequest], async_op: bool) -> list[Work]: ...


def issue(
    group: P2PGroup,
    requests: list[P2PRequest],
    start: Callable[[Any, bool], list[Work]],
    what: Any,
    async_op: bool,
) -> list[Work]:
    """Issue point-to-point operations (they never advance ``_seq``); return their works.

    ``start(what, async_op)`` starts them; with ``async_op=False`` it may run them to the end first.
    The diagnosis, when it is on, watches them.
    """
    diagnostics = group._diagnostics
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


def run(group: P2PGroup, request: P2PRequest) -> int:
    """Run one ``send`` or ``recv`` to its end, followed by the diagnosis; return the peer (source)."""
    diagnostics = group._diagnostics
    if diagnostics is None:
        return group._p2p_now(request)
    return diagnostics.run_p2p(request, group._p2p_now)


def point_to_point(
    group: P2PGroup, name: str, kind: str, tensor: torch.Tensor, peer: int | None, tag: int
) -> Work:
    """Check, record and start one ``isend`` or ``irecv``; return its work."""
    group._check_usable(name)
    checked = checked_request(group, name, kind, tensor, peer, tag)
    (work,) = issue(group, [checked], group._start_p2p, checked, True)
    return work


def batch_isend_irecv(group: P2PGroup, p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Check every op of ``p2p_op_list`` and start them all at once; return their works, in order."""
    name = "batch_isend_irecv"
    group._check_usable(name)
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError(
            f"{group._prefix(name)}expected a non-empty list of commlib.P2POp, got {p2p_op_list!r}"
        )
    requests = []
    for i, p2p in enumerate(p2p_op_list):
        if not isinstance(p2p, P2POp):
            raise TypeError(
                f"{group._prefix(name)}p2p_op_list[{i}] is {type(p2p).__name__}, not a commlib.P2POp"
            )
        if p2p.group is not None and p2p.group is not group:
            raise ValueError(
                f"{group._prefix(name)}p2p_op_list[{i}] belongs to another group ({p2p.group!r}); "
                "every op of one batch must belong to the group it is issued on"
            )
        peer = _peer_of(group, name, p2p, f"p2p_op_list[{i}]")
        requests.append(checked_request(group, name, p2p.kind, p2p.tensor, peer, p2p.tag))
    return issue(group, requests, group._batch_p2p, requests, True)


def checked_request(
    group: P2PGroup, name: str, kind: str, tensor: torch.Tensor, peer: int | None, tag: int
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


def reserved(group: P2PGroup, kind: str, tensor: torch.Tensor, peer: int) -> Work:
    """Start a send or receive of the interface's own on the reserved tag ``max_tag + 1``.

    No user's send or receive can name that tag, so these never match one. ``tensor`` is
    the interface's own: flat, on the host, never seen by autograd.
    """
    key = (kind, peer, group.max_tag + 1)
    group._p2p_counts[key] = seq = group._p2p_counts.get(key, 0) + 1
    own = P2PRequest(kind, tensor, peer, group.max_tag + 1, seq)
    (work,) = issue(group, [own], group._start_p2p, own, True)
    return work


def _peer_of(group: P2PGroup, name: str, p2p: P2POp, what: str) -> int | None:
    """The group rank a ``P2POp`` names (``peer`` is global, ``group_peer`` a rank of this group)."""
    if (p2p.peer is None) == (p2p.group_peer is None):
        if p2p.kind == "recv" and p2p.peer is None:
            return None
        raise ValueError(f"{group._prefix(name)}{what}: give exactly one of peer (global) and group_peer")
    if p2p.group_peer is not None:
        return p2p.group_peer
    return group._group_rank_of(name, p2p.peer, f"{what}.peer")
