"""Who came to a store for the job check, and under which job token: read only for error messages.

In a store several jobs may share, each job token meets in its own part
(``backends.common.store_rendezvous``), so a rank never sees another token's
challenge or answers. What it can still tell the user, when its rank 0 or its
ranks do not come, is who else came: every rank leaves a record in a list kept
apart from any job's part, rank 0s in one list and the other ranks in another.

Nothing written there can do more than change a message:

- a record takes a slot with ``compare_set`` from empty (the first free one,
  found with ``check`` alone, in at most ``_PROBES`` checks), at most
  ``_CLAIM_TRIES`` times, and a slot is read only once ``check`` has found it:
  stray slots cost a rank a bounded number of calls, never a wait;
- no counter is kept (torch's store server drops the connection of a client
  whose ``add`` meets a value that is not a number, so a shared counter would
  let anyone break every job's connection);
- a record names no job token: it carries, per key the rank accepts, an HMAC of
  its fields, so only a rank holding one of those keys can tell the record is of
  its own job (a copy with a field changed is not), and nobody learns where a
  job's part lies.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import time
from typing import Any

from backends.common.admission import Claim, decode_json
from backends.common.jobtoken import JobToken, sign_with

__all__ = ["Arrival", "Presence", "first_free_slot"]

_ROOT = "commlib/job-check/v1/present"
_CLAIM_TRIES = 16
"""Slots a rank tries to take for its record before it goes on without one."""
_PROBES = 48
"""Existence checks a search for the first free slot may make; past them it gives up (a flood)."""
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
        self._record = self._signed(
            {
                "rank": self._rank,
                "world_size": self._world_size,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "identity": self._token.identity,
                "nonce": secrets.token_hex(8),
                "time": time.time(),
            }
        )
        where = _list(self._rank)
        try:
            slot: int | None = 1
            for _ in range(_CLAIM_TRIES):
                slot = first_free_slot(self._store, where, slot, _PROBES)
                if slot is None:
                    return
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
        fields = json.loads(self._record)
        fields.pop("marks")
        done = self._signed(fields | {"finished": True})
        try:
            self._store.compare_set(f"{_list(self._rank)}/{self._slot}", self._record, done)
        except Exception:  # noqa: BLE001, S110 - only a message would be wrong
            pass

    def _signed(self, fields: dict[str, Any]) -> str:
        """``fields`` with ``marks``: an HMAC of them under each key this rank accepts."""
        return json.dumps(
            fields | {"marks": [sign_with(key, "present", fields) for key in self._token.accepted]}
        )

    def arrivals(self, rank0: bool, newest: int) -> list[Arrival]:
        """The newest ``newest`` records of rank 0s (or of the other ranks), newest first, this one left out.

        Records older than the horizon and malformed ones are skipped. Empty if the store fails.
        """
        where = _list(0 if rank0 else 1)
        found: list[Arrival] = []
        try:
            free = first_free_slot(self._store, where, 1, _PROBES)
            if free is None:
                return []
            for slot in range(free - 1, max(0, free - 1 - newest), -1):
                key = f"{where}/{slot}"
                if (slot == self._slot and where == _list(self._rank)) or not self._store.check([key]):
                    continue  # this rank's own; or a gap a stray write left: never wait for a slot
                arrival = self._read(key, slot)
                if arrival is not None:
                    found.append(arrival)
        except Exception:  # noqa: BLE001 - a failing store: the message goes without them
            return []
        return found

    def _read(self, key: str, slot: int) -> Arrival | None:
        record = decode_json(bytes(self._store.get(key)), _RECORD_BYTES)
        if not isinstance(record, dict):
            return None
        numbers = [record.get(name) for name in ("rank", "world_size", "pid")]
        when, marks = record.get("time"), record.pop("marks", None)
        if (
            not all(type(v) is int for v in numbers)
            or not isinstance(when, float | int)
            or when < self._since
        ):
            return None
        if not isinstance(marks, list):
            return None
        ours = any(sign_with(key, "present", record) in marks for key in self._token.accepted)
        rank, world_size, pid = (int(v) for v in numbers)
        claim = Claim(rank, world_size, pid, str(record.get("host")), str(record.get("identity")))
        return Arrival(slot, claim, ours, record.get("finished") is True)


def _list(rank: int) -> str:
    return f"{_ROOT}/rank0" if rank == 0 else f"{_ROOT}/ranks"


def first_free_slot(store: Any, where: str, start: int, probes: int | None = None) -> int | None:
    """The first slot ``where/<n>`` from ``start`` on that was free when looked at: gallop, then bisect.

    Slots only ever go from free to taken (``compare_set`` from empty), in order, so the
    taken ones form a prefix: a slot seen free bounds the search from above and one seen
    taken from below, and ``O(log k)`` existence checks find it among ``k`` taken ones. A
    stray write past the end only makes a rank skip a few slots.

    Args:
        store: The store.
        where: The slots' key prefix.
        start: The first slot to look at.
        probes: The most existence checks to make (None: no bound; where only ranks holding
            the job's key write, the search ends by the slots they took).

    Returns:
        The slot, or None if ``probes`` checks did not find it.
    """
    checks = 0

    def taken(slot: int) -> bool:
        nonlocal checks
        checks += 1
        if probes is not None and checks > probes:
            raise _TooMany
        return bool(store.check([f"{where}/{slot}"]))

    try:
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
    except _TooMany:
        return None


class _TooMany(Exception):
    """``first_free_slot`` made the checks it may."""
