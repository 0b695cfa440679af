"""``TorchWork``: the ``Work`` of a torch collective's handle."""

from __future__ import annotations

import datetime
import threading
from typing import Any, Protocol

import torch

from backends.torch.errors import is_wait_expiry, translate
from commlib.errors import CommTimeoutError
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
    enforced by NCCL's watchdog, not by the host.
    """

    def __init__(
        self, group: WorkOwner, label: CollectiveLabel, handle: Any, cuda: bool, keep_alive: Any
    ) -> None:
        super().__init__(label, keep_alive)
        self._group = group
        self._handle = handle
        self._cuda = cuda
        self._wait_lock = threading.Lock()

    def _wait_for_backend(self, timeout: float | None) -> None:
        with self._wait_lock:
            if self._done:
                return
            try:
                if timeout is None or self._cuda:
                    # Gloo fails any operation after the group's timeout (torch.distributed's,
                    # set from CommConfig) and NCCL's watchdog aborts it, so this is bounded.
                    # For CUDA it is a stream dependency: torch's WorkNCCL.wait(timeout) would
                    # block the host and abort the communicator when it expires.
                    self._handle.wait()
                else:
                    self._handle.wait(datetime.timedelta(seconds=max(float(timeout), 1e-3)))
            except Exception as e:  # noqa: BLE001 - every torch failure becomes a CommError
                if timeout is not None and not self._cuda and is_wait_expiry(e):
                    raise CommTimeoutError(
                        f"{self._label}: Work.wait(timeout={timeout}) expired before the "
                        "collective finished; it is still running. Wait again, or look for a rank "
                        "that has not issued the same collective."
                    ) from e
                self._fail(e)
                return
            self._settle()

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
