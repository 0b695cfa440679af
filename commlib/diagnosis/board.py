"""The fingerprint check's exchange between ranks on one host: a small board in shared memory.

Each rank owns two slots of a file in ``/dev/shm`` that every rank maps. For
its ``n``-th exchange a rank writes its bytes into slot ``n % 2``, then the
number ``n`` into the slot's first word, and polls the other ranks' slots ``n % 2``
until each holds ``n``. Two slots suffice: a rank that finished exchange ``n + 1``
has seen every rank's ``n + 1``, so every rank has finished reading ``n``
before anyone writes ``n + 2`` over it. An exchange costs a few microseconds once the
ranks have arrived, against a round trip through Gloo or TCP.

Memory order. The writer stores the bytes, then the number; the reader loads the
number, then the bytes. On x86-64 stores become visible in program order and loads
are not reordered with older loads, so this is enough. Elsewhere
(``STORES_NEED_FENCE``) a fence sits between the two stores and between the two
loads: Python cannot issue a bare barrier, and a lock's acquire and release are
the nearest it has.

A rank that waits for a peer's number looks every ``LIVENESS_S`` whether the
peer's process still runs and still has the group open (each rank writes its
pid, start time and pid namespace into the board's presence table when it maps
the board, and marks its entry when it closes the group): a peer that exited or
closed its group is reported at once as a ``PeerFailureError``, not at the timeout.

Set-up (``Diagnostics.start``): rank 0 creates the file, mode 0600, under a name no
other process can guess, writes a random token into its header, and hands the
name, the token and its host's identity (hostname and kernel boot id) to the other
ranks in the group's set-up broadcast. A rank on the same host maps the file and
checks the token; the ranks then agree, with one all-reduce, whether every rank
could; rank 0 unlinks the file in either case. Ranks on other hosts (or behind
another ``/dev/shm``) make the group fall back to the backend's own exchange.
"""

from __future__ import annotations

import mmap
import os
import platform
import re
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from commlib.errors import CommError, CommTimeoutError, PeerFailureError
from commlib.procfs import read_process

__all__ = [
    "BOARD_DIR",
    "STORES_NEED_FENCE",
    "FingerprintBoard",
    "board_capacity",
    "host_identity",
    "reap_stale_boards",
]

BOARD_DIR = "/dev/shm"
"""Where boards are created (a RAM-backed file system on Linux)."""

STORES_NEED_FENCE = platform.machine().lower() not in ("x86_64", "amd64")
"""True where two stores (and two loads) may be seen out of order by another core (all but x86-64)."""

_MAGIC = b"CLDGBRD1"
_HEADER = struct.Struct("=8s16sII")
"""File header: magic, token, world size, slot size (bytes of payload per slot)."""
_HEADER_BYTES = 64
_PRESENCE = struct.Struct("=QQQQ")
"""Per rank, after the header: its pid, its start time (clock ticks since boot), its pid namespace,
and 1 once it has closed its group (unmapped the board)."""
_SLOT_HEAD = 8
"""Per slot: the number of the exchange it holds (u64), then its bytes."""
_LINE = 64
_NAME = re.compile(r"commlib-board-(\d+)-(\d+)-(\d+)-[0-9a-f]{24}")

PURE_SPIN_S = 5e-5
"""Seconds a waiting rank polls back to back (ranks in step arrive within microseconds)."""
YIELD_S = 2e-3
"""Seconds after which a waiting rank stops yielding its core between polls and naps instead."""
NAP_S = 1e-4
"""A waiting rank's nap between polls once ``YIELD_S`` has passed."""
BACKGROUND_NAP_S = (5e-5, 2e-4)
"""The launcher thread's first and longest naps: it waits while the caller computes."""
QUICK_POLLS = 256
"""Polls of a missing peer's number back to back, without a clock, before ``agrees`` waits the long way
(about 10 us: ranks in step post within a few)."""
_QUICK_POLLS = range(QUICK_POLLS)
LIVENESS_S = 0.02
"""How often a waiting rank looks whether the ranks it waits for still run."""

_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: None)
_fence_lock = threading.Lock()


def _fence() -> None:
    _fence_lock.acquire()
    _fence_lock.release()


def host_identity() -> str:
    """Identify this machine: hostname and kernel boot id (containers on one machine differ in hostname)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def board_capacity(world_size: int, *payloads: int) -> int:
    """Bytes of payload a slot needs for ``payloads`` and an all_to_all's splits (``2 * world`` int64)."""
    return max(16 * world_size, *payloads)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def reap_stale_boards(directory: str = BOARD_DIR) -> list[str]:
    """Remove boards in ``directory`` whose creator has exited (killed during set-up); return their names.

    Only files of this user and pid namespace, named by a process that no longer
    exists (its pid and start time), are removed.
    """
    namespace, uid, me = _pid_namespace(), os.geteuid(), os.getpid()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or int(match[1]) != namespace or int(match[2]) == me:
            continue
        path = os.path.join(directory, name)
        try:
            info = read_process(int(match[2]))
            if os.lstat(path).st_uid != uid or (info is not None and info.start == int(match[3])):
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
    return removed


class FingerprintBoard:
    """One rank's view of a shared-memory board; ``board(mine, timeout, label, background)`` exchanges.

    Build it with ``FingerprintBoard.create`` (rank 0) or ``FingerprintBoard.open``.
    An exchange is also ``post(mine)`` then ``collect(...)``, or ``agrees(...)``, which
    compares every rank's bytes with what this rank expects (the check's path before each
    collective); ``poll()`` tells without waiting whether every rank has posted. Every
    rank posts the same number of bytes in a given exchange (the caller's protocol
    guarantees it: fingerprints, then, after a mismatch, call sites or all_to_all
    splits, alike on every rank).

    Args:
        memory: The mapped file.
        rank: This rank.
        world_size: Ranks on the board.
        capacity: Payload bytes per slot.
        path: The file's path (rank 0 unlinks it once the others have mapped it).
    """

    def __init__(self, memory: mmap.mmap, rank: int, world_size: int, capacity: int, path: str) -> None:
        self._memory = memory
        self._rank = rank
        self._world = world_size
        self._capacity = capacity
        self.path = path
        stride = _slot_stride(capacity)
        base = _slots_at(world_size)
        slots = [[base + (2 * r + parity) * stride for r in range(world_size)] for parity in (0, 1)]
        self._mine_at = [row[rank] + _SLOT_HEAD for row in slots]
        """Per parity: where this rank's bytes go."""
        self._sources = [[-1 if r == rank else at + _SLOT_HEAD for r, at in enumerate(row)] for row in slots]
        """Per parity, per rank: where its bytes start (-1: this rank's own, kept in ``_mine``)."""
        self._flags = [[at >> 3 for r, at in enumerate(row) if r != rank] for row in slots]
        """Per parity: the other ranks' slot numbers, as indexes into ``_words``."""
        self._mine_flag = [row[rank] >> 3 for row in slots]
        self._words = memoryview(memory).cast("Q")
        """The mapped file as aligned 64-bit words: one load or store reads or writes a slot's number."""
        self._count = 0
        """Exchanges this rank has posted."""
        self._others = [r for r in range(world_size) if r != rank]
        self._peers = [[(r, at) for r, at in enumerate(row) if at >= 0] for row in self._sources]
        """Per parity: the other ranks and where their bytes start."""
        self._mine = b""
        self._closed = False
        me = read_process(os.getpid())
        _PRESENCE.pack_into(
            memory,
            _HEADER_BYTES + rank * _PRESENCE.size,
            os.getpid(),
            me.start if me else 0,
            _pid_namespace(),
            0,
        )
        self.pure_spin_s = PURE_SPIN_S
        """Seconds a waiting rank polls back to back before it yields; a backend whose own waits spin
        longer (MPI's, when every rank has a core) has the check's follow them."""

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def size_for(world_size: int, capacity: int) -> int:
        """Bytes of the file for ``world_size`` ranks and ``capacity`` payload bytes per slot."""
        return _slots_at(world_size) + 2 * world_size * _slot_stride(capacity)

    @classmethod
    def create(
        cls, world_size: int, capacity: int, directory: str = BOARD_DIR
    ) -> tuple[FingerprintBoard, bytes]:
        """Rank 0: create and map a new board; return it and its token.

        Raises:
            OSError: The file could not be created or mapped.
        """
        reap_stale_boards(directory)
        me = read_process(os.getpid())
        name = (
            f"commlib-board-{_pid_namespace()}-{os.getpid()}-{me.start if me is not None else 0}-"
            f"{secrets.token_hex(12)}"
        )
        path = os.path.join(directory, name)
        size = cls.size_for(world_size, capacity)
        token = secrets.token_bytes(16)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        memory[: _HEADER.size] = _HEADER.pack(_MAGIC, token, world_size, capacity)
        return cls(memory, 0, world_size, capacity, path), token

    @classmethod
    def open(cls, path: str, token: bytes, rank: int, world_size: int) -> FingerprintBoard:
        """Map the board rank 0 created at ``path``, after checking its token and size.

        Raises:
            OSError: The file is not there (another host or ``/dev/shm``), or is not the board handed out.
        """
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        try:
            info = os.fstat(fd)
            if info.st_uid != os.geteuid() or info.st_size < _HEADER_BYTES:
                raise OSError(f"{path} is not a board of this user")
            memory = mmap.mmap(fd, info.st_size)
        finally:
            os.close(fd)
        magic, found, world, capacity = _HEADER.unpack_from(memory)
        if (
            magic != _MAGIC
            or not secrets.compare_digest(found, token)
            or world != world_size
            or info.st_size != cls.size_for(world_size, capacity)
        ):
            memory.close()
            raise OSError(f"{path} holds another board")
        return cls(memory, rank, world_size, capacity, path)

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay); nothing is left behind once every rank has closed."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap the board; an exchange after this raises ``CommError``."""
        if self._closed:
            return
        self._closed = True
        self._words[(_HEADER_BYTES + self._rank * _PRESENCE.size) // 8 + 3] = 1  # closed: peers stop waiting
        self._words.release()
        try:
            self._memory.close()
        except BufferError:  # another thread holds a view for a moment: the mapping goes with the object
            pass

    # ----------------------------------------------------------------- exchange
    def __call__(self, mine: bytes, timeout: float, label: object, background: bool) -> bytes:
        """Post ``mine`` and wait for every rank's; return them in rank order (a ``FingerprintExchange``).

        ``label`` names the call in errors; it may be a function that returns the name.

        Raises:
            CommTimeoutError: Some rank did not post within ``timeout``; it is named.
            CommError: The board was closed.
        """
        self.swap(mine, timeout, label, background)
        return self.gather()

    def swap(self, mine: bytes, timeout: float, label: object, background: bool) -> None:
        """Post ``mine`` and wait until every rank has posted; then read them with ``gather``.

        Raises:
            CommTimeoutError: Some rank did not post within ``timeout``; it is named.
            CommError: The board was closed.
        """
        # ``post``, inline: the fingerprint check runs this before every collective.
        size = len(mine)
        if self._closed or size > self._capacity:
            self.post(mine)  # raises
        self._count = count = self._count + 1
        parity = count & 1
        at = self._mine_at[parity]
        words = self._words
        self._memory[at : at + size] = mine
        if STORES_NEED_FENCE:
            _fence()
        words[self._mine_flag[parity]] = count
        self._mine = mine
        for flag in self._flags[parity]:
            if words[flag] != count:
                self._await(timeout, label, background)
                return
        if STORES_NEED_FENCE:
            _fence()

    def agrees(
        self, head: bytes, tails: Sequence[bytes], timeout: float, label: object, *args: object
    ) -> bool:
        """Wait for every rank's post of this rank's last exchange; True if each is ``head + tails[rank]``.

        ``label`` names the call in errors: the name, or a function that returns it when
        called with ``args`` (called only on a failure: every collective's check runs this).

        Raises:
            CommTimeoutError: Some rank did not post within ``timeout``; it is named.
            CommError: The board was closed.
        """
        words, count = self._words, self._count
        parity = count & 1
        for flag in self._flags[parity]:
            if words[flag] != count and not self._posts_soon(flag, count):
                self._await(timeout, (lambda: label(*args)) if callable(label) else label, False)
                break
        else:
            if STORES_NEED_FENCE:
                _fence()
        memory, size = self._memory, len(self._mine)
        for rank, at in self._peers[parity]:
            if memory[at : at + size] != head + tails[rank]:
                return False
        return True

    def _posts_soon(self, flag: int, count: int) -> bool:
        """True if the rank behind ``flag`` posts ``count`` within ``QUICK_POLLS`` clockless polls.

        A rank a moment behind is seen sooner so than by ``_await``'s loop, which reads the
        clock and naps between polls.
        """
        words = self._words
        for _ in _QUICK_POLLS:
            if words[flag] == count:
                return True
        return False

    def gather(self) -> bytes:
        """Every rank's bytes of the exchange just made, in rank order."""
        memory, mine, size = self._memory, self._mine, len(self._mine)
        # A loop, not a comprehension: no call of its own (Python < 3.12) before a collective starts.
        parts = []
        for at in self._sources[self._count & 1]:
            parts.append(mine if at < 0 else memory[at : at + size])
        return b"".join(parts)

    def post(self, mine: bytes) -> None:
        """Write this rank's bytes for its next exchange (at most ``capacity``).

        Raises:
            CommError: The board was closed.
        """
        if self._closed:
            raise CommError("the fingerprint board is closed; the group was closed")
        if len(mine) > self._capacity:
            raise ValueError(f"{len(mine)} bytes do not fit a board slot of {self._capacity}")
        self._count = count = self._count + 1
        at = self._mine_at[count & 1]
        self._memory[at : at + len(mine)] = mine
        if STORES_NEED_FENCE:
            _fence()
        self._words[self._mine_flag[count & 1]] = count
        self._mine = mine

    def poll(self, spin_s: float = 0.0) -> bytes | None:
        """Every rank's bytes of the last posted exchange, in rank order, if all have posted; else None.

        Polls back to back for up to ``spin_s`` seconds before it gives up (keep it to microseconds:
        the caller's thread holds its core and Python's lock meanwhile).

        Raises:
            CommError: The board was closed.
        """
        try:
            words, count = self._words, self._count
            flags = self._flags[count & 1]
            deadline = None
            while True:
                for flag in flags:
                    if words[flag] != count:
                        break
                else:
                    if STORES_NEED_FENCE:
                        _fence()
                    return self.gather()
                now = time.monotonic()
                if deadline is None:
                    deadline = now + spin_s
                if now >= deadline:
                    return None
        except ValueError as e:  # unmapped by close() on another thread
            raise CommError(f"the fingerprint board was closed: {e}") from e

    def collect(self, timeout: float, label: object, background: bool = False) -> bytes:
        """Wait until every rank has posted the last exchange; return their bytes in rank order.

        Polls back to back for ``pure_spin_s``, then yields the core between polls
        until ``YIELD_S`` (or ``pure_spin_s`` if longer), then naps (``background``: naps from the start, the
        launcher thread's caller is computing). ``label`` names the call in the
        error; it may be a function that returns the name.

        Raises:
            CommTimeoutError: Some rank did not post within ``timeout``; it is named.
            CommError: The board was closed meanwhile.
        """
        self._await(timeout, label, background)
        return self.gather()

    def _await(self, timeout: float, label: object, background: bool) -> None:
        """``collect`` without reading: return once every rank has posted, or raise."""
        try:
            late, gone = self._wait(timeout, background)
        except ValueError as e:  # unmapped by close() on another thread
            raise CommError(f"{label() if callable(label) else label}: the group was closed: {e}") from e
        if not late:
            if STORES_NEED_FENCE:
                _fence()
            return
        if callable(label):
            label = label()
        if gone:
            what = ", ".join(f"{r} (pid {p}) {'exited' if e else 'closed the group'}" for r, p, e in gone)
            plural = len(gone) > 1
            raise PeerFailureError(
                f"{label}: rank{'s' if plural else ''} {what} while this rank waited in the fingerprint "
                f"check for {'their' if plural else 'its'} exchange #{self._count}; the group is unusable: "
                "every rank must create a new one",
                exited=tuple(r for r, _, ended in gone if ended),
            )
        raise CommTimeoutError(
            f"{label}: timed out after {timeout:g} s in the fingerprint check waiting for rank"
            f"{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} to reach this collective (their "
            f"exchange #{self._count} did not arrive over shared memory); they may be stuck, slower, or "
            "have exited. Raise COMMLIB_TIMEOUT if they are just slow"
        )

    def _wait(self, timeout: float, background: bool) -> tuple[list[int], list[tuple[int, int, bool]]]:
        """Poll until every rank has posted the last exchange, ``timeout`` passed, or one it waits for exited.

        Returns the ranks late (none: all posted) and, of those, ``(rank, pid, exited)`` of the
        ones gone (``exited`` False: it closed the group).
        """
        words, count = self._words, self._count
        missing = [flag for flag in self._flags[count & 1] if words[flag] != count]
        if not missing:
            return [], []
        start = time.monotonic()
        deadline = start + timeout
        if background:
            nap, longest = BACKGROUND_NAP_S
            yield_until = nap_from = start
        else:
            nap, longest = NAP_S, NAP_S
            yield_until = start + self.pure_spin_s
            nap_from = start + max(YIELD_S, self.pure_spin_s)
        look_at = start + LIVENESS_S
        gone: list[tuple[int, int, bool]] = []
        while True:
            missing = [flag for flag in missing if words[flag] != count]
            if not missing:
                return [], []
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= look_at:
                look_at = now + LIVENESS_S
                gone = self._gone(missing)
                if gone:
                    break
            if now > nap_from:
                time.sleep(nap)
                nap = min(nap * 2, longest)
            elif now > yield_until:
                _yield()
        flags = self._flags[count & 1]
        return [rank for rank, flag in zip(self._others, flags, strict=True) if words[flag] != count], gone

    def _gone(self, missing: list[int]) -> list[tuple[int, int, bool]]:
        """``(rank, pid, exited)`` of the ranks behind ``missing`` slots that exited or closed their group."""
        count, flags = self._count, self._flags[self._count & 1]
        namespace = _pid_namespace()
        gone = []
        for rank, flag in zip(self._others, flags, strict=True):
            if flag not in missing or self._words[flag] == count:
                continue
            at = _HEADER_BYTES + rank * _PRESENCE.size
            pid, started, their_namespace, closed = _PRESENCE.unpack_from(self._memory, at)
            exited = not closed and bool(pid) and their_namespace == namespace and not _running(pid, started)
            if closed or exited:
                gone.append((rank, pid, exited))
        return gone


def _running(pid: int, started: int) -> bool:
    """True if process ``pid``, started at ``started``, still runs (not a zombie, not a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0] not in ("Z", "X") and int(fields[19]) == started


def _slots_at(world_size: int) -> int:
    """Where the slots start: after the header and the presence table, on a cache line."""
    return -(-(_HEADER_BYTES + world_size * _PRESENCE.size) // _LINE) * _LINE


def _slot_stride(capacity: int) -> int:
    """Bytes from one slot to the next: its number and bytes, rounded up to whole cache lines."""
    return -(-(_SLOT_HEAD + capacity) // _LINE) * _LINE
