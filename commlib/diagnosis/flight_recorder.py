"""Flight recorder: the last N collectives of each group, written out when something goes wrong.

With ``COMMLIB_FLIGHT_RECORDER=N`` every group keeps its last ``N`` operations
(op, sequence number, dtype, shape, start and end, status; sends and receives
with their peer and tag, numbered per peer and tag). Each group is named alike
on every member (``gloo#0``, its subgroups ``gloo#0.1``...) and lists its
members' global ranks. The process writes them all to
``COMMLIB_DUMP_DIR/commlib_flight_rank{R}.json`` (``R``: its global rank) on any
``CommError`` an operation raises, on SIGUSR1, and on ``dump_flight_recorder()``.

Read the dumps of every rank with ``python -m commlib flight DIR`` (``main``),
which prints, per group, the first sequence number at which the ranks disagree
(different collective, dtype, size, op or root) or at which some rank is
missing, each rank's last collective, and the sends and receives that did not
complete.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from commlib.diagnosis.fingerprint import ROOT_NAMES
from commlib.diagnosis.watchdog import Record
from commlib.errors import CommError, GroupClosedError
from commlib.types import dtype_name
from commlib.work import Work

__all__ = ["FlightRecorder", "dump_flight_recorder", "find_divergence", "load_dumps", "main"]

logger = logging.getLogger("commlib")

DUMP_PATTERN = "commlib_flight_rank{rank}.json"
"""File name of one rank's dump inside the dump directory."""

_lock = threading.Lock()
_recorders: list[weakref.ref[FlightRecorder]] = []
_created = 0
_signal_installed = False
_signal_thread: threading.Thread | None = None
_signal_sockets: tuple[socket.socket, socket.socket] | None = None
"""The wakeup socket pair, held for the life of the process (the signal machinery writes to its fd)."""


class _Entry:
    """One collective in the recorder."""

    __slots__ = ("record", "start", "end", "status", "error", "work", "context")

    def __init__(self, record: Record, start: float) -> None:
        self.record = record
        self.start = start
        self.end: float | None = None
        self.status = "in flight"
        self.error: str | None = None
        self.work: Work | None = None
        self.context: str | None = None  # the work's annotation, kept once the work is let go

    def as_json(self) -> dict[str, Any]:
        seq, kind, dtype, shape, op, root = self.record[:6]
        work = self.work
        extra = {"peer": root, "tag": self.record[6]} if len(self.record) > 6 else {}
        return {
            **extra,
            "seq": seq,
            "op": kind,
            "dtype": dtype_name(dtype) if dtype is not None else None,
            "shape": list(shape),
            "numel": math.prod(shape) if dtype is not None else 0,
            "reduce_op": op.name if op is not None else None,
            "root": -1 if extra else root,
            "start": self.start,
            "end": self.end,
            "duration_s": None if self.end is None else round(self.end - self.start, 6),
            "status": self.status,
            "error": self.error,
            "context": work.context if work is not None else self.context,
        }


class FlightRecorder:
    """The last ``capacity`` collectives of one group on this rank.

    Args:
        capacity: How many collectives to keep.
        backend: The group's backend.
        rank: This rank in the group.
        world_size: Ranks in the group.
        dump_dir: Where dumps go (None: ``COMMLIB_DUMP_DIR``, else the temporary directory).
        name: The group's name, alike on every member (default: backend and creation order).
        global_ranks: The members' global ranks (default: ``0..world_size-1``).
    """

    def __init__(
        self,
        capacity: int,
        backend: str,
        rank: int,
        world_size: int,
        dump_dir: str | None,
        *,
        name: str | None = None,
        global_ranks: tuple[int, ...] | None = None,
    ) -> None:
        global _created
        self._entries: deque[_Entry] = deque(maxlen=capacity)
        self._issued = 0  # the number of the latest collective begun, whether or not still in the window
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.dump_dir = dump_dir
        self.global_ranks = global_ranks if global_ranks is not None else tuple(range(world_size))
        self.global_rank = self.global_ranks[rank]
        """This process's global rank: names its dump file."""
        with _lock:
            self.name = name if name is not None else f"{backend}#{_created}"
            """Names the group in dumps, alike on every member."""
            _created += 1
            _recorders.append(weakref.ref(self))
        _install_signal_dump()

    def begin(self, record: Record) -> _Entry:
        """Record that the collective ``record`` starts now."""
        entry = _Entry(record, time.time())
        self._entries.append(entry)
        if len(record) <= 6:  # a collective (a send or receive also has a tag)
            self._issued = record[0]
        return entry

    def completed(self, entry: _Entry) -> None:
        """Record that a synchronous collective finished."""
        entry.end = time.time()
        entry.status = "completed"

    def failed(self, entry: _Entry, error: BaseException, *, dump: bool = True) -> None:
        """Record that the collective failed; dump everything if it is a ``CommError`` (and ``dump``).

        A group closing under an operation (``GroupClosedError``) writes no dump: the dump of
        whatever failed first stays as it was.
        """
        entry.end = time.time()
        entry.status = "failed"
        entry.error = f"{type(error).__name__}: {error}"
        if entry.work is not None:
            entry.context = entry.work.context
            entry.work = None
        if dump and isinstance(error, CommError) and not isinstance(error, GroupClosedError):
            dump_on_error(error)

    def follow(self, entry: _Entry, work: Work) -> None:
        """Record the end of an asynchronous collective when its work settles."""
        entry.work = work
        work.add_observer(lambda settled: self._settled(entry, settled))

    def _settled(self, entry: _Entry, work: Work) -> None:
        error = work.exception()
        if error is not None:
            self.failed(entry, error)
            return
        entry.end = time.time()
        entry.status = "completed"

    def snapshot(self) -> dict[str, Any]:
        """This group's part of a dump."""
        return {
            "name": self.name,
            "backend": self.backend,
            "rank": self.rank,
            "world_size": self.world_size,
            "global_ranks": list(self.global_ranks),
            "capacity": self._entries.maxlen,
            "issued": self._issued,
            "entries": [entry.as_json() for entry in list(self._entries)],
        }


def _live() -> list[FlightRecorder]:
    with _lock:
        alive = [r() for r in _recorders]
        _recorders[:] = [r for r, obj in zip(list(_recorders), alive, strict=True) if obj is not None]
    return [r for r in alive if r is not None]


def dump_flight_recorder(
    path: str | os.PathLike[str] | None = None, *, reason: str = "requested"
) -> Path | None:
    """Write this process's flight recorders to ``path/commlib_flight_rank{R}.json``.

    ``R`` is this process's global rank. Every rank writes its own
    file, so one directory gathers the whole job for ``python -m commlib flight DIR``.

    Args:
        path: Directory to write into; default ``COMMLIB_DUMP_DIR``, else the
            system's temporary directory. It is created if needed.
        reason: Why the dump was written (stored in it).

    Returns:
        The file written, or None if no group records (``COMMLIB_FLIGHT_RECORDER`` is 0).
    """
    recorders = _live()
    if not recorders:
        return None
    first = recorders[0]
    directory = Path(
        path
        if path is not None
        else (first.dump_dir or os.environ.get("COMMLIB_DUMP_DIR") or tempfile.gettempdir())
    )
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / DUMP_PATTERN.format(rank=first.global_rank)
    document = {
        "rank": first.global_rank,
        "world_size": max(len(r.global_ranks) if r.global_ranks else r.world_size for r in recorders),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "reason": reason,
        "groups": [r.snapshot() for r in recorders],
    }
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(document, indent=1))
    os.replace(partial, target)
    return target


def dump_on_error(error: BaseException) -> None:
    """Dump after a failed collective (never raises: the error itself is what the caller must see)."""
    try:
        path = dump_flight_recorder(reason=f"{type(error).__name__}: {error}")
    except Exception as e:  # noqa: BLE001
        logger.warning("commlib flight recorder: could not write the dump after an error: %s", e)
        return
    if path is not None:
        logger.warning("commlib flight recorder: wrote %s after %s", path, type(error).__name__)


def _dump_for_signal() -> None:
    try:
        path = dump_flight_recorder(reason="SIGUSR1")
    except Exception as e:  # noqa: BLE001
        logger.warning("commlib flight recorder: could not write the dump on SIGUSR1: %s", e)
        return
    if path is not None:
        logger.warning("commlib flight recorder: wrote %s on SIGUSR1", path)


def _install_signal_dump() -> None:
    """Dump on SIGUSR1, at once, even while the main thread waits in native code.

    A Python signal handler runs only when the main thread next runs Python code,
    which a collective blocked in Gloo does not do until it times out. So the
    handler only marks the signal, and a thread woken by the signal's wakeup file
    descriptor writes the dump. Where another library owns the wakeup fd
    (asyncio), the handler writes it, when it gets to run. A handler installed
    before is called after ours.
    """
    global _signal_installed, _signal_thread, _signal_sockets
    if _signal_installed or not hasattr(signal, "SIGUSR1"):
        return
    if threading.current_thread() is not threading.main_thread():
        logger.debug("commlib flight recorder: not on the main thread; SIGUSR1 dumps are off")
        return
    _signal_installed = True
    previous = signal.getsignal(signal.SIGUSR1)

    def on_signal(signum: int, frame: object) -> None:
        if _signal_thread is None:
            _dump_for_signal()
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGUSR1, on_signal)
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    try:
        owner = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    except ValueError:
        owner = -2
    if owner != -1:
        if owner >= 0:
            signal.set_wakeup_fd(owner)
        wake_r.close()
        wake_w.close()
        return

    def watch_signals() -> None:
        while True:
            try:
                data = wake_r.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGUSR1 in data:
                _dump_for_signal()

    _signal_sockets = (wake_r, wake_w)
    _signal_thread = threading.Thread(target=watch_signals, name="commlib-flight-sigusr1", daemon=True)
    _signal_thread.start()


# ------------------------------------------------------------------ reading
def load_dumps(directory: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Read every ``commlib_flight_rank*.json`` in ``directory``: ``{rank: document}``."""
    dumps = {}
    for path in sorted(Path(directory).glob("commlib_flight_rank*.json")):
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
        dumps[int(document["rank"])] = document
    return dumps


def _call_text(entry: dict[str, Any]) -> str:
    parts = [f"{entry['op']} #{entry['seq']}"]
    if entry.get("dtype"):
        shape = entry["shape"]
        parts.append(f"{entry['dtype']} ({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})")
    if entry.get("reduce_op"):
        parts.append(entry["reduce_op"])
    if entry.get("root", -1) >= 0:
        parts.append(f"{ROOT_NAMES.get(entry['op'], 'src')}={entry['root']}")
    status = entry["status"] + (f": {entry['error']}" if entry.get("error") else "")
    return " ".join(parts) + f" [{status}]"


def _p2p_text(rank: int, entry: dict[str, Any]) -> str:
    peer = "any rank" if entry.get("peer") is None else f"rank {entry['peer']}"
    way = "to" if entry["op"] == "send" else "from"
    status = entry["status"] + (f": {entry['error']}" if entry.get("error") else "")
    return f"rank {rank}: {entry['op']} #{entry['seq']} {way} {peer} tag {entry['tag']} [{status}]"


def _is_p2p(entry: dict[str, Any]) -> bool:
    return "tag" in entry


def _key(entry: dict[str, Any]) -> tuple[Any, ...]:
    """What every rank's call of one collective shares (an all_to_all's size is each rank's own)."""
    numel = None if entry["op"] == "all_to_all" else entry.get("numel")
    return (entry["op"], entry.get("dtype"), numel, entry.get("reduce_op"), entry.get("root"))


def find_divergence(dumps: dict[int, dict[str, Any]]) -> list[str]:
    """Describe, per group, where the ranks' recorded collectives first diverge.

    A rank diverges at sequence number ``s`` when its collective ``s`` differs
    from another rank's (collective, dtype, size, op, root), or when it never
    reached ``s`` while another rank did. Collectives that left a rank's window
    (older than its first recorded one) are not held against it.

    Returns:
        Lines of text, one block per group.
    """
    lines: list[str] = []
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    sizes: dict[str, int] = {}
    for document in dumps.values():
        for group in document["groups"]:
            groups.setdefault(group["name"], {})[int(group["rank"])] = group
            sizes[group["name"]] = int(group["world_size"])
    for name in sorted(groups):
        lines.extend(_group_divergence(name, groups[name], sizes[name]))
    return lines


def _group_divergence(name: str, by_rank: dict[int, dict[str, Any]], world: int) -> list[str]:
    absent = [r for r in range(world) if r not in by_rank]
    head = f"group {name}: {world} ranks, dumps from rank(s) {', '.join(map(str, sorted(by_rank)))}"
    if absent:
        head += f"; no dump from rank(s) {', '.join(map(str, absent))}"
    lines = [head]
    unfinished = [
        _p2p_text(r, e)
        for r, g in sorted(by_rank.items())
        for e in g["entries"]
        if _is_p2p(e) and e["status"] != "completed"
    ]
    entries = {r: {e["seq"]: e for e in g["entries"] if not _is_p2p(e)} for r, g in by_rank.items()}
    # A rank reached every collective it began, also those that sends and receives pushed out of its window.
    last = {r: max(max(entries[r], default=0), int(g.get("issued", 0))) for r, g in by_rank.items()}
    first = {r: min(e, default=last[r] + 1) for r, e in entries.items()}
    divergence = None
    for seq in sorted(set().union(*(set(e) for e in entries.values()))):
        missing = [r for r in entries if last[r] < seq]
        present = {r: entries[r][seq] for r in entries if seq in entries[r]}
        if missing or len({_key(e) for e in present.values()}) > 1:
            divergence = (seq, present, missing)
            break
    if divergence is None:
        lines.append("  no divergence: every rank recorded the same collectives")
        stuck = _first_unfinished(entries)
        if stuck is not None:
            seq, present = stuck
            lines.append(f"  first collective not completed on every rank: #{seq}")
            lines.extend(f"    rank {r}: {_call_text(e)}" for r, e in sorted(present.items()))
    else:
        seq, present, missing = divergence
        why = "some rank never reached it" if missing else "the ranks' calls differ"
        lines.append(f"  first divergence at #{seq} ({why}):")
        for r in sorted(entries):
            if r in present:
                lines.append(f"    rank {r}: {_call_text(present[r])}")
            elif r in missing:
                tail = entries[r].get(last[r])
                before = f"its last recorded collective is {_call_text(tail)}" if tail else "it recorded none"
                lines.append(f"    rank {r}: missing ({before})")
            elif entries[r]:
                lines.append(f"    rank {r}: not in its window (it keeps #{first[r]} onwards)")
            else:
                lines.append(f"    rank {r}: not in its window (#{last[r]} began; sends, receives followed)")
    for r in sorted(entries):
        tail = entries[r].get(last[r])
        gone = f"#{last[r]}, out of its window" if last[r] else "nothing recorded"
        lines.append(f"  rank {r} last: {_call_text(tail) if tail else gone}")
    if unfinished:
        lines.append("  sends and receives not completed:")
        lines.extend(f"    {text}" for text in unfinished)
    return lines


def _first_unfinished(entries: dict[int, dict[int, dict[str, Any]]]) -> tuple[int, dict[int, Any]] | None:
    for seq in sorted(set().union(*(set(e) for e in entries.values()))):
        present = {r: e[seq] for r, e in entries.items() if seq in e}
        if any(e["status"] != "completed" for e in present.values()):
            return seq, present
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m commlib flight DIR``: print where the ranks' dumps diverge."""
    parser = argparse.ArgumentParser(
        prog="python -m commlib flight",
        description="Read every rank's commlib flight-recorder dump in DIR; print where the ranks diverge.",
    )
    parser.add_argument("directory", help="the COMMLIB_DUMP_DIR the ranks wrote into")
    args = parser.parse_args(argv)
    try:
        dumps = load_dumps(args.directory)
    except (OSError, ValueError, KeyError) as e:
        print(f"{parser.prog}: cannot read the dumps in {args.directory}: {e}", file=sys.stderr)
        return 2
    if not dumps:
        print(
            f"{parser.prog}: no commlib_flight_rank*.json in {args.directory}; run the job with "
            "COMMLIB_FLIGHT_RECORDER=N and COMMLIB_DUMP_DIR set",
            file=sys.stderr,
        )
        return 2
    for line in find_divergence(dumps):
        print(line)
    return 0
