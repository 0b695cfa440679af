"""The ``Work`` of an MPI request: who settles it, its timeout, and what it leaves in flight at exit."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Protocol

from backends.mpi import device_path
from backends.mpi.p2p import P2PEngine, RecvRequest, SendRequest
from backends.mpi.progress import ProgressThread, wait_until
from backends.mpi.waiting import tester
from commlib.errors import CommError, CommTimeoutError, MessageMismatchError
from commlib.work import CollectiveLabel, Work

__all__ = ["MPIWork", "P2PWork", "WorkOwner"]


class WorkOwner(Protocol):
    """What a work uses of the group that issued its request (``MPIProcessGroup``)."""

    _keys: itertools.count[int]
    _pending: dict[int, MPIWork]
    _progress: ProgressThread | None
    _pure_spin_s: float
    _messages: P2PEngine
    _broken: BaseException | None

    @property
    def timeout(self) -> float:
        """Seconds a request may run before it fails."""

    def _device(self) -> device_path.DevicePath: ...

    def _mark_broken(self, error: BaseException) -> None: ...

    def _failure(self, label: CollectiveLabel | str, error: BaseException) -> CommError: ...

    def _ensure_polled(self, work: MPIWork) -> None: ...


class MPIWork(Work):
    """A ``Work`` around one MPI request.

    Whoever sees the request finished settles the work: a waiter, a test from
    ``is_completed()``, or the progress thread. The progress thread also fails
    a request that has run past the group's timeout, so a future that nobody
    waits on still completes (with ``CommTimeoutError``).
    """

    def __init__(
        self,
        group: WorkOwner,
        label: CollectiveLabel,
        request: Any,
        keep_alive: Any,
        issued: float | None = None,
        stream: Any = None,
    ) -> None:
        super().__init__(label, keep_alive)
        self._group = group
        self._key = next(group._keys)
        """This work's entry in the group's ``_pending`` while its request may be in flight."""
        self._request = request
        self._stream = stream
        """The CUDA stream current when the collective was issued (None for host tensors)."""
        self._drive_lock = threading.Lock()
        self._issued = time.monotonic() if issued is None else issued
        self._abandoned = False

    @property
    def describe(self) -> str:
        """``[rank 0/2] mpi.all_reduce #7 (float32, 1024 elements)``."""
        return str(self._label)

    def _settle(self, error: BaseException | None = None) -> None:
        if self._done:
            return
        if self._stream is None:
            super()._settle(error)
        else:
            # The finishing steps may run on the progress thread: queue their kernels on
            # the issuing thread's stream, which the copies back have been ordered before.
            with self._group._device().on_stream(self._stream):
                super()._settle(error)
        if self._error is not None and self._breaks_group(self._error):
            self._group._mark_broken(self._error)
        if not self._abandoned:
            self._group._pending.pop(self._key, None)

    def _test_locked(self) -> bool:
        """Test once (the caller holds the drive lock); settle the work if the request is done.

        A work abandoned at its timeout is settled already, but its request is
        tested on (the exit hook asks whether it ever finished).
        """
        if self._done and not self._abandoned:
            return True
        try:
            flag = self._request.Test()
        except Exception as e:  # noqa: BLE001 - MPI.Exception and friends
            self._settle(self._group._failure(self._label, e))
            return True
        if flag:
            if self._abandoned:
                self._group._pending.pop(self._key, None)
            self._succeeded()
        return bool(flag)

    def _test(self) -> bool:
        with self._drive_lock:
            return self._test_locked()

    def _poll_background(self) -> bool:
        if self._done:
            return True  # an abandoned request is left to the exit hook
        if not self._drive_lock.acquire(blocking=False):
            return False  # a waiter holds it and drives the request itself
        try:
            if self._test_locked():
                return True
            if time.monotonic() - self._issued > self._group.timeout:
                self._abandon(self._group.timeout)
                return True
            return False
        finally:
            self._drive_lock.release()

    def _wait_for_backend(self, timeout: float | None) -> None:
        """Drive MPI on the calling thread until the request ends (see ``Work.wait``).

        The calling thread tests the request itself (``wait_until``: back-to-back
        tests, then yielding, then short naps) and gives up at ``timeout``
        (default: the group's timeout).
        """
        limit = self._group.timeout if timeout is None else max(float(timeout), 0.0)
        deadline = time.monotonic() + limit
        # Hold the lock for the whole wait: the progress thread leaves this request
        # alone, and each poll is one bare MPI_Test. A large collective moves one
        # step per test on each rank, so a slower poll would slow the transfer.
        progress = self._group._progress
        with self._drive_lock:
            if self._done:
                return
            if progress is not None:
                progress.waiter_enter()
            try:
                test = tester(self._request, self._group._messages)
                done = wait_until(test, deadline, pure_spin_s=self._group._pure_spin_s)
            except Exception as e:  # noqa: BLE001 - MPI.Exception and friends
                self._settle(self._group._failure(self._label, e))
            else:
                if done:
                    self._succeeded()
                else:
                    self._expired(timeout, limit)
            finally:
                if progress is not None:
                    progress.waiter_exit()
                    if self._done:
                        progress.discard(self)

    def _test_backend(self) -> None:
        if not self._drive_lock.acquire(blocking=False):
            return
        try:
            self._test_locked()
        finally:
            self._drive_lock.release()

    def _arm_future(self) -> None:
        self._group._ensure_polled(self)

    def _succeeded(self) -> None:
        """The request finished: settle the work (a receive records its source first)."""
        self._settle()

    def _withdraw(self) -> bool:
        """At the group's timeout: take the request back from MPI if possible; True if nothing remains.

        A collective cannot be withdrawn.
        """
        return False

    def _finish_at_close(self) -> None:
        """At ``close()``, the progress thread stopped: drive the collective to its end, as the thread would.

        Every rank issued it before closing, so it finishes, and its future completes; at its
        timeout it is abandoned as the progress thread abandons one.
        """
        if self._done or self._group._broken is not None:  # a broken group's collectives never finish
            return
        if wait_until(self._test, self._issued + self._group.timeout):
            return
        with self._drive_lock:
            if not self._done:
                self._abandon(self._group.timeout)

    def _let_go(self) -> bool:
        """When the group closes or the process exits: True if MPI no longer holds anything of it.

        A collective in flight is held until it finishes.
        """
        return False

    @staticmethod
    def _breaks_group(error: BaseException) -> bool:
        """Return True if failing with ``error`` leaves the group unusable (every collective failure does)."""
        return True

    def _timeout_error(self, limit: float) -> CommTimeoutError:
        return CommTimeoutError(
            f"{self.describe}: no progress for {limit:g} s; a peer rank is missing, stuck "
            "or called a different collective. MPI cannot cancel a collective, so the "
            "group is unusable and this process will abort the MPI job when it exits "
            "(MPI_Finalize would wait forever). Raise COMMLIB_TIMEOUT if the peers are "
            "just slow."
        )

    def _abandon(self, limit: float) -> CommTimeoutError:
        """Fail the work at its timeout (the caller holds the drive lock); return its error.

        Unless it can be withdrawn, the request is still in flight: it stays listed for the exit
        hook, which aborts the job rather than hang in MPI_Finalize.
        """
        self._abandoned = not self._withdraw()
        error = self._timeout_error(limit)
        self._settle(error)
        return error

    def _expired(self, timeout: float | None, limit: float) -> None:
        if timeout is not None:
            raise self._wait_expired(timeout, "it is still in flight")
        # Failed for its caller (a later wait raises the same error), as one abandoned by the
        # progress thread.
        raise self._abandon(limit)


class P2PWork(MPIWork):
    """The work of a send or receive: its failures leave the group usable.

    A size mismatch consumed the message on both sides; a receive that times
    out unmatched is withdrawn (it held nothing in MPI); a send that times out
    stays queued at its peer (MPI cannot withdraw a send) and is said so.
    """

    _request: SendRequest | RecvRequest

    def _succeeded(self) -> None:
        request = self._request
        if isinstance(request, RecvRequest) and request.source is not None:
            self._set_source(request.source)
        self._settle()

    def _withdraw(self) -> bool:
        request = self._request
        return isinstance(request, RecvRequest) and self._group._messages.cancel(request)

    def _finish_at_close(self) -> None:
        """A send whose receiver never comes would hold ``close()`` for a whole timeout: left as it is."""

    def _let_go(self) -> bool:
        request = self._request
        with self._drive_lock:
            if isinstance(request, SendRequest) and request.let_go():
                self._group._pending.pop(self._key, None)
                return True
        return False

    @staticmethod
    def _breaks_group(error: BaseException) -> bool:
        return not isinstance(error, (CommTimeoutError, MessageMismatchError))

    def _timeout_error(self, limit: float) -> CommTimeoutError:
        request = self._request
        hint = "Raise COMMLIB_TIMEOUT if the peer is just slow."
        if isinstance(request, RecvRequest):
            if request.cancelled:
                return CommTimeoutError(
                    f"{self.describe}: no message arrived within {limit:g} s; did the sender call send "
                    f"with the same tag ({request.tag})? The receive was withdrawn: the group stays "
                    f"usable. {hint}"
                )
            return CommTimeoutError(
                f"{self.describe}: the message from rank {request.source} "
                f"({request.sent[0] if request.sent else '?'} bytes) started "
                f"but did not finish within {limit:g} s; the sender stopped or died. It stays in flight: "
                "this process aborts the MPI job when it exits if it never finishes."
            )
        return CommTimeoutError(
            f"{self.describe}: rank {request.peer} did not receive the message within {limit:g} s: no "
            f"matching recv (tag {request.tag}) was posted there. MPI cannot withdraw a send: the message "
            f"stays queued for rank {request.peer}, and its next recv with tag {request.tag} from this "
            "rank receives it first. The group stays usable for collectives and other messages. A "
            "large message that never leaves this process makes it abort the MPI job when it exits "
            f"(MPI_Finalize would wait for it). {hint}"
        )
