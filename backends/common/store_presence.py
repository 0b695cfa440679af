"""Who came to a store for the job check, and under which job token: read only for error messages.

In a store several jobs may share, each job token meets in its own part
(``backends.common.store_rendezvous``), so a rank never sees another token's
challenge or answers. What it can still tell the user, when its rank 0 or its
ranks do not come, is who else came: every rank leaves a record in a list kept
apart from any job's part, rank 0s in one list and the other ranks in another.

Nothing written there can do more than change a message:

- a record takes a slot with ``compare_set`` from empty (the first free one,
  found with ``check`` alone), at most ``_CLAIM_TRIES`` times: a flood of slots
  costs a rank a few calls, never its deadline;
- no counter is kept (torch's store server drops the connection of a client
  whose ``add`` meets a value that is not a number, so a shared counter would
  let anyone break every job's connection);
- a record names no job token: it carries a nonce and, per key the rank
  accepts, an HMAC of it, so only a rank holding one of those keys can tell the
  record is of its own job, and nobody learns where a job's part lies.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import time
from typing import Any

from backends.common.admission import Claim
from backends.common.jobtoken import JobToken, sign_with

__all__ = ["Arrival", "Presence", "first_free_slot"]

_ROOT = "commlib/job-check/v1/present"
_CLAIM_TRIES = 4
"""Slots a rank tries to take for its record before it goes on without one."""
_RECORD_BYTES = 4096
"""A record is a few hundred bytes; a longer value is not one."""


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A rank's record in the store.

    Attributes:
        slot: Its slot in its list.
        claim: What it claimed: rank, world size, pid, host, job description.
        ours: It was made with a key this rank accepts (a rank of this job).
        finished: Its rank said that its check ended (rank 0s say so).
    """

    slot: int
    claim: Claim
    ours: bool
    finished: bool


class Presence:
    """This rank's record in a store's lists of arrivals, and what it reads there.

    Args:
        store: The store the check runs in.
        rank: This rank (rank 0s are listed apart, so that a glance finds them).
        world_size: The world size it was started with.
        token: Its job token.
        horizon: Seconds back (from now) whose records count.
    """

    def __init__(self, store: Any, rank: int, world_size: int, token: JobToken, horizon: float) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._token = token
        self._since = time.time() - horizon
        self._slot = 0
        self._record = ""

    def note(self) -> None:
        """Leave this rank's record (best effort: a failing store fails the check's next step anyway)."""
        nonce = secrets.token_hex(8)
        self._record = json.dumps(
            {
                "rank": self._rank,
                "world_size": self._world_size,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "identity": self._token.identity,
                "nonce": nonce,
                "marks": [sign_with(key, "present", nonce) for key in self._token.accepted],
                "time": time.time(),
            }
        )
        where = _list(self._rank)
        try:
            slot = 1
            for _ in range(_CLAIM_TRIES):
                slot = first_free_slot(self._store, where, slot)
                if (
                    bytes(self._store.compare_set(f"{where}/{slot}", "", self._record))
                    == self._record.encode()
                ):
                    self._slot = slot
                    return
                slot += 1
        except Exception:  # noqa: BLE001, S110 - only a message would miss the record
            pass

    def finished(self) -> None:
        """Mark this rank's record: its check ended (so a later rank 0 does not take it for a duplicate)."""
        if not self._slot:
            return
        done = json.dumps(json.loads(self._record) | {"finished": True})
        try:
            self._store.compare_set(f"{_list(self._rank)}/{self._slot}", self._record, done)
        except Exception:  # noqa: BLE001, S110 - only a message would be wrong
            pass

    def arrivals(self, rank0: bool, newest: int) -> list[Arrival]:
        """The newest ``newest`` records of rank 0s (or of the other ranks), newest first, this one left out.

        Records older than the horizon and malformed ones are skipped. Empty if the store fails.
        """
        where = _list(0 if rank0 else 1)
        found: list[Arrival] = []
        try:
            last = first_free_slot(self._store, where, 1) - 1
            for slot in range(last, max(0, last - newest), -1):
                if slot == self._slot and where == _list(self._rank):
                    continue
                arrival = self._read(f"{where}/{slot}", slot)
                if arrival is not None:
                    found.append(arrival)
        except Exception:  # noqa: BLE001 - a failing store: the message goes without them
            return []
        return found

    def _read(self, key: str, slot: int) -> Arrival | None:
        raw = bytes(self._store.get(key))
        if len(raw) > _RECORD_BYTES:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(record, dict):
            return None
        numbers = [record.get(name) for name in ("rank", "world_size", "pid")]
        when, nonce, marks = record.get("time"), record.get("nonce"), record.get("marks")
        if (
            not all(type(v) is int for v in numbers)
            or not isinstance(when, float | int)
            or when < self._since
        ):
            return None
        if not isinstance(nonce, str) or not isinstance(marks, list):
            return None
        ours = any(sign_with(key, "present", nonce) in marks for key in self._token.accepted)
        rank, world_size, pid = (int(v) for v in numbers)
        claim = Claim(rank, world_size, pid, str(record.get("host")), str(record.get("identity")))
        return Arrival(slot, claim, ours, record.get("finished") is True)


def _list(rank: int) -> str:
    return f"{_ROOT}/rank0" if rank == 0 else f"{_ROOT}/ranks"


def first_free_slot(store: Any, where: str, start: int) -> int:
    """The first slot ``where/<n>`` from ``start`` on that was free when looked at: gallop, then bisect.

    Slots only ever go from free to taken (``compare_set`` from empty), in order, so the
    taken ones form a prefix: a slot seen free bounds the search from above and one seen
    taken from below, and ``O(log k)`` existence checks find it among ``k`` taken ones. A
    stray write past the end only makes a rank skip a few slots.
    """

    def taken(slot: int) -> bool:
        return bool(store.check([f"{where}/{slot}"]))

    if not taken(start):
        return start
    low, step = start, 1
    while taken(low + step):
        low += step
        step *= 2
    high = low + step
    while high - low > 1:
        middle = (low + high) // 2
        if taken(middle):
            low = middle
        else:
            high = middle
    return high
