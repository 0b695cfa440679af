"""Host staging of CUDA tensors: pinned buffers by size class, a chunk planner, an overlapped copy pipeline.

Backends that move host memory (the ring, and MPI libraries that cannot read
device memory) stage a CUDA tensor through pinned host memory, one chunk at a
time, so that copying and communicating overlap::

    caller's stream   ... kernels that wrote the tensor ... [event P]            ... waits for [event L] ...
    copy-out stream   wait P, D2H chunk 0 [e0], D2H chunk 1 [e1], D2H chunk 2 [e2]
    host thread              wait e0, work on chunk 0, publish 0, wait e1, work on chunk 1, publish 1, ...
    copy-in stream                                    H2D chunk 0,               H2D chunk 1, ... [event L]

- Every device-to-host copy is issued at once on a side stream, after that
  stream waits for an event recorded on the caller's current stream when the
  collective was issued (the kernels that produced the tensor): no
  ``torch.cuda.synchronize()``, and the host never blocks on the caller's
  stream. The copy engine works through the chunks while the host works on
  earlier ones.
- The host waits for one chunk's event (polling, bounded by a timeout) before
  it reads or sends that chunk.
- A chunk whose result is final is copied back at once on a second side
  stream, so the copy back overlaps the next chunk's work. The caller's stream
  then waits for the last copy (a stream dependency, not a host wait), so
  kernels queued on it afterwards see the result.
- Pinned buffers come from a pool of power-of-two size classes (64 KiB and
  up). A buffer goes back to the pool fenced by the events of the last copies
  that used it, and is handed out again only once they have completed; the pool
  keeps a bounded number of idle buffers per class. No pageable copy is made.

Every CUDA call goes through one small object (``DeviceOps``; ``TorchCudaOps``
is the real one), so the planning (chunk bounds, size classes, buffer reuse and
the order of the operations) runs, and is tested, on a machine without a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from commlib.errors import CommError, CommTimeoutError

__all__ = [
    "Chunk",
    "ChunkedRequests",
    "DeviceOps",
    "PinnedBufferPool",
    "PoolStats",
    "StagingConfig",
    "StagingPipeline",
    "TorchCudaOps",
    "chunks_in",
    "fetch_order",
    "plan_chunks",
    "shared_pool",
    "size_class",
    "stage",
    "wait_for_event",
]

KiB = 1024
MiB = 1024 * KiB

MIN_CLASS_BYTES = 64 * KiB
"""Smallest pinned buffer: tensors up to this size share one size class."""

DEFAULT_CHUNK_BYTES = 4 * MiB
"""Pipeline unit: large enough that a copy's launch cost (a few microseconds) is small
against its transfer (about 0.2 ms at 20 GB/s), small enough that the first chunk is on
the host soon after the collective starts."""

DEFAULT_BUFFERS_PER_CLASS = 2
"""Idle buffers the pool keeps per size class (two collectives in flight per size)."""

_SPIN_S = 5e-5
"""Seconds a host wait polls an event back to back before it starts to nap."""

_MAX_NAP_S = 1e-3
"""Longest nap between two polls of an event."""

_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: None)


# ------------------------------------------------------------------ planning
def size_class(nbytes: int, min_bytes: int = MIN_CLASS_BYTES) -> int:
    """Return the pinned buffer size that holds ``nbytes``: the next power of two, at least ``min_bytes``.

    Args:
        nbytes: Bytes to hold (>= 0).
        min_bytes: The smallest class (a power of two).

    Raises:
        ValueError: ``nbytes`` is negative or ``min_bytes`` is not a power of two.
    """
    if nbytes < 0:
        raise ValueError(f"size_class: nbytes must be >= 0, got {nbytes}")
    if min_bytes < 1 or min_bytes & (min_bytes - 1):
        raise ValueError(f"size_class: min_bytes must be a power of two, got {min_bytes}")
    return 1 << (max(nbytes, min_bytes) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One pipeline unit of a flat tensor: elements ``[start, stop)``."""

    index: int
    """Position in the plan, from 0."""
    start: int
    """First element."""
    stop: int
    """One past the last element."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self.stop - self.start


def plan_chunks(numel: int, element_size: int, chunk_bytes: int) -> tuple[Chunk, ...]:
    """Split ``numel`` elements into chunks of ``chunk_bytes`` (whole elements; the last one shorter).

    Args:
        numel: Elements of the flat tensor (0 gives no chunks).
        element_size: Bytes per element.
        chunk_bytes: Bytes per chunk; rounded down to whole elements, at least one.

    Raises:
        ValueError: A number is out of range.
    """
    if numel < 0 or element_size < 1 or chunk_bytes < 1:
        raise ValueError(
            f"plan_chunks: need numel >= 0, element_size >= 1 and chunk_bytes >= 1, got "
            f"numel={numel}, element_size={element_size}, chunk_bytes={chunk_bytes}"
        )
    step = max(1, chunk_bytes // element_size)
    return tuple(
        Chunk(index, start, min(start + step, numel)) for index, start in enumerate(range(0, numel, step))
    )


def chunks_in(chunks: Sequence[Chunk], start: int, stop: int) -> range:
    """Return the indices of the chunks that hold any element of ``[start, stop)``.

    ``chunks`` must come from ``plan_chunks`` (equal chunks, the last one shorter).
    """
    if stop <= start or not chunks:
        return range(0)
    step = chunks[0].numel
    first = max(0, start) // step
    last = min((stop - 1) // step, len(chunks) - 1)
    return range(first, last + 1)


def fetch_order(chunks: Sequence[Chunk], first: Iterable[tuple[int, int]] = ()) -> list[int]:
    """Return the order in which to copy chunks out: those holding the ``first`` ranges, then the rest.

    Args:
        chunks: The plan.
        first: Element ranges ``(start, stop)`` the consumer needs first, in the
            order it needs them (a ring rank starts with its own segment).
    """
    order: list[int] = []
    seen: set[int] = set()
    for start, stop in first:
        for index in chunks_in(chunks, start, stop):
            if index not in seen:
                seen.add(index)
                order.append(index)
    order.extend(chunk.index for chunk in chunks if chunk.index not in seen)
    return order


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagingConfig:
    """Sizes of the host staging of CUDA tensors."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Pipeline unit in bytes (rounded down to whole elements). Default 4 MiB. Collectives that
    run one call per chunk (MPI) need the same value on every rank."""

    min_class_bytes: int = MIN_CLASS_BYTES
    """Smallest pinned buffer in bytes, a power of two. Default 64 KiB."""

    buffers_per_class: int = DEFAULT_BUFFERS_PER_CLASS
    """Idle pinned buffers kept per size class; more are freed. Default 2."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.chunk_bytes, bool)
            or not isinstance(self.chunk_bytes, int)
            or self.chunk_bytes < 1
        ):
            raise ValueError(f"StagingConfig.chunk_bytes: must be an integer >= 1, got {self.chunk_bytes!r}")
        m = self.min_class_bytes
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or m & (m - 1):
            raise ValueError(f"StagingConfig.min_class_bytes: must be a power of two, got {m!r}")
        b = self.buffers_per_class
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(f"StagingConfig.buffers_per_class: must be an integer >= 0, got {b!r}")


# ----------------------------------------------------------------- CUDA calls
class DeviceOps(Protocol):
    """The CUDA calls staging makes, in one place (a recording fake stands in for them in tests)."""

    def current_stream(self, device: torch.device) -> Any:
        """Return the calling thread's current stream on ``device``."""

    def side_stream(self, device: torch.device, role: str) -> Any:
        """Return the side stream for ``role`` (``"d2h"`` or ``"h2d"``) on ``device``, created once."""

    def record_event(self, stream: Any) -> Any:
        """Record an event on ``stream`` and return it."""

    def stream_wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (no host wait)."""

    def event_done(self, event: Any) -> bool:
        """Return True if the work before ``event`` has completed (does not block)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` without waiting for it."""

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator that ``stream`` uses ``tensor``'s memory (it is not reused before)."""

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        """Allocate ``nbytes`` of pinned host memory as a uint8 tensor."""

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` the calling thread's current stream inside the ``with`` block."""


class TorchCudaOps:
    """``DeviceOps`` on torch.cuda: side streams per device, events, non-blocking copies, pinned memory."""

    def __init__(self) -> None:
        self._streams: dict[tuple[int, str], Any] = {}
        self._lock = threading.Lock()

    def current_stream(self, device: torch.device) -> Any:
        """Return the calling thread's current stream on ``device``."""
        return torch.cuda.current_stream(device)

    def side_stream(self, device: torch.device, role: str) -> Any:
        """Return the side stream for ``role`` on ``device`` (one per device and role, made once)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, role)
        stream = self._streams.get(key)
        if stream is None:
            with self._lock:
                stream = self._streams.get(key)
                if stream is None:
                    stream = torch.cuda.Stream(device=torch.device("cuda", index))
                    self._streams[key] = stream
        return stream

    def record_event(self, stream: Any) -> Any:
        """Record a (non-timing) event on ``stream``."""
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def stream_wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event``."""
        stream.wait_event(event)

    def event_done(self, event: Any) -> bool:
        """Return True if ``event`` has completed."""
        return bool(event.query())

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """Queue the copy on ``stream`` (asynchronous: one side is pinned host memory)."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Record ``stream`` as a user of ``tensor``'s memory (the caching allocator waits for it)."""
        tensor.record_stream(stream)

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        """Allocate pinned (page-locked) host memory."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` the calling thread's current stream inside the ``with`` block."""
        return torch.cuda.stream(stream)


def wait_for_event(ops: DeviceOps, event: Any, timeout_s: float) -> bool:
    """Poll ``event`` until it completes or ``timeout_s`` passes; return True if it completed.

    Polls back to back for 50 microseconds (a chunk's copy takes about that
    long), then naps between polls, doubling the nap up to 1 ms.
    """
    if ops.event_done(event):
        return True
    start = time.monotonic()
    deadline = start + max(0.0, timeout_s)
    nap = 1e-5
    while True:
        if ops.event_done(event):
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        if now - start < _SPIN_S:
            _yield()
        else:
            time.sleep(min(nap, deadline - now))
            nap = min(nap * 2, _MAX_NAP_S)


# ---------------------------------------------------------------------- pool
@dataclasses.dataclass(frozen=True)
class PoolStats:
    """What a ``PinnedBufferPool`` has done so far."""

    allocated: int
    """Buffers allocated (pinned memory registered with the driver: slow, so rare)."""
    reused: int
    """Buffers handed out again from the pool."""
    dropped: int
    """Buffers freed because their class already held ``buffers_per_class`` idle ones."""
    idle_bytes: int
    """Bytes of the idle buffers the pool holds now."""


class PinnedBufferPool:
    """Pinned host buffers by power-of-two size class, allocated once and reused.

    A buffer returned with ``release(buffer, fences)`` is handed out again only
    after every one of ``fences`` (the events of the last copies that used it)
    has completed; until then a request of its class gets another idle buffer
    or a new one. Thread-safe.

    Args:
        ops: Allocates pinned memory and tells whether a fence has completed.
        min_class_bytes: Smallest class, a power of two.
        buffers_per_class: Idle buffers kept per class; one released beyond that
            frees the oldest idle buffer of the class. Freeing one whose copy is
            still in flight is safe: torch's pinned-memory allocator holds a block
            until the copies recorded on it have finished.
    """

    def __init__(
        self,
        ops: DeviceOps,
        *,
        min_class_bytes: int = MIN_CLASS_BYTES,
        buffers_per_class: int = DEFAULT_BUFFERS_PER_CLASS,
    ) -> None:
        size_class(0, min_class_bytes)  # checks min_class_bytes
        if buffers_per_class < 0:
            raise ValueError(f"PinnedBufferPool: buffers_per_class must be >= 0, got {buffers_per_class}")
        self._ops = ops
        self._min = min_class_bytes
        self._keep = buffers_per_class
        self._idle: dict[int, collections.deque[tuple[torch.Tensor, tuple[Any, ...]]]] = {}
        self._lock = threading.Lock()
        self._allocated = 0
        self._reused = 0
        self._dropped = 0

    def size_class(self, nbytes: int) -> int:
        """Return the class (buffer size in bytes) that a request for ``nbytes`` gets."""
        return size_class(nbytes, self._min)

    def acquire(self, nbytes: int) -> torch.Tensor:
        """Return a pinned uint8 buffer of ``size_class(nbytes)`` bytes, idle or new.

        The caller owns it until ``release``.
        """
        size = self.size_class(nbytes)
        with self._lock:
            idle = self._idle.get(size)
            if idle:
                for i, (buffer, fences) in enumerate(idle):
                    if all(self._ops.event_done(fence) for fence in fences):
                        del idle[i]
                        self._reused += 1
                        return buffer
            self._allocated += 1
        return self._ops.allocate_host(size)

    def release(self, buffer: torch.Tensor, fences: Iterable[Any] = ()) -> None:
        """Give ``buffer`` back; it is reused once every event of ``fences`` has completed.

        Raises:
            ValueError: ``buffer`` is not a whole buffer of a size class (a view, a slice).
        """
        size = buffer.numel()
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or size != self.size_class(size):
            raise ValueError(
                f"PinnedBufferPool.release: expected a whole pool buffer (1-d uint8 of a size class), got "
                f"{buffer.dtype} of shape {tuple(buffer.shape)}"
            )
        with self._lock:
            idle = self._idle.setdefault(size, collections.deque())
            idle.append((buffer, tuple(fences)))
            while len(idle) > self._keep:
                idle.popleft()
                self._dropped += 1

    def clear(self) -> None:
        """Free every idle buffer."""
        with self._lock:
            self._idle.clear()

    @property
    def stats(self) -> PoolStats:
        """Counts of allocations, reuses and drops, and the idle bytes held."""
        with self._lock:
            idle = sum(size * len(buffers) for size, buffers in self._idle.items())
            return PoolStats(self._allocated, self._reused, self._dropped, idle)


# ------------------------------------------------------------------ pipeline
class StagingPipeline:
    """One CUDA tensor staged through a pinned host buffer, chunk by chunk, overlapped with the caller's work.

    Create it on the thread that issues the collective, when it is issued: it
    records an event on that thread's current stream (the point after which the
    tensor holds the input) and remembers that stream (the one that will read
    the result). The rest may run on another thread (a progress thread), one
    thread at a time:

    - ``start()`` takes a pinned buffer and queues every device-to-host copy on
      the copy-out stream, after that stream waits for the event; it returns the
      host tensor (same shape and dtype), not yet filled.
    - ``wait_host(start, stop)`` blocks until the elements ``[start, stop)`` are
      on the host (``ready(start, stop)`` asks without blocking).
    - ``publish(start, stop)`` says that those host elements hold their final
      values: every chunk whose elements are all published is copied back on
      the copy-in stream at once. Publish each element once, and do not write
      a published element again.
    - ``finish()`` copies back what was not published, makes the caller's stream
      wait for the last copies, and returns the buffer to the pool, fenced by them.
      ``abort()`` does the same without copying back (after a failure).

    ``run(process)`` does all of this for a chunk-by-chunk job, and the pipeline
    is also a context manager (``with pipeline as host: ...`` starts, then
    finishes or aborts).

    Args:
        tensor: Contiguous tensor on the device ``ops`` drives.
        describe: Names the collective in errors (``[rank 0/2] ring.all_reduce #7``).
        ops: The CUDA calls.
        pool: Where the pinned buffer comes from.
        chunk_bytes: Pipeline unit (rounded down to whole elements).
        timeout_s: Bound of every host wait for a copy.
        copy_in: Copy the tensor to the host (False: an output only, such as an
            all-gather's output).
        copy_out: Copy the host result back (False: an input only).
        fetch_first: Element ranges to copy out first, in this order (the rest
            follow in order).
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        *,
        describe: str,
        ops: DeviceOps,
        pool: PinnedBufferPool,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 300.0,
        copy_in: bool = True,
        copy_out: bool = True,
        fetch_first: Iterable[tuple[int, int]] = (),
    ) -> None:
        if not tensor.is_contiguous():
            raise ValueError(f"{describe}: staging needs a contiguous tensor, got stride {tensor.stride()}")
        self._describe = describe
        self._ops = ops
        self._pool = pool
        self._tensor = tensor
        self._flat = tensor.view(-1)
        self._nbytes = tensor.numel() * tensor.element_size()
        self._timeout = timeout_s
        self._copy_in = copy_in
        self._copy_out = copy_out
        self._fetch_first = tuple(fetch_first)
        self.chunks = plan_chunks(tensor.numel(), tensor.element_size(), chunk_bytes)
        """The plan: chunk bounds in elements."""
        count = len(self.chunks)
        self._out_events: list[Any] = [None] * count
        self._on_host = [not copy_in] * count
        self._unpublished = [c.numel for c in self.chunks]
        self._published: list[list[tuple[int, int]]] = [[] for _ in self.chunks]
        self._copied_back = [False] * count
        self._last_out: Any = None
        self._last_in: Any = None
        self._in_stream: Any = None
        self._buffer: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._state = "new"
        if count:
            self._consumer = ops.current_stream(tensor.device)
            self._produced = ops.record_event(self._consumer)

    def on_consumer_stream(self) -> contextlib.AbstractContextManager[Any]:
        """Make the stream the result is read on (current at creation) current inside the ``with`` block.

        What another thread queues there after ``finish`` (a finished collective's
        future callbacks) runs after the copies back.
        """
        if not self.chunks:
            return contextlib.nullcontext()
        return self._ops.use_stream(self._consumer)

    # -------------------------------------------------------------- facts
    @property
    def host(self) -> torch.Tensor:
        """The host tensor (the tensor's shape and dtype); valid after ``start()``."""
        if self._host is None:
            raise RuntimeError(f"{self._describe}: StagingPipeline.host read before start()")
        return self._host

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        return self._nbytes

    def element_range(self, view: torch.Tensor) -> tuple[int, int]:
        """Return ``(start, stop)``: where ``view``, a contiguous slice of ``host``, lies in it (elements).

        Lets code that works on views (a ring's segments and chunks) call
        ``wait_host(*pipeline.element_range(view))`` and ``publish(...)``.

        Raises:
            ValueError: ``view`` is not inside the host tensor.
        """
        host = self.host
        size = host.element_size()
        offset, rest = divmod(view.data_ptr() - host.data_ptr(), size)
        if view.numel() == 0:
            return (0, 0)
        if rest or offset < 0 or offset + view.numel() > host.numel() or not view.is_contiguous():
            raise ValueError(
                f"{self._describe}: the view ({view.numel()} elements at byte offset "
                f"{view.data_ptr() - host.data_ptr()}) is not a contiguous slice of the host tensor "
                f"({host.numel()} elements)"
            )
        return offset, offset + view.numel()

    # ----------------------------------------------------------- the steps
    def start(self) -> torch.Tensor:
        """Take a pinned buffer, queue every device-to-host copy (``copy_in``); return the host tensor."""
        if self._state != "new":
            raise RuntimeError(f"{self._describe}: StagingPipeline.start() called twice")
        self._state = "started"
        tensor = self._tensor
        if not self.chunks:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype)
            return self._host
        self._buffer = self._pool.acquire(self._nbytes)
        host_flat = self._buffer[: self._nbytes].view(tensor.dtype)
        self._host = host_flat.view(tensor.shape)
        if self._copy_in:
            ops, device_flat = self._ops, self._flat
            stream = ops.side_stream(tensor.device, "d2h")
            ops.stream_wait(stream, self._produced)
            ops.keep_alive(device_flat, stream)
            for index in fetch_order(self.chunks, self._fetch_first):
                c = self.chunks[index]
                ops.copy(host_flat[c.start : c.stop], device_flat[c.start : c.stop], stream)
                self._out_events[index] = self._last_out = ops.record_event(stream)
        return self._host

    def ready(self, start: int = 0, stop: int | None = None) -> bool:
        """Return True if elements ``[start, stop)`` are on the host (does not block)."""
        self._check_started("ready")
        stop = self._flat.numel() if stop is None else stop
        for index in chunks_in(self.chunks, start, stop):
            if not self._on_host[index]:
                if not self._ops.event_done(self._out_events[index]):
                    return False
                self._on_host[index] = True
        return True

    def wait_host(self, start: int = 0, stop: int | None = None) -> None:
        """Block until elements ``[start, stop)`` are on the host.

        Raises:
            CommTimeoutError: A copy did not finish within the timeout.
        """
        self._check_started("wait_host")
        stop = self._flat.numel() if stop is None else stop
        for index in chunks_in(self.chunks, start, stop):
            if self._on_host[index]:
                continue
            if not wait_for_event(self._ops, self._out_events[index], self._timeout):
                c = self.chunks[index]
                raise CommTimeoutError(
                    f"{self._describe}: the device-to-host copy of chunk {index + 1}/{len(self.chunks)} "
                    f"(elements {c.start}..{c.stop} of {self._flat.numel()}) did not finish within "
                    f"{self._timeout:g} s; the GPU is stalled, or busy with kernels queued before the "
                    "collective. Raise COMMLIB_TIMEOUT if they are just long"
                )
            self._on_host[index] = True

    def publish(self, start: int = 0, stop: int | None = None) -> None:
        """Mark host elements ``[start, stop)`` final; copy back every chunk now complete (``copy_out``).

        Raises:
            ValueError: An element was published twice.
        """
        self._check_started("publish")
        stop = self._flat.numel() if stop is None else stop
        indices = chunks_in(self.chunks, start, stop)
        for index in indices:
            lo, hi = max(start, self.chunks[index].start), min(stop, self.chunks[index].stop)
            if any(lo < done_hi and done_lo < hi for done_lo, done_hi in self._published[index]):
                raise ValueError(
                    f"{self._describe}: elements {start}..{stop} published again (some were published "
                    f"before: {self._published[index]})"
                )
        for index in indices:
            lo, hi = max(start, self.chunks[index].start), min(stop, self.chunks[index].stop)
            self._published[index].append((lo, hi))
            self._unpublished[index] -= hi - lo
            if self._unpublished[index] == 0:
                self._copy_back(index)

    def finish(self) -> None:
        """Copy back what was not published, make the caller's stream wait, return the buffer."""
        self._check_started("finish")
        for index in range(len(self.chunks)):
            if self._unpublished[index]:
                self._unpublished[index] = 0
                self._copy_back(index)
        self._close()

    def abort(self) -> None:
        """After a failure: copy nothing back; make the caller's stream wait; return the buffer."""
        if self._state == "started":
            self._close()
        self._state = "closed"

    def run(self, process: Callable[[Chunk, torch.Tensor], None]) -> None:
        """Stage, then ``process(chunk, host_chunk)`` chunk by chunk in order, copying each back after it.

        The device-to-host copy of chunk k+1 runs while ``process`` works on
        chunk k, and the copy back of chunk k while it works on chunk k+1.
        ``host_chunk`` is a flat view of the chunk's host elements; ``process``
        leaves the result there.
        """
        host = self.start().view(-1)
        try:
            for chunk in self.chunks:
                self.wait_host(chunk.start, chunk.stop)
                process(chunk, host[chunk.start : chunk.stop])
                self.publish(chunk.start, chunk.stop)
        except BaseException:
            self.abort()
            raise
        self.finish()

    def __enter__(self) -> torch.Tensor:
        return self.start()

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()

    # ----------------------------------------------------------- internals
    def _check_started(self, step: str) -> None:
        if self._state != "started":
            raise RuntimeError(
                f"{self._describe}: StagingPipeline.{step}() needs a started pipeline (state {self._state})"
            )

    def _copy_back(self, index: int) -> None:
        if not self._copy_out or self._copied_back[index]:
            return
        ops = self._ops
        if self._in_stream is None:
            self._in_stream = ops.side_stream(self._tensor.device, "h2d")
            # The copies back overwrite the tensor: after the kernels that wrote it
            # (copy_in=False: an output the caller may have just filled).
            ops.stream_wait(self._in_stream, self._produced)
            ops.keep_alive(self._flat, self._in_stream)
        out_event = self._out_events[index]
        if out_event is not None and not self._on_host[index]:
            # Nobody waited for this chunk's copy out: it must read the device before we overwrite it.
            ops.stream_wait(self._in_stream, out_event)
        c = self.chunks[index]
        assert self._host is not None
        host_flat = self._host.view(-1)
        ops.copy(self._flat[c.start : c.stop], host_flat[c.start : c.stop], self._in_stream)
        self._copied_back[index] = True
        self._last_in = ops.record_event(self._in_stream)

    def _close(self) -> None:
        self._state = "closed"
        if not self.chunks:
            return
        # Later work on the caller's stream reads the result (copies back) or may overwrite
        # the tensor (copies out not waited for): it waits for both side streams. The buffer
        # is reused only after both are done with it.
        last = [event for event in (self._last_out, self._last_in) if event is not None]
        for event in last:
            self._ops.stream_wait(self._consumer, event)
        if self._buffer is not None:
            self._pool.release(self._buffer, last)
            self._buffer = None


class ChunkedRequests:
    """One non-blocking collective per chunk over a ``StagingPipeline``, advanced by polling.

    ``Test()`` never blocks: it starts the next chunks whose data is on the host
    (in chunk order, at most ``depth`` in flight), tests the ones in flight, and
    copies each finished chunk back at once. When every chunk is done it
    finishes the pipeline and returns True. So it stands in for one MPI request
    (``wait_until(requests.Test, deadline)``, a progress thread), and
    ``Iallreduce`` of chunk k runs while chunk k+1 is copied out and chunk k-1
    copied back.

    Every rank must plan the same chunks (the same ``chunk_bytes``): the chunk
    collectives are matched in order.

    Args:
        pipeline: A pipeline not yet started.
        start_chunk: ``start_chunk(chunk, host_chunk)`` issues the collective on the
            flat host view of one chunk and returns its request (``Test() -> bool``).
        after_chunk: Called as ``after_chunk(chunk, host_chunk)`` when a chunk's
            collective has finished, before it is copied back (AVG's division).
        depth: Chunk collectives in flight at most.
    """

    def __init__(
        self,
        pipeline: StagingPipeline,
        start_chunk: Callable[[Chunk, torch.Tensor], Any],
        *,
        after_chunk: Callable[[Chunk, torch.Tensor], None] | None = None,
        depth: int = 2,
    ) -> None:
        if depth < 1:
            raise ValueError(f"ChunkedRequests: depth must be >= 1, got {depth}")
        self._pipeline = pipeline
        self._start_chunk = start_chunk
        self._after_chunk = after_chunk
        self._depth = depth
        self._host: torch.Tensor | None = None
        self._next = 0
        self._in_flight: collections.deque[tuple[Chunk, Any]] = collections.deque()
        self._done = False

    @property
    def done(self) -> bool:
        """True once every chunk is back on the device (queued) and the pipeline finished."""
        return self._done

    def Test(self) -> bool:  # noqa: N802 - mpi4py's request method name
        """Advance without blocking; return True when the whole collective is done.

        Raises:
            Exception: Whatever a chunk's start or test raised (the pipeline is aborted).
        """
        if self._done:
            return True
        try:
            return self._advance()
        except BaseException:
            self._pipeline.abort()
            self._done = True
            raise

    def _advance(self) -> bool:
        pipeline = self._pipeline
        if self._host is None:
            self._host = pipeline.start().view(-1)
        host, chunks = self._host, pipeline.chunks
        still: collections.deque[tuple[Chunk, Any]] = collections.deque()
        for chunk, request in self._in_flight:
            if request.Test():
                view = host[chunk.start : chunk.stop]
                if self._after_chunk is not None:
                    self._after_chunk(chunk, view)
                pipeline.publish(chunk.start, chunk.stop)
            else:
                still.append((chunk, request))
        self._in_flight = still
        while self._next < len(chunks) and len(self._in_flight) < self._depth:
            chunk = chunks[self._next]
            if not pipeline.ready(chunk.start, chunk.stop):
                break
            self._in_flight.append((chunk, self._start_chunk(chunk, host[chunk.start : chunk.stop])))
            self._next += 1
        if self._next == len(chunks) and not self._in_flight:
            pipeline.finish()
            self._done = True
        return self._done


# --------------------------------------------------------------- shared state
_shared_lock = threading.Lock()
_shared: tuple[TorchCudaOps, PinnedBufferPool] | None = None


def shared_pool(config: StagingConfig | None = None) -> tuple[TorchCudaOps, PinnedBufferPool]:
    """Return the process's CUDA calls and pinned buffer pool (made on first use, then shared).

    ``config`` applies when the pool is made (the first call).
    """
    global _shared
    if _shared is None:
        with _shared_lock:
            if _shared is None:
                config = config or StagingConfig()
                ops = TorchCudaOps()
                pool = PinnedBufferPool(
                    ops, min_class_bytes=config.min_class_bytes, buffers_per_class=config.buffers_per_class
                )
                _shared = (ops, pool)
    return _shared


def stage(
    tensor: torch.Tensor,
    describe: str,
    *,
    timeout_s: float,
    config: StagingConfig | None = None,
    copy_in: bool = True,
    copy_out: bool = True,
    fetch_first: Iterable[tuple[int, int]] = (),
    parts: tuple[DeviceOps, PinnedBufferPool] | None = None,
) -> StagingPipeline:
    """Return a ``StagingPipeline`` for CUDA ``tensor`` (see that class for the arguments it shares).

    Call it on the thread that issues the collective, when it is issued.

    Args:
        tensor: Contiguous CUDA tensor.
        describe: Names the collective in errors.
        timeout_s: Bound of every host wait for a copy.
        config: Chunk and pool sizes (default ``StagingConfig()``).
        copy_in: Copy the tensor to the host.
        copy_out: Copy the host result back.
        fetch_first: Element ranges to copy out first.
        parts: The CUDA calls and pinned pool to stage through; default the
            process's shared ones (``shared_pool(config)``).

    Raises:
        CommError: ``tensor`` is not a CUDA tensor (checked on the shared parts only:
            injected ones drive whatever device they emulate).
    """
    if parts is None and tensor.device.type != "cuda":
        raise CommError(f"{describe}: host staging is for CUDA tensors, got one on {tensor.device}")
    config = config or StagingConfig()
    ops, pool = parts if parts is not None else shared_pool(config)
    return StagingPipeline(
        tensor,
        describe=describe,
        ops=ops,
        pool=pool,
        chunk_bytes=config.chunk_bytes,
        timeout_s=timeout_s,
        copy_in=copy_in,
        copy_out=copy_out,
        fetch_first=fetch_first,
    )
