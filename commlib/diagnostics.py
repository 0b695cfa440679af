"""One group's diagnosis: stall reports, the fingerprint check (``COMMLIB_DEBUG=DETAIL``), flight recorder.

``IProcessGroup`` creates a ``Diagnostics`` once the backend is connected
(``IProcessGroup._start_diagnostics``), if the config asks for any of the three,
and then routes every collective through ``Diagnostics.run``. With all three off
there is no ``Diagnostics`` and a collective pays one attribute test.

The side channel (``commlib.sidechannel``) is set up here: rank 0 starts the hub
and broadcasts its address and token once, over the backend itself (the data
path is in step at creation by construction); every rank then joins it.
"""

from __future__ import annotations

import logging
import secrets
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from commlib.deferred import DeferredWork, Launcher, launch_step
from commlib.errors import CommError, CommTimeoutError
from commlib.fingerprint import FINGERPRINT, Fingerprint, check_fingerprints
from commlib.flight import FlightRecorder
from commlib.sidechannel import SideChannelClient, SideChannelHub, hub_host
from commlib.types import ReduceOp
from commlib.watchdog import CollectiveTracker, Record, Watchdog
from commlib.work import CollectiveLabel, Work

if TYPE_CHECKING:
    from commlib.process_group import IProcessGroup

__all__ = ["Diagnostics", "FingerprintExchange"]

logger = logging.getLogger("commlib")

FingerprintExchange = Callable[[bytes, float, object, bool], bytes]
"""``exchange(mine, timeout_s, label, background) -> every rank's fingerprint, in rank order``.

``background`` is True on the launcher thread: there, wait without spinning (the
caller is computing meanwhile)."""

_ADDRESS = struct.Struct("!8sq16sH")
"""Set-up broadcast: magic, hub port (0: no hub), token, length of the text that follows
(the hub's host, or why rank 0 has no hub)."""
_ADDRESS_MAGIC = b"CLDGADDR"
_ADDRESS_WORDS = 48
"""Size of the set-up broadcast in int64 words (384 bytes)."""
_RANK_FIELD = slice(16, 20)
"""Where a packed fingerprint holds the rank (skipped when comparing two ranks' calls)."""


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
    ) -> None:
        self.tracker = tracker
        self.recorder = recorder
        self.exchange = exchange
        self._world = world_size
        self._hub = hub
        self._client = client
        self._watchdog = watchdog
        self._launcher = launcher
        self._last_seq = 0
        """Sequence number given to the last collective (ahead of ``_seq`` while the launcher has work)."""

    # --------------------------------------------------------------- set-up
    @classmethod
    def start(cls, group: IProcessGroup) -> Diagnostics | None:
        """Set up what ``group.config`` asks for; None if it asks for nothing.

        Every rank of the group must call this (it broadcasts once).

        Raises:
            CommError: ``COMMLIB_DEBUG=DETAIL`` is on and the side channel could not be set up.
        """
        config = group.config
        world = group.world_size
        debug = config.debug if config.debug is not None else group.default_debug
        detail = debug == "detail" and world > 1
        stall = config.stall_s > 0 and world > 1
        recorder = (
            FlightRecorder(config.flight_recorder, group.backend, group.rank, world, config.dump_dir)
            if config.flight_recorder > 0
            else None
        )
        if not (detail or stall or recorder):
            return None
        exchange = group._fingerprint_exchange() if detail else None
        needs_hub = stall or (detail and exchange is None)
        hub = client = None
        if needs_hub:
            try:
                hub, client = _join_side_channel(group, control=stall)
            except CommError as e:
                if detail and exchange is None:
                    raise
                logger.warning("%s; stall reports will not name the other ranks", e)
        if detail and exchange is None:
            assert client is not None
            exchange = client.exchange
        tracker = CollectiveTracker() if stall else None
        watchdog = None
        if tracker is not None:
            testable = group._works_testable_from_any_thread
            watchdog = Watchdog(
                tracker,
                client.control if client is not None else None,
                stall_s=config.stall_s,
                timeout_s=group.timeout,
                label=f"[rank {group.rank}/{world}] {group.backend}",
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
            hub=hub,
            client=client,
            watchdog=watchdog,
            launcher=launcher,
        )
        diagnostics._last_seq = group._seq
        return diagnostics

    def close(self) -> None:
        """Stop the launcher and the watchdog, and leave the side channel (rank 0: stop the hub)."""
        if self._launcher is not None:
            self._launcher.close()
        if self._watchdog is not None:
            self._watchdog.close()
        if self._client is not None:
            self._client.close()
        if self._hub is not None:
            self._hub.close()

    # ------------------------------------------------------------ collectives
    def run(
        self,
        group: IProcessGroup,
        kind: str,
        tensor: torch.Tensor | None,
        op: ReduceOp | None,
        root: int,
        async_op: bool,
        value: object,
        issue: Callable[..., Work],
        *args: Any,
    ) -> Work | None:
        """Run one collective under watch: number it, record it, check it (DETAIL), issue it, follow it.

        The group's ``_seq`` is advanced here, by whichever thread issues the
        collective to the backend: an asynchronous collective under the
        fingerprint check is checked and issued by the launcher thread, in order,
        so that ``async_op=True`` does not wait for the other ranks.

        Args:
            group: The group.
            kind: The collective's name.
            tensor: Its tensor (None for ``barrier``).
            op: Its reduce op, for reductions.
            root: The source rank of ``broadcast``; -1 otherwise.
            async_op: Return the work instead of waiting.
            value: What the work's future completes with.
            issue: Starts the collective: ``issue(*args) -> Work``.
            *args: Arguments of ``issue``.
        """
        launcher = self._launcher
        if launcher is not None and async_op and (tensor is None or tensor.device.type == "cpu"):
            return self._defer(group, kind, tensor, op, root, value, issue, args)
        if launcher is not None and not launcher.idle and not launcher.drain(group.timeout * 2 + 30.0):
            raise CommTimeoutError(
                f"{group._label(kind, tensor)}: the collectives issued before it did not start within "
                f"{group.timeout * 2 + 30.0:g} s: the group's launcher thread is stuck"
            )
        group._seq += 1
        self._last_seq = seq = group._seq
        record: Record = (
            seq,
            kind,
            tensor.dtype if tensor is not None else None,
            tensor.shape if tensor is not None else (),
            op,
            root,
        )
        tracker, recorder = self.tracker, self.recorder
        if tracker is not None:
            tracker.issued = tracker.active = record
        entry = recorder.begin(record) if recorder is not None else None
        try:
            if self.exchange is not None:
                self._check(group, record, tensor, group._label(kind, tensor), False)
            work = issue(*args)
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
                recorder.failed(entry, e)  # type: ignore[union-attr]
            raise
        finally:
            if tracker is not None:
                tracker.active = None
        if tracker is not None:
            tracker.completed = record
        if entry is not None:
            recorder.completed(entry)  # type: ignore[union-attr]
        return None

    def _defer(
        self,
        group: IProcessGroup,
        kind: str,
        tensor: torch.Tensor | None,
        op: ReduceOp | None,
        root: int,
        value: object,
        issue: Callable[..., Work],
        args: tuple[Any, ...],
    ) -> Work:
        """Queue an asynchronous collective's check and issue on the launcher; return its work at once."""
        self._last_seq += 1
        seq = self._last_seq
        label = CollectiveLabel(group.rank, group.world_size, group.backend, kind, seq, tensor)
        record: Record = (
            seq,
            kind,
            tensor.dtype if tensor is not None else None,
            tensor.shape if tensor is not None else (),
            op,
            root,
        )
        work = DeferredWork(label, bound_s=group.timeout * 2 + 30.0)
        work._set_value(value)  # noqa: SLF001 - what the work's future completes with
        if self.tracker is not None:
            self.tracker.issued = record
            self.tracker.pending.append((record, work))
        if self.recorder is not None:
            self.recorder.follow(self.recorder.begin(record), work)

        def check() -> None:
            group._seq += 1  # only the launcher advances it while it has work queued
            if group._closed or group._broken is not None:
                group._check_usable(kind)
            self._check(group, record, tensor, label, True)

        assert self._launcher is not None
        self._launcher.submit(launch_step(work, check, issue, args))
        return work

    def _check(
        self,
        group: IProcessGroup,
        record: Record,
        tensor: torch.Tensor | None,
        label: object,
        background: bool,
    ) -> None:
        """Exchange fingerprints; raise ``CollectiveMismatchError`` on every rank if they differ."""
        seq, kind, _, _, op, root = record
        mine = Fingerprint.of(group.rank, seq, kind, tensor, op, root).pack()
        assert self.exchange is not None
        try:
            everyone = self.exchange(mine, group.timeout, label, background)
        except CommError as e:
            group._mark_broken(e)
            raise
        size = FINGERPRINT.size
        if len(everyone) != size * self._world:
            raise CommError(
                f"{label}: the fingerprint exchange returned {len(everyone)} bytes, not {size * self._world}"
            )
        head, tail = mine[: _RANK_FIELD.start], mine[_RANK_FIELD.stop :]
        for start in range(0, len(everyone), size):
            theirs = everyone[start : start + size]
            if theirs[: _RANK_FIELD.start] != head or theirs[_RANK_FIELD.stop :] != tail:
                prints = [Fingerprint.unpack(everyone[i : i + size]) for i in range(0, len(everyone), size)]
                check_fingerprints(label, prints)
                return


def _join_side_channel(
    group: IProcessGroup, *, control: bool
) -> tuple[SideChannelHub | None, SideChannelClient]:
    """Rank 0 starts the hub and broadcasts where it is; every rank joins it.

    Raises:
        CommError: Rank 0 could not start the hub, or this rank could not join it.
    """
    env = group.env
    prefix = group._prefix("diagnostics")
    hub = None
    words = torch.zeros(_ADDRESS_WORDS, dtype=torch.int64)
    if group.rank == 0:
        token = secrets.token_bytes(16)
        host = hub_host(env.master_addr, env.local_world_size >= env.world_size)
        try:
            hub = SideChannelHub(group.world_size, host, token, name=f"{group.backend}-rank0")
            port, text = hub.port, host
        except OSError as e:
            port, text = 0, f"rank 0 could not listen on {host}: {e}"
        _pack_address(words, port, token, text)
    try:
        device = group.preferred_device()
        shared = words.to(device)
        group._broadcast(shared, 0, False).wait()
        words = shared.cpu()
    except BaseException:
        if hub is not None:
            hub.close()
        raise
    try:
        port, token, text = _unpack_address(words)
    except ValueError as e:
        raise CommError(f"{prefix}the side channel's address from rank 0 is garbled ({e})") from e
    if port == 0:
        raise CommError(f"{prefix}no diagnosis side channel: {text}")
    try:
        client = SideChannelClient(
            text,
            port,
            token,
            group.rank,
            group.world_size,
            control=control,
            timeout=min(group.timeout, 60.0),
            prefix=prefix,
        )
    except BaseException:
        if hub is not None:
            hub.close()
        raise
    return hub, client


def _pack_address(words: torch.Tensor, port: int, token: bytes, text: str) -> None:
    raw = text.encode()[: _ADDRESS_WORDS * 8 - _ADDRESS.size]
    data = _ADDRESS.pack(_ADDRESS_MAGIC, port, token, len(raw)) + raw
    data += bytes(_ADDRESS_WORDS * 8 - len(data))
    words.copy_(torch.frombuffer(bytearray(data), dtype=torch.int64))


def _unpack_address(words: torch.Tensor) -> tuple[int, bytes, str]:
    data = words.numpy().tobytes()
    magic, port, token, length = _ADDRESS.unpack_from(data)
    if magic != _ADDRESS_MAGIC:
        raise ValueError(f"magic {magic!r}")
    return port, token, data[_ADDRESS.size : _ADDRESS.size + length].decode(errors="replace")
