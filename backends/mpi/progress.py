"""Progress for non-blocking MPI collectives: a polling thread and a bounded wait loop.

MPI advances a non-blocking collective (``Iallreduce``...) only while some
thread is inside an MPI call. Without help, an ``Iallreduce`` issued before a
backward pass would mostly run in ``wait()``, after the compute, and overlap
nothing. ``ProgressThread`` keeps it moving: a daemon thread calls ``Test`` on
each outstanding request, then sleeps for a short interval, so it costs little
CPU (MPI itself busy-polls inside blocking calls and would take a whole core).
``wait_until`` is the caller's side: test, spin briefly, then nap between
tests, and give up at a deadline so no wait is unbounded.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: None)

__all__ = ["Pollable", "ProgressThread", "wait_until", "PURE_SPIN_S", "SPIN_S", "NAP_S"]

PURE_SPIN_S = 5e-5
"""Seconds a waiter tests back to back before it yields its core between tests, where ranks
outnumber cores (a small collective ends in microseconds; then the peer needs the core)."""

SPIN_S = 0.02
"""Seconds after which a waiter naps between tests (until then it spins, or yields)."""

NAP_S = 1e-4
"""Seconds a waiter sleeps between tests once the spin phase is over."""

_BURST = range(4)
_ONE = range(1)


class Pollable(Protocol):
    """Something the progress thread can advance without blocking."""

    def _poll_background(self) -> bool:
        """Test once; return True when finished (successfully or not) and no longer needs polling."""


class ProgressThread:
    """A daemon thread that drives outstanding requests while the caller computes.

    The thread starts on the first ``submit`` and sleeps on a condition while
    nothing is outstanding, so an idle group costs nothing.

    Args:
        interval_s: Pause between two polling rounds. Each round tests every
            outstanding request once; MPICH moves a large shared-memory
            collective in a handful of such calls, so a pause of 0.1-1 ms keeps
            it moving at a few percent of one core.
        name: Thread name (shows in debuggers and ``py-spy``).

    """

    def __init__(self, interval_s: float, name: str) -> None:
        self._interval = max(0.0, float(interval_s))
        self._name = name
        self._cond = threading.Condition()
        self._items: list[Pollable] = []
        self._waiters = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def interval_s(self) -> float:
        """Pause between two polling rounds, in seconds."""
        return self._interval

    def submit(self, item: Pollable) -> None:
        """Poll ``item`` from now on, until it reports that it is finished."""
        with self._cond:
            if self._stopping:
                return
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif len(self._items) == 1:
                # The thread may be idle on the condition; a busy one finds the item next round.
                self._cond.notify()

    def discard(self, item: Pollable) -> None:
        """Stop polling ``item`` (its waiter finished it)."""
        with self._cond:
            if item in self._items:
                self._items.remove(item)

    def waiter_enter(self) -> None:
        """Pause polling: a thread waits on a request, and so drives MPI itself.

        MPI's progress is global (a test of one request advances all of them), so
        while someone waits the thread would only take the core and the GIL from it.
        """
        with self._cond:
            self._waiters += 1

    def waiter_exit(self) -> None:
        """Resume polling what is still outstanding: the waiter is done."""
        with self._cond:
            self._waiters -= 1
            if self._waiters == 0 and self._items:
                self._cond.notify()

    def idle(self) -> bool:
        """Return True if nothing is being polled (a lock-free read, for hot paths)."""
        return not self._items

    def pending(self) -> int:
        """Return the number of items still being polled."""
        with self._cond:
            return len(self._items)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop polling and join the thread (at most ``timeout`` seconds)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        interval = self._interval
        while True:
            with self._cond:
                while (not self._items or self._waiters) and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
            # Sleep first (even with interval 0: it releases the GIL and the core). A small
            # collective that its caller waits on at once is finished by then, and this
            # thread never competes with the caller for the GIL or the MPI lock.
            time.sleep(interval)
            with self._cond:
                if self._waiters:
                    continue
                items = list(self._items)
            finished = [item for item in items if item._poll_background()]
            if finished:
                with self._cond:
                    self._items = [item for item in self._items if item not in finished]


def wait_until(
    test: Callable[[], bool],
    deadline: float,
    *,
    pure_spin_s: float = PURE_SPIN_S,
    spin_s: float = SPIN_S,
    nap_s: float = NAP_S,
) -> bool:
    """Call ``test()`` until it returns True or ``time.monotonic()`` passes ``deadline``.

    Tests back to back for ``pure_spin_s`` (a small collective finishes in
    microseconds), then yields the core between tests until ``spin_s`` (so an
    oversubscribed peer rank can run), then sleeps ``nap_s`` between tests, so
    a rank waiting for a late peer does not hold a core for the whole timeout.

    Returns:
        True if ``test()`` returned True, False if the deadline passed first.

    """
    if test():
        return True
    start = time.monotonic()
    yield_from, nap_from = start + pure_spin_s, start + spin_s
    burst = _BURST
    while True:
        for _ in burst:  # a few tests per clock reading while spinning: completion is seen sooner
            if test():
                return True
        now = time.monotonic()
        if now >= deadline:
            return bool(test())
        if now > nap_from:
            time.sleep(nap_s)
        elif now > yield_from:
            # Free the core if another process (a peer rank, oversubscribed) can use it.
            burst = _ONE
            _yield()
