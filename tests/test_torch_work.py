"""``TorchWork`` over a stand-in for torch's handle: timed waits, with and without a torch future."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from backends.torch.work import TorchWork
from commlib.errors import CommTimeoutError
from commlib.work import CollectiveLabel


class _Owner:
    timeout = 30.0

    def __init__(self) -> None:
        self.background: list[TorchWork] = []

    def _wait_in_background(self, work: TorchWork) -> None:
        self.background.append(work)

    def _mark_broken(self, error: BaseException) -> None:
        raise AssertionError(f"nothing fails here: {error}")


class _FutureLessHandle:
    """As torch's Gloo reduce_scatter_base work: no future, and ``wait(timeout)`` ignores its timeout."""

    def __init__(self) -> None:
        self.finished = threading.Event()

    def get_future(self) -> Any:
        raise RuntimeError("this work has no future")

    def is_completed(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: Any = None) -> bool:
        assert self.finished.wait(30), "the test finishes the collective"
        return True


def test_a_timed_wait_on_a_work_without_a_torch_future_expires_on_time() -> None:
    handle = _FutureLessHandle()
    label = CollectiveLabel(0, 2, "gloo", "reduce_scatter", 3, torch.ones(4, dtype=torch.int16))
    work = TorchWork(_Owner(), label, handle, cuda=None, keep_alive=None)  # type: ignore[arg-type]
    with pytest.raises(CommTimeoutError, match=r"gloo.reduce_scatter #3 .*Work.wait\(timeout=0.2\) expired"):
        work.wait(timeout=0.2)
    assert not work.is_completed()
    handle.finished.set()
    work.wait(timeout=5)  # a later wait completes it
    assert work.is_completed()


def test_a_timed_wait_is_bounded_while_another_thread_waits_without_a_timeout() -> None:
    """The background waiter of ``get_future()`` holds the handle's wait: a timed wait still expires."""
    handle = _FutureLessHandle()
    label = CollectiveLabel(0, 2, "gloo", "reduce_scatter", 4, torch.ones(4, dtype=torch.int16))
    work = TorchWork(_Owner(), label, handle, cuda=None, keep_alive=None)  # type: ignore[arg-type]
    untimed = threading.Thread(target=work.wait, daemon=True)
    untimed.start()
    with pytest.raises(CommTimeoutError, match=r"expired before the collective finished"):
        work.wait(timeout=0.2)
    handle.finished.set()
    untimed.join(10)
    assert not untimed.is_alive() and work.is_completed()


class _EnqueuedHandle:
    """As NCCL's work: its torch future is complete once the collective is queued; ``wait()`` is a
    stream dependency of the caller's current stream (counted here)."""

    def __init__(self) -> None:
        self.waits = 0
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result([torch.ones(2)])

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        self.waits += 1
        return True


def test_a_cuda_work_settled_by_its_future_still_orders_every_waiter_after_the_collective() -> None:
    """NCCL completes its future when the collective is queued: settling the work there must not
    let a later wait(), or the future's own completion, skip the stream dependency on NCCL."""
    handle = _EnqueuedHandle()
    label = CollectiveLabel(0, 2, "nccl", "all_reduce", 5, torch.ones(2))
    work = TorchWork(_Owner(), label, handle, cuda=torch.device("cuda", 0), keep_alive=None)  # type: ignore[arg-type]
    work._new_future = torch.futures.Future  # type: ignore[method-assign]  # this torch has no CUDA
    future = work.get_future()
    assert future.done() and work.is_completed()
    assert handle.waits == 1  # the future was completed on a stream ordered after the collective
    work.wait()
    work.wait()
    assert handle.waits == 3  # each waiter's current stream is ordered too
