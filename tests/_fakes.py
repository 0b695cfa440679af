"""An in-process ``IProcessGroup`` for unit tests: N threads, one fake group each, sharing a hub.

The hub really reduces: the k-th collective of every rank meets in slot k, and the
rank that arrives last combines the contributions. Each group runs its collectives
on one worker thread, in the order they were issued (like a backend's progress
thread), so ``async_op=True`` really is asynchronous. Every wait has a deadline.

    >>> results = run_threads(body, world_size=2)      # body(group, *args) on 2 threads
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from commlib.capabilities import Route, Row
from commlib.config import CommConfig
from commlib.env import DistEnv
from commlib.errors import CollectiveMismatchError, CommTimeoutError
from commlib.process_group import IProcessGroup
from commlib.types import INT_DTYPES, ReduceOp
from commlib.work import EventWork, Work
from tests._reference import reduce_reference

__all__ = ["FakeHub", "FakeProcessGroup", "Issued", "run_threads", "seeded", "ThreadsFailed"]

_T = TypeVar("_T")
_GLOBAL_GENERATOR = threading.Lock()


def seeded(seed: int, build: Callable[[], _T]) -> _T:
    """Return ``build()`` made right after ``torch.manual_seed(seed)``, as one step.

    Threaded ranks share torch's global generator: a module built while another
    rank's thread draws from it gets other values on every run. Every thread that
    builds through here takes the generator in turn.
    """
    with _GLOBAL_GENERATOR:
        torch.manual_seed(seed)
        return build()


@dataclasses.dataclass(frozen=True)
class Issued:
    """One collective as a fake group saw it issued."""

    seq: int
    kind: str
    numel: int
    dtype: torch.dtype
    op: ReduceOp | None
    async_op: bool


class FakeHub:
    """Where the ranks' collectives meet.

    Args:
        world_size: Number of ranks.
        timeout: Seconds a rank waits for the others in one collective.
    """

    def __init__(self, world_size: int, *, timeout: float = 20.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._slots: dict[int, dict[int, tuple[str, Any]]] = {}
        self._results: dict[int, Any] = {}
        self._reads: dict[int, int] = {}

    def exchange(
        self, seq: int, rank: int, signature: str, payload: Any, combine: Callable[[list[Any]], Any]
    ) -> Any:
        """Deposit ``payload`` for collective ``seq``; once all arrived, return ``combine(payloads)``."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            slot = self._slots.setdefault(seq, {})
            slot[rank] = (signature, payload)
            if len(slot) == self.world_size:
                signatures = {r: s for r, (s, _) in slot.items()}
                if len(set(signatures.values())) > 1:
                    result: Any = CollectiveMismatchError(
                        f"fake collective #{seq}: ranks disagree: "
                        + "; ".join(f"rank {r}: {s}" for r, s in sorted(signatures.items()))
                    )
                else:
                    try:
                        result = combine([slot[r][1] for r in range(self.world_size)])
                    except Exception as e:  # noqa: BLE001 - handed to every rank
                        result = e
                self._results[seq] = result
                self._cond.notify_all()
            while seq not in self._results:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [r for r in range(self.world_size) if r not in slot]
                    raise CommTimeoutError(
                        f"[rank {rank}/{self.world_size}] fake collective #{seq} ({signature}): ranks "
                        f"{missing} did not arrive within {self.timeout}s"
                    )
                self._cond.wait(remaining)
            result = self._results[seq]
            self._reads[seq] = self._reads.get(seq, 0) + 1
            if self._reads[seq] == self.world_size:
                del self._results[seq], self._slots[seq], self._reads[seq]
        if isinstance(result, Exception):
            raise result
        return result


def _reduce(op: ReduceOp, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Combine the ranks' tensors in rank order (in float64, rounded back once)."""
    return reduce_reference(tensors, op).to(tensors[0].dtype)


class FakeProcessGroup(IProcessGroup):
    """One rank of a fake group (see the module docstring).

    Args:
        rank: This rank.
        hub: The hub shared with the other ranks.
        supports_avg: Average natively (False: the interface sums, then divides).
        delay_s: Extra seconds each collective takes on the worker thread.
        backend_name: Name reported as ``backend``.
    """

    backend_name = "fake"

    def __init__(
        self,
        rank: int,
        hub: FakeHub,
        *,
        supports_avg: bool = True,
        delay_s: float = 0.0,
        timeout: float | None = None,
    ) -> None:
        super().__init__(
            DistEnv(rank=rank, world_size=hub.world_size), CommConfig(timeout=timeout or hub.timeout)
        )
        self.hub = hub
        self.supports_avg = supports_avg
        self.delay_s = delay_s
        self.issued: list[Issued] = []
        self._queue: queue.Queue[tuple[EventWork, Callable[[], None]] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._serve, name=f"fake-rank{rank}", daemon=True)
        self._worker.start()

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, task = item
            error: BaseException | None = None
            try:
                task()
            except BaseException as e:  # noqa: BLE001 - handed to the work
                error = e
            work._settle(error)

    @property
    def all_reduces(self) -> list[Issued]:
        """The all-reduces issued so far."""
        return [i for i in self.issued if i.kind == "all_reduce"]

    def _run(
        self,
        kind: str,
        tensor: torch.Tensor | None,
        op: ReduceOp | None,
        async_op: bool,
        body: Callable[[int], None],
    ) -> Work:
        seq = self._seq
        numel = tensor.numel() if tensor is not None else 0
        dtype = tensor.dtype if tensor is not None else torch.float32
        self.issued.append(Issued(seq, kind, numel, dtype, op, async_op))

        def task() -> None:
            if self.delay_s:
                time.sleep(self.delay_s)
            body(seq)

        work = EventWork(self._label(kind, tensor), bound_s=60.0, keep_alive=tensor)
        self._queue.put((work, task))
        return work

    def _sig(self, kind: str, tensor: torch.Tensor | None, extra: object = "") -> str:
        if tensor is None:
            return kind
        return f"{kind}({tensor.dtype}, {tensor.numel()} elements{extra})"

    def _reduction_rows(self) -> tuple[Row, ...]:
        """Average in the hub when ``supports_avg``; else the interface sums, then divides."""
        return (Row(Route.NATIVE, ops=frozenset({ReduceOp.AVG})),) if self.supports_avg else ()

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work:
        def body(seq: int) -> None:
            if op is ReduceOp.AVG and tensor.dtype in INT_DTYPES:
                raise AssertionError("AVG on integers")
            result = self.hub.exchange(
                seq,
                self.rank,
                self._sig("all_reduce", tensor, op),
                tensor.clone(),
                lambda ts: _reduce(op, ts),
            )
            tensor.copy_(result)

        return self._run("all_reduce", tensor, op, async_op, body)

    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work:
        def body(seq: int) -> None:
            result = self.hub.exchange(
                seq, self.rank, self._sig("broadcast", tensor, src), tensor.clone(), lambda ts: ts[src]
            )
            tensor.copy_(result)

        return self._run("broadcast", tensor, None, async_op, body)

    def _all_gather(
        self,
        flat_output: torch.Tensor | None,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool,
    ) -> Work:
        def body(seq: int) -> None:
            parts = self.hub.exchange(
                seq, self.rank, self._sig("all_gather", tensor), tensor.clone(), lambda ts: ts
            )
            for out, part in zip(outputs, parts, strict=True):
                out.copy_(part)

        return self._run("all_gather", tensor, None, async_op, body)

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        flat_input: torch.Tensor | None,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool,
    ) -> Work:
        stacked = torch.cat([t.reshape(-1) for t in inputs])

        def body(seq: int) -> None:
            total = self.hub.exchange(
                seq,
                self.rank,
                self._sig("reduce_scatter", output, op),
                stacked.clone(),
                lambda ts: _reduce(op, ts),
            )
            n = output.numel()
            output.copy_(total[self.rank * n : (self.rank + 1) * n])

        return self._run("reduce_scatter", output, op, async_op, body)

    def _barrier(self, async_op: bool) -> Work:
        return self._run(
            "barrier",
            None,
            None,
            async_op,
            lambda seq: self.hub.exchange(seq, self.rank, "barrier", None, lambda _: None),
        )

    def _close(self) -> None:
        self._queue.put(None)


class ThreadsFailed(AssertionError):
    """One or more threaded ranks failed; the message has each rank's error and traceback."""


def run_threads(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    supports_avg: bool = True,
    delay_s: float = 0.0,
    per_rank_args: list[tuple[Any, ...]] | None = None,
    return_errors: bool = False,
    group_factory: Callable[..., FakeProcessGroup] | None = None,
) -> list[Any]:
    """Run ``fn(group, *args)`` on ``world_size`` threads, each with a ``FakeProcessGroup``.

    ``group_factory(rank, hub, supports_avg=..., delay_s=...)`` makes the groups
    instead (a ``FakeProcessGroup`` subclass).

    Returns:
        Each rank's return value (or, with ``return_errors``, the exception it raised).

    Raises:
        ThreadsFailed: A rank raised (without ``return_errors``) or did not finish in time.
    """
    hub = FakeHub(world_size, timeout=min(timeout, 20.0))
    make = group_factory if group_factory is not None else FakeProcessGroup
    groups = [make(r, hub, supports_avg=supports_avg, delay_s=delay_s) for r in range(world_size)]
    results: list[Any] = [None] * world_size
    errors: list[tuple[BaseException, str] | None] = [None] * world_size

    def target(rank: int) -> None:
        try:
            rank_args = per_rank_args[rank] if per_rank_args is not None else args
            results[rank] = fn(groups[rank], *rank_args)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[rank] = (e, traceback.format_exc())

    threads = [
        threading.Thread(target=target, args=(r,), name=f"fake-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for g in groups:
        g.close()
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        raise ThreadsFailed(f"ranks {hung} did not finish within {timeout}s")
    if return_errors:
        return [err[0] if err is not None else res for res, err in zip(results, errors, strict=True)]
    failed = [(r, err) for r, err in enumerate(errors) if err is not None]
    if failed:
        raise ThreadsFailed("\n".join(f"rank {r}: {e!r}\n{tb}" for r, (e, tb) in failed))
    return results
