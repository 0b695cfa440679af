"""Stall reports: a watchdog thread per group that notices a collective waiting too long and says why.

The thread that issues collectives only records, in a few attribute stores, which
collective it issued and which it finished (``CollectiveTracker``). The watchdog
thread looks at that once per poll. When the oldest collective still in flight
has waited ``stall_s`` seconds, it asks every rank, over the side channel, for
its progress, and logs one WARNING on the ``"commlib"`` logger naming the
collective, the ranks that have not reached it and their last completed
collective. It repeats at most every ``stall_s`` while the collective waits; the
collective itself goes on waiting until its timeout. The same thread answers
the other ranks' progress questions.

Point-to-point operations are watched too: a send or receive that waits
``stall_s`` gets a report naming the pair and the tag, and what the peer has
posted for it (its progress answer lists each rank's sends and receives per
peer and tag).

Records are tuples ``(seq, kind, dtype, shape, op, root)`` for collectives and
``(seq, kind, dtype, shape, None, peer, tag)`` for point-to-point (``seq``
counts per peer and tag there): cheap to build, and turned into text only when
a report needs it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from commlib.diagnosis.fingerprint import describe_call
from commlib.diagnosis.sidechannel import T_PROGRESS, T_QUERY, T_REPORT, T_STATUS, FrameReader, send_frame
from commlib.errors import format_ranks
from commlib.p2p import P2PRequest
from commlib.work import Work

__all__ = [
    "CollectiveTracker",
    "Record",
    "Watchdog",
    "describe_record",
    "format_p2p_stall",
    "format_stall",
    "p2p_record",
]

logger = logging.getLogger("commlib")

Record = tuple[Any, ...]
"""``(seq, kind, dtype, shape, op, root)`` of one collective; ``(seq, kind, dtype, shape, None, peer, tag)``
of one send or receive."""

P2PKey = tuple[str, "int | None", int]
"""``(send or recv, peer, tag)``."""


def p2p_record(request: P2PRequest) -> Record:
    """The record of a send or receive."""
    kind, tensor, peer, tag, seq = request
    return (seq, kind, tensor.dtype, tensor.shape, None, peer, tag)


_REPORT_WAIT_S = 5.0
"""How long the watchdog waits for the hub's answer before it reports what it knows alone."""


def describe_record(record: Record | None) -> str:
    """``#7 all_reduce float32 (100,) SUM``, or ``none`` for no collective."""
    if record is None:
        return "none"
    if len(record) > 6:
        return f"#{record[0]} {_p2p_call(record)}"
    seq, kind, dtype, shape, op, root = record
    return f"#{seq} {describe_call(kind, dtype, shape, op, root)}"


def _p2p_call(record: Record) -> str:
    """``send to rank 1 tag 0 float32 (8,)``."""
    _, kind, dtype, shape, _, peer, tag = record
    other = f"rank {peer}" if peer is not None else "any rank"
    tensor = describe_call(kind, dtype, shape, None, -1).removeprefix(kind).strip()
    return f"{kind} {'to' if kind == 'send' else 'from'} {other} tag {tag} {tensor}"


class CollectiveTracker:
    """What one rank has issued and finished on a group: written by the issuing thread, read by the watchdog.

    Attributes:
        issued: The last collective issued.
        active: The collective the issuing thread is blocked in (a synchronous
            call, or the issue of an asynchronous one), else None.
        completed: The last collective known to have finished successfully.
        pending: Asynchronous collectives issued and not yet seen finished, oldest first.
        p2p_pending: Sends and receives not finished when issued, with when they were issued
            (the issuing thread appends, the watchdog takes out the finished ones).
        p2p_done: Per (``send``/``recv``, peer, tag): the number of the last one the watchdog saw
            finish (written by the watchdog).
        p2p_active: The synchronous send or receive the issuing thread is blocked in (it has
            no work), with when it was issued, else None (its request: its record is made only
            if a report needs it).
        p2p_done_inline: The same as ``p2p_done`` for those that finished before their call
            returned: every synchronous one, and asynchronous ones already done when issued
            (written by the issuing thread, so that they are never queued).

    Args:
        p2p_issued: The group's own count of sends and receives per (kind, peer, tag), read here.
    """

    __slots__ = (
        "issued",
        "active",
        "completed",
        "pending",
        "p2p_pending",
        "p2p_done",
        "p2p_active",
        "p2p_done_inline",
        "_p2p_issued",
    )

    def __init__(self, p2p_issued: dict[P2PKey, int] | None = None) -> None:
        self.issued: Record | None = None
        self.active: Record | None = None
        self.completed: Record | None = None
        self.pending: deque[tuple[Record, Work]] = deque(maxlen=4096)
        self.p2p_pending: deque[tuple[Record, Work, float]] = deque(maxlen=4096)
        self.p2p_done: dict[P2PKey, int] = {}
        self.p2p_active: tuple[P2PRequest, float] | None = None
        self.p2p_done_inline: dict[P2PKey, int] = {}
        self._p2p_issued = p2p_issued if p2p_issued is not None else {}

    def prune(self, may_test: Callable[[Work], bool]) -> None:
        """Forget finished asynchronous collectives (oldest first); note the last that succeeded.

        ``may_test(work)`` says whether a work not yet settled may be tested
        with ``is_completed()`` (which asks the backend) from this thread.
        """
        pending = self.pending
        while pending:
            record, work = pending[0]
            done = work._done or (may_test(work) and work.is_completed())  # noqa: SLF001 - a plain read
            if not done:
                return
            pending.popleft()
            if work.exception() is None and (self.completed is None or record[0] > self.completed[0]):
                self.completed = record

    def track_p2p(self, records: list[Record], works: list[Work], now: float) -> None:
        """Note sends and receives just issued (the issuing thread): queue those still in flight.

        One that already finished is counted at once and never queued.
        """
        for record, work in zip(records, works, strict=True):
            if not work._done:  # noqa: SLF001 - a plain read
                self.p2p_pending.append((record, work, now))
            elif work._error is None:  # noqa: SLF001
                self.finished_inline((record[1], record[5], record[6]), record[0])

    def finished_inline(self, key: P2PKey, seq: int) -> None:
        """Count send or receive number ``seq`` of ``key``, which just finished (the issuing thread)."""
        done = self.p2p_done_inline
        if done.get(key, 0) < seq:  # another thread may have counted a later one
            done[key] = seq

    def prune_p2p(self, may_test: Callable[[Work], bool]) -> None:
        """Forget sends and receives that finished (in any order; each counts toward its peer and tag).

        Takes each queued item out once and puts back the unfinished ones, so
        that an item the issuing thread appends meanwhile is never lost.
        """
        pending = self.p2p_pending
        for _ in range(len(pending)):
            item = pending.popleft()
            record, work, _ = item
            if work._done or (may_test(work) and work.is_completed()):  # noqa: SLF001 - a plain read
                if work.exception() is None:
                    key = (record[1], record[5], record[6])
                    self.p2p_done[key] = max(self.p2p_done.get(key, 0), record[0])
            else:
                pending.append(item)

    def oldest_p2p(self) -> tuple[Record, Work | None, float] | None:
        """The send or receive in flight the longest: its record, work (None: inline), issue time."""
        pending: list[tuple[Record, Work | None, float]] = list(self.p2p_pending)
        active = self.p2p_active
        if active is not None:
            pending.append((p2p_record(active[0]), None, active[1]))
        return min(pending, key=lambda item: item[2]) if pending else None

    def oldest_in_flight(self) -> tuple[Record, Work | None] | None:
        """Return the oldest collective still in flight, with its work if it is asynchronous."""
        candidates: list[tuple[Record, Work | None]] = []
        if self.pending:
            with contextlib.suppress(IndexError):
                candidates.append(self.pending[0])
        active = self.active
        if active is not None:
            candidates.append((active, None))
        if not candidates:
            return None
        return min(candidates, key=lambda item: item[0][0])

    def progress(self) -> dict[str, Any]:
        """This rank's progress, as JSON-ready values (for the other ranks' stall reports)."""
        in_flight = self.oldest_in_flight()
        progress: dict[str, Any] = {
            "issued": _record_json(self.issued),
            "completed": _record_json(self.completed),
            "waiting": _record_json(in_flight[0]) if in_flight else None,
        }
        issued = dict(self._p2p_issued)  # one C-level copy: the issuing thread may add keys meanwhile
        if issued:
            done = dict(self.p2p_done)
            for key, seq in dict(self.p2p_done_inline).items():
                done[key] = max(done.get(key, 0), seq)
            progress["p2p"] = {
                _p2p_key_text(key): {"issued": count, "completed": done.get(key, 0)}
                for key, count in issued.items()
            }
        return progress


def _p2p_key_text(key: P2PKey) -> str:
    kind, peer, tag = key
    return f"{kind} {'any' if peer is None else peer} {tag}"


def _record_json(record: Record | None) -> dict[str, Any] | None:
    if record is None:
        return None
    return {"seq": record[0], "what": describe_record(record)}


def _details(record: Record) -> str:
    """``float32 (100,) SUM``: the record without its sequence number and collective."""
    _, kind, dtype, shape, op, root = record
    return describe_call(kind, dtype, shape, op, root).removeprefix(kind).strip()


def format_stall(
    label: str,
    record: Record,
    waited_s: float,
    stall_s: float,
    timeout_s: float,
    peers: dict[str, Any] | None,
    context: str | None,
    no_peers_reason: str = "",
) -> str:
    """Compose the stall warning.

    Args:
        label: ``[rank 0/2] gloo``: this rank and backend.
        record: The collective that waits.
        waited_s: How long it has waited.
        stall_s: ``COMMLIB_STALL_S``.
        timeout_s: The group's timeout.
        peers: Every rank's progress (``{"0": {...}, "1": {"absent": why}}``), or None.
        context: What the caller attached to the collective (``Work.annotate``).
        no_peers_reason: Why ``peers`` is None.
    """
    seq, kind = record[0], record[1]
    details = _details(record)
    head = (
        f"{label}.{kind} #{seq}{f' ({details})' if details else ''} has waited {waited_s:.0f} s "
        f"(COMMLIB_STALL_S={stall_s:g}); it goes on waiting until the timeout ({timeout_s:g} s, "
        "COMMLIB_TIMEOUT)."
    )
    if context:
        head += f" Context: {context}."
    if peers is None:
        return f"{head} The other ranks could not be asked: {no_peers_reason}"
    behind, absent = [], []
    calls: dict[str, str] = {}
    for rank_text in sorted(peers, key=int):
        info = peers[rank_text]
        if "absent" in info:
            absent.append(f"rank {rank_text} ({info['absent']})")
            continue
        issued = info.get("issued") or {}
        if issued.get("seq", 0) < seq:
            completed = info.get("completed") or {}
            behind.append(
                f"rank {rank_text} (last completed: {completed.get('what', 'none')}; "
                f"last issued: {issued.get('what', 'none')})"
            )
        else:
            calls[rank_text] = _call_at(seq, info)
    parts = [head]
    if behind:
        parts.append("Ranks that have not reached it: " + "; ".join(behind) + ".")
    if absent:
        parts.append("Ranks that did not answer: " + "; ".join(absent) + ".")
    if not behind and not absent:
        parts.append(_reached_by_all(seq, calls))
    return " ".join(parts)


def format_p2p_stall(
    label: str,
    rank: int,
    record: Record,
    waited_s: float,
    stall_s: float,
    timeout_s: float,
    peers: dict[str, Any] | None,
    context: str | None,
    no_peers_reason: str = "",
) -> str:
    """Compose the stall warning of a send or receive: the pair, the tag, and what the peer has posted.

    Args:
        label: ``[rank 0/2] gloo``: this rank and backend.
        rank: This rank.
        record: The send or receive that waits (``(seq, kind, dtype, shape, None, peer, tag)``).
        waited_s: How long it has waited.
        stall_s: ``COMMLIB_STALL_S``.
        timeout_s: The group's timeout.
        peers: Every rank's progress, or None.
        context: What the caller attached to the operation (``Work.annotate``).
        no_peers_reason: Why ``peers`` is None.
    """
    seq, kind, _, _, _, peer, tag = record
    head = (
        f"{label}.{kind} #{seq} {_p2p_call(record).removeprefix(kind).strip()} has waited {waited_s:.0f} s "
        f"(COMMLIB_STALL_S={stall_s:g}); it goes on waiting until the timeout ({timeout_s:g} s, "
        "COMMLIB_TIMEOUT)."
    )
    if context:
        head += f" Context: {context}."
    if peers is None:
        return f"{head} The other ranks could not be asked: {no_peers_reason}"
    other = "recv" if kind == "send" else "send"
    senders = [peer] if peer is not None else [int(r) for r in sorted(peers, key=int) if int(r) != rank]
    parts = [head]
    for sender in senders:
        info = peers.get(str(sender)) or {"absent": "no answer"}
        if "absent" in info:
            parts.append(f"Rank {sender} did not answer ({info['absent']}).")
            continue
        table = info.get("p2p") or {}
        if other == "recv":
            mine = table.get(f"recv {rank} {tag}", {}).get("issued", 0)
            anyone = table.get(f"recv any {tag}", {}).get("issued", 0)
            if mine + anyone >= seq:
                parts.append(
                    f"Rank {sender} has posted {mine} receive(s) from rank {rank} and {anyone} from any rank "
                    f"with tag {tag}: the matching receive was issued; it is stuck inside the backend, "
                    "or the two tensors differ in size."
                )
            else:
                parts.append(
                    f"Rank {sender} has posted {mine} receive(s) from rank {rank} and {anyone} from any rank "
                    f"with tag {tag}: it has not reached the receive that matches send #{seq}."
                )
        else:
            sent = table.get(f"send {rank} {tag}", {}).get("issued", 0)
            if peer is None:
                if sent:
                    parts.append(f"Rank {sender} has issued {sent} send(s) to rank {rank} with tag {tag}.")
                continue
            verdict = (
                "the matching send was issued; it is stuck inside the backend, or the two tensors "
                "differ in size"
                if sent >= seq
                else f"it has not reached the send that matches receive #{seq}"
            )
            parts.append(f"Rank {sender} has issued {sent} send(s) to rank {rank} with tag {tag}: {verdict}.")
    if peer is None and len(parts) == 1:
        parts.append(f"No rank has issued a send to rank {rank} with tag {tag}.")
    return " ".join(parts)


def _call_at(seq: int, info: dict[str, Any]) -> str:
    """What one rank that reached ``seq`` called there, from its progress answer."""
    for key in ("waiting", "issued"):
        record = info.get(key) or {}
        if record.get("seq") == seq:
            return str(record.get("what", "unknown"))
    issued = info.get("issued") or {}
    return f"past it (last issued: {issued.get('what', 'none')})"


def _reached_by_all(seq: int, calls: dict[str, str]) -> str:
    """Every rank reached ``seq``: say whether their calls there agree, and name each rank's if not."""
    by_call: dict[str, list[str]] = {}
    for rank_text, call in calls.items():
        by_call.setdefault(call, []).append(rank_text)
    each = "; ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(ranks)}: {call}"
        for call, ranks in by_call.items()
    )
    known = {call for call in by_call if call.startswith("#")}
    if len(known) > 1:
        return (
            f"Every rank has reached #{seq}, but in different calls: {each}. Every rank must issue the "
            "same collectives in the same order, with the same arguments (COMMLIB_DEBUG=DETAIL raises "
            "a CollectiveMismatchError at once instead)."
        )
    if len(by_call) > 1:
        return (
            f"Every rank has reached it ({each}): it is stuck inside the backend, or the ranks passed "
            "different arguments (COMMLIB_DEBUG=DETAIL checks them)."
        )
    return (
        f"Every rank has reached it, with the same call (ranks {', '.join(calls)}): it is stuck inside "
        "the backend (a rank blocked in native code, or a lost connection the backend has not noticed)."
    )


def _never(work: Work) -> bool:
    return False


class Watchdog:
    """The watchdog thread of one group on one rank.

    Args:
        tracker: What the issuing thread records.
        control: The control connection to the side channel's hub, or None.
        stall_s: Seconds before a stall is reported (> 0).
        timeout_s: The group's timeout (named in the report).
        label: ``[rank 0/2] gloo``.
        may_test: Whether a work may be tested from the watchdog thread.
        name: The thread's name.
        rank: This rank (named in point-to-point reports).
        group: The group's name, added to the label of a subgroup's reports.
        global_ranks: The group's global ranks, added there too.
    """

    def __init__(
        self,
        tracker: CollectiveTracker,
        control: socket.socket | None,
        *,
        stall_s: float,
        timeout_s: float,
        label: str,
        may_test: Callable[[Work], bool],
        name: str,
        rank: int = 0,
        group: str | None = None,
        global_ranks: tuple[int, ...] | None = None,
    ) -> None:
        self._tracker = tracker
        self._control = control
        self._stall_s = stall_s
        self._timeout_s = timeout_s
        self._label = label
        if group is not None and "." in group:  # a subgroup: its ranks are numbered within it
            ranks = f": global ranks {format_ranks(global_ranks)}" if global_ranks is not None else ""
            self._label = f"{label} (group {group}{ranks})"
        self._rank = rank
        self._p2p_warned: tuple[int, float] | None = None
        """The send or receive warned about last (its work's id), and when."""
        self._may_test = may_test
        self._poll_s = min(1.0, stall_s / 4)
        self._reader = FrameReader()
        self._stop_r, self._stop_w = socket.socketpair()
        self._watching: tuple[int, float] | None = None
        self._last_warned = 0.0
        self._asked: tuple[Record, Work | None, float, float] | None = None
        self._channel_lost: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread."""
        with contextlib.suppress(OSError):
            self._stop_w.send(b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        for sock in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                sock.close()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        try:
            while True:
                watched = [self._stop_r] + ([self._control] if self._control is not None else [])
                readable, _, _ = select.select(watched, [], [], self._poll_s)
                if self._stop_r in readable:
                    return
                if self._control is not None and self._control in readable:
                    self._from_hub()
                self._check(time.monotonic())
        except Exception:  # noqa: BLE001 - a diagnosis aid must never take the job down
            logger.exception("%s: the commlib watchdog stopped", self._label)

    def _from_hub(self) -> None:
        control = self._control
        assert control is not None
        try:
            data = control.recv(65536)
            frames = self._reader.feed(data) if data else None
        except (OSError, ValueError) as e:
            data, frames = b"", None
            reason = f"{type(e).__name__}: {e}"
        else:
            reason = "rank 0, which hosts the diagnosis side channel, closed it (exited or closed the group)"
        if frames is None:
            self._channel_lost = reason
            self._control = None
            with contextlib.suppress(OSError):
                control.close()
            if self._asked is not None:
                self._report(None)
            return
        for kind, payload in frames:
            if kind == T_STATUS:
                self._send(T_PROGRESS, json.dumps(self._tracker.progress()).encode())
            elif kind == T_REPORT:
                try:
                    peers = json.loads(payload)
                except ValueError:
                    peers = None
                self._report(peers)

    def _send(self, kind: int, payload: bytes = b"") -> bool:
        if self._control is None:
            return False
        try:
            send_frame(self._control, kind, payload)
        except OSError as e:
            self._channel_lost = f"{type(e).__name__}: {e}"
            self._control = None
            return False
        return True

    def _check(self, now: float) -> None:
        self._check_collectives(now)
        asked = self._asked
        if asked is not None:
            if now - asked[3] > _REPORT_WAIT_S:
                self._report(None, f"rank 0's side channel did not answer within {_REPORT_WAIT_S:g} s")
            return
        self._check_p2p(now)

    def _check_p2p(self, now: float) -> None:
        tracker = self._tracker
        tracker.prune_p2p(self._may_test)
        oldest = tracker.oldest_p2p()
        if oldest is None:
            return
        record, work, since = oldest
        if now - since < self._stall_s:
            return
        warned, which = self._p2p_warned, id(work if work is not None else record)
        if warned is not None and warned[0] == which and now - warned[1] < self._stall_s:
            return
        self._p2p_warned = (which, now)
        self._asked = (record, work, now - since, now)
        if not self._send(T_QUERY):
            self._report(None)

    def _check_collectives(self, now: float) -> None:
        tracker = self._tracker
        tracker.prune(_never)
        in_flight = tracker.oldest_in_flight()
        if in_flight is not None and in_flight[1] is not None and self._overdue(in_flight[0][0], now):
            # An async collective may have finished without anyone asking: test it before reporting.
            tracker.prune(self._may_test)
            in_flight = tracker.oldest_in_flight()
        if in_flight is None:
            self._watching = None
            return
        record, work = in_flight
        if self._watching is None or self._watching[0] != record[0]:
            self._watching = (record[0], now)
            self._last_warned = 0.0
            return
        if self._asked is not None:
            return
        if not self._overdue(record[0], now) or (
            self._last_warned and now - self._last_warned < self._stall_s
        ):
            return
        self._last_warned = now
        self._asked = (record, work, now - self._watching[1], now)
        if not self._send(T_QUERY):
            self._report(None)

    def _overdue(self, seq: int, now: float) -> bool:
        watching = self._watching
        return watching is not None and watching[0] == seq and now - watching[1] >= self._stall_s

    def _report(self, peers: dict[str, Any] | None, reason: str | None = None) -> None:
        asked, self._asked = self._asked, None
        if asked is None:
            return
        record, work, waited, _ = asked
        if peers is None and reason is None:
            reason = self._channel_lost or "this group has no side channel"
        context = work.context if work is not None else None
        if len(record) > 6:
            text = format_p2p_stall(
                self._label,
                self._rank,
                record,
                waited,
                self._stall_s,
                self._timeout_s,
                peers,
                context,
                reason or "",
            )
        else:
            text = format_stall(
                self._label, record, waited, self._stall_s, self._timeout_s, peers, context, reason or ""
            )
        logger.warning(text)
