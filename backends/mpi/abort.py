"""Abort the MPI job rather than hang: the live groups, what a closing one lets go, and the exit hooks.

``MPI_Finalize`` waits for every rank and for every request in flight. A
process that exits with a collective unfinished, after a collective that
missed a peer, or on an uncaught exception, calls ``MPI_Abort`` instead.
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from backends.mpi.library import loaded_mpi
from backends.mpi.progress import wait_until
from backends.mpi.work import MPIWork

__all__ = ["LiveGroup", "forget_group", "note_missed_peer", "register_group", "release_group"]


class LiveGroup(Protocol):
    """What the exit hooks use of a group (``MPIProcessGroup``)."""

    _closed: bool
    _pending: dict[int, MPIWork]
    _MPI: Any

    def _prefix(self, op: str) -> str: ...

    def _stop_progress(self) -> None: ...


_lock = threading.Lock()
_live_groups: dict[int, LiveGroup] = {}
"""Open groups, and closed ones with collectives still in flight, held for the exit hook.

Strong references: a group that failed sits in a reference cycle once its caller's
frames are gone, and must not be collected before the hook has looked at it."""
_exit_hook_registered = False
_missed_peer: tuple[str, str] | None = None
"""This process's prefix and the first timeout that broke one of its groups (the exit hook aborts)."""


def register_group(group: LiveGroup) -> None:
    """Hold ``group`` for the exit hooks (installed with the first group)."""
    _live_groups[id(group)] = group
    _register_exit_hook()


def forget_group(group: LiveGroup) -> None:
    """Stop holding ``group``: it closed with nothing in flight."""
    _live_groups.pop(id(group), None)


def release_group(group: LiveGroup, comms: tuple[Any, ...]) -> None:
    """At ``close()``: let go of what MPI no longer holds; then forget ``group`` and free ``comms``.

    Each collective still in flight is driven to its end first (the progress thread has
    stopped), bounded by its timeout. A group with requests still in flight after that keeps
    its communicators and stays held for the exit hook, which aborts the job rather than hang.

    Args:
        group: The closing group.
        comms: Its communicators (None for one it never made).
    """
    for work in list(group._pending.values()):
        work._finish_at_close()  # a collective: to its end (or its timeout), so its future completes
        # A send abandoned at its timeout may have been received since, or its data have left.
        if not work._test():
            work._let_go()
    if group._pending:
        return
    forget_group(group)
    if not group._MPI.Is_finalized():
        for comm in comms:
            if comm is None:
                continue
            try:
                comm.Free()
            except Exception:  # noqa: BLE001 - closing must not raise
                pass


def note_missed_peer(prefix: str, error: str) -> None:
    """Record the first timeout (or peer's exit) that broke a group: the exit hook aborts the job.

    Args:
        prefix: The group's message prefix for the exit (``[rank 0/2] mpi.exit: ``).
        error: The error that broke the group.
    """
    global _missed_peer
    if _missed_peer is None:
        _missed_peer = (prefix, error)


def _register_exit_hook() -> None:
    global _exit_hook_registered
    with _lock:
        if not _exit_hook_registered:
            _exit_hook_registered = True
            # Registered after mpi4py's import, so it runs before MPI_Finalize.
            atexit.register(_abort_if_unfinished)
            sys.excepthook = functools.partial(_abort_on_uncaught, sys.excepthook)


def _abort_on_uncaught(
    previous: Callable[..., Any], kind: type[BaseException], error: BaseException, tb: Any
) -> None:
    """``sys.excepthook`` while an MPI group is open: print the traceback, then abort the MPI job.

    A rank that dies of an uncaught exception would otherwise sit in
    ``MPI_Finalize``, and its peers would wait for its collectives until their
    timeout, then read that it "has not started" them. ``MPI_Abort`` makes the
    launcher end every rank at once, as ``python -m mpi4py`` does. An
    interactive session (which goes on after the traceback) is left alone.
    """
    previous(kind, error, tb)
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return
    mpi = loaded_mpi()
    groups = [g for g in _live_groups.values() if not g._closed]
    if not groups or mpi is None or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() == 1:
        return
    for group in groups:
        group._stop_progress()
    _abort_job(
        mpi,
        f"{groups[0]._prefix('exit')}this rank is ending on an uncaught {kind.__name__}, so it aborts the "
        "MPI job (MPI_Abort, exit code 1): the other ranks would wait for its collectives until "
        "COMMLIB_TIMEOUT. The first error of the job is the traceback above.",
    )


def _abort_if_unfinished(grace_s: float = 1.0) -> None:
    """At exit: stop progress threads; abort the MPI job if a collective is still in flight."""
    groups = list(_live_groups.values())
    for group in groups:
        group._stop_progress()
    mpi = loaded_mpi()
    if mpi is None or mpi.Is_finalized():
        return
    deadline = time.monotonic() + grace_s
    for group in groups:
        works = list(group._pending.values())
        for work in works:
            if wait_until(work._test, deadline) or work._let_go():
                continue
            MPI = group._MPI
            if MPI.Is_finalized():
                return
            age = time.monotonic() - work._issued
            count = sum(len(g._pending) for g in groups)
            _abort_job(
                MPI,
                f"{work.describe}: still unfinished at exit, {age:.1f} s after it was issued "
                f"({count} collective(s) in flight in all). MPI_Finalize would wait for it forever, "
                "so this rank aborts the MPI job (MPI_Abort, exit code 1).",
            )
            return
    if _missed_peer is not None and mpi.COMM_WORLD.Get_size() > 1:
        prefix, error = _missed_peer
        _abort_job(
            mpi,
            f"{prefix}a collective of this rank missed a peer ({error}); MPI_Finalize "
            "would wait for that peer, so this rank aborts the MPI job (MPI_Abort, exit code 1).",
        )


def _abort_job(mpi: Any, message: str) -> None:
    """Say why on stderr, then end the whole MPI job (``MPI_Abort``, exit code 1)."""
    print(message, file=sys.stderr, flush=True)
    time.sleep(0.2)  # let the launcher forward the message before MPI_Abort tears the job down
    mpi.COMM_WORLD.Abort(1)
