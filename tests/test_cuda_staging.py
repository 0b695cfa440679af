"""backends.common.cuda_staging on the CPU: size classes, chunk plans, buffer reuse and the order of copies.

A recording fake stands in for the CUDA calls (streams, events, copies, pinned
memory); CPU tensors play the device tensor, and the fake's copies really copy,
so each test checks both the operations issued and the data that comes back.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from backends.common.cuda_staging import (
    Chunk,
    ChunkedRequests,
    PinnedBufferPool,
    StagingConfig,
    StagingPipeline,
    chunks_in,
    fetch_order,
    plan_chunks,
    size_class,
    stage,
)
from commlib.errors import CommError, CommTimeoutError

KiB, MiB = 1024, 1024 * 1024


# ---------------------------------------------------------------------- fake
class FakeEvent:
    def __init__(self, name: str, done: bool) -> None:
        self.name = name
        self.done = done

    def __repr__(self) -> str:
        return self.name


class FakeOps:
    """Records every CUDA call as a line of text; events complete at once unless ``hold_events``."""

    def __init__(self, *, hold_events: bool = False) -> None:
        self.log: list[str] = []
        self.hold_events = hold_events
        self.events: list[FakeEvent] = []
        self.allocated: list[int] = []
        self._counts: dict[str, int] = {}
        self._device_base: int | None = None

    def watch(self, tensor: torch.Tensor) -> None:
        """Name copies by the element range of ``tensor`` (the fake device tensor) they touch."""
        self._device_base = tensor.data_ptr()

    def _range(self, view: torch.Tensor) -> str:
        assert self._device_base is not None
        start = (view.data_ptr() - self._device_base) // view.element_size()
        return f"{start}:{start + view.numel()}"

    def current_stream(self, device: torch.device) -> str:
        return "current"

    def side_stream(self, device: torch.device, role: str) -> str:
        return role

    def record_event(self, stream: str) -> FakeEvent:
        self._counts[stream] = self._counts.get(stream, 0) + 1
        event = FakeEvent(f"{stream}#{self._counts[stream]}", done=not self.hold_events)
        self.events.append(event)
        self.log.append(f"record {event}")
        return event

    def stream_wait(self, stream: str, event: FakeEvent) -> None:
        self.log.append(f"{stream} waits {event}")

    def event_done(self, event: FakeEvent) -> bool:
        self.log.append(f"query {event}")
        return event.done

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: str) -> None:
        device_side = src if stream == "d2h" else dst
        self.log.append(f"{stream} copy {self._range(device_side)}")
        dst.copy_(src)

    def keep_alive(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(f"keep_alive {stream}")

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        self.allocated.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    def use_stream(self, stream: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def release_all(self) -> None:
        for event in self.events:
            event.done = True


def pipeline(
    tensor: torch.Tensor, ops: FakeOps, pool: PinnedBufferPool | None = None, **kwargs: Any
) -> StagingPipeline:
    ops.watch(tensor)
    kwargs.setdefault("chunk_bytes", 16)
    return StagingPipeline(
        tensor,
        describe="[rank 0/2] test.all_reduce #1",
        ops=ops,
        pool=pool or PinnedBufferPool(ops),
        **kwargs,
    )


def without_queries(log: list[str]) -> list[str]:
    return [line for line in log if not line.startswith("query")]


# ------------------------------------------------------------ size classes
@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (0, 64 * KiB),
        (1, 64 * KiB),
        (64 * KiB, 64 * KiB),
        (64 * KiB + 1, 128 * KiB),
        (1 * MiB, 1 * MiB),
        (25_000_000, 32 * MiB),
        (100 * MiB, 128 * MiB),
    ],
)
def test_size_class_is_the_next_power_of_two_from_64_kib(nbytes: int, expected: int) -> None:
    assert size_class(nbytes) == expected


def test_size_class_rejects_bad_numbers() -> None:
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        size_class(-1)
    with pytest.raises(ValueError, match="power of two"):
        size_class(10, min_bytes=3000)
    assert size_class(5, min_bytes=4) == 8


# ------------------------------------------------------------- chunk plans
def test_plan_chunks_whole_elements_last_chunk_shorter() -> None:
    chunks = plan_chunks(10, 4, 16)
    assert [(c.index, c.start, c.stop) for c in chunks] == [(0, 0, 4), (1, 4, 8), (2, 8, 10)]
    assert [c.numel for c in chunks] == [4, 4, 2]
    # chunk_bytes not a multiple of the element size: rounded down to whole elements.
    assert [c.numel for c in plan_chunks(10, 4, 18)] == [4, 4, 2]
    # Smaller than one element: one element per chunk.
    assert [c.numel for c in plan_chunks(3, 8, 5)] == [1, 1, 1]
    # Exactly divisible, and a single chunk.
    assert [c.numel for c in plan_chunks(8, 2, 8)] == [4, 4]
    assert plan_chunks(5, 4, 1 << 20) == (Chunk(0, 0, 5),)
    assert plan_chunks(0, 4, 16) == ()


def test_plan_chunks_covers_every_element_once() -> None:
    for numel in (1, 13, 1000, 40_003):
        for element_size, chunk_bytes in ((2, 4096), (4, 1000), (8, 1 << 20)):
            chunks = plan_chunks(numel, element_size, chunk_bytes)
            assert chunks[0].start == 0 and chunks[-1].stop == numel
            assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:], strict=False))
            assert all(c.numel * element_size <= max(chunk_bytes, element_size) for c in chunks)


def test_plan_chunks_rejects_bad_numbers() -> None:
    with pytest.raises(ValueError, match="numel=-1"):
        plan_chunks(-1, 4, 16)
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        plan_chunks(4, 4, 0)


def test_chunks_in_and_fetch_order() -> None:
    chunks = plan_chunks(10, 4, 16)  # 0:4, 4:8, 8:10
    assert list(chunks_in(chunks, 0, 10)) == [0, 1, 2]
    assert list(chunks_in(chunks, 3, 5)) == [0, 1]
    assert list(chunks_in(chunks, 4, 8)) == [1]
    assert list(chunks_in(chunks, 9, 100)) == [2]
    assert list(chunks_in(chunks, 5, 5)) == []
    assert list(chunks_in((), 0, 3)) == []
    assert fetch_order(chunks) == [0, 1, 2]
    # A ring rank that needs its own segment (elements 5..10) first, then 0..5.
    assert fetch_order(chunks, [(5, 10), (0, 5)]) == [1, 2, 0]
    assert fetch_order(chunks, [(8, 10)]) == [2, 0, 1]


def test_staging_config_validates() -> None:
    assert StagingConfig().chunk_bytes == 4 * MiB
    with pytest.raises(ValueError, match="chunk_bytes"):
        StagingConfig(chunk_bytes=0)
    with pytest.raises(ValueError, match="min_class_bytes"):
        StagingConfig(min_class_bytes=1000)
    with pytest.raises(ValueError, match="buffers_per_class"):
        StagingConfig(buffers_per_class=-1)


# -------------------------------------------------------------------- pool
def test_pool_reuses_a_released_buffer_of_the_same_class() -> None:
    ops = FakeOps()
    pool = PinnedBufferPool(ops)
    first = pool.acquire(1000)
    assert first.numel() == 64 * KiB and first.dtype == torch.uint8
    second = pool.acquire(50 * KiB)  # same class, the first is still out: a new one
    assert ops.allocated == [64 * KiB, 64 * KiB]
    pool.release(first)
    again = pool.acquire(64 * KiB)
    assert again is first
    bigger = pool.acquire(64 * KiB + 1)  # another class
    assert bigger.numel() == 128 * KiB
    assert ops.allocated == [64 * KiB, 64 * KiB, 128 * KiB]
    pool.release(second)
    pool.release(again)
    pool.release(bigger)
    stats = pool.stats
    assert (stats.allocated, stats.reused, stats.dropped) == (3, 1, 0)
    assert stats.idle_bytes == 2 * 64 * KiB + 128 * KiB


def test_pool_hands_a_buffer_out_again_only_after_its_fences() -> None:
    ops = FakeOps(hold_events=True)
    pool = PinnedBufferPool(ops)
    buffer = pool.acquire(100)
    copy_back, copy_out = ops.record_event("h2d"), ops.record_event("d2h")
    pool.release(buffer, [copy_back, copy_out])
    other = pool.acquire(100)  # the copies that used it are still in flight
    assert other is not buffer and len(ops.allocated) == 2
    pool.release(other)
    copy_back.done = True
    # 'other' has no fence: it goes out first even though it was released later.
    assert pool.acquire(100) is other
    assert pool.acquire(100) is not buffer  # copy_out still running: a third allocation
    copy_out.done = True
    assert pool.acquire(100) is buffer
    assert pool.stats.allocated == 3 and pool.stats.reused == 2


def test_pool_keeps_a_bounded_number_of_idle_buffers_per_class() -> None:
    ops = FakeOps()
    pool = PinnedBufferPool(ops, buffers_per_class=2)
    buffers = [pool.acquire(10) for _ in range(3)]
    for b in buffers:
        pool.release(b)
    assert pool.stats.dropped == 1 and pool.stats.idle_bytes == 2 * 64 * KiB
    # The oldest idle buffer was dropped; the two newest come back.
    assert {id(pool.acquire(10)), id(pool.acquire(10))} == {id(buffers[1]), id(buffers[2])}
    pool.clear()
    assert pool.stats.idle_bytes == 0
    none_kept = PinnedBufferPool(ops, buffers_per_class=0)
    none_kept.release(none_kept.acquire(1))
    assert none_kept.stats.dropped == 1 and none_kept.stats.idle_bytes == 0


def test_pool_refuses_what_is_not_one_of_its_buffers() -> None:
    ops = FakeOps()
    pool = PinnedBufferPool(ops)
    buffer = pool.acquire(10)
    with pytest.raises(ValueError, match="whole pool buffer"):
        pool.release(buffer[:100])
    with pytest.raises(ValueError, match="whole pool buffer"):
        pool.release(torch.zeros(64 * KiB // 4, dtype=torch.float32))
    with pytest.raises(ValueError, match="buffers_per_class"):
        PinnedBufferPool(ops, buffers_per_class=-1)


# ---------------------------------------------------------------- pipeline
def test_pipeline_order_of_operations_copy_process_copy_back() -> None:
    ops = FakeOps()
    tensor = torch.arange(10, dtype=torch.float32)
    p = pipeline(tensor, ops)  # 16-byte chunks: 0:4, 4:8, 8:10
    assert ops.log == ["record current#1"]  # the producer's point, on the issuing thread

    def process(chunk: Chunk, host: torch.Tensor) -> None:
        ops.log.append(f"process {chunk.start}:{chunk.stop}")
        host.mul_(2)

    p.run(process)
    assert torch.equal(tensor, torch.arange(10, dtype=torch.float32) * 2)
    assert ops.log == [
        "record current#1",
        # every copy out queued at once, after the side stream waits for the producer
        "d2h waits current#1",
        "keep_alive d2h",
        "d2h copy 0:4",
        "record d2h#1",
        "d2h copy 4:8",
        "record d2h#2",
        "d2h copy 8:10",
        "record d2h#3",
        # chunk 0: wait for its copy, process, copy back at once
        "query d2h#1",
        "process 0:4",
        "h2d waits current#1",
        "keep_alive h2d",
        "h2d copy 0:4",
        "record h2d#1",
        # chunk 1 is processed while chunk 0 goes back
        "query d2h#2",
        "process 4:8",
        "h2d copy 4:8",
        "record h2d#2",
        "query d2h#3",
        "process 8:10",
        "h2d copy 8:10",
        "record h2d#3",
        # the caller's stream waits for both side streams; no host synchronisation
        "current waits d2h#3",
        "current waits h2d#3",
    ]


def test_pipeline_returns_its_buffer_fenced_and_the_next_collective_reuses_it() -> None:
    ops = FakeOps(hold_events=True)
    pool = PinnedBufferPool(ops)
    tensor = torch.arange(10, dtype=torch.float64)
    first = pipeline(tensor, ops, pool)
    host = first.start()
    ops.release_all()  # the copies out complete
    first.wait_host()
    host.add_(1)
    first.publish()
    first.finish()
    assert torch.equal(tensor, torch.arange(10, dtype=torch.float64) + 1)
    assert len(ops.allocated) == 1 and pool.stats.idle_bytes == 64 * KiB
    # The copies back are still in flight (held): the next collective gets a new buffer.
    second = pipeline(torch.zeros(3, dtype=torch.float64), ops, pool)
    second.start()
    assert len(ops.allocated) == 2
    ops.release_all()
    second.abort()
    third = pipeline(torch.zeros(7, dtype=torch.float64), ops, pool)
    third.start()
    assert len(ops.allocated) == 2 and pool.stats.reused == 1


def test_pipeline_fetches_the_ranges_asked_first_and_publishes_across_chunks() -> None:
    ops = FakeOps()
    tensor = torch.arange(10, dtype=torch.int32)
    p = pipeline(tensor, ops, fetch_first=[(5, 10), (0, 5)])
    host = p.start().view(-1)
    copies = [line for line in ops.log if " copy " in line]
    assert copies == ["d2h copy 4:8", "d2h copy 8:10", "d2h copy 0:4"]
    ops.log.clear()
    # A segment 5..10 (the end of chunk 1, all of chunk 2): only chunk 2 is complete.
    p.wait_host(5, 10)
    host[5:10] += 100
    p.publish(5, 10)
    assert [line for line in ops.log if " copy " in line] == ["h2d copy 8:10"]
    ops.log.clear()
    p.wait_host(0, 5)
    host[0:5] += 100
    p.publish(0, 5)  # completes chunks 0 and 1
    assert [line for line in ops.log if " copy " in line] == ["h2d copy 0:4", "h2d copy 4:8"]
    p.finish()
    assert torch.equal(tensor, torch.arange(10, dtype=torch.int32) + 100)
    with pytest.raises(RuntimeError, match="needs a started pipeline"):
        p.publish(0, 1)


def test_element_range_places_a_view_of_the_host_tensor() -> None:
    ops = FakeOps()
    p = pipeline(torch.zeros(3, 10), ops)
    host = p.start().view(-1)
    assert p.element_range(host[7:19]) == (7, 19)
    assert p.element_range(host) == (0, 30) and p.element_range(host[5:5]) == (0, 0)
    with pytest.raises(ValueError, match="not a contiguous slice"):
        p.element_range(torch.zeros(4))
    with pytest.raises(ValueError, match="not a contiguous slice"):
        p.element_range(host[::2])


def test_pipeline_refuses_an_element_published_twice() -> None:
    ops = FakeOps()
    p = pipeline(torch.zeros(10), ops)
    p.start()
    p.publish(0, 6)
    with pytest.raises(ValueError, match="published again"):
        p.publish(5, 7)


def test_pipeline_output_only_and_input_only() -> None:
    ops = FakeOps()
    out = torch.full((6,), -1.0)
    p = pipeline(out, ops, copy_in=False)  # an all-gather's output: nothing to copy out
    with p as host:
        host.copy_(torch.arange(6.0))
    assert torch.equal(out, torch.arange(6.0))
    assert not any(line.startswith("d2h") for line in ops.log)
    # The copies back overwrite the output: after the kernels that wrote it.
    assert without_queries(ops.log)[1:3] == ["h2d waits current#1", "keep_alive h2d"]
    assert without_queries(ops.log)[-1] == "current waits h2d#2"

    ops = FakeOps()
    source = torch.arange(6.0)
    p = pipeline(source, ops, copy_out=False)  # an input only
    with p as host:
        p.wait_host()
        seen = host.clone()
    assert torch.equal(seen, source)
    assert not any(line.startswith("h2d") for line in ops.log)
    assert without_queries(ops.log)[-1] == "current waits d2h#2"


def test_pipeline_copy_back_waits_for_a_copy_out_nobody_waited_for() -> None:
    ops = FakeOps(hold_events=True)
    tensor = torch.arange(8.0)
    p = pipeline(tensor, ops)
    p.start()
    ops.log.clear()
    p.finish()  # never waited on the host: each copy back must follow its chunk's copy out on the GPU
    assert ops.log[:3] == ["h2d waits current#1", "keep_alive h2d", "h2d waits d2h#1"]
    assert "h2d waits d2h#2" in ops.log


def test_pipeline_timeout_names_the_chunk_and_aborts_cleanly() -> None:
    ops = FakeOps(hold_events=True)
    pool = PinnedBufferPool(ops)
    p = pipeline(torch.zeros(10), ops, pool, timeout_s=0.0)

    def never(chunk: Chunk, host: torch.Tensor) -> None:
        raise AssertionError("must not run before its data is on the host")

    with pytest.raises(CommTimeoutError) as info:
        p.run(never)
    message = str(info.value)
    assert message.startswith("[rank 0/2] test.all_reduce #1: the device-to-host copy of chunk 1/3")
    assert "elements 0..4 of 10" in message and "COMMLIB_TIMEOUT" in message
    assert not any(line.startswith("h2d") for line in ops.log)  # nothing copied back
    assert ops.log[-1] == "current waits d2h#3"
    assert pool.stats.idle_bytes == 64 * KiB  # the buffer went back, fenced


def test_pipeline_empty_tensor_does_nothing() -> None:
    ops = FakeOps()
    tensor = torch.zeros(0, 3)
    p = pipeline(tensor, ops)
    p.run(lambda chunk, host: None)
    assert ops.log == [] and ops.allocated == [] and p.chunks == ()


def test_pipeline_host_view_keeps_shape_and_dtype_and_misuse_is_refused() -> None:
    ops = FakeOps()
    tensor = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    p = pipeline(tensor, ops, chunk_bytes=6)
    with pytest.raises(RuntimeError, match="before start"):
        _ = p.host
    host = p.start()
    assert host.shape == (3, 4) and host.dtype == torch.bfloat16 and p.nbytes == 24
    with pytest.raises(RuntimeError, match="called twice"):
        p.start()
    p.wait_host()
    assert torch.equal(host, tensor)
    p.finish()
    with pytest.raises(ValueError, match="contiguous"):
        pipeline(torch.zeros(4, 4).t(), ops)


def test_stage_refuses_a_cpu_tensor() -> None:
    with pytest.raises(CommError, match="for CUDA tensors"):
        stage(torch.zeros(3), "[rank 0/1] ring.all_reduce #1", timeout_s=1.0)


# ----------------------------------------------------------- chunked requests
class FakeRequest:
    def __init__(self, log: list[str], name: str) -> None:
        self.log = log
        self.name = name
        self.finished = False

    def Test(self) -> bool:  # noqa: N802
        return self.finished


def test_chunked_requests_overlap_copies_with_the_chunk_collectives() -> None:
    ops = FakeOps(hold_events=True)
    tensor = torch.arange(10, dtype=torch.float32)
    p = pipeline(tensor, ops)
    requests: dict[int, FakeRequest] = {}

    def start_chunk(chunk: Chunk, host: torch.Tensor) -> FakeRequest:
        ops.log.append(f"start {chunk.start}:{chunk.stop}")
        requests[chunk.index] = FakeRequest(ops.log, str(chunk.index))
        return requests[chunk.index]

    def after_chunk(chunk: Chunk, host: torch.Tensor) -> None:
        host.mul_(3)  # what the collective "computed"

    job = ChunkedRequests(p, start_chunk, after_chunk=after_chunk, depth=2)
    assert not job.Test()  # copies out queued, none finished: nothing starts
    assert not any(line.startswith("start") for line in ops.log)
    ops.events[1].done = True  # chunk 0 is on the host (events[0] is the producer's)
    assert not job.Test()
    assert [line for line in ops.log if line.startswith("start")] == ["start 0:4"]
    ops.release_all()
    assert not job.Test()  # chunk 1 starts; chunk 2 waits: two in flight already
    assert [line for line in ops.log if line.startswith("start")] == ["start 0:4", "start 4:8"]
    requests[0].finished = True
    ops.log.clear()
    assert not job.Test()
    # chunk 0 is copied back as soon as its collective finishes, then chunk 2 starts
    assert [line for line in without_queries(ops.log) if "copy" in line or "start" in line] == [
        "h2d copy 0:4",
        "start 8:10",
    ]
    requests[1].finished = requests[2].finished = True
    assert job.Test() and job.done and job.Test()
    assert torch.equal(tensor, torch.arange(10, dtype=torch.float32) * 3)
    assert ops.log[-2:] == ["current waits d2h#3", "current waits h2d#3"]


def test_chunked_requests_failure_aborts_the_pipeline() -> None:
    ops = FakeOps()
    pool = PinnedBufferPool(ops)
    tensor = torch.arange(10, dtype=torch.float32)
    p = pipeline(tensor, ops, pool)

    def start_chunk(chunk: Chunk, host: torch.Tensor) -> FakeRequest:
        raise RuntimeError("MPI error class 15")

    job = ChunkedRequests(p, start_chunk)
    with pytest.raises(RuntimeError, match="MPI error class 15"):
        job.Test()
    assert job.done and torch.equal(tensor, torch.arange(10, dtype=torch.float32))
    assert not any(line.startswith("h2d") for line in ops.log)
    assert pool.stats.idle_bytes == 64 * KiB
    with pytest.raises(ValueError, match="depth"):
        ChunkedRequests(p, start_chunk, depth=0)


def test_chunked_requests_on_an_empty_tensor_finish_at_once() -> None:
    ops = FakeOps()
    job = ChunkedRequests(pipeline(torch.zeros(0), ops), lambda c, h: FakeRequest([], "x"))
    assert job.Test() and ops.log == []
