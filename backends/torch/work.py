"""``TorchWork``: the ``Work`` of a torch collective's handle."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Protocol

import torch

from backends.torch.errors import is_wait_expiry, translate
from commlib.errors import CommError
from commlib.work import CollectiveLabel, Work

__all__ = ["TorchWork", "WorkOwner"]


class WorkOwner(Protocol):
    """What a work uses of the group that issued it (``TorchDistProcessGroup``)."""

    @property
    def timeout(self) -> float:
        """Seconds a collective may run before it fails."""

    def _wait_in_background(self, work: TorchWork) -> None: ...

    def _mark_broken(self, error: BaseException) -> None: ...


class TorchWork(Work):
    """A ``Work`` around torch's work handle.

    Waiting: for CPU tensors (Gloo) the calling thread blocks in torch's
    ``wait``, which Gloo bounds by the group's timeout. For CUDA tensors (NCCL)
    ``wait()`` makes the current CUDA stream wait for the collective, as torch's
    DDP does, and returns without blocking the host; the group's timeout is
    enforced by NCCL's watchdog, not by the host. Every ``wait()`` orders its
    caller's stream, also after the work settled elsewhere (a future's callback
    settles it on a stream of its own), and ``get_future()`` gives a future of the
    tensor's device: its ``wait()`` and ``then`` order the consumer's stream too.

    Args:
        group: The group that issued it.
        label: What the collective is.
        handle: torch's work handle.
        cuda: The CUDA device of the collective's tensor; None for CPU tensors.
        keep_alive: Objects to hold until the collective ends.
    """

    def __init__(
        self,
        group: WorkOwner,
        label: CollectiveLabel,
        handle: Any,
        cuda: torch.device | None,
        keep_alive: Any,
    ) -> None:
        super().__init__(label, keep_alive)
        self._group = group
        self._handle = handle
        self._cuda = cuda
        self._wait_lock = threading.Lock()
        self._no_future: bool | None = None
        """True for torch's works without a future, whose ``wait(timeout)`` ignores the timeout."""

    def wait(self, timeout: float | None = None) -> None:  # noqa: D102 - Work.wait
        if self._cuda is not None and self._done and self._error is None:
            self._order_current_stream()
            return
        super().wait(timeout)

    def _order_current_stream(self) -> None:
        """Make the caller's current stream wait for the collective (no host block on NCCL)."""
        try:
            self._handle.wait()
        except Exception as e:  # noqa: BLE001 - every torch failure becomes a CommError
            raise translate(self._label, e, self._group.timeout) from e

    def _new_future(self) -> torch.futures.Future[Any]:
        if self._cuda is None:
            return super()._new_future()
        return torch.futures.Future(devices=[self._cuda])

    def _complete_future(self, future: torch.futures.Future[Any]) -> None:
        # A CUDA future records its events on the current stream when it is completed: order that
        # stream after the collective first (a torch callback's stream has waited already; this
        # costs one more stream wait there).
        if self._cuda is not None and self._error is None and not future.done():
            try:
                self._order_current_stream()
            except CommError as e:
                future.set_exception(e)
                return
        super()._complete_future(future)

    def _wait_for_backend(self, timeout: float | None) -> None:
        if timeout is not None and self._cuda is None:
            self._wait_timed(timeout)
            return
        with self._wait_lock:
            if self._done:
                return
            try:
                # Gloo fails any operation after the group's timeout (torch.distributed's,
                # set from CommConfig) and NCCL's watchdog aborts it, so this is bounded.
                # For CUDA it is a stream dependency: torch's WorkNCCL.wait(timeout) would
                # block the host and abort the communicator when it expires.
                self._handle.wait()
            except Exception as e:  # noqa: BLE001 - every torch failure becomes a CommError
                self._fail(e)
                return
            self._settle()

    def _wait_timed(self, timeout: float) -> None:
        """Wait on the host for at most ``timeout`` seconds; ``CommTimeoutError`` leaves the work going on.

        The lock may be held by the waiter lane, in an untimed wait for a work with no torch
        future (``get_future()``), so taking it is bounded by the timeout too.
        """
        limit = max(float(timeout), 1e-3)
        deadline = time.monotonic() + limit
        if not self._wait_lock.acquire(timeout=limit):
            raise self._wait_expired(timeout, "it is still running")
        try:
            if self._done:
                return
            if self._has_no_future():  # torch's works without a future ignore wait(timeout): poll
                self._poll_until(deadline, timeout)
            try:
                self._handle.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except Exception as e:  # noqa: BLE001 - every torch failure becomes a CommError
                if is_wait_expiry(e):
                    raise self._wait_expired(timeout, "it is still running") from e
                self._fail(e)
                return
            self._settle()
        finally:
            self._wait_lock.release()

    def _has_no_future(self) -> bool:
        if self._no_future is None:
            try:
                self._handle.get_future()
            except RuntimeError:
                self._no_future = True
            else:
                self._no_future = False
        return self._no_future

    def _poll_until(self, deadline: float, timeout: float) -> None:
        """Return once torch's handle has completed; raise ``CommTimeoutError`` at ``deadline``."""
        pause = 1e-4
        while not self._handle.is_completed():
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._wait_expired(timeout, "it is still running")
            time.sleep(min(pause, left))
            pause = min(2 * pause, 5e-3)

    def _test_backend(self) -> None:
        if self._handle.is_completed():
            self._wait_for_backend(None)

    def _arm_future(self) -> None:
        try:
            torch_future = self._handle.get_future()
        except RuntimeError:  # some torch Work kinds (Gloo's reduce_scatter) have no future
            self._group._wait_in_background(self)
        else:
            torch_future.then(self._on_torch_future)

    def _on_torch_future(self, future: torch.futures.Future[Any]) -> None:
        try:
            future.wait()
        except Exception as e:  # noqa: BLE001
            self._fail(e)
        else:
            self._settle()

    def _fail(self, cause: BaseException) -> None:
        error = translate(self._label, cause, self._group.timeout)
        error.__cause__ = cause
        self._group._mark_broken(error)
        self._settle(error)
