"""Lanes: operations that run in the order issued, each lane on a thread of its own.

The one queue-and-thread engine of commlib and its backends. A ``Lane`` runs
what is queued on it one after the other, on a thread started on first use:

- ``submit(label, body, async_op)`` returns a ``Work`` settled with the body's
  error (``on_value`` hands its value over first). A synchronous operation
  (``async_op=False``) runs on the caller's thread when nothing is queued (no
  thread hop on the hot path: the ``Work`` comes back completed) or when the
  caller is the lane's own thread (a work's callback), and behind the queued
  ones otherwise; an asynchronous one always queues, and its ``EventWork``
  reports the lane's thread stuck after ``bound_s``. A lane is busy until the
  work of what it ran is settled (its finishers, future callbacks and
  observers have run), so whatever those issue is ordered before what anyone
  issues once the lane is idle.
- ``call(label, fn, *args)`` runs ``fn`` to its end and returns its value.
- ``post(step)`` queues a step that settles whatever it owns itself (no ``Work``).
- ``idle`` / ``busy``, ``on_own_thread()``, ``wait_idle(timeout)``: nothing
  queued or running; ``close(timeout)`` runs what is queued, then ends the thread,
  waiting at most ``timeout`` (the lane's ``bound_s`` unless given); after it,
  whatever would queue raises ``GroupClosedError`` (a synchronous operation on an
  idle lane still runs inline: its owner refuses it first).

A lingering lane (the default) keeps its thread until ``close``; with
``linger=False`` the thread ends whenever the lane drains and the next queued
operation starts a new one (for lanes made per key, that come and go); with
``linger=<seconds>`` it ends after that long idle. ``Lanes``
is a keyed collection of such lanes: one per key, made on first use; idle ones
are dropped when a new key comes and 64 are held.

Users: the ring's collectives and its point-to-point lanes per peer and direction
(``backends.ring``), Gloo's point-to-point lanes per peer and tag and the waiter
of works without a torch future (``backends.torch``), the bounded connect to
torch's store (``backends.common.store_rendezvous``), and a deterministic group's
helper (``commlib.deterministic``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from commlib.errors import GroupClosedError
from commlib.work import CollectiveLabel, CompletedWork, EventWork, Work

__all__ = ["Lane", "Lanes"]

Body = Callable[[], Any]
"""An operation: returns a value for ``on_value`` (a receive's source rank), or None."""

_log = logging.getLogger(__name__)


class Lane:
    """A FIFO of operations on a thread of its own, with an inline fast path; see the module docstring.

    Args:
        name: Names the lane's thread (``commlib-<name>``).
        bound_s: How long a ``Work.wait()`` without a timeout waits before it
            reports the lane's thread stuck (each step of an operation is bounded
            by its group's timeout; this catches a thread that stopped), and how
            long ``close`` waits for the thread by default.
        linger: Keep the thread, waiting for more, when the lane drains (until
            ``close``); False ends it, and the next queued operation starts another;
            a number of seconds keeps it that long idle, then ends it.
    """

    def __init__(self, name: str, bound_s: float, *, linger: bool | float = True) -> None:
        self._name = name
        self.bound_s = bound_s
        self._linger = linger
        self._idle_s: float | None = None if isinstance(linger, bool) else float(linger)
        """How long the thread waits idle before it ends; None: until ``close`` (or not at all)."""
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        """Notified whenever the lane's thread has finished everything queued."""
        self._inflight = 0
        """Operations queued or running on the lane's thread; written under ``_lock``."""
        self._queue: queue.SimpleQueue[tuple[EventWork | None, Body, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def idle(self) -> bool:
        """True when nothing is queued or running on the lane's thread."""
        return self._inflight == 0

    @property
    def busy(self) -> bool:
        """True while anything is queued or running on the lane's thread."""
        return self._inflight != 0

    def on_own_thread(self) -> bool:
        """True on the lane's thread."""
        thread = self._thread
        return thread is not None and threading.get_ident() == thread.ident

    def submit(
        self,
        label: CollectiveLabel | str,
        body: Body,
        async_op: bool,
        keep_alive: object = None,
        on_value: Callable[[Work, Any], None] | None = None,
        on_issue: Callable[[], None] | None = None,
        settle_in: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> Work:
        """Run ``body`` after everything issued before it on this lane; return its ``Work``.

        ``on_value(work, value)`` hands the body's return value to the work
        before it is settled (or, inline, before it is returned). Inline, the
        body's error is raised here. ``on_issue()`` runs as the operation takes
        its place on the lane (under the lane's lock), so what it records is in
        the lane's order. The lane's thread settles the work inside ``settle_in()``
        (``EventWork``).

        Raises:
            GroupClosedError: The lane was closed (and the operation would queue).
        """
        with self._lock:
            if on_issue is not None:
                on_issue()
            # Inline when idle, or on the lane's own thread (a callback of a work it settles):
            # queued there, the operation would wait for the very step that waits for it.
            inline = not async_op and (self._inflight == 0 or self._thread is threading.current_thread())
            if not inline:
                event_work = EventWork(
                    label, bound_s=self.bound_s, keep_alive=keep_alive, settle_in=settle_in
                )
                self._enqueue(label, (event_work, body, on_value))
        if inline:
            value = body()
            work: Work = CompletedWork(label=label)
            if on_value is not None:
                on_value(work, value)
            return work
        return event_work

    def post(self, step: Callable[[], None]) -> None:
        """Queue ``step`` behind everything issued before it; it settles what it owns itself.

        An error that escapes ``step`` is logged (it has no ``Work`` to go to).

        Raises:
            GroupClosedError: The lane was closed.
        """
        with self._lock:
            self._enqueue(f"commlib-{self._name}", (None, step, None))

    def call(
        self,
        label: CollectiveLabel | str,
        fn: Callable[..., Any],
        *args: Any,
        issue: Callable[..., None] | None = None,
    ) -> Any:
        """Run ``fn(*args)`` to its end and return its value, after everything issued before it.

        On the caller's thread when the lane is idle (no work is made), as ``submit`` does.
        ``issue(*args)`` runs first when it runs here, else as it is queued (``submit``'s
        ``on_issue``): nothing queued on the lane was issued after it.
        """
        if self._inflight == 0 or self._thread is threading.current_thread():
            if issue is not None:
                issue(*args)
            return fn(*args)
        values: list[Any] = []
        body = functools.partial(fn, *args)
        on_issue = functools.partial(issue, *args) if issue is not None else None
        work = self.submit(label, body, True, None, lambda _, value: values.append(value), on_issue)
        work.wait()
        return values[0]

    def _enqueue(self, label: object, item: tuple[EventWork | None, Body, Any]) -> None:
        """Queue ``item`` and start the thread if there is none (the caller holds ``_lock``)."""
        if self._closed:
            raise GroupClosedError(f"{label}: the process group was closed")
        if self._thread is None:
            thread = threading.Thread(target=self._loop, name=f"commlib-{self._name}", daemon=True)
            thread.start()  # if it cannot start, nothing is counted or queued
            self._thread = thread
        self._inflight += 1
        self._queue.put(item)

    def _loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._idle_s)
            except queue.Empty:  # idle for ``linger`` seconds
                with self._lock:
                    if self._inflight:  # queued as the wait ended
                        continue
                    self._thread = None  # the next queued operation starts a new thread
                return
            if item is None:  # ``close``: everything before it has run
                return
            work, body, on_value = item
            error: BaseException | None = None
            try:
                value = body()
                if on_value is not None:
                    on_value(work, value)
            except BaseException as e:  # noqa: BLE001 - handed to the work
                error = e
            try:
                if work is not None:
                    work._settle(error)  # noqa: SLF001 - the lane's thread completes its work
                elif error is not None:
                    _log.error("commlib-%s: a queued step failed", self._name, exc_info=error)
            except BaseException:  # noqa: BLE001 - a failing callback must not stop the lane
                _log.exception("commlib-%s: settling a finished operation failed", self._name)
            with self._lock:  # idle only now: what the settled work's callbacks issued is queued
                self._inflight -= 1
                drained = self._inflight == 0
                if drained:
                    self._drained.notify_all()
                    if not self._linger:
                        self._thread = None  # the next queued operation starts a new thread
            if drained and not self._linger:
                return

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until nothing is queued or running on the lane's thread.

        Returns:
            True if the lane is idle.
        """
        with self._lock:
            return self._drained.wait_for(lambda: self._inflight == 0, timeout=max(0.0, timeout))

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new queued operations; let the queued ones run, then end the thread.

        Args:
            timeout: How long to wait for the thread to end: the lane's
                ``bound_s`` if None, 0 not to wait. Never waits on the lane's own thread.

        Returns:
            True if the thread has ended (or there was none).
        """
        with self._lock:
            self._closed = True
            thread = self._thread
            if thread is not None and self._linger:
                self._queue.put(None)
        if thread is None:
            return True
        limit = self.bound_s if timeout is None else max(0.0, timeout)
        if thread.ident == threading.get_ident() or limit == 0:
            return not thread.is_alive()
        thread.join(limit)
        if thread.is_alive():
            _log.warning(
                "commlib-%s: the lane's thread did not finish what was queued within %g s of close; "
                "it is left running (a daemon thread)",
                self._name,
                limit,
            )
            return False
        return True


class Lanes:
    """Lanes made on first use, one per key, each on a thread of its own while it has work.

    Different keys run at once; one key's steps run in the order posted. A
    lane is dropped once idle (its thread ended), so keys may come and go.

    Args:
        name: Names the threads (``commlib-<name>-<key>``).
        bound_s: Each lane's ``bound_s``.
    """

    def __init__(self, name: str, bound_s: float) -> None:
        self._name = name
        self._bound_s = bound_s
        self._lock = threading.Lock()
        self._lanes: dict[Hashable, Lane] = {}

    def post(self, key: Hashable, step: Callable[[], None]) -> None:
        """Queue ``step`` on ``key``'s lane, behind the steps posted there before."""
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                if len(self._lanes) >= 64:  # drop the idle lanes: nothing is posted to them but here
                    self._lanes = {k: held for k, held in self._lanes.items() if held.busy}
                lane = self._lanes[key] = Lane(f"{self._name}-{key}", self._bound_s, linger=False)
            lane.post(step)

    def busy_keys(self, keep: Callable[[Any], bool] = lambda key: True) -> list[Any]:
        """The keys ``keep`` accepts whose lanes have something queued or running."""
        with self._lock:
            return [key for key, lane in self._lanes.items() if lane.busy and keep(key)]

    def wait_idle(self, timeout: float, keep: Callable[[Any], bool] = lambda key: True) -> list[Any]:
        """Wait up to ``timeout`` seconds until the lanes whose keys ``keep`` accepts are idle.

        Returns:
            The keys still busy (empty when all are idle).
        """
        deadline = time.monotonic() + timeout
        while True:
            left = self.busy_keys(keep)
            remaining = deadline - time.monotonic()
            if not left or remaining <= 0:
                return left
            with self._lock:
                lane = self._lanes.get(left[0])
            if lane is not None:
                lane.wait_idle(remaining)
