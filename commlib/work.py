"""``Work``: the handle an asynchronous collective returns, and two ready-made kinds."""

from __future__ import annotations

import abc
import concurrent.futures
from typing import Any

from commlib.errors import CommTimeoutError

__all__ = ["Work", "CompletedWork", "FutureWork"]


class Work(abc.ABC):
    """Handle of an asynchronous collective (``async_op=True``).

    The tensors of the collective must not be read or written until ``wait()``
    has returned. The handle keeps them alive until then.
    """

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until the result is in the tensor.

        Args:
            timeout: Seconds to wait for this handle; ``None`` waits until the
                collective ends, which the backend bounds by the group's own
                timeout (a stuck peer raises ``CommTimeoutError`` there).

        Raises:
            CommTimeoutError: The collective did not finish within ``timeout``.
            CommError: The collective failed (the same error on every call).
        """

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """Return True once the collective has finished, successfully or not."""

    @abc.abstractmethod
    def exception(self) -> BaseException | None:
        """Return the error the collective failed with, or None (also while running)."""


class CompletedWork(Work):
    """A ``Work`` that is already done: for collectives that finished inline."""

    def __init__(self, error: BaseException | None = None) -> None:
        self._error = error

    def wait(self, timeout: float | None = None) -> None:
        """Return at once, or raise the error the collective failed with."""
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        """Return True: the collective has finished."""
        return True

    def exception(self) -> BaseException | None:
        """Return the error the collective failed with, or None."""
        return self._error


class FutureWork(Work):
    """A ``Work`` backed by a ``concurrent.futures.Future`` run by a progress thread.

    Args:
        future: The future that completes when the collective does.
        describe: Text naming the collective, for the timeout message
            (``"[rank 0/2] ring.all_reduce #7 (float32, 1048576 elements)"``).
        keep_alive: Objects (tensors, staging buffers) to hold until done.
    """

    def __init__(self, future: concurrent.futures.Future[Any], describe: str, keep_alive: Any = None) -> None:
        self._future = future
        self._describe = describe
        self._keep_alive = keep_alive

    def wait(self, timeout: float | None = None) -> None:
        """Block until the result is in the tensor (see ``Work.wait``)."""
        done, _ = concurrent.futures.wait([self._future], timeout=timeout)
        if not done:
            raise CommTimeoutError(
                f"{self._describe}: Work.wait(timeout={timeout}) expired before the collective "
                "finished; it is still running on the progress thread. Wait longer, or look "
                "for a rank that has not issued the same collective."
            )
        self._future.result()  # raises the collective's own error, timeouts included
        self._keep_alive = None

    def is_completed(self) -> bool:
        """Return True once the collective has finished, successfully or not."""
        return self._future.done()

    def exception(self) -> BaseException | None:
        """Return the error the collective failed with, or None (also while running)."""
        if not self._future.done():
            return None
        return self._future.exception()
