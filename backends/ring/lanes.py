"""Lanes: operations that run in the order issued, on the caller's thread when nothing is queued.

A ring group has one lane for its collectives and, once point-to-point is
used, one per peer and direction (``backends.ring.p2p``), so that a send that
waits for its receiver never holds up a receive from anyone, nor a
collective. A synchronous operation runs on the caller's thread when its lane
is idle (no thread hop on the hot path), and after the queued ones otherwise;
``async_op=True`` queues it on the lane's own thread (started on first use),
which settles the returned ``Work``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable
from typing import Any

from commlib.work import CollectiveLabel, CompletedWork, EventWork, Work

__all__ = ["Lane"]

Body = Callable[[], Any]
"""The operation: returns a value for ``on_value`` (a receive's source rank), or None."""


class Lane:
    """A FIFO of operations with an inline fast path; see the module docstring.

    Args:
        name: Names the lane's thread (``commlib-ring-<name>``).
        bound_s: How long a ``Work.wait()`` without a timeout waits before it
            reports the lane's thread stuck (each step of an operation is
            bounded by the group's timeout; this catches a thread that stopped).
    """

    def __init__(self, name: str, bound_s: float) -> None:
        self._name = name
        self._bound_s = bound_s
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        """Notified whenever the lane's thread has finished everything queued."""
        self._inflight = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def idle(self) -> bool:
        """True when nothing is queued or running on the lane's thread."""
        return self._inflight == 0

    def submit(
        self,
        label: CollectiveLabel | str,
        body: Body,
        async_op: bool,
        keep_alive: object = None,
        on_value: Callable[[Work, Any], None] | None = None,
    ) -> Work:
        """Run ``body`` after everything issued before it on this lane; return its ``Work``.

        ``on_value(work, value)`` hands the body's return value to the work
        before it is settled (or, inline, before it is returned).
        """
        with self._lock:
            inline = not async_op and self._inflight == 0
            if not inline:
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix=f"commlib-ring-{self._name}"
                    )
                self._inflight += 1
        if inline:
            value = body()
            work: Work = CompletedWork(label=label)
            if on_value is not None:
                on_value(work, value)
            return work
        event_work = EventWork(label, bound_s=self._bound_s, keep_alive=keep_alive)
        self._executor.submit(self._run, event_work, body, on_value)  # type: ignore[union-attr]
        return event_work

    def call(self, label: CollectiveLabel | str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` to its end and return its value, after everything issued before it.

        On the caller's thread when the lane is idle (no work is made), as ``submit`` does.
        """
        if self._inflight == 0:
            return fn(*args)
        values: list[Any] = []
        body = functools.partial(fn, *args)
        work = self.submit(label, body, True, None, lambda _, value: values.append(value))
        work.wait()
        return values[0]

    def _run(self, work: EventWork, body: Body, on_value: Callable[[Work, Any], None] | None) -> None:
        error: BaseException | None = None
        try:
            value = body()
            if on_value is not None:
                on_value(work, value)
        except BaseException as e:  # noqa: BLE001 - handed to the work
            error = e
        finally:
            with self._lock:
                self._inflight -= 1
                if self._inflight == 0:
                    self._drained.notify_all()
        work._settle(error)  # noqa: SLF001 - the lane's thread completes its work

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until nothing is queued or running on the lane's thread.

        Returns:
            True if the lane is idle.
        """
        with self._lock:
            return self._drained.wait_for(lambda: self._inflight == 0, timeout=max(0.0, timeout))

    def close(self) -> None:
        """Run what is queued, then stop the thread (wake blocked operations first)."""
        executor = self._executor
        if executor is not None:
            executor.shutdown(wait=True)
