"""Per-rank Chrome trace ("timeline") of DDP's gradient communication."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from commlib.errors import error_prefix
from ddp.observe.stats import StepStats

logger = logging.getLogger("commlib")

__all__ = [
    "FORMAT",
    "TIMELINE_ENV_VAR",
    "TimelineWriter",
    "load_timeline",
    "timeline_path_from_env",
]

FORMAT = "commlib-ddp-timeline/1"
"""Value of ``otherData["format"]`` in every file this module writes."""

TIMELINE_ENV_VAR = "COMMLIB_TIMELINE"
"""Environment variable naming the timeline file (see ``timeline_path_from_env``)."""

DEFAULT_MAX_STEPS = 200

TID_BACKWARD = 0
TID_READY = 1
TID_COMM = 2
TID_COMM_LANE = 100
"""Lane ``k`` >= 1 of the communication track is thread ``TID_COMM_LANE + k``: buckets in flight at
once get lanes of their own, since a trace viewer shows only nested spans on one thread."""
_THREAD_NAMES = {TID_BACKWARD: "backward", TID_READY: "buckets ready", TID_COMM: "communication"}


def lanes(spans: Sequence[tuple[float, float, Any]]) -> tuple[list[int], int]:
    """Give overlapping spans ``(start, duration, ...)`` separate lanes, greedily in start order.

    Returns:
        Each span's lane, and how many lanes there are (at least 1).
    """
    ends: list[float] = []
    lane_of = [0] * len(spans)
    for k in sorted(range(len(spans)), key=lambda k: spans[k][0]):
        start, duration = spans[k][0], spans[k][1]
        for lane, end in enumerate(ends):
            if end <= start:
                ends[lane] = start + duration
                lane_of[k] = lane
                break
        else:
            lane_of[k] = len(ends)
            ends.append(start + duration)
    return lane_of, max(1, len(ends))


def _comm_tid(lane: int) -> int:
    return TID_COMM if lane == 0 else TID_COMM_LANE + lane


# Writers with steps not yet on disk, saved by one atexit hook; weak, so that a writer
# nobody holds any more can be garbage collected (its unsaved steps are then lost).
_unsaved: weakref.WeakSet[TimelineWriter] = weakref.WeakSet()
_atexit_registered = False
_writers: weakref.WeakSet[TimelineWriter] = weakref.WeakSet()  # every writer of this process


def _own_path(path: Path) -> Path:
    """``path``, or ``path`` with ``.model1``, ``.model2``... in its name while an open writer holds it."""
    taken = {writer.path for writer in _writers if not writer.closed}
    candidate, k = path, 0
    while candidate in taken:
        k += 1
        candidate = path.with_name(f"{path.stem}.model{k}{path.suffix}")
    return candidate


def _ts_key(event: dict[str, Any]) -> float:
    return event["ts"]  # type: ignore[no-any-return]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _resolve_path(path: str | os.PathLike[str], rank: int, world_size: int) -> Path:
    prefix = error_prefix(rank, world_size, "ddp", "timeline")
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{prefix}the timeline path must be a str or os.PathLike, got {type(path).__name__}; "
            "pass a file name such as 'trace.json'"
        )
    text = os.fspath(path)
    if not text.strip():
        raise ValueError(
            f"{prefix}the timeline path is empty; pass a file name such as '/tmp/trace.json' "
            f"(or leave {TIMELINE_ENV_VAR} unset to record no timeline)"
        )
    seps = (os.sep, os.altsep or os.sep)
    if text.endswith(seps):
        raise ValueError(
            f"{prefix}the timeline path {text!r} names a directory; pass a file path inside it, "
            f"such as {os.path.join(text, 'trace.json')!r}"
        )
    if "{rank}" in text:
        text = text.replace("{rank}", str(rank))
        resolved = Path(text)
    else:
        resolved = Path(text)
        if world_size > 1:
            resolved = resolved.with_name(f"{resolved.stem}.rank{rank}{resolved.suffix}")
    if resolved.name in ("", ".", ".."):
        raise ValueError(
            f"{prefix}the timeline path {text!r} names a directory; pass a file path inside it, "
            f"such as {os.path.join(text, 'trace.json')!r}"
        )
    resolved = Path(os.path.abspath(resolved))
    if resolved.is_dir():
        raise ValueError(
            f"{prefix}the timeline path {str(resolved)!r} is an existing directory; pass a file "
            f"path inside it, such as {str(resolved / 'trace.json')!r}"
        )
    try:
        resolved.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(
            f"{prefix}cannot create the directory of the timeline path {str(resolved)!r}: a part of "
            "it is a file; pass a path whose parent is a directory (or does not exist yet)"
        ) from None
    return resolved


def _save_all_at_exit() -> None:
    for writer in list(_unsaved):
        try:
            writer.save()
        except Exception as e:  # one failing writer must not stop the others
            print(f"ddp.timeline: could not save {writer.path} at exit: {e}", file=sys.stderr)


class TimelineWriter:
    """Record each backward's gradient communication and write it as a Chrome trace.

    One writer per rank, one file per rank. Load the files of all ranks together in
    https://ui.perfetto.dev or chrome://tracing: timestamps are wall-clock microseconds
    since the Unix epoch, so the ranks line up (as well as the hosts' clocks agree), one
    process row per rank (``pid`` = rank) with three tracks:

    - ``backward`` (tid 0): ``backward step K``, from the first gradient hook to the end of
      backward's computation, then ``wait for communication``, the exposed wait at the end
      of backward (synchronised steps only).
    - ``buckets ready`` (tid 1): an instant ``bucket B ready`` when a bucket got all its
      gradients.
    - ``communication`` (tid 2): ``all_reduce bucket B`` from launch to when completion was
      first observed (an upper bound of the true end). A bucket whose completion was not
      observed gets an instant ``bucket B launched`` instead.

    A ``no_sync()`` backward records only its backward span. Every event's ``args`` carry
    the step number.

    The file name: ``{rank}`` in ``path`` is replaced by the rank; otherwise, with more than
    one rank, ``.rank<R>`` is inserted before the suffix (``trace.json`` becomes
    ``trace.rank0.json``, ``trace.rank1.json``, ...). With one rank and no ``{rank}`` the
    path is used as given. A second writer of the process for a file an open writer
    holds (two DDP models under one ``COMMLIB_TIMELINE``) inserts ``.model1`` (then
    ``.model2``...): ``trace.rank0.model1.json``. The parent directory is created if missing.

    Steps are kept in memory and written by ``save()``/``close()``; an exit hook saves
    any unsaved steps when the interpreter exits normally (not on ``os._exit`` or a kill).

    Args:
        path: The file to write (see above).
        rank: This process's rank.
        world_size: Number of ranks.
        backend: Backend name, shown in the process name (``ring``, ``gloo``, ...).
        max_steps: Record the first ``max_steps`` steps (the file is written as soon as
            they are in); later ones are counted in
            ``otherData["steps_dropped"]`` and otherwise ignored.
        collective: What the buckets' events are called (``all_reduce``, or
            ``reduce_scatter`` with ``gradient_sync="reduce_scatter"``).

    Raises:
        ValueError: ``path`` is empty or names a directory, or a number is out of range.

    Example::

        >>> writer = TimelineWriter("/tmp/trace.json", rank=1, world_size=2, backend="ring")
        >>> writer.path
        PosixPath('/tmp/trace.rank1.json')
        >>> loss.backward(); writer.record(model.last_step_stats)  # after each backward
        >>> writer.close()                                          # writes the file
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        rank: int,
        world_size: int,
        backend: str,
        max_steps: int = DEFAULT_MAX_STEPS,
        collective: str = "all_reduce",
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"ddp.timeline: world_size must be a positive integer, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(
                f"ddp.timeline: rank must be an integer in [0, {world_size - 1}] for world_size "
                f"{world_size}, got {rank!r}"
            )
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(
                f"{error_prefix(rank, world_size, 'ddp', 'timeline')}max_steps must be a positive "
                f"integer, got {max_steps!r}"
            )
        self._path = _own_path(_resolve_path(path, rank, world_size))
        _writers.add(self)
        self._rank = rank
        self._world_size = world_size
        self._backend = str(backend)
        self._max_steps = max_steps
        self._collective = collective  # names the buckets' events (reduce_scatter in that mode)
        # The two clocks read together (perf_counter averaged around time.time): every
        # perf_counter value maps to wall-clock microseconds as wall0 + (value - perf0).
        p1 = time.perf_counter()
        wall = time.time()
        p2 = time.perf_counter()
        self._perf0 = (p1 + p2) / 2
        self._wall0_us = wall * 1e6
        self._steps: list[StepStats] = []
        self._steps_dropped = 0
        self._dirty = False
        self._closed = False
        global _atexit_registered
        if not _atexit_registered:
            atexit.register(_save_all_at_exit)
            _atexit_registered = True

    # ------------------------------------------------------------------ facts
    @property
    def path(self) -> Path:
        """The file this writer writes (absolute, after ``{rank}`` / ``.rankR`` naming)."""
        return self._path

    @property
    def rank(self) -> int:
        """This writer's rank (the ``pid`` of its events)."""
        return self._rank

    @property
    def steps_recorded(self) -> int:
        """Steps recorded so far (at most ``max_steps``)."""
        return len(self._steps)

    @property
    def steps_dropped(self) -> int:
        """Steps ignored because ``max_steps`` were already recorded."""
        return self._steps_dropped

    @property
    def closed(self) -> bool:
        """True after ``close()``."""
        return self._closed

    def __repr__(self) -> str:
        return (
            f"TimelineWriter({str(self._path)!r}, rank={self._rank}, world_size={self._world_size}, "
            f"backend={self._backend!r}, steps_recorded={self.steps_recorded}, "
            f"steps_dropped={self._steps_dropped}, closed={self._closed})"
        )

    # -------------------------------------------------------------- recording
    def record(self, stats: StepStats) -> None:
        """Add one backward (cheap: the statistics are kept, and turned into events by ``save``).

        Args:
            stats: The step's statistics, e.g. ``model.last_step_stats``.

        A closed writer counts the step as dropped (DDP goes on publishing steps
        to it). Where the record is complete, it is written at once; a write that
        fails is logged at WARNING, and ``save()`` or the exit writes it later.
        """
        if self._closed:
            self._steps_dropped += 1
            return
        if len(self._steps) >= self._max_steps:
            self._steps_dropped += 1
        else:
            self._steps.append(stats)
        if not self._dirty:
            self._mark_unsaved()
        if len(self._steps) == self._max_steps and self._steps_dropped == 0:
            # The record is complete: write it now, so a job killed later still leaves it.
            try:
                self.save()
            except OSError as e:  # tracing must not stop training: the exit tries again
                self._mark_unsaved()
                logger.warning(
                    "%scould not write %s (%s); it is written again at exit or on save()",
                    error_prefix(self._rank, self._world_size, "ddp", "timeline"),
                    self._path,
                    e,
                )

    def _step_events(self, stats: StepStats) -> list[dict[str, Any]]:
        """Return one step's events, sorted by ``ts``."""
        pid = self._rank
        step = stats.step
        base = self._wall0_us + (stats.start - self._perf0) * 1e6
        backward_us = max(0.0, _finite(stats.backward_s) * 1e6)
        if stats.synced:
            exposed_s = max(0.0, _finite(stats.exposed_wait_s))
            args: dict[str, Any] = {
                "step": step,
                "synced": True,
                "collectives": stats.collectives,
                "bytes_reduced": stats.bytes_reduced,
                "bytes_sent": stats.bytes_sent,
                "grads_copied": stats.grads_copied,
                "hook_ms": round(_finite(stats.hook_s) * 1e3, 6),
                "comm_ms": round(_finite(stats.comm_time_s) * 1e3, 6),
                "exposed_ms": round(exposed_s * 1e3, 6),
                "overlap": round(_finite(stats.overlap), 6),
            }
            name = f"backward step {step}"
        else:
            args = {"step": step, "synced": False, "grads_copied": stats.grads_copied}
            name = f"backward step {step} (no_sync)"
        comm = [
            (b.launch_s, b.done_s - b.launch_s, b)
            for b in stats.buckets
            if math.isfinite(b.launch_s) and math.isfinite(b.done_s)
        ]
        lane_of = dict(zip((b.index for _, _, b in comm), lanes(comm)[0], strict=True))
        events: list[dict[str, Any]] = [
            {
                "name": name,
                "cat": "backward",
                "ph": "X",
                "ts": base,
                "dur": round(backward_us, 3),
                "pid": pid,
                "tid": TID_BACKWARD,
                "args": args,
            }
        ]
        if not stats.synced:
            return events
        for b in stats.buckets:
            i = b.index
            if math.isfinite(b.ready_s):
                events.append(
                    {
                        "name": f"bucket {i} ready",
                        "cat": "ready",
                        "ph": "i",
                        "s": "t",
                        "ts": base + b.ready_s * 1e6,
                        "pid": pid,
                        "tid": TID_READY,
                        "args": {"step": step, "bucket": i},
                    }
                )
            if not math.isfinite(b.launch_s):
                continue
            bucket_args: dict[str, Any] = {
                "step": step,
                "bucket": i,
                "params": b.params,
                "nbytes": b.nbytes,
                "MB": round(b.nbytes / 1e6, 6),
            }
            launch = base + b.launch_s * 1e6
            if math.isfinite(b.done_s):
                events.append(
                    {
                        "name": f"{self._collective} bucket {i}",
                        "cat": "comm",
                        "ph": "X",
                        "ts": launch,
                        "dur": round(max(0.0, (b.done_s - b.launch_s) * 1e6), 3),
                        "pid": pid,
                        "tid": _comm_tid(lane_of[i]),
                        "args": bucket_args,
                    }
                )
            else:
                bucket_args["done"] = "not observed"
                events.append(
                    {
                        "name": f"bucket {i} launched",
                        "cat": "launched",
                        "ph": "i",
                        "s": "t",
                        "ts": launch,
                        "pid": pid,
                        "tid": TID_COMM,
                        "args": bucket_args,
                    }
                )
        events.append(
            {
                "name": "wait for communication",
                "cat": "wait",
                "ph": "X",
                "ts": base + backward_us,
                "dur": round(exposed_s * 1e6, 3),
                "pid": pid,
                "tid": TID_BACKWARD,
                "args": {"step": step, "exposed_ms": round(exposed_s * 1e3, 6)},
            }
        )
        events.sort(key=_ts_key)
        return events

    def _mark_unsaved(self) -> None:
        self._dirty = True
        _unsaved.add(self)

    # ---------------------------------------------------------------- writing
    def _metadata(self, comm_lanes: int) -> list[dict[str, Any]]:
        pid = self._rank
        names = dict(_THREAD_NAMES)
        names.update({_comm_tid(k): f"communication (lane {k + 1})" for k in range(1, comm_lanes)})
        events: list[dict[str, Any]] = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"name": f"rank {self._rank}/{self._world_size} ({self._backend})"},
            },
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        ]
        for tid, thread in names.items():
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}}
            )
            events.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )
        return events

    def _other_data(self, steps: list[StepStats]) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "rank": self._rank,
            "world_size": self._world_size,
            "backend": self._backend,
            "steps_recorded": len(steps),
            "steps_dropped": self._steps_dropped,
            "max_steps": self._max_steps,
            "step_numbers": [stats.step for stats in steps],
            "clock": "ts in wall-clock microseconds since the Unix epoch",
        }

    def save(self) -> Path:
        """Write everything recorded so far to ``path`` (atomically) and return the path.

        The file is a Chrome trace in the JSON object form: ``{"traceEvents": [...],
        "displayTimeUnit": "ms", "otherData": {...}}``, one event per line. It is written to
        a temporary file in the same directory, then renamed over ``path``, so a reader
        never sees half a file.

        Raises:
            OSError: The file could not be written.
        """
        dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
        steps = list(self._steps)
        events = []
        for stats in steps:
            events += self._step_events(stats)
        tids = {e["tid"] for e in events if e["cat"] == "comm"}
        events[:0] = self._metadata(1 + max((t - TID_COMM_LANE for t in tids if t > TID_COMM), default=0))
        other = self._other_data(steps)
        # Clear the flag first: a step recorded while writing marks the writer unsaved again.
        self._dirty = False
        _unsaved.discard(self)
        text = "".join(
            [
                '{"traceEvents":[\n',
                ",\n".join(map(dumps, events)),
                '\n],\n"displayTimeUnit":"ms",\n"otherData":',
                dumps(other),
                "}\n",
            ]
        )
        path = self._path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except BaseException:
            self._mark_unsaved()
            raise
        return path

    def close(self) -> Path:
        """Save (the first time only) and stop recording; calling it again does nothing.

        Returns:
            The path of the file.
        """
        if not self._closed:
            self._closed = True
            self.save()
        return self._path

    def __enter__(self) -> TimelineWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def timeline_path_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """Return the timeline path in ``COMMLIB_TIMELINE``, or None when it is unset or empty.

    Args:
        environ: Mapping to read instead of ``os.environ``.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(TIMELINE_ENV_VAR, "").strip()
    return value or None


def load_timeline(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a timeline file written by ``TimelineWriter`` and check that it is one.

    Args:
        path: The file (one rank's).

    Returns:
        The parsed JSON object: ``traceEvents``, ``displayTimeUnit``, ``otherData``.

    Raises:
        FileNotFoundError: There is no such file.
        ValueError: The file is not valid JSON or not a commlib DDP timeline; the
            message names the file and what is wrong.
    """
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as f:
            data = json.load(f)
    except UnicodeDecodeError:
        raise ValueError(f"{name}: not a commlib DDP timeline (not a UTF-8 text file)") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{name}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
            "was it written completely?"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{name}: not a commlib DDP timeline (the JSON is a {type(data).__name__}, expected an "
            'object with "traceEvents" and "otherData")'
        )
    events = data.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError(f'{name}: not a Chrome trace (no "traceEvents" list)')
    other = data.get("otherData")
    marker = other.get("format") if isinstance(other, dict) else None
    if marker != FORMAT:
        raise ValueError(
            f'{name}: not a commlib DDP timeline (otherData["format"] is {marker!r}, expected '
            f"{FORMAT!r}); write it with ddp.TimelineWriter"
        )
    for i, event in enumerate(events):
        if not isinstance(event, dict) or "ph" not in event:
            raise ValueError(f'{name}: traceEvents[{i}] is not a trace event (an object with "ph")')
    return data
