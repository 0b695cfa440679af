"""``monitored_barrier``: a barrier whose failure names the ranks that did not arrive.

torch.distributed's algorithm (Gloo's ``monitoredBarrier``), over the group's
own point-to-point messages, so it runs on every backend:

- every rank but 0 sends rank 0 an arrival (the number of this call on the
  group), then waits for rank 0's release;
- rank 0 waits for every arrival until its timeout, then releases every rank
  that arrived: with "go" if all did, or with the list of those that did not.

So rank 0 raises naming the missing ranks (the first one it waited for, or all
of them with ``wait_all_ranks=True``), and so does every rank that arrived, as
soon as rank 0 knows. A rank that arrived waits for rank 0 a little longer than
its timeout (``RELEASE_GRACE_S``), so that rank 0's verdict, reached at rank
0's own deadline, comes before its own. The messages use the tag reserved for
the interface (``max_tag + 1``): they never match a user's send or receive.

After a failure the group still holds the unmatched messages: end the job, or
destroy the group, as after any timeout.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from commlib.errors import CommError, CommTimeoutError, error_prefix
from commlib.work import Work

__all__ = ["RELEASE_GRACE_S", "monitored_barrier"]

RELEASE_GRACE_S = 2.0
"""How much longer than its timeout a rank that arrived waits for rank 0's release."""

_GO = 0
_MISSING = 1
_OTHER_CALL = 2
_NOT_WAITED_FOR = 3
"""A release's per-rank entries: arrived; did not arrive in time (or failed); arrived at another
call; not arrived when rank 0 stopped at the first missing rank (``wait_all_ranks=False``)."""

_NAME = "monitored_barrier"


class MonitoredGroup(Protocol):
    """What the monitored barrier needs of a group (``IProcessGroup`` has it)."""

    rank: int
    world_size: int
    backend: str
    _named_ranks: tuple[int, ...] | None

    def _reserved_p2p(self, kind: str, tensor: torch.Tensor, peer: int) -> Work: ...


def _prefix(group: MonitoredGroup) -> str:
    """``[rank 1/2] ring.monitored_barrier: ``, naming a subgroup by its global ranks."""
    return error_prefix(group.rank, group.world_size, group.backend, _NAME, group._named_ranks)


def monitored_barrier(group: MonitoredGroup, timeout_s: float, wait_all_ranks: bool, call: int) -> None:
    """Run one monitored barrier on ``group`` (see the module docstring).

    Args:
        group: The group; every rank calls this with the same ``call``.
        timeout_s: Seconds rank 0 waits for the arrivals (checked by the caller).
        wait_all_ranks: Rank 0 waits for every rank before it raises, and names all that did not arrive.
        call: The number of this call on the group (1 for the first), carried by every message.

    Raises:
        CommTimeoutError: A rank did not arrive within ``timeout_s`` (every rank that arrived
            raises it, naming the missing ranks), or rank 0 did not answer.
        CommError: A rank arrived at another monitored barrier call of this group.
    """
    if group.world_size == 1:
        return
    deadline = time.monotonic() + timeout_s
    if group.rank == 0:
        _lead(group, timeout_s, deadline, wait_all_ranks, call)
    else:
        _follow(group, timeout_s, deadline + RELEASE_GRACE_S, call)


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _lead(group: MonitoredGroup, timeout_s: float, deadline: float, wait_all_ranks: bool, call: int) -> None:
    """Rank 0: collect the arrivals, release the ranks that arrived, raise if any did not."""
    arrivals = {peer: torch.zeros(1, dtype=torch.int64) for peer in range(1, group.world_size)}
    works = {peer: group._reserved_p2p("recv", tensor, peer) for peer, tensor in arrivals.items()}
    verdict = [_GO] * group.world_size
    reasons: dict[int, str] = {}
    for peer, work in works.items():
        stop_early = bool(reasons) and not wait_all_ranks
        if stop_early and not work.is_completed():
            verdict[peer] = _NOT_WAITED_FOR
            continue
        try:
            work.wait(_remaining(deadline))
        except CommError as e:
            verdict[peer] = _MISSING
            reasons[peer] = "" if isinstance(e, CommTimeoutError) else f" ({e})"
            continue
        if int(arrivals[peer].item()) != call:
            verdict[peer] = _OTHER_CALL
            reasons[peer] = f" (it is at call #{int(arrivals[peer].item())})"
    release = torch.tensor([call, *verdict], dtype=torch.int64)
    answered = [peer for peer, work in works.items() if work.is_completed() and work.exception() is None]
    sends = [group._reserved_p2p("send", release, peer) for peer in answered]
    for send in sends:  # a rank that arrived is waiting for it: this takes no time unless it died
        try:
            send.wait(RELEASE_GRACE_S)
        except CommError:
            pass  # its own wait fails: it says so itself
    if reasons:
        raise _failure(group, verdict, reasons, timeout_s, call)


def _follow(group: MonitoredGroup, timeout_s: float, deadline: float, call: int) -> None:
    """A rank other than 0: announce the arrival, wait for rank 0's release."""
    arrival = torch.tensor([call], dtype=torch.int64)
    release = torch.zeros(group.world_size + 1, dtype=torch.int64)
    sent = group._reserved_p2p("send", arrival, 0)
    released = group._reserved_p2p("recv", release, 0)
    waited = timeout_s + RELEASE_GRACE_S
    try:
        sent.wait(_remaining(deadline))
        released.wait(_remaining(deadline))
    except CommTimeoutError:
        raise CommTimeoutError(
            f"{_prefix(group)}rank 0 did not answer within {waited:g} s ({timeout_s:g} s and "
            f"{RELEASE_GRACE_S:g} s of grace): rank 0 has not reached monitored_barrier call #{call}, or "
            "has not finished it (rank 0's error names the ranks it waited for)"
        ) from None
    verdict = [int(v) for v in release.tolist()]
    if verdict[0] != call:
        raise CommError(
            f"{_prefix(group)}rank 0 answered monitored_barrier call #{verdict[0]}, this rank is at "
            f"call #{call}: the ranks called monitored_barrier a different number of times"
        )
    if any(v != _GO for v in verdict[1:]):
        raise _failure(group, verdict[1:], {}, timeout_s, call)


def _failure(
    group: MonitoredGroup, verdict: list[int], reasons: dict[int, str], timeout_s: float, call: int
) -> CommError:
    """The error for a failed monitored barrier: the ranks missing, at another call, not waited for."""
    named = group._named_ranks

    def ranks(code: int) -> str:
        def who(r: int) -> str:  # on a subgroup, a group rank and the global rank it is
            return f"{r} (global {named[r]})" if named is not None else str(r)

        return ", ".join(f"{who(r)}{reasons.get(r, '')}" for r, v in enumerate(verdict) if v == code)

    parts = []
    if _MISSING in verdict:
        parts.append(
            f"ranks [{ranks(_MISSING)}] did not reach monitored_barrier call #{call} within {timeout_s:g} s"
        )
    if _OTHER_CALL in verdict:
        parts.append(f"ranks [{ranks(_OTHER_CALL)}] arrived at another monitored_barrier call than #{call}")
    if _NOT_WAITED_FOR in verdict:
        parts.append(
            f"ranks [{ranks(_NOT_WAITED_FOR)}] had not arrived either when rank 0 stopped at the first "
            "missing one (wait_all_ranks=True waits for every rank)"
        )
    source = "" if group.rank == 0 else "rank 0 reports: "
    error = CommTimeoutError if _MISSING in verdict else CommError
    return error(f"{_prefix(group)}{source}{'; '.join(parts)}")
