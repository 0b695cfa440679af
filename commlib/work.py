"""``Work``: the handle a collective returns, with completion, finishing steps and a torch future.

Every backend's handle is a ``Work``. The base class owns what they share: the
completion state, the error, the steps that must run once the data has arrived
(AVG's division, a copy back from a staging buffer), and the
``torch.futures.Future`` that ``get_future()`` hands out. A backend supplies only
how to wait for its collective (``_wait_for_backend``) and, if it can, how to test
it without blocking (``_test_backend``); whoever learns that the collective ended
calls ``_settle()`` exactly once in effect (later calls are ignored).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from commlib.errors import CommError, CommTimeoutError, in_group
from commlib.types import dtype_name

__all__ = ["CollectiveLabel", "CompletedWork", "EventWork", "Work"]

_log = logging.getLogger(__name__)


class CollectiveLabel:
    """Names one operation in messages: ``[rank 0/2] gloo.all_reduce #7 (float32, 1024 elements)``.

    Point-to-point operations name their peer and tag, and count per peer and
    tag: ``[rank 0/2] gloo.send #3 to rank 1 tag 0 (float32, 8 elements)``. An
    operation on a subgroup names the group by its global ranks, since its ranks
    are numbered within it: ``[rank 1/2] gloo.all_reduce #4 (float32, 8 elements)
    in group [0, 2] (global ranks)``. It is formatted only when a message needs it,
    so the hot path pays for no string.

    Args:
        rank: This rank.
        world_size: Ranks in the group.
        backend: Backend name.
        op: Operation name (``all_reduce``, ``send``...).
        seq: The collective's sequence number in its group (1 for the first); for
            point-to-point, its number among this rank's operations with that peer and tag.
        tensor: The tensor the operation works on, if any (its dtype and size are named).
        peer: Point-to-point only: the other rank (None: a receive from any rank).
        tag: Point-to-point only: the tag (None for collectives).
        group: A subgroup's members' global ranks, in its rank order; None for a root group.
    """

    __slots__ = ("rank", "world_size", "backend", "op", "seq", "dtype", "numel", "peer", "tag", "group")

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend: str,
        op: str,
        seq: int,
        tensor: torch.Tensor | None = None,
        peer: int | None = None,
        tag: int | None = None,
        group: tuple[int, ...] | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.op = op
        self.seq = seq
        self.dtype = tensor.dtype if tensor is not None else None
        self.numel = tensor.numel() if tensor is not None else 0
        self.peer = peer
        self.tag = tag
        self.group = group

    def __str__(self) -> str:
        what = f" ({dtype_name(self.dtype)}, {self.numel} elements)" if self.dtype is not None else ""
        pair = ""
        if self.tag is not None:
            other = f"rank {self.peer}" if self.peer is not None else "any rank"
            pair = f" {'to' if self.op == 'send' else 'from'} {other} tag {self.tag}"
        where = in_group(self.group)
        return f"[rank {self.rank}/{self.world_size}] {self.backend}.{self.op} #{self.seq}{pair}{what}{where}"

    def __repr__(self) -> str:
        return f"CollectiveLabel({self})"


class Work:
    """Handle of a collective (returned with ``async_op=True``).

    The tensors of the collective must not be read or written until ``wait()``
    has returned (or the future from ``get_future()`` has completed). The handle
    keeps them alive until then.

    Example::

        >>> work = group.all_reduce(t, async_op=True)
        >>> fut = work.get_future().then(lambda f: f.value()[0] * 2)
        >>> work.wait()                 # t holds the sum
        >>> fut.wait()                  # the sum, doubled

    Args:
        label: What the collective is, for messages (a ``CollectiveLabel`` or text).
        keep_alive: Objects (tensors, staging buffers) to hold until the collective ends.
    """

    _context: str | Callable[[], object] | None = None
    """What the caller attached with ``annotate`` (a class default: most works carry none)."""

    _is_recv = False
    """True for the work of a ``recv`` / ``irecv`` (set by the interface)."""

    _source: int | None = None
    """The rank a receive got its message from, once known (``source_rank()``)."""

    def __init__(self, label: CollectiveLabel | str = "collective", keep_alive: Any = None) -> None:
        self._label = label
        self._keep_alive = keep_alive
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._finishers: list[Callable[[], None]] | None = None
        self._future: torch.futures.Future[Any] | None = None
        self._value: Any = None
        self._observers: list[Callable[[Work], None]] | None = None

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else ("done" if self._done else "pending")
        return f"<{type(self).__name__} {self._label} {state}>"

    @property
    def label(self) -> CollectiveLabel | str:
        """What the collective is (``[rank 0/2] ring.all_reduce #7 (float32, 1024 elements)``)."""
        return self._label

    @property
    def context(self) -> str | None:
        """The text attached with ``annotate`` (a callable is called now), or None."""
        context = self._context
        if context is None:
            return None
        if callable(context):
            try:
                return str(context())
            except Exception as e:  # noqa: BLE001 - a message must not fail for its context
                return f"<context unavailable: {type(e).__name__}: {e}>"
        return str(context)

    def _wait_expired(self, timeout: float, still: str) -> CommTimeoutError:
        """The error of a ``wait(timeout)`` that ran out; ``still`` says where the collective goes on."""
        return CommTimeoutError(
            f"{self._label}: Work.wait(timeout={timeout}) expired before the collective finished; "
            f"{still}. Wait again, or look for a rank that has not issued the same collective."
        )

    # ------------------------------------------------------------------ public
    def annotate(self, context: str | Callable[[], object]) -> Work:
        """Say what this collective is for; stall warnings and flight-recorder dumps name it.

        Costs one attribute store: a callable is called only when a report needs
        the text, so pass ``lambda: f"..."`` rather than a formatted string on a
        hot path. A later call replaces the context.

        Args:
            context: Text, or a callable returning it.

        Returns:
            This work, so that a call can be chained.

        Example::

            >>> work = group.all_reduce(bucket.buffer, async_op=True)
            >>> work.annotate(lambda: f"DDP bucket {i}: {', '.join(names[:3])}")
        """
        self._context = context
        return self

    def wait(self, timeout: float | None = None) -> None:
        """Block until the result is in the tensor.

        Args:
            timeout: Seconds to wait for this handle; ``None`` waits until the
                collective ends, which the backend bounds by the group's own
                timeout (a stuck peer raises ``CommTimeoutError`` there). On
                CUDA tensors of the ``nccl`` backend the wait is a stream
                dependency and does not block the host; see docs/backends.md.

        Raises:
            CommTimeoutError: The collective did not finish within ``timeout``
                (it goes on; wait again), or within the group's timeout.
            CommError: The collective failed (the same error on every call).
        """
        if not self._done:
            self._wait_for_backend(timeout)
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        """Return True once the collective has finished, successfully or not (never blocks)."""
        if not self._done:
            self._test_backend()
        return self._done

    def exception(self) -> BaseException | None:
        """Return the error the collective failed with, or None (also while running)."""
        return self._error

    def source_rank(self) -> int:
        """Return the group rank a completed ``recv`` / ``irecv`` received its message from.

        Useful after ``irecv(tensor, src=None)``, which takes a message from any rank.

        Raises:
            CommError: This is not the work of a receive, it has not completed
                (call ``wait()`` first), or it failed.
        """
        if not self._is_recv:
            raise CommError(f"{self._label}: source_rank() is defined for the work of recv / irecv only")
        if not self.is_completed():
            raise CommError(f"{self._label}: the receive has not completed; call wait() before source_rank()")
        if self._error is not None:
            raise CommError(f"{self._label}: the receive failed, so it has no source: {self._error}")
        if self._source is None:
            raise CommError(f"{self._label}: the backend did not report which rank the message came from")
        return self._source

    def get_future(self) -> torch.futures.Future[Any]:
        """Return a ``torch.futures.Future`` that completes when the collective does.

        Its value is what torch's gives for the same collective: for
        ``all_reduce``, ``broadcast`` and ``reduce_scatter`` a list holding the
        tensor, so communication hooks written for torch port unchanged; for
        ``all_gather`` into a list the list of outputs, and a list holding the
        output tensor for ``all_gather_into_tensor`` and ``all_to_all_single``;
        for ``barrier`` None. A failed or timed-out collective completes the
        future with its ``CommError``. Chain work with ``fut.then(callback)``;
        callbacks may run on the backend's progress thread.

        Every call returns the same future.
        """
        with self._lock:
            future = self._future
            if future is None:
                future = self._future = self._new_future()
                settled = self._done
            else:
                return future
        if settled:
            self._complete_future(future)
        else:
            self._arm_future()
        return future

    # ------------------------------------------------------- for the interface
    def add_finisher(self, step: Callable[[], None]) -> None:
        """Run ``step`` once the collective has succeeded, before the result is visible.

        Steps run in the order added, on whichever thread settles the work; a
        step added after the work succeeded runs at once, on the caller's thread.
        A step that raises fails the work with a ``CommError``.
        """
        with self._lock:
            if not self._done:
                if self._finishers is None:
                    self._finishers = []
                self._finishers.append(step)
                return
            if self._error is not None:
                return
            try:
                step()
            except Exception as e:  # noqa: BLE001 - becomes the work's error
                self._error = self._finishing_failed(e)
                raise self._error from e

    def add_observer(self, observer: Callable[[Work], None]) -> None:
        """Call ``observer(work)`` once the work has settled (at once if it has)."""
        with self._lock:
            if not self._done:
                if self._observers is None:
                    self._observers = []
                self._observers.append(observer)
                return
        observer(self)

    def _set_value(self, value: Any) -> None:
        """Set what the future completes with (the interface does, for async collectives)."""
        self._value = value

    def _set_source(self, rank: int) -> None:
        """Record the sender of a receive from any rank (backends call it before the work settles)."""
        self._source = rank

    # --------------------------------------------------------- for backends
    def _wait_for_backend(self, timeout: float | None) -> None:
        """Block until the collective has ended and ``_settle`` was called.

        Raise ``CommTimeoutError`` when an explicit ``timeout`` expires first
        (without settling: the collective goes on). Backends override this.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement waiting")

    def _test_backend(self) -> None:
        """Test the collective once without blocking; settle the work if it ended."""

    def _arm_future(self) -> None:
        """Make sure ``_settle`` runs even if nobody waits (a future was asked for)."""

    def _new_future(self) -> torch.futures.Future[Any]:
        """The future ``get_future`` hands out.

        A backend whose results land on a CUDA stream gives one that lists the
        device, so that waiting on it orders the waiter's stream.
        """
        return torch.futures.Future()

    def _settle(self, error: BaseException | None = None) -> None:
        """Record that the collective ended: run the finishing steps, complete the future.

        Called by whoever learns it first (a waiter, a progress thread, a torch
        callback); later calls do nothing.
        """
        with self._lock:
            if self._done:
                return
            finishers, self._finishers = self._finishers, None
            if error is None and finishers:
                for step in finishers:
                    try:
                        step()
                    except Exception as e:  # noqa: BLE001 - becomes the work's error
                        error = self._finishing_failed(e)
                        break
            self._error = error
            self._done = True
            self._keep_alive = None
            future, observers = self._future, self._observers
            self._observers = None
        if future is not None:
            self._complete_future(future)
        if observers:
            for observer in observers:
                try:
                    observer(self)
                except Exception:  # noqa: BLE001 - an observer (diagnosis, statistics) must not stop the settling
                    _log.exception("%s: an observer of the finished work failed", self._label)

    def _finishing_failed(self, cause: BaseException) -> CommError:
        error = CommError(f"{self._label}: finishing the result failed: {type(cause).__name__}: {cause}")
        error.__cause__ = cause
        return error

    def _complete_future(self, future: torch.futures.Future[Any]) -> None:
        if future.done():
            return
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._value)


class CompletedWork(Work):
    """A ``Work`` that is already done: for collectives that finished inline.

    Cheap to create (no lock): a synchronous collective may return one per call.

    Args:
        error: The error the collective failed with, if it did.
        label: What the collective was.
    """

    def __init__(
        self, error: BaseException | None = None, label: CollectiveLabel | str = "collective"
    ) -> None:
        self._label = label
        self._keep_alive = None
        self._done = True
        self._error = error
        self._finishers = None
        self._future = None
        self._value = None
        self._observers = None

    def add_finisher(self, step: Callable[[], None]) -> None:
        """Run ``step`` at once (the collective has finished), unless it failed."""
        if self._error is not None:
            return
        try:
            step()
        except Exception as e:  # noqa: BLE001 - becomes the work's error
            self._error = self._finishing_failed(e)
            raise self._error from e

    def add_observer(self, observer: Callable[[Work], None]) -> None:
        """Call ``observer(work)`` at once."""
        observer(self)

    def get_future(self) -> torch.futures.Future[Any]:
        """Return a completed ``torch.futures.Future`` (see ``Work.get_future``)."""
        if self._future is None:
            self._future = torch.futures.Future()
            self._complete_future(self._future)
        return self._future

    def _wait_for_backend(self, timeout: float | None) -> None:
        return

    def _settle(self, error: BaseException | None = None) -> None:
        return


class EventWork(Work):
    """A ``Work`` settled by another thread (a progress thread); waiters sleep on an event.

    Args:
        label: What the collective is, for messages.
        bound_s: How long ``wait()`` without a timeout waits before it reports the
            progress thread stuck. The collective bounds itself by the group's
            timeout, so this fires only if the thread itself stops.
        keep_alive: Objects to hold until the collective ends.
        settle_in: Returns the context the work is settled in (its finishing steps
            run, its future completed): for CUDA tensors, the issuing stream made
            current, so that their kernels follow the copies back.
    """

    def __init__(
        self,
        label: CollectiveLabel | str,
        bound_s: float,
        keep_alive: Any = None,
        settle_in: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        super().__init__(label, keep_alive)
        self._event = threading.Event()
        self._bound_s = bound_s
        self._settle_in = settle_in

    def _settle(self, error: BaseException | None = None) -> None:
        if self._settle_in is None or self._done:
            super()._settle(error)
        else:
            with self._settle_in():
                super()._settle(error)
        self._event.set()

    def _wait_for_backend(self, timeout: float | None) -> None:
        limit = self._bound_s if timeout is None else max(float(timeout), 0.0)
        if self._event.wait(limit):
            return
        if timeout is not None:
            raise self._wait_expired(timeout, "it is still running on the progress thread")
        raise CommTimeoutError(
            f"{self._label}: not finished after {limit:g} s, although every step of a collective is "
            "bounded by the group's timeout: the backend's progress thread is stuck or gone"
        )
