"""The torch work handles the adapter returns: one finished inline, one wrapping a commlib ``Work``.

torch reads a work in two ways. Python call sites (``dist.all_reduce``...)
call its Python methods. C++ callers (DDP's reducer, the functional
collectives DTensor and FSDP2 use) go through torch's trampoline, which calls
``wait`` and ``get_future`` and expects the future to hold a tensor or a list
of tensors: ``value`` is what torch's Gloo gives for the same operation (also
what ``result()`` returns), or a function that makes it when first asked for.

The futures a pending work hands out are completed on a small pool of threads
of their own, never on the backend's progress thread: torch's hooks (PowerSGD)
issue another collective inside a future's callback and wait for it, which
would deadlock the thread that has to run that collective.

A failed operation fails its future in C++, where torch's C++ callers look.
``torch.futures.Future.set_exception`` cannot do that: it completes the future
*successfully*, with the exception object as its value, and only Python's
``wait()`` raises it. DDP's reducer reads such a value as the bucket's tensors
(``parseCppCommHookResult``): it finds none and indexes past the end, and the
process dies of SIGSEGV. A future made by ``then`` from a callback that raises
is the one a Python process group can fail in C++: every caller (the reducer's
``value()``, a hook's ``then``, Python's ``wait()``) then raises a
``RuntimeError`` that carries commlib's message, as torch's own backends fail
their futures with a ``RuntimeError``. ``PendingWork.wait()`` raises commlib's
error itself.
"""

from __future__ import annotations

import concurrent.futures
import copy
import datetime
from typing import Any

import torch
import torch.distributed as dist

from commlib.work import Work

__all__ = ["DoneWork", "PendingWork", "done"]

_NO_TIMEOUT = datetime.timedelta(0)

_COMPLETERS = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="commlib-torch-future")
"""Completes torch futures (and so runs their callbacks); threads start on demand, up to 8 callbacks deep."""


class _Failed:
    """The value a future's source holds when the operation failed: the chained future raises ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _value_or_raise(source: torch.futures.Future[Any]) -> Any:
    """The chained future's value: the operation's, or its error raised (which fails the future in C++).

    A copy of the error is raised: the work's own error may be raised on another thread at once.
    """
    value = source.value()
    if type(value) is _Failed:
        try:
            error = copy.copy(value.error)
        except Exception:  # noqa: BLE001 - an error that cannot be copied is raised itself
            error = value.error
        raise error
    return value


def _made(value: Any) -> Any:
    """The work's value: ``value`` itself, or what it makes when it is a function (see ``done``)."""
    return value() if callable(value) else value


def _seconds(timeout: datetime.timedelta | None) -> float | None:
    """Torch's ``wait(timeout)`` in seconds; None for torch's "no timeout" (zero or negative)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds()
    return seconds if seconds > 0 else None


class DoneWork(dist._Work):
    """An operation that finished before the call returned (synchronous calls run inline).

    Made by ``done(value)``: a Python ``__init__`` would add a microsecond to every synchronous call.
    """

    _value: Any = None
    """What ``get_future()`` completes with (torch's value for the operation)."""

    _source = -1

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        """Return True: the operation has finished."""
        return True

    def is_completed(self) -> bool:
        """Return True."""
        return True

    def is_success(self) -> bool:
        """Return True."""
        return True

    def exception(self) -> None:
        """Return None: it did not fail."""
        return None

    def get_future(self) -> torch.futures.Future[Any]:
        """Return a completed future holding torch's value for the operation."""
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(_made(self._value))
        return future

    def result(self) -> Any:
        """Return torch's value for the operation: its output tensors (torch's ``Work.result()``)."""
        return _made(self._value)

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        """Return -1: no finished work is a receive from any rank (those are pending works)."""
        return self._source


def done(value: Any) -> DoneWork:
    """A finished work whose future holds ``value``.

    ``value`` may be a function instead, called when the value is first asked for: a value
    that costs a tensor operation to build (``all_gather_into_tensor``'s blocks) then costs
    nothing on the calls whose future nobody reads.
    """
    work = DoneWork()
    work._value = value
    return work


class PendingWork(dist._Work):
    """A commlib ``Work`` in flight, as torch sees it.

    ``wait()`` raises our ``CommError`` (a ``CommTimeoutError`` when a timeout
    runs out; the operation goes on) and returns True once the result is in
    place. The future completes with ``value``, or with our error.

    Args:
        work: The commlib work.
        value: What ``get_future()`` completes with and ``result()`` returns, or a function
            that makes it (see ``done``).
    """

    def __init__(self, work: Work, value: Any) -> None:
        super().__init__()
        self._work = work
        self._value = value
        self._future: torch.futures.Future[Any] | None = None

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        """Block until the result is in place; raise commlib's error if the operation failed."""
        self._work.wait(_seconds(timeout))
        return True

    def is_completed(self) -> bool:
        """Return True once the operation has ended (never blocks)."""
        return self._work.is_completed()

    def is_success(self) -> bool:
        """Return True once the operation has ended without an error."""
        return self._work.is_completed() and self._work.exception() is None

    def exception(self) -> BaseException | None:
        """Return the error the operation failed with, or None."""
        return self._work.exception()

    def get_future(self) -> torch.futures.Future[Any]:
        """Return a future that completes with torch's value for the operation, or fails with our error.

        A failure fails the future as torch's C++ sees it (see the module's
        docstring): ``wait()`` and ``value()`` raise a ``RuntimeError`` carrying
        commlib's message; this work's ``wait()`` raises commlib's error itself.
        """
        if self._future is None:
            source: torch.futures.Future[Any] = torch.futures.Future()
            self._future = source.then(_value_or_raise)
            value = _made(self._value)

            def complete(ours: torch.futures.Future[Any]) -> None:
                error = self._work.exception()
                source.set_result(value if error is None else _Failed(error))

            # commlib's future, not an observer: asking for it makes sure the work advances
            # even if nobody waits (an MPI library without a progress thread).
            self._work.get_future().add_done_callback(lambda ours: _COMPLETERS.submit(complete, ours))
        return self._future

    def result(self) -> Any:
        """Return torch's value for the operation (its output tensors) once it has completed.

        Raises:
            RuntimeError: The operation has not completed yet: call ``wait()`` first, as with
                torch's own backends.
            CommError: The operation failed (the error ``wait()`` raises).
        """
        if not self._work.is_completed():
            raise RuntimeError(
                f"{self._work.label}: Work.result() was called before the operation completed; "
                "call wait() first"
            )
        self._work.wait()  # raises commlib's error if the operation failed
        return _made(self._value)

    def _source_rank(self) -> int:
        return self._work.source_rank()

    def source_rank(self) -> int:
        """Return the rank a receive got its message from."""
        return self._work.source_rank()
