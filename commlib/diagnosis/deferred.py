"""Asynchronous collectives whose issue must wait for a check: an in-order launcher thread and its works.

With the fingerprint check on, a collective may start only once every rank
has reached it. A synchronous call waits for that anyway; an asynchronous one
must not, or ``async_op=True`` would stop overlapping anything with compute. So
the check and the issue of an asynchronous collective run on the group's
launcher thread, in issue order, and the caller gets a ``DeferredWork`` at once.
It stands for the collective until the launcher has issued it, then follows
the backend's work. A synchronous collective first waits until the launcher
has issued everything queued before it, so the backend still sees every
collective in the order the caller made them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from commlib.errors import CommError, CommTimeoutError
from commlib.work import CollectiveLabel, Work

__all__ = ["DeferredWork", "Launcher"]


class DeferredWork(Work):
    """The handle of an asynchronous collective that the launcher has yet to issue.

    It waits for the launcher on the launcher's own condition (``Launcher.wait_started``),
    which the launcher notifies after each collective it starts, so that a deferred
    collective costs its caller one object and one queue entry, no event of its own.

    Args:
        label: What the collective is, for messages.
        launcher: The launcher that will start it (``Launcher.submit``).
        bound_s: How long a ``wait()`` without timeout waits for the launcher before
            it reports it stuck (the check itself is bounded by the group's timeout).
        value: What the work's future completes with.
    """

    def __init__(
        self, label: CollectiveLabel | str, launcher: Launcher, bound_s: float, value: Any = None
    ) -> None:
        super().__init__(label)
        self._value = value
        self._launcher = launcher
        self._started = False
        """The launcher has issued the collective (``_real``) or failed to (the work is settled)."""
        self._real: Work | None = None
        self._bound_s = bound_s
        self._armed = False
        """A future was asked for: the real work must settle without a waiter (``_arm_future``)."""

    @property
    def started(self) -> bool:
        """True once the launcher has issued the collective, or failed to."""
        return self._started

    def attach(self, real: Work | None, error: BaseException | None = None) -> None:
        """Called by the launcher: the collective was issued as ``real``, or failed with ``error``."""
        if real is None:
            self._started = True
            self._settle(error)
            return
        with self._lock:
            self._real = real
            armed = self._armed
        self._started = True
        real.add_observer(self._follow)
        if armed:
            real._arm_future()  # noqa: SLF001 - the future of this work is the real one's

    def _follow(self, real: Work) -> None:
        self._settle(real.exception())

    def _wait_for_backend(self, timeout: float | None) -> None:
        start = time.monotonic()
        limit = self._bound_s if timeout is None else max(float(timeout), 0.0)
        if not self._started and not self._launcher.wait_started(self, limit):
            if timeout is not None:
                raise CommTimeoutError(
                    f"{self._label}: Work.wait(timeout={timeout}) expired before every rank reached this "
                    "collective (it has not started yet); wait again, or look for a rank that has not "
                    "issued it, or that has exited"
                )
            raise CommTimeoutError(
                f"{self._label}: not started after {limit:g} s, although the check before it is bounded by "
                "the group's timeout: the group's launcher thread is stuck or gone"
            )
        real = self._real
        if real is None or self._done:
            return
        remaining = None if timeout is None else max(0.0, float(timeout) - (time.monotonic() - start))
        try:
            real.wait(remaining)
        except CommTimeoutError:
            if timeout is not None and not real.is_completed():
                raise  # the caller's own timeout: the collective goes on
            self._settle(real.exception())
            return
        except CommError:
            self._settle(real.exception())
            return
        self._settle()

    def _test_backend(self) -> None:
        real = self._real
        if real is not None and real.is_completed():
            self._settle(real.exception())

    def _arm_future(self) -> None:
        """Have the real work settle without a waiter; its observer then settles this one.

        Some backends' works settle only when waited for or asked to (torch's).
        """
        with self._lock:
            self._armed = True
            real = self._real
        if real is not None:
            real._arm_future()  # noqa: SLF001


class Launcher:
    """Checks and starts a group's deferred collectives on one thread, in the order submitted.

    ``queued`` counts the collectives submitted and not yet started or failed (0:
    idle): ``submit`` adds one, the launcher thread takes one off after each.

    Args:
        name: The thread's name.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[_Step | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        """Notified after each step: ``drain`` and ``DeferredWork.wait`` wait on it."""
        self.queued = 0
        """Collectives submitted and not yet started (or failed); written under ``_lock``."""
        self._thread: threading.Thread | None = None

    def submit(
        self, work: DeferredWork, check: Callable[[], None], start: Callable[..., Work], args: tuple[Any, ...]
    ) -> None:
        """Queue ``work``'s collective behind everything submitted before.

        The launcher thread runs ``check()``, then ``start(*args)``, and attaches
        the backend's work to ``work`` (or the error either raised).
        """
        with self._lock:  # the condition's lock, taken directly
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                thread.start()  # if it cannot start, nothing is counted
                self._thread = thread
            self.queued += 1
        self._queue.put((work, check, start, args))

    def wait_started(self, work: DeferredWork, timeout: float) -> bool:
        """Wait until the launcher has started ``work`` (or failed to); False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: work.started, timeout)

    def drain(self, timeout: float) -> bool:
        """Wait until every queued step has run; return False if ``timeout`` passed first.

        Called from the launcher thread itself (a future's callback that issues a
        collective), it returns at once: that thread cannot wait for its own step.
        """
        if threading.current_thread() is self._thread:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: self.queued == 0, timeout)

    def close(self) -> None:
        """Stop the thread once the queued steps have run."""
        if self._thread is not None:
            self._queue.put(None)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=10.0)

    def _run(self) -> None:
        while True:
            step = self._queue.get()
            if step is None:
                return
            work, check, start, args = step
            try:
                launch(work, check, start, args)
            finally:
                with self._cond:
                    self.queued -= 1
                    self._cond.notify_all()


_Step = tuple[DeferredWork, Callable[[], None], Callable[..., Work], tuple[Any, ...]]
"""What ``Launcher.submit`` queues: the work, its check, and how to start its collective."""


def launch(
    work: DeferredWork, check: Callable[[], None], start: Callable[..., Work], args: tuple[Any, ...]
) -> None:
    """The launcher's step for one collective: check, then start, then hand the work over."""
    try:
        check()
        real = start(*args)
    except BaseException as e:  # noqa: BLE001 - becomes the work's error
        work.attach(None, e)
        return
    work.attach(real)
