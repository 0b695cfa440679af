"""Waiting on the group's MPI requests: on the calling thread (bounded), or on a progress thread.

A synchronous collective is tested on the caller's thread at once: a small
one ends within a few tests, which come before any clock or set-up; then
``wait_until`` spins, yields and naps up to the deadline. While receives wait
for their message, whoever tests a request also matches them (``tester``).
An asynchronous one is handed to the group's ``ProgressThread``, made here
when the settings ask for it and MPI's thread level allows it.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

from backends.mpi.config import MPIConfig
from backends.mpi.p2p import P2PEngine
from backends.mpi.progress import PURE_SPIN_S, SPIN_S, ProgressThread, wait_until

__all__ = ["progress_thread", "spin_for_host", "tester", "wait_here"]

_FIRST_TESTS = range(16)
"""Tests a synchronous wait makes before it reads the clock (on one host a 4 KiB all-reduce of two
ranks ends within 3-5 tests)."""

_THREAD_LEVELS = {0: "SINGLE", 1: "FUNNELED", 2: "SERIALIZED", 3: "MULTIPLE"}

_warned: set[str] = set()


def _warn_once(key: str, message: str, stacklevel: int) -> None:
    """Warn with ``message`` (a ``RuntimeWarning``) the first time this process meets ``key``."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def tester(request: Any, messages: P2PEngine) -> Callable[[], bool]:
    """``request.Test``, also matching the group's waiting receives when it has any.

    A sender waits until its receiver has matched the message (the size
    verdict), and a receive is matched only while someone tests: whoever
    waits drives the matching, as the progress thread would when nobody waits.
    """
    if not messages.waiting:
        return request.Test  # type: ignore[no-any-return]
    match, test = messages.match, request.Test

    def drive() -> bool:
        match()
        return bool(test())

    return drive


def wait_here(
    request: Any,
    messages: P2PEngine,
    progress: ProgressThread | None,
    timeout: float,
    pure_spin_s: float,
    issued: float | None = None,
) -> bool:
    """Test ``request`` on this thread until it finishes (True) or the deadline passes (False).

    Args:
        request: Anything with an MPI request's ``Test``.
        messages: The group's point-to-point engine (its waiting receives are matched meanwhile).
        progress: The group's progress thread: told that a waiter drives MPI while this waits.
        timeout: Seconds from ``issued`` (default: the end of the first tests) to the deadline.
        pure_spin_s: Seconds of back-to-back tests before yielding the core between them.
        issued: When the request was issued.

    Raises:
        Exception: Whatever ``Test`` raised (an ``MPI.Exception``).
    """
    test = tester(request, messages) if messages.waiting else request.Test
    if progress is not None and progress.idle():
        progress = None
    if progress is not None:
        progress.waiter_enter()  # this wait drives the outstanding async work too
    try:
        for _ in _FIRST_TESTS:
            if test():
                return True
        deadline = (time.monotonic() if issued is None else issued) + timeout
        return wait_until(test, deadline, pure_spin_s=pure_spin_s)
    finally:
        if progress is not None:
            progress.waiter_exit()


def spin_for_host(comm: Any, MPI: Any) -> float:  # noqa: N803 - the mpi4py module's own name
    """Seconds a waiter tests back to back: like MPI while every rank on this host has a core.

    With more ranks than cores on this host, it yields between tests so that the
    rank it waits for can run.
    """
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = local.Get_size()
    local.Free()
    return PURE_SPIN_S if ranks_here > (os.cpu_count() or 1) else SPIN_S


def progress_thread(
    config: MPIConfig,
    thread_level: int,
    MPI: Any,  # noqa: N803 - the mpi4py module's own name
    rank: int,
    prefix: str,
    *,
    asked: bool = False,
) -> ProgressThread | None:
    """The progress thread of rank ``rank``'s group, or None (and a warning, once) if there is none.

    Args:
        config: The backend's settings (``progress``, ``progress_interval_us``).
        thread_level: MPI's thread level: below MULTIPLE only the calling thread may test requests.
        MPI: The mpi4py module.
        rank: The rank (names the thread).
        prefix: The group's message prefix for the warning.
        asked: A future needs one now, whatever ``config.progress`` says.
    """
    if not asked and config.progress != "thread":
        return None
    if thread_level >= MPI.THREAD_MULTIPLE:
        return ProgressThread(config.progress_interval_us * 1e-6, f"commlib-mpi-progress-rank{rank}")
    if asked:
        _warn_once(
            "future-without-progress",
            f"{prefix}MPI runs without thread level MULTIPLE, so no thread can drive requests in the "
            "background: a future completes only when Work.wait() or Work.is_completed() is called on "
            "its work",
            stacklevel=5,
        )
    else:
        level = _THREAD_LEVELS.get(thread_level, str(thread_level))
        _warn_once(
            "thread-level",
            f"{prefix}MPI was initialised with thread level {level}, not MULTIPLE, so no progress thread "
            "runs: async collectives advance only inside Work.wait() / is_completed(). Initialise MPI with "
            "thread level MULTIPLE (mpi4py.rc.thread_level = 'multiple') to overlap them with compute.",
            stacklevel=5,
        )
    return None
