"""The ring backend's staging of CUDA tensors on the CPU: real ring ranks, an emulated device.

Run by ``tests/distributed/test_ring_device_emulated.py`` on spawned ranks. Each
body, for its duration (``emulated``):

- makes "CUDA tensors" that are CPU tensors claiming ``is_cuda`` and device
  ``cuda:0`` (``FakeCudaTensor`` from ``mpi_device_bodies``), so the ring takes
  its staging path;
- replaces the staging pipeline factory (``backends.common.cuda_staging.stage``) with one
  that builds ``StagingPipeline`` over recording fake CUDA calls
  (``StagingOps``: a copy out reaches the host only once the host has seen its
  event complete, ``lag`` polls after it was queued, so a chunk read before it
  was waited for gives a wrong result; copies back are made at once) and a
  pinned pool over them, with tiny chunks (``CHUNK_BYTES``), so that a
  40003-element tensor is staged in about a hundred chunks;
- wraps the group's links so that every chunk sent or received goes into the
  same log as the copies and the host waits.

What the emulation cannot show: real streams and events, the copies' overlap in
time, pinned memory (``tests/gpu/`` covers those on a device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from backends.common import cuda_staging
from backends.common.cuda_staging import PinnedBufferPool, StagingPipeline
from commlib import IProcessGroup, ReduceOp
from commlib.errors import CommError, GroupClosedError
from tests._reference import assert_close_to_reference, digest, rank_input, reduce_reference, tolerance
from tests.distributed.bodies import scatter_blocks
from tests.distributed.mpi_device_bodies import (
    Event,
    FakeCudaTensor,
    RecordingOps,
    new_ops_matrix,
    on_device,
    on_host,
)

CHUNK_BYTES = 1536
"""Staging chunk: not a divisor of the ring's 4 KiB chunks, nor aligned with segments."""

SIZES = (0, 1, 13, 1000, 40_003)
"""Empty, one element, a prime (all three on the small path), past it, about a hundred staging chunks."""

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


# ----------------------------------------------------------------- the fakes
class StagingOps(RecordingOps):
    """``RecordingOps`` whose copies out reach the host only when their events complete.

    A copy out is queued, not made: the copy-out stream runs its copies in
    order, and reaches one only when the host sees a later event complete
    (``lag`` polls after it was recorded), or another stream is made to wait
    for such an event (the fake then runs them at once). So a host tensor read
    before its chunk was waited for holds stale bytes (a reused buffer's), and
    the result is wrong. Copies back are made at once, and their events
    complete at once.

    The log names each copy by its stream, first element and length
    (``d2h 384+384``), and when the host first sees a copy out complete
    (``host has d2h 384+384``). The thread that asked for the caller's stream
    (where a pipeline was made) goes into ``issued_on``.
    """

    def __init__(self, log: list[str], lag: int) -> None:
        super().__init__(log, lag)
        self.issued_on: list[str] = []
        self.copied_on: set[str] = set()
        self._queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._made = 0
        self._last_copy = ""

    def current_stream(self, device: torch.device) -> str:
        self.issued_on.append(threading.current_thread().name)
        return super().current_stream(device)

    def record_event(self, stream: str) -> Event:
        event: Any = super().record_event(stream)
        if stream == "d2h":
            event.copy, event.upto = self._last_copy, len(self._queued)
        else:
            event.copy, event.upto, event.lag = None, 0, 0
        return event

    def event_done(self, event: Any) -> bool:
        done = event.done()
        if done and event.copy:
            self._run_copies_out(event.upto)
            self.log.append(f"host has {event.copy}")
            event.copy = None
        return done

    def stream_wait(self, stream: str, event: Any) -> None:
        super().stream_wait(stream, event)
        self._run_copies_out(event.upto)  # what waits on the copy-out stream comes after its copies

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: str) -> None:
        device_side = src if stream == "d2h" else dst
        self._last_copy = f"{stream} {device_side.storage_offset()}+{device_side.numel()}"
        self.log.append(self._last_copy)
        self.copied_on.add(threading.current_thread().name)
        if stream == "d2h":
            self._queued.append((dst, src))
        else:
            dst.copy_(src)

    def _run_copies_out(self, upto: int) -> None:
        while self._made < upto:
            dst, src = self._queued[self._made]
            self._queued[self._made] = (dst[:0], src[:0])  # made: hold no memory any more
            dst.copy_(src)
            self._made += 1


class CountingPool(PinnedBufferPool):
    """A pinned pool that counts the buffers handed out and not yet returned."""

    def __init__(self, ops: StagingOps) -> None:
        super().__init__(ops, min_class_bytes=1024)
        self.outstanding = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        buffer = super().acquire(nbytes)
        self.outstanding += 1
        return buffer

    def release(self, buffer: torch.Tensor, fences: Iterable[Any] = ()) -> None:
        self.outstanding -= 1
        super().release(buffer, fences)


class RecordingLink:
    """A ring link that logs each chunk it sends or receives (``send 1024``, ``recv 1024``)."""

    def __init__(self, link: Any, log: list[str]) -> None:
        self._link = link
        self._log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)

    def send(self, chunk: torch.Tensor) -> None:
        self._log.append(f"send {chunk.numel()}")
        self._link.send(chunk)

    def recv_into(self, dst: torch.Tensor) -> None:
        self._link.recv_into(dst)
        self._log.append(f"recv {dst.numel()}")

    def recv_reduce(self, dst: torch.Tensor, reduce: Any) -> None:
        self._link.recv_reduce(dst, reduce)
        self._log.append(f"recv {dst.numel()}")

    def recv_reduce_back(self, dst: torch.Tensor, reduce: Any) -> bool:
        written_back = self._link.recv_reduce_back(dst, reduce)
        self._log.append(f"recv {dst.numel()}")
        return bool(written_back)


def use_links(group: IProcessGroup, send: Any, recv: Any) -> None:
    """Make the ring group's collectives run over ``send`` and ``recv`` (wrappers of its links)."""
    group._ring = dataclasses.replace(group._ring, send=send, recv=recv)  # type: ignore[attr-defined]


@contextlib.contextmanager
def emulated(group: IProcessGroup, *, lag: int = 1) -> Iterator[dict[str, Any]]:
    """Stage the group's CUDA tensors through the fakes; yield what they record."""
    log: list[str] = []
    ops = StagingOps(log, lag)
    pool = CountingPool(ops)
    timeouts: set[float] = set()
    staged: list[tuple[str, str, bool]] = []  # one (kind, what, device memory to the ring) per pipeline

    def pipeline(
        tensor: torch.Tensor,
        describe: str,
        *,
        timeout_s: float,
        config: object = None,
        copy_in: bool = True,
        copy_out: bool = True,
        fetch_first: Iterable[tuple[int, int]] = (),
    ) -> StagingPipeline:
        assert isinstance(tensor, FakeCudaTensor), f"staged a {type(tensor).__name__}"
        timeouts.add(timeout_s)
        staged.append(("stage", describe, False))
        return StagingPipeline(
            tensor,
            describe=describe,
            ops=ops,
            pool=pool,
            chunk_bytes=CHUNK_BYTES,
            timeout_s=timeout_s,
            copy_in=copy_in,
            copy_out=copy_out,
            fetch_first=fetch_first,
        )

    links = group._right, group._left  # type: ignore[attr-defined]
    previous = cuda_staging.stage
    cuda_staging.stage = pipeline  # type: ignore[assignment]
    use_links(group, *(RecordingLink(link, log) for link in links))
    try:
        yield {"log": log, "ops": ops, "pool": pool, "timeouts": timeouts, "staged": staged}
    finally:
        cuda_staging.stage = previous
        if group._right is not None:  # type: ignore[attr-defined]  # None once the group is closed
            use_links(group, *links)


def _ops_for(group: IProcessGroup, dtype: torch.dtype) -> list[ReduceOp]:
    return [
        op
        for op in ReduceOp
        if group.supports(op, dtype, "cuda") and op.value in ("sum", "avg", "product", "min", "max")
    ]


# ------------------------------------------------------------ correctness
def _all_reduce_matrix(group: IProcessGroup, dtype: torch.dtype, log: list[str]) -> tuple[list[str], int]:
    n, r = group.world_size, group.rank
    digests, staged = [], 0
    for op in _ops_for(group, dtype):
        for integer_valued in (True, False) if dtype.is_floating_point else (True,):
            for numel in SIZES:
                inputs = [rank_input(k, numel, dtype, op, 11, integer_valued) for k in range(n)]
                expected = reduce_reference(inputs, op)
                exact = integer_valued and op is not ReduceOp.AVG
                tol = 0.0 if exact else tolerance(inputs, op, dtype)
                for async_op in (False, True):
                    tensor = on_device(inputs[r])
                    log.clear()
                    work = group.all_reduce(tensor, op, async_op=async_op)
                    if work is not None:
                        work.wait()
                    staged += any(line.startswith("d2h") for line in log) or numel == 0  # 0: nothing to copy
                    what = f"all_reduce {op.name} {dtype} numel={numel} integer_valued={integer_valued}"
                    assert isinstance(tensor, FakeCudaTensor), what
                    assert_close_to_reference(on_host(tensor), expected, tol, f"{what} async={async_op}")
                    digests.append(digest(on_host(tensor)))
    return digests, staged


def _broadcast_matrix(group: IProcessGroup, dtype: torch.dtype) -> None:
    n, r = group.world_size, group.rank
    for src in range(n):
        for numel in SIZES:
            inputs = [rank_input(k, numel, dtype, ReduceOp.SUM, 12 + src, False) for k in range(n)]
            for async_op in (False, True):
                tensor = on_device(inputs[r])
                work = group.broadcast(tensor, src, async_op=async_op)
                if work is not None:
                    work.wait()
                assert torch.equal(on_host(tensor), inputs[src]), (
                    f"broadcast src={src} {dtype} numel={numel} async={async_op}: wrong data"
                )


def _all_gather_matrix(group: IProcessGroup, dtype: torch.dtype) -> None:
    n, r = group.world_size, group.rank
    for numel in SIZES:
        inputs = [rank_input(k, numel, dtype, ReduceOp.SUM, 13, False) for k in range(n)]
        expected = torch.cat(inputs)
        for async_op in (False, True):
            what = f"all_gather {dtype} numel={numel} async={async_op}"
            flat = on_device(torch.full((n * numel,), 7, dtype=dtype))
            outputs = [on_device(torch.zeros(numel, dtype=dtype)) for _ in range(n)]
            in_place = on_device(torch.full((n * numel,), 7, dtype=dtype))
            in_place[r * numel : (r + 1) * numel].copy_(inputs[r])
            works = [
                group.all_gather(flat, on_device(inputs[r]), async_op=async_op),
                group.all_gather(outputs, on_device(inputs[r]), async_op=async_op),
                group.all_gather(in_place, in_place[r * numel : (r + 1) * numel], async_op=async_op),
            ]
            for work in works:
                if work is not None:
                    work.wait()
            assert torch.equal(on_host(flat), expected), f"{what} (one tensor): wrong data"
            assert torch.equal(torch.cat([on_host(t) for t in outputs]), expected), f"{what} (list)"
            assert torch.equal(on_host(in_place), expected), f"{what} (in place): wrong data"


def _reduce_scatter_matrix(group: IProcessGroup, dtype: torch.dtype) -> None:
    n, r = group.world_size, group.rank
    for op in _ops_for(group, dtype):
        for numel in scatter_blocks(SIZES, n):
            inputs = [rank_input(k, n * numel, dtype, op, 14, True) for k in range(n)]
            mine = slice(r * numel, (r + 1) * numel)
            expected = reduce_reference(inputs, op)[mine]
            tol = 0.0 if op is not ReduceOp.AVG else tolerance([t[mine] for t in inputs], op, dtype)
            for form in ("tensor", "list", "in place"):
                for async_op in (False, True):
                    what = f"reduce_scatter {op.name} {dtype} numel={numel} {form} async={async_op}"
                    source = on_device(inputs[r])
                    if form == "in place":
                        output = source[mine]
                        arg: Any = source
                    else:
                        output = on_device(torch.zeros(numel, dtype=dtype))
                        arg = list(source.split(numel)) if form == "list" and numel else source
                        if form == "list" and not numel:
                            arg = [on_device(torch.zeros(0, dtype=dtype)) for _ in range(n)]
                    work = group.reduce_scatter(output, arg, op, async_op=async_op)
                    if work is not None:
                        work.wait()
                    assert_close_to_reference(on_host(output), expected, tol, what)
                    if form != "in place":
                        assert torch.equal(on_host(source), inputs[r]), f"{what}: the input was modified"


def staged_matrix(group: IProcessGroup, collective: str) -> dict[str, Any]:
    """One collective x every dtype x op x size on emulated CUDA tensors, against float64 references.

    Returns the all-reduce digests (every rank must agree bit for bit), how
    many all-reduces took the staging path, the pool's counts, the timeouts the
    pipelines were given and the threads that made them and copied.
    """
    with emulated(group, lag=0) as seen:
        digests: list[str] = []
        staged = 0
        for dtype in DTYPES:
            if collective == "all_reduce":
                more, count = _all_reduce_matrix(group, dtype, seen["log"])
                digests += more
                staged += count
            elif collective == "broadcast":
                _broadcast_matrix(group, dtype)
            elif collective == "all_gather":
                _all_gather_matrix(group, dtype)
            else:
                _reduce_scatter_matrix(group, dtype)
        stats = seen["pool"].stats
        return {
            "digests": digests,
            "staged": staged,
            "allocated": stats.allocated,
            "reused": stats.reused,
            "outstanding": seen["pool"].outstanding,
            "timeouts": sorted(seen["timeouts"]),
            "group_timeout": group.timeout,
            "issued_on": sorted(set(seen["ops"].issued_on)),
            "copied_on": sorted(seen["ops"].copied_on),
        }


def future_callbacks_on_the_issuing_stream(group: IProcessGroup) -> list[str]:
    """An async all-reduce of an emulated CUDA tensor: its future's callback runs on the issuing stream.

    Returns the log from the last copy back on: the lane's thread makes the
    caller's stream current (``on caller``), and the callback, registered before
    the work ended, runs inside (a DDP communication hook's decompression queues
    its kernels there, after the copies back).
    """
    with emulated(group, lag=1) as seen:
        log = seen["log"]
        tensor = on_device(torch.arange(40_003, dtype=torch.float32))
        # The lane runs the all-reduce only once the callback is registered: it cannot end before.
        registered = threading.Event()
        group._lane.post(lambda: registered.wait(30))  # type: ignore[attr-defined]  # noqa: SLF001
        work = group.all_reduce(tensor, async_op=True)
        work.get_future().then(lambda _: log.append("callback"))
        registered.set()
        work.wait()
        assert torch.equal(on_host(tensor), torch.arange(40_003, dtype=torch.float32) * 2)
        last_back = max(i for i, line in enumerate(log) if line.startswith("h2d"))
        return [line for line in log[last_back:] if not line.startswith(("h2d", "host has"))]


def staged_new_ops(group: IProcessGroup) -> dict[str, Any]:
    """reduce, gather, scatter, all_to_all (uneven) and isend/irecv on emulated CUDA tensors, exactly.

    ``device_buffers`` says, per operation and dtype, whether the ring was ever
    handed device memory (it never may: each of them is staged).
    """
    with emulated(group, lag=1) as seen:
        result = new_ops_matrix(group, seen["staged"])
        result.update(outstanding=seen["pool"].outstanding, reused=seen["pool"].stats.reused)
    return result


def staged_recv_whose_staging_fails(group: IProcessGroup, async_op: bool) -> dict[str, Any]:
    """Rank 1's receive into a CUDA tensor fails to stage; its next receive, on the host, gets the message.

    The failed receive was issued (posted) before its staging failed on the lane: it must not
    stay posted, where it would take rank 0's message and the host receive would time out.
    """

    class NoPinnedMemory:
        def __enter__(self) -> torch.Tensor:
            raise RuntimeError("CUDA error: out of memory (pinned host buffer)")

        def __exit__(self, *exc: object) -> None:
            return None

    result: dict[str, Any] = {}
    if group.rank == 1:
        previous = cuda_staging.stage
        cuda_staging.stage = lambda *args, **kwargs: NoPinnedMemory()  # type: ignore[assignment]
        try:
            work = group.irecv(on_device(torch.zeros(5)), src=0, tag=7) if async_op else None
            if work is not None:
                work.wait()
            else:
                group.recv(on_device(torch.zeros(5)), src=0, tag=7)
        except Exception as e:  # noqa: BLE001 - what the caller sees
            result["failed"] = f"{type(e).__name__}: {e}"
        finally:
            cuda_staging.stage = previous
    group.barrier()  # rank 0 sends only once the staged receive has failed
    if group.rank == 0:
        group.send(torch.arange(5.0) + 1, dst=1, tag=7)
    elif group.rank == 1:
        got = torch.zeros(5)
        group.recv(got, src=0, tag=7)
        result["got"] = got.tolist()
    group.barrier()
    return result


# ------------------------------------------------------------- the pipeline
def staged_order(
    group: IProcessGroup, collective: str, async_op: bool, numel: int = 40_003
) -> dict[str, Any]:
    """One staged collective of ``numel`` float32 elements; return its log, in order, and the facts around it.

    The copies out complete two polls late, so every host wait really waits.
    """
    n, r = group.world_size, group.rank
    inputs = [torch.arange(numel, dtype=torch.float32) * (k + 1) for k in range(n)]
    with emulated(group, lag=2) as seen:
        if collective == "all_reduce":
            tensor = on_device(inputs[r])
            expected = sum(inputs, torch.zeros(numel))
            work = group.all_reduce(tensor, async_op=async_op)
        elif collective == "broadcast":
            tensor = on_device(inputs[r])
            expected = inputs[0]
            work = group.broadcast(tensor, 0, async_op=async_op)
        elif collective == "all_gather":
            tensor = on_device(torch.zeros(n * numel))
            expected = torch.cat(inputs)
            work = group.all_gather(tensor, on_device(inputs[r]), async_op=async_op)
        else:
            tensor = on_device(torch.zeros(numel))
            source = torch.cat(inputs)  # rank k contributes source * (k + 1)
            expected = (source * sum(range(1, n + 1)))[r * numel : (r + 1) * numel]
            work = group.reduce_scatter(tensor, on_device(source * (r + 1)), async_op=async_op)
        if work is not None:
            work.wait()
        return {
            "correct": bool(torch.equal(on_host(tensor), expected)),
            "log": list(seen["log"]),
            "issued_on": seen["ops"].issued_on,
            "copied_on": sorted(seen["ops"].copied_on),
            "chunk_elements": CHUNK_BYTES // 4,
            "outstanding": seen["pool"].outstanding,
        }


def pool_reuse(group: IProcessGroup, rounds: int = 40) -> dict[str, Any]:
    """Many staged collectives of a few sizes: the pool allocates a handful of buffers and reuses them."""
    with emulated(group, lag=1) as seen:
        for i in range(rounds):
            numel = (1000, 40_003, 5000)[i % 3]
            t = on_device(torch.ones(numel))
            work = group.all_reduce(t, async_op=bool(i % 2))
            if work is not None:
                work.wait()
            out = on_device(torch.zeros(group.world_size * numel))
            group.all_gather(out, t)
        stats = seen["pool"].stats
        return {
            "collectives": 2 * rounds,
            "allocated": stats.allocated,
            "reused": stats.reused,
            "outstanding": seen["pool"].outstanding,
        }


# ----------------------------------------------------------------- failures
def mismatch(group: IProcessGroup, async_op: bool) -> dict[str, Any]:
    """The last rank all-reduces one element more: every rank raises, aborts its staging, and goes on."""
    n, r = group.world_size, group.rank
    numel = 40_003 + (r == n - 1)
    with emulated(group, lag=1) as seen:
        t = on_device(torch.ones(numel))
        try:
            work = group.all_reduce(t, async_op=async_op)
            if work is not None:
                work.wait()
        except CommError as e:
            error, kind = str(e), type(e).__name__
        else:
            raise AssertionError("a mismatched all_reduce did not raise")
        log = list(seen["log"])
        outstanding = seen["pool"].outstanding
        again = on_device(torch.ones(1000) * (r + 1))  # the group is still usable, and staging too
        group.all_reduce(again)
        return {
            "kind": kind,
            "error": error,
            "log": log,
            "outstanding": outstanding,
            "after": on_host(again)[:3].tolist(),
            "outstanding_after": seen["pool"].outstanding,
        }


class DyingLink:
    """A send link whose process exits after ``chunks`` chunks: a rank dying in the middle of a ring."""

    def __init__(self, link: Any, chunks: int) -> None:
        self._link = link
        self._left = chunks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)

    def send(self, chunk: torch.Tensor) -> None:
        if self._left == 0:
            os._exit(17)
        self._left -= 1
        self._link.send(chunk)


def peer_dies(group: IProcessGroup, victim: int, numel: int = 40_003, chunks: int = 10) -> dict[str, Any]:
    """``victim`` exits after sending ``chunks`` chunks of the all-reduce; the others fail and abort."""
    with emulated(group, lag=1) as seen:
        if group.rank == victim:
            use_links(group, DyingLink(group._right, chunks), group._left)  # type: ignore[attr-defined]
        start = time.monotonic()
        try:
            group.all_reduce(on_device(torch.ones(numel)))
        except CommError as e:
            error, kind = str(e), type(e).__name__
        else:
            raise AssertionError("all_reduce with a dead peer did not raise")
        elapsed = time.monotonic() - start
        try:
            group.all_reduce(on_device(torch.ones(3)))
        except GroupClosedError as e:
            closed = str(e)
        else:
            raise AssertionError("a collective after the failure did not raise GroupClosedError")
        return {
            "kind": kind,
            "error": error,
            "elapsed": elapsed,
            "closed": closed,
            "log": list(seen["log"]),
            "outstanding": seen["pool"].outstanding,
        }


def stalled_copy(group: IProcessGroup, numel: int = 40_003, stalled_chunk: int = 5) -> dict[str, Any]:
    """Rank 0's copy out of one chunk never completes: its host wait times out, every rank fails cleanly."""
    with emulated(group, lag=1) as seen:
        ops: StagingOps = seen["ops"]
        if group.rank == 0:
            # Events are numbered in order: the caller's stream's, then one per copy out.
            stalled = f"d2h#{ops.count + 2 + stalled_chunk}"
            record = ops.record_event

            def stalling(stream: str) -> Event:
                event = record(stream)
                if event.name == stalled:
                    event.lag = 1 << 62
                return event

            ops.record_event = stalling  # type: ignore[method-assign]
        try:
            group.all_reduce(on_device(torch.ones(numel)))
        except CommError as e:
            error, kind = str(e), type(e).__name__
        else:
            raise AssertionError("all_reduce with a stalled copy did not raise")
        return {
            "kind": kind,
            "error": error,
            "outstanding": seen["pool"].outstanding,
            "log": list(seen["log"]),
        }
