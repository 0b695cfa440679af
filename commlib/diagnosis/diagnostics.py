"""One group's diagnosis: stall reports, the fingerprint check (``COMMLIB_DEBUG=DETAIL``), flight recorder.

``IProcessGroup`` creates a ``Diagnostics`` once the backend is connected
(``IProcessGroup._start_diagnostics``), if the config asks for any of the three,
and then hands it every operation (``Diagnostics.issue``, ``Diagnostics.issue_p2p``). With all three off
there is no ``Diagnostics`` and a collective pays one attribute test.

Set-up is one broadcast over the backend itself (the data path is in step at
creation by construction), on every group of more than one rank: rank 0's
settings, and, if they need the side channel (``commlib.diagnosis.sidechannel``), the
address and token of the hub rank 0 starts; every rank then joins it. With the
fingerprint check on, the broadcast also offers rank 0's shared-memory board
(``commlib.diagnosis.board``), and one all-reduce tells whether every rank could
map it: if so fingerprints travel there, else over the backend's own exchange
(``_fingerprint_exchange``) or the hub.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
import struct
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from commlib.config import CommConfig
from commlib.diagnosis import history
from commlib.diagnosis.board import FingerprintBoard, board_capacity, host_identity
from commlib.diagnosis.call_site import SITE_BYTES, call_site, pack_site, unpack_site
from commlib.diagnosis.deferred import DeferredWork, Launcher
from commlib.diagnosis.fingerprint import (
    FINGERPRINT,
    Fingerprint,
    check_fingerprints,
    check_splits,
    mismatch_detail,
    only_splits_differ,
)
from commlib.diagnosis.flight_recorder import FlightRecorder
from commlib.diagnosis.history import HISTORY, HISTORY_BYTES
from commlib.diagnosis.sidechannel import SideChannelClient, SideChannelHub, hub_host
from commlib.diagnosis.watchdog import CollectiveTracker, Record, Watchdog, p2p_record
from commlib.env import DistEnv
from commlib.errors import CollectiveMismatchError, CommError, CommTimeoutError
from commlib.p2p import P2PRequest
from commlib.types import PremulSum, ReduceOp
from commlib.work import CollectiveLabel, CompletedWork, Work

__all__ = ["DiagnosedGroup", "Diagnostics", "FingerprintExchange"]

logger = logging.getLogger("commlib")

FingerprintExchange = Callable[[bytes, float, object, bool], bytes]
"""``exchange(mine, timeout_s, label, background) -> every rank's fingerprint, in rank order``.

``background`` is True on the launcher thread: there, wait without spinning (the
caller is computing meanwhile)."""


class DiagnosedGroup(Protocol):
    """What the diagnosis reads and calls on the group it watches (``IProcessGroup`` has all of it)."""

    rank: int
    world_size: int
    backend: str
    group_name: str
    global_ranks: tuple[int, ...]
    config: CommConfig
    env: DistEnv
    timeout: float
    default_debug: str
    _seq: int
    _recent: list[str]
    _closing_with: str
    _closed: bool
    _broken: BaseException | None
    _p2p_counts: dict[tuple[str, int | None, int], int]
    _works_testable_from_any_thread: bool

    @property
    def collective_count(self) -> int: ...  # noqa: D102
    def preferred_device(self) -> torch.device: ...  # noqa: D102
    def _prefix(self, op: str) -> str: ...
    def _label(self, op: str, tensor: torch.Tensor | None = None) -> CollectiveLabel: ...
    def _next_seq(self) -> int: ...
    def _parting_history(self) -> str: ...
    def _check_usable(self, op: str) -> None: ...
    def _mark_broken(self, error: BaseException) -> None: ...
    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work: ...
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work: ...
    def _fingerprint_exchange(self) -> FingerprintExchange | None: ...


_ADDRESS = struct.Struct("!8s??dq16s16s16sHH")
"""Set-up broadcast: magic, rank 0's DETAIL and call-site flags and stall seconds, hub port (0: no hub),
hub token, digest of rank 0's host identity, board token, the lengths of the two texts that follow:
the hub's host (or why rank 0 has no hub), and the path of rank 0's board (empty: none)."""
_ADDRESS_MAGIC = b"CLDGADDR"
_ADDRESS_WORDS = 64
"""Size of the set-up broadcast in int64 words (512 bytes)."""
_SLOT = HISTORY - 1
"""``seq & _SLOT``: the slot of collective ``seq`` in the group's history."""
_RANK_FIELD = slice(16, 20)
"""Where a packed fingerprint holds the rank (skipped when comparing two ranks' calls)."""
_SEQ = struct.Struct("!Q")
"""A packed fingerprint's first field, the sequence number; the rest depends on the call alone."""
_MAX_REMEMBERED = 4096
"""Calls whose packed fingerprints a group keeps (a model with shapes that keep changing starts over)."""
_NO_SITE = (0, "")
ASYNC_POLL_S = 2e-5
"""Seconds an asynchronous collective waits on its caller's thread for the other ranks' fingerprints
(ranks in step post theirs within microseconds) before it hands the wait to the launcher thread."""


def _host_digest() -> bytes:
    return hashlib.blake2b(host_identity().encode(), digest_size=16).digest()


class Diagnostics:
    """Stall watchdog, fingerprint check and flight recorder of one group on one rank.

    Build it with ``Diagnostics.start(group)``.
    """

    def __init__(
        self,
        *,
        tracker: CollectiveTracker | None,
        recorder: FlightRecorder | None,
        exchange: FingerprintExchange | None,
        world_size: int,
        hub: SideChannelHub | None = None,
        client: SideChannelClient | None = None,
        watchdog: Watchdog | None = None,
        launcher: Launcher | None = None,
        call_sites: bool = False,
        rank: int = 0,
        backend: str = "",
        timeout: float = 300.0,
    ) -> None:
        self.tracker = tracker
        self.recorder = recorder
        self.exchange = exchange
        self._board = exchange if isinstance(exchange, FingerprintBoard) else None
        """The exchange when it is a shared-memory board: then an asynchronous collective posts and
        polls it on the caller's thread, and needs the launcher only when some rank is not there yet."""
        self._world = world_size
        self._rank = rank
        self._backend = backend
        """The group's backend name, for the labels of deferred collectives."""
        self._timeout = timeout
        self._hub = hub
        self._client = client
        self._watchdog = watchdog
        self._launcher = launcher
        self.call_sites = call_sites and exchange is not None
        """Whether fingerprints carry the caller's call site (DETAIL asked for, not a backend's default)."""
        self._last_seq = 0
        """Sequence number given to the last collective (ahead of ``_seq`` while the launcher has work)."""
        self._tails: dict[tuple[Any, ...], tuple[bytes, ...]] = {}
        """Per call (collective, dtype, shape, op, root, call site): every rank's packed fingerprint
        after the sequence number, in rank order."""

    @property
    def transport(self) -> str:
        """How fingerprints travel: ``shared memory``, ``backend``, ``side channel`` or ``none``."""
        if self.exchange is None:
            return "none"
        if self._board is not None:
            return "shared memory"
        if self._client is not None and self.exchange == self._client.exchange:
            return "side channel"
        return "backend"

    @property
    def issued(self) -> int:
        """Collectives issued on the group so far (the launcher may not have started the last ones)."""
        return self._last_seq

    # --------------------------------------------------------------- set-up
    @classmethod
    def start(cls, group: DiagnosedGroup) -> Diagnostics | None:
        """Set up what the group's config asks for; None if it asks for nothing.

        Every rank of the group must call this: with more than one rank it
        broadcasts once, always, so that the ranks agree even when their
        environments differ. Rank 0's ``COMMLIB_DEBUG`` and ``COMMLIB_STALL_S``
        apply to the whole group (a rank whose own differ logs a warning); call
        sites are compared when rank 0 asked for DETAIL itself, not when DETAIL
        is only its backend's default. The flight recorder is each rank's own choice.
        With the fingerprint check on, the ranks also agree on how fingerprints
        travel: a shared-memory board when every rank maps rank 0's, else the
        backend's exchange, else the side channel.

        Raises:
            CommError: The fingerprint check is on and its side channel could not be set up.
        """
        config = group.config
        world = group.world_size
        recorder = (
            FlightRecorder(
                config.flight_recorder,
                group.backend,
                group.rank,
                world,
                config.dump_dir,
                name=group.group_name,
                global_ranks=group.global_ranks,
            )
            if config.flight_recorder > 0
            else None
        )
        if world == 1:
            return cls(tracker=None, recorder=recorder, exchange=None, world_size=1) if recorder else None
        debug = config.debug if config.debug is not None else group.default_debug
        agreed = _agree(group, debug == "detail", config.debug == "detail", config.stall_s)
        detail, stall_s = agreed.detail, agreed.stall_s
        if (detail, stall_s) != (debug == "detail", config.stall_s):
            logger.warning(
                "%sCOMMLIB_DEBUG / COMMLIB_STALL_S here (%s, %g s) differ from rank 0's (%s, %g s); rank 0's "
                "apply to the group",
                group._prefix("diagnostics"),
                debug,
                config.stall_s,
                "detail" if detail else "off",
                stall_s,
            )
        if not (detail or stall_s > 0 or recorder):
            if agreed.hub is not None:
                agreed.hub.close()
            return None
        exchange: FingerprintExchange | None = None
        if detail:
            try:
                exchange = agreed.open_board(group)
                if exchange is None:
                    exchange = group._fingerprint_exchange()
            except BaseException:
                if agreed.hub is not None:
                    agreed.hub.close()
                raise
        needs_hub = detail and exchange is None
        client = None
        if stall_s > 0 or needs_hub:
            try:
                client = agreed.join(group, control=stall_s > 0)
            except CommError as e:
                if needs_hub:
                    if agreed.hub is not None:
                        agreed.hub.close()
                    raise
                logger.warning("%s; stall reports will not name the other ranks", e)
        elif agreed.hub is not None:
            # Every rank agreed on this: no rank joins the hub.
            agreed.hub.close()
            agreed.hub = None
        if needs_hub:
            assert client is not None
            exchange = client.exchange
        watchdog = tracker = None
        if stall_s > 0:
            tracker = CollectiveTracker(group._p2p_counts)
            testable = group._works_testable_from_any_thread
            watchdog = Watchdog(
                tracker,
                client.control if client is not None else None,
                stall_s=stall_s,
                timeout_s=group.timeout,
                label=f"[rank {group.rank}/{world}] {group.backend}",
                rank=group.rank,
                group=group.group_name,
                global_ranks=group.global_ranks,
                may_test=lambda work: testable,
                name=f"commlib-watchdog-{group.backend}-rank{group.rank}",
            )
        launcher = None
        if exchange is not None and group._works_testable_from_any_thread:
            launcher = Launcher(f"commlib-launcher-{group.backend}-rank{group.rank}")
        diagnostics = cls(
            tracker=tracker,
            recorder=recorder,
            exchange=exchange,
            world_size=world,
            hub=agreed.hub,
            client=client,
            watchdog=watchdog,
            launcher=launcher,
            call_sites=agreed.call_sites,
            rank=group.rank,
            backend=group.backend,
            timeout=group.timeout,
        )
        diagnostics._last_seq = group._seq
        return diagnostics

    def close(self) -> None:
        """Stop the launcher and the watchdog, leave the side channel (rank 0: its hub), unmap the board."""
        if self._launcher is not None:
            self._launcher.close()
        if self._watchdog is not None:
            self._watchdog.close()
        if self._client is not None:
            self._client.close()
        if self._hub is not None:
            self._hub.close()
        if self._board is not None:
            self._board.close()

    # ------------------------------------------------------------ operations
    def issue(
        self,
        group: DiagnosedGroup,
        kind: str,
        tensor: torch.Tensor | None,
        op: ReduceOp | PremulSum | None,
        root: int,
        async_op: bool,
        value: object,
        start: Callable[..., Work],
        args: tuple[Any, ...],
        counts: tuple[list[int], list[int]] | None = None,
    ) -> Work | None:
        """Run one collective under watch: number it, record it, check it (DETAIL), start it, follow it.

        An asynchronous collective under the fingerprint check does not wait for
        the other ranks: on a shared-memory board it posts its fingerprint and, if
        every rank has posted within a few microseconds, is checked and started
        here; otherwise the launcher thread waits, checks and starts it, in
        order. Every other collective is checked and started here.

        Args:
            group: The group.
            kind: The collective's name.
            tensor: Its tensor (None for ``barrier``).
            op: Its reduce op, for reductions.
            root: The root rank of a rooted collective; -1 otherwise.
            async_op: Return the work instead of waiting.
            value: What the work's future completes with.
            start: Calls the backend hook: ``start(*args) -> Work``.
            args: Arguments of ``start``.
            counts: ``all_to_all`` only: elements received from and sent to each rank.
        """
        launcher = self._launcher
        if launcher is not None:
            if async_op and (tensor is None or tensor.is_cpu):
                return self._issue_async(group, kind, tensor, op, root, value, start, args, counts)
            if launcher.queued:
                self._drain(group, kind, tensor)
        seq = self._last_seq = self._last_seq + 1
        group._recent[seq & _SLOT] = kind
        site = call_site() if self.call_sites else _NO_SITE
        if op.__class__ is PremulSum:
            op = op.op  # type: ignore[union-attr]
        call = (kind, None, (), op, root) if tensor is None else (kind, tensor.dtype, tensor.shape, op, root)
        board = self._board
        if board is not None and counts is None:
            # The fingerprint goes on the board first, so that the bookkeeping below overlaps
            # with the other ranks' (``_fingerprint`` and ``_exchange``, inline: every collective's path).
            key = (call, site[0]) if site[0] else call
            tails = self._tails.get(key) or self._tails_for(call, tensor, site[0])
            stamp = _SEQ.pack(seq)
            mine = stamp + tails[self._rank]
            try:
                board.post(mine)
            except CommError as e:
                group._mark_broken(e)
                raise
        else:
            board = None
        record: Record = (seq, *call)  # type: ignore[assignment]
        tracker, recorder = self.tracker, self.recorder
        if tracker is not None:
            tracker.issued = tracker.active = record
        entry = recorder.begin(record) if recorder is not None else None
        try:
            group._next_seq()
            if self.exchange is not None:
                if board is not None:
                    try:
                        agreed = board.agrees(stamp, tails, self._timeout, group._label, kind, tensor)
                    except CommError as e:
                        group._mark_broken(e)
                        raise
                    if not agreed:
                        label = group._label(kind, tensor)
                        self._verify(group, board.gather(), mine, record, None, label, False, site)
                else:
                    mine, expected = self._fingerprint(seq, call, tensor, counts, site[0])
                    everyone = self._exchange(group, mine, lambda: group._label(kind, tensor), False)
                    if everyone != expected:
                        label = group._label(kind, tensor)
                        self._verify(group, everyone, mine, record, counts, label, False, site)
            work = start(*args)
            if async_op:
                if tracker is not None:
                    tracker.pending.append((record, work))
                if entry is not None:
                    recorder.follow(entry, work)  # type: ignore[union-attr]
                work._set_value(value)  # noqa: SLF001 - what the work's future completes with
                return work
            work.wait()
        except BaseException as e:
            if entry is not None:
                # The barrier before a group closes meeting a peer that closed first is no failure of
                # the caller's collectives: it is recorded, and the dump of the real failure is kept.
                dump = not group._closing_with or isinstance(e, CollectiveMismatchError)
                recorder.failed(entry, e, dump=dump)  # type: ignore[union-attr]
            raise
        finally:
            if tracker is not None:
                tracker.active = None
        if tracker is not None:
            tracker.completed = record
        if entry is not None:
            recorder.completed(entry)  # type: ignore[union-attr]
        return None

    def _drain(self, group: DiagnosedGroup, kind: str, tensor: torch.Tensor | None) -> None:
        """Wait until the launcher has started everything queued (a collective issued here comes after it)."""
        assert self._launcher is not None
        bound = self._timeout * 2 + 30.0
        if not self._launcher.drain(bound):
            raise CommTimeoutError(
                f"{group._label(kind, tensor)}: the collectives issued before it did not start within "
                f"{bound:g} s: the group's launcher thread is stuck"
            )

    def _issue_async(
        self,
        group: DiagnosedGroup,
        kind: str,
        tensor: torch.Tensor | None,
        op: ReduceOp | PremulSum | None,
        root: int,
        value: object,
        start: Callable[..., Work],
        args: tuple[Any, ...],
        counts: tuple[list[int], list[int]] | None,
    ) -> Work:
        """An asynchronous collective under the check: at once if every rank is there, else on the launcher.

        With a shared-memory board and nothing queued, the fingerprint is posted
        here; if every rank has posted within ``ASYNC_POLL_S``, the collective is
        checked and started on this thread (a mismatch fails the returned work, as
        on the launcher). Otherwise a ``DeferredWork`` stands for it until the
        launcher thread has waited for the other ranks, checked it and started it,
        in issue order.
        """
        launcher = self._launcher
        assert launcher is not None
        seq = self._last_seq = self._last_seq + 1
        group._recent[seq & _SLOT] = kind
        site = call_site() if self.call_sites else _NO_SITE
        if op.__class__ is PremulSum:
            op = op.op  # type: ignore[union-attr]
        call = (kind, None, (), op, root) if tensor is None else (kind, tensor.dtype, tensor.shape, op, root)
        record: Record = (seq, *call)  # type: ignore[assignment]
        board = self._board
        posted = board is not None and not launcher.queued
        if posted:
            assert board is not None
            group._next_seq()
            mine, expected = self._fingerprint(seq, call, tensor, counts, site[0])
            try:
                board.post(mine)
                everyone = board.poll(ASYNC_POLL_S)
            except CommError as e:
                group._mark_broken(e)
                raise
            if everyone is not None:
                checked = (everyone, mine, expected)
                return self._start_checked(group, record, tensor, counts, site, checked, value, start, args)
        label = CollectiveLabel(
            self._rank, self._world, self._backend, kind, seq, tensor, group=group._named_ranks
        )
        deferred = DeferredWork(label, launcher, self._timeout * 2 + 30.0, value)
        tracker, recorder = self.tracker, self.recorder
        if tracker is not None:
            tracker.issued = record
            tracker.pending.append((record, deferred))
        if recorder is not None:
            recorder.follow(recorder.begin(record), deferred)
        if posted:
            check = functools.partial(self._collect, group, record, mine, expected, counts, label, site)
        else:
            check = functools.partial(self._launch, group, record, tensor, counts, label, site)
        launcher.submit(deferred, check, start, args)
        return deferred

    def _start_checked(
        self,
        group: DiagnosedGroup,
        record: Record,
        tensor: torch.Tensor | None,
        counts: tuple[list[int], list[int]] | None,
        site: tuple[int, str],
        checked: tuple[bytes, bytes, bytes | None],
        value: object,
        start: Callable[..., Work],
        args: tuple[Any, ...],
    ) -> Work:
        """Check an asynchronous collective whose fingerprints all arrived, start it, return its work.

        ``checked``: every rank's fingerprints, this rank's, and what they would be if the calls
        agree. A mismatch (or a failure to start) comes back as a failed work, as from
        the launcher: ``wait()`` raises it, on every rank.
        """
        everyone, mine, expected = checked
        tracker, recorder = self.tracker, self.recorder
        entry = recorder.begin(record) if recorder is not None else None
        try:
            if everyone != expected:
                label = group._label(record[1], tensor)
                self._verify(group, everyone, mine, record, counts, label, False, site)
            work = start(*args)
        except CommError as e:
            if entry is not None:
                recorder.failed(entry, e)  # type: ignore[union-attr]
            if tracker is not None:
                tracker.issued = tracker.completed = record
            failed = CompletedWork(e, group._label(record[1], tensor))
            failed._set_value(value)  # noqa: SLF001
            return failed
        if tracker is not None:
            tracker.issued = record
            tracker.pending.append((record, work))
        if entry is not None:
            recorder.follow(entry, work)  # type: ignore[union-attr]
        work._set_value(value)  # noqa: SLF001 - what the work's future completes with
        return work

    def _launch(
        self,
        group: DiagnosedGroup,
        record: Record,
        tensor: torch.Tensor | None,
        counts: tuple[list[int], list[int]] | None,
        label: CollectiveLabel,
        site: tuple[int, str],
    ) -> None:
        """The launcher thread's step before it starts a deferred collective: number it, then check it.

        The launcher advances the group's sequence number while it has work
        queued, so that the backend sees the number of the collective it starts.
        """
        group._next_seq()
        if group._closed or group._broken is not None:
            group._check_usable(record[1])
        mine, expected = self._fingerprint(record[0], record[1:], tensor, counts, site[0])
        everyone = self._exchange(group, mine, label, True)
        if everyone != expected:
            self._verify(group, everyone, mine, record, counts, label, True, site)

    def _collect(
        self,
        group: DiagnosedGroup,
        record: Record,
        mine: bytes,
        expected: bytes | None,
        counts: tuple[list[int], list[int]] | None,
        label: CollectiveLabel,
        site: tuple[int, str],
    ) -> None:
        """The launcher thread's step for a collective whose fingerprint is on the board: wait, then check."""
        assert self._board is not None
        if group._closed or group._broken is not None:
            group._check_usable(record[1])
        try:
            everyone = self._board.collect(self._timeout, label, True)
        except CommError as e:
            group._mark_broken(e)
            raise
        if everyone != expected:
            self._verify(group, everyone, mine, record, counts, label, True, site)

    def issue_p2p(
        self,
        group: DiagnosedGroup,
        requests: list[P2PRequest],
        start: Callable[[Any, bool], list[Work]],
        what: Any,
        async_op: bool,
    ) -> list[Work]:
        """Record sends and receives, start them, and follow their works (no fingerprint, no ``_seq``)."""
        now = time.monotonic()
        records = [p2p_record(request) for request in requests]
        recorder = self.recorder
        entries = [recorder.begin(record) for record in records] if recorder is not None else None
        try:
            works = start(what, async_op)
        except BaseException as e:
            if entries is not None:
                for entry in entries:
                    recorder.failed(entry, e)  # type: ignore[union-attr]
            raise
        if self.tracker is not None:
            self.tracker.track_p2p(records, works, now)
        if entries is not None:
            for entry, work in zip(entries, works, strict=True):
                recorder.follow(entry, work)  # type: ignore[union-attr]
        return works

    def run_p2p(self, request: P2PRequest, run: Callable[[P2PRequest], int]) -> int:
        """Record a synchronous send or receive and ``run`` it on this thread; return what ``run`` returns.

        While it runs, the tracker holds it as the one this thread is blocked in.
        """
        recorder, tracker = self.recorder, self.tracker
        entry = recorder.begin(p2p_record(request)) if recorder is not None else None
        if tracker is not None:
            tracker.p2p_active = (request, time.monotonic())
        try:
            peer = run(request)
        except BaseException as e:
            if entry is not None:
                recorder.failed(entry, e)  # type: ignore[union-attr]
            raise
        finally:
            if tracker is not None:
                tracker.p2p_active = None
        if tracker is not None:
            tracker.finished_inline((request.kind, request.peer, request.tag), request.seq)
        if entry is not None:
            recorder.completed(entry)  # type: ignore[union-attr]
        return peer

    def _fingerprint(
        self,
        seq: int,
        call: tuple[Any, ...],
        tensor: torch.Tensor | None,
        counts: tuple[list[int], list[int]] | None,
        site: int,
    ) -> tuple[bytes, bytes | None]:
        """This rank's packed fingerprint, and every rank's as they would be if the calls agree.

        ``call`` is (collective, dtype, shape, op, root). The part of a fingerprint
        after the sequence number depends on the call alone (and the call site), so
        it is packed once per call for every rank. An ``all_to_all``'s carries
        digests of its splits: packed each time, and compared field by field
        (``expected`` None).
        """
        kind, _, _, op, root = call
        if counts is not None:
            return Fingerprint.of(self._rank, seq, kind, tensor, op, root, counts, site).pack(), None
        tails = self._tails.get((call, site) if site else call) or self._tails_for(call, tensor, site)
        stamp = _SEQ.pack(seq)
        return stamp + tails[self._rank], stamp + stamp.join(tails)

    def _tails_for(self, call: tuple[Any, ...], tensor: torch.Tensor | None, site: int) -> tuple[bytes, ...]:
        """Every rank's packed fingerprint of ``call`` after the sequence number, packed once per call."""
        key = (call, site) if site else call
        tails = self._tails.get(key)
        if tails is None:
            if len(self._tails) >= _MAX_REMEMBERED:
                self._tails.clear()
            kind, _, _, op, root = call
            tails = self._tails[key] = tuple(
                Fingerprint.of(rank, 0, kind, tensor, op, root, None, site).pack()[_SEQ.size :]
                for rank in range(self._world)
            )
        return tails

    def _verify(
        self,
        group: DiagnosedGroup,
        everyone: bytes,
        mine: bytes,
        record: Record,
        counts: tuple[list[int], list[int]] | None,
        label: object,
        background: bool,
        site: tuple[int, str] = _NO_SITE,
    ) -> None:
        """Raise ``CollectiveMismatchError`` on every rank if the fingerprints differ in more than the rank.

        ``site``: the call site's digest and text (``(0, "")`` when call sites are not compared).
        """
        size = FINGERPRINT.size
        head, tail = mine[: _RANK_FIELD.start], mine[_RANK_FIELD.stop :]
        if all(
            everyone[i : i + _RANK_FIELD.start] == head and everyone[i + _RANK_FIELD.stop : i + size] == tail
            for i in range(0, len(everyone), size)
        ):
            return
        prints = [Fingerprint.unpack(everyone[i : i + size]) for i in range(0, len(everyone), size)]
        histories = None
        if len({(fp.kind, fp.seq) for fp in prints}) > 1:
            # The ranks called different collectives: every rank holds the same fingerprints, so every
            # rank swaps its count and last collectives once, to name them (commlib.diagnosis.history).
            texts = self._exchange(
                group, history.pack(group._parting_history()), label, background, HISTORY_BYTES
            )
            histories = [
                history.unpack(texts[i : i + HISTORY_BYTES]) for i in range(0, len(texts), HISTORY_BYTES)
            ]
        sites = None
        if self.call_sites and mismatch_detail(prints) is not None:
            # Every rank holds the same fingerprints, so every rank takes this second exchange (an
            # all_to_all's fingerprints differ from rank to rank without a mismatch: not then).
            texts = self._exchange(group, pack_site(site[1]), label, background, SITE_BYTES)
            sites = [unpack_site(texts[i : i + SITE_BYTES]) for i in range(0, len(texts), SITE_BYTES)]
        if counts is not None and only_splits_differ(prints):
            # The all_to_all calls agree but their splits do not add up: swap the splits to name them.
            row = struct.Struct(f"!{2 * self._world}q")
            matrix = self._exchange(group, row.pack(*counts[0], *counts[1]), label, background, row.size)
            check_splits(label, [row.unpack_from(matrix, i) for i in range(0, len(matrix), row.size)], prints)
        check_fingerprints(label, prints, sites, histories)

    def _exchange(
        self,
        group: DiagnosedGroup,
        mine: bytes,
        label: object,
        background: bool,
        size: int = FINGERPRINT.size,
    ) -> bytes:
        """Swap ``mine`` with every rank's; a failure marks the group broken.

        ``label`` names the call in errors; it may be a function that returns the
        name (built only if the exchange fails).
        """
        assert self.exchange is not None
        try:
            if self._board is not None:
                everyone = self._board(mine, self._timeout, label, background)
            else:
                named = label() if callable(label) else label
                everyone = self.exchange(mine, self._timeout, named, background)
        except CommError as e:
            group._mark_broken(e)
            raise
        if len(everyone) != size * self._world:
            if callable(label):
                label = label()
            raise CommError(
                f"{label}: the fingerprint exchange returned {len(everyone)} bytes, not {size * self._world}"
            )
        return everyone


class _Agreement:
    """What rank 0 broadcast at set-up: its settings, where its hub listens, and its board."""

    def __init__(
        self,
        detail: bool,
        stall_s: float,
        hub: SideChannelHub | None,
        address: tuple[str, int, bytes] | None,
        problem: str,
        call_sites: bool = False,
        board: FingerprintBoard | None = None,
        board_offer: tuple[bytes, bytes, str] | None = None,
    ) -> None:
        self.detail = detail
        self.call_sites = detail and call_sites
        self.stall_s = stall_s
        self.hub = hub
        """The hub itself, on rank 0 (None elsewhere)."""
        self.address = address
        self.problem = problem
        """Why there is no hub, when there is none."""
        self.board = board
        """The board rank 0 created (None elsewhere)."""
        self.board_offer = board_offer
        """Rank 0's host digest, board token and board path, if it offered one."""

    def join(self, group: DiagnosedGroup, *, control: bool) -> SideChannelClient:
        """Connect this rank to the hub.

        Raises:
            CommError: There is no hub, or it cannot be reached.
        """
        prefix = group._prefix("diagnostics")
        if self.address is None:
            raise CommError(f"{prefix}no diagnosis side channel: {self.problem}")
        host, port, token = self.address
        return SideChannelClient(
            host,
            port,
            token,
            group.rank,
            group.world_size,
            control=control,
            timeout=min(group.timeout, 60.0),
            prefix=prefix,
        )

    def open_board(self, group: DiagnosedGroup) -> FingerprintBoard | None:
        """Map rank 0's board here if this rank is on its host; return it if every rank could, else None.

        Every rank calls this when the check is on: with an offer it takes one
        all-reduce (MIN of "mapped it") over the backend, after which rank 0
        removes the file's name, whatever the verdict.
        """
        if self.board_offer is None:
            return None
        host, token, path = self.board_offer
        board = self.board
        if group.rank != 0 and host == _host_digest():
            try:
                board = FingerprintBoard.open(path, token, group.rank, group.world_size)
            except (OSError, ValueError) as e:
                logger.debug("%scannot map rank 0's board %s: %s", group._prefix("diagnostics"), path, e)
        try:
            verdict = torch.tensor([1 if board is not None else 0], dtype=torch.int64)
            shared = verdict.to(group.preferred_device())
            group._all_reduce(shared, ReduceOp.MIN, False).wait()
            everyone = int(shared.cpu()[0])
        except BaseException:
            if board is not None:
                board.close()
            raise
        finally:
            if self.board is not None:
                self.board.unlink()
        if everyone == 1 and board is not None:
            # Wait as the backend's own waits do: MPI's spin while every rank has a core, and a
            # rank that yields instead loses its core for a whole time slice on a busy host.
            spin = getattr(group, "_pure_spin_s", None)
            if isinstance(spin, float) and spin > board.pure_spin_s:
                board.pure_spin_s = spin
            return board
        if board is not None:
            board.close()
        return None


def _agree(group: DiagnosedGroup, detail: bool, call_sites: bool, stall_s: float) -> _Agreement:
    """Broadcast rank 0's settings and, if they need them, the addresses of its hub and its board."""
    env = group.env
    hub = None
    board = None
    words = torch.zeros(_ADDRESS_WORDS, dtype=torch.int64)
    if group.rank == 0:
        token = secrets.token_bytes(16)
        port, text = 0, "rank 0 runs without stall reports and without COMMLIB_DEBUG=DETAIL"
        if detail or stall_s > 0:
            single_host = env.local_world_size >= env.world_size
            host = hub_host(env.master_addr, single_host)
            # MASTER_ADDR may name an address rank 0 reaches but cannot bind (a forwarded port): on one
            # host, loopback still serves every rank.
            for where in dict.fromkeys([host, "127.0.0.1"] if single_host else [host]):
                try:
                    hub = SideChannelHub(group.world_size, where, token, name=f"{group.backend}-rank0")
                    port, text = hub.port, where
                    break
                except OSError as e:
                    text = f"rank 0 could not listen on {where}: {e}"
        board_token, board_path = bytes(16), ""
        if detail:
            capacity = board_capacity(group.world_size, FINGERPRINT.size, SITE_BYTES, HISTORY_BYTES)
            try:
                board, board_token = FingerprintBoard.create(group.world_size, capacity)
                board_path = board.path
            except (OSError, ValueError) as e:
                logger.debug("%sno shared-memory board: %s", group._prefix("diagnostics"), e)
        try:
            _pack_address(
                words, detail, call_sites, stall_s, port, token, text, _host_digest(), board_token, board_path
            )
        except ValueError:
            if board is not None:
                board.unlink()
                board.close()
            board = None
            _pack_address(words, detail, call_sites, stall_s, port, token, text, bytes(16), bytes(16), "")
    try:
        shared = words.to(group.preferred_device())
        group._broadcast(shared, 0, False).wait()
        words = shared.cpu()
        detail, call_sites, stall_s, port, token, text, offer = _unpack_address(words)
    except ValueError as e:
        # Only a backend whose broadcast moves nothing (a test double) gets here: go on with
        # this rank's own settings and no side channel.
        if hub is not None:
            hub.close()
        if board is not None:
            board.unlink()
            board.close()
        garbled = f"the set-up broadcast from rank 0 came back garbled ({e})"
        return _Agreement(detail, stall_s, None, None, garbled, call_sites)
    except BaseException:
        if hub is not None:
            hub.close()
        if board is not None:
            board.unlink()
            board.close()
        raise
    address = (text, port, token) if port else None
    return _Agreement(detail, stall_s, hub, address, "" if port else text, call_sites, board, offer)


def _pack_address(
    words: torch.Tensor,
    detail: bool,
    call_sites: bool,
    stall_s: float,
    port: int,
    token: bytes,
    text: str,
    host: bytes,
    board_token: bytes,
    board_path: str,
) -> None:
    path = board_path.encode()
    room = _ADDRESS_WORDS * 8 - _ADDRESS.size - len(path)
    if room < 0:
        raise ValueError(f"the board's path is too long for the set-up broadcast: {board_path}")
    raw = text.encode()[:room]
    data = (
        _ADDRESS.pack(
            _ADDRESS_MAGIC, detail, call_sites, stall_s, port, token, host, board_token, len(raw), len(path)
        )
        + raw
        + path
    )
    data += bytes(_ADDRESS_WORDS * 8 - len(data))
    words.copy_(torch.frombuffer(bytearray(data), dtype=torch.int64))


def _unpack_address(
    words: torch.Tensor,
) -> tuple[bool, bool, float, int, bytes, str, tuple[bytes, bytes, str] | None]:
    data = words.numpy().tobytes()
    magic, detail, call_sites, stall_s, port, token, host, board_token, length, path_length = (
        _ADDRESS.unpack_from(data)
    )
    if magic != _ADDRESS_MAGIC:
        raise ValueError(f"magic {magic!r}")
    text = data[_ADDRESS.size : _ADDRESS.size + length].decode(errors="replace")
    at = _ADDRESS.size + length
    path = data[at : at + path_length].decode(errors="replace")
    offer = (host, board_token, path) if path else None
    return detail, call_sites, stall_s, port, token, text, offer
