"""Per-step communication statistics: what was sent, how long it took, how much of it backward waited for."""

from __future__ import annotations

import collections
import dataclasses
import math
import time

__all__ = ["BucketTiming", "StepHistory", "StepRecorder", "StepStats"]

_NAN = math.nan


@dataclasses.dataclass(frozen=True)
class BucketTiming:
    """When one bucket of one step became ready, was launched and was seen done.

    Times are seconds since the step's ``start`` (the first gradient of the backward).
    ``done_s`` is when completion was first observed (polled each time a bucket becomes
    ready, and in the end-of-backward wait; the hooks' fast path does not poll), so it is
    an upper bound of the true completion time (and ``comm_time_s`` and ``overlap`` upper bounds).
    """

    index: int
    params: int
    nbytes: int
    ready_s: float
    launch_s: float
    done_s: float


@dataclasses.dataclass(frozen=True)
class StepStats:
    """Communication of one backward pass, readable after it returns.

    Attributes:
        step: Number of this backward among all backwards of the module (0-based).
        synced: False for a backward inside ``no_sync()`` (no communication).
        collectives: Buckets launched (each one all-reduce, or one call of the
            communication hook), plus the small all-reduces of the parameters-used
            map (``find_unused_parameters``) and the NaN check. The step agreement
            (``ddp.step_guard``) is not counted.
        bytes_reduced: Bytes of the bucket buffers communicated (in the dtype
            they are summed in).
        grads_copied: Gradients that arrived as fresh tensors and had to be copied
            into their bucket (0 when ``.grad`` stayed a view; see
            ``DistributedDataParallel``).
        backward_s: From the first gradient hook to the end of backward's computation.
        comm_time_s: Wall time during which at least one bucket's collective was in
            flight (union of the launch-to-done intervals).
        exposed_wait_s: Time the end of backward blocked waiting for communication.
        start: ``time.perf_counter()`` at the first gradient hook, for timelines.
        buckets: Per-bucket timings, in launch order.
        bytes_sent: Bytes this rank handed to the group's collectives for this
            model's backward (``IProcessGroup.bytes_issued``, counted around its
            launches and its end): the buckets, or what a communication hook sent
            instead (half with bf16 compression), plus the small flag
            all-reduces (not the step agreement's all-gather).
        hook_s: Time spent in DDP's gradient hooks' general path (taking
            gradients into buckets) and in launching buckets, on the thread
            running backward; the fast path's count-down is not timed.
        padding_bytes: Bytes of ``bytes_reduced`` that are padding, not
            gradients (``gradient_sync="reduce_scatter"`` pads each bucket to a
            multiple of the world size; 0 otherwise).
        wire_bytes: Bytes this rank puts on the wire, by a bandwidth-optimal
            (ring) algorithm: ``2 (w - 1) / w`` of what it hands to all-reduces,
            ``(w - 1) / w`` of what it hands to reduce-scatters (so the
            reduce-scatter mode shows half of the all-reduce's; see
            ``ddp.bucket_shards.wire_bytes``).
    """

    step: int
    synced: bool
    collectives: int
    bytes_reduced: int
    grads_copied: int
    backward_s: float
    comm_time_s: float
    exposed_wait_s: float
    start: float
    buckets: tuple[BucketTiming, ...] = ()
    bytes_sent: int = 0
    hook_s: float = 0.0
    padding_bytes: int = 0
    wire_bytes: int = 0

    @property
    def overlap(self) -> float:
        """Fraction of communication time hidden behind backward: ``1 - exposed / comm``.

        1.0 when nothing was communicated.
        """
        if self.comm_time_s <= 0:
            return 1.0
        return max(0.0, 1.0 - self.exposed_wait_s / self.comm_time_s)

    def summary(self) -> str:
        """One line for logs: ``3 coll, 12.5 MB, comm 8.1 ms, exposed 1.2 ms (85% hidden)``.

        The size is the bytes sent (``bytes_sent``).
        """
        if not self.synced:
            return "no_sync (no communication)"
        return (
            f"{self.collectives} coll, {self.bytes_sent / 1e6:.1f} MB, "
            f"comm {self.comm_time_s * 1e3:.1f} ms, exposed {self.exposed_wait_s * 1e3:.1f} ms "
            f"({self.overlap:.0%} hidden)"
        )


class StepRecorder:
    """Cheap event record of one backward: three timestamps per bucket, filled in place.

    An observer of ``GradientBucketManager`` (``GradSync`` installs one): it is told
    ``begin``, then ``ready``/``launched``/``done`` with a bucket index, and keeps only
    times and sizes (readiness itself is the manager's). The arrays are reused from
    step to step, so recording allocates nothing.
    """

    def __init__(self) -> None:
        self._resize(0)
        self._step = 0
        self.start = 0.0
        self.collectives = 0
        self.bytes_reduced = 0
        self.backward_end = _NAN

    def _resize(self, num_buckets: int) -> None:
        self._ready = [_NAN] * num_buckets
        self._launch = [_NAN] * num_buckets
        self._done = [_NAN] * num_buckets
        self._nbytes = [0] * num_buckets
        self._params = [0] * num_buckets
        self._order: list[int] = []

    def begin(self, num_buckets: int) -> None:
        """Start recording a backward (at its first gradient) over ``num_buckets`` buckets."""
        if num_buckets != len(self._ready):
            self._resize(num_buckets)
        else:
            self._ready[:] = [_NAN] * num_buckets
            self._launch[:] = [_NAN] * num_buckets
            self._done[:] = [_NAN] * num_buckets
            self._order.clear()
        self.start = time.perf_counter()
        self.collectives = 0
        self.bytes_reduced = 0
        self.backward_end = _NAN

    def ready(self, index: int) -> None:
        """Bucket ``index`` has all its gradients."""
        self._ready[index] = time.perf_counter()

    def launched(self, index: int, nbytes: int, params: int, at: float) -> None:
        """Bucket ``index``'s collective was issued at ``at`` (``perf_counter()`` before the call)."""
        self._launch[index] = at
        self._nbytes[index] = nbytes
        self._params[index] = params
        self._order.append(index)
        self.collectives += 1
        self.bytes_reduced += nbytes

    def done(self, index: int) -> None:
        """Bucket ``index``'s collective was seen complete (first observation wins)."""
        if math.isnan(self._done[index]):
            self._done[index] = time.perf_counter()

    def service_times(self) -> list[tuple[int, float]]:
        """``(bytes, seconds)`` each launched bucket's all-reduce took, in launch order.

        Buckets are served one after another, so bucket ``i`` is counted from its launch
        or the previous one's completion, whichever is later, to its completion. A
        completion is seen at the next gradient hook or the final wait, so these are
        upper bounds. Buckets not seen complete are left out.
        """
        out: list[tuple[int, float]] = []
        previous_done = -math.inf
        for i in self._order:
            done = self._done[i]
            if math.isnan(done):
                continue
            out.append((self._nbytes[i], done - max(self._launch[i], previous_done)))
            previous_done = done
        return out

    def extra_collective(self, count: int = 1) -> None:
        """Count collectives that are not buckets (the used-parameters map, the NaN check)."""
        self.collectives += count

    def end_backward(self) -> None:
        """Backward's computation is over (the end-of-backward callback started)."""
        self.backward_end = time.perf_counter()

    def finish(
        self,
        *,
        synced: bool,
        exposed_wait_s: float,
        grads_copied: int = 0,
        bytes_sent: int = 0,
        hook_s: float = 0.0,
        padding_bytes: int = 0,
        wire_bytes: int = 0,
    ) -> StepStats:
        """Close the record and return the step's statistics (the arguments are DDP's and the manager's)."""
        t0 = self.start
        intervals = sorted(
            (self._launch[i], self._done[i]) for i in self._order if not math.isnan(self._done[i])
        )
        comm = 0.0
        cur_start = cur_end = None
        for lo, hi in intervals:
            if cur_end is None or lo > cur_end:
                if cur_end is not None:
                    comm += cur_end - cur_start  # type: ignore[operator]
                cur_start, cur_end = lo, hi
            else:
                cur_end = max(cur_end, hi)
        if cur_end is not None:
            comm += cur_end - cur_start  # type: ignore[operator]
        buckets = tuple(
            BucketTiming(
                index=i,
                params=self._params[i],
                nbytes=self._nbytes[i],
                ready_s=self._ready[i] - t0,
                launch_s=self._launch[i] - t0,
                done_s=self._done[i] - t0,
            )
            for i in self._order
        )
        end = self.backward_end if not math.isnan(self.backward_end) else time.perf_counter()
        stats = StepStats(
            step=self._step,
            synced=synced,
            collectives=self.collectives,
            bytes_reduced=self.bytes_reduced,
            bytes_sent=bytes_sent,
            grads_copied=grads_copied,
            backward_s=end - t0,
            hook_s=hook_s,
            padding_bytes=padding_bytes,
            wire_bytes=wire_bytes,
            comm_time_s=comm,
            exposed_wait_s=exposed_wait_s,
            start=t0,
            buckets=buckets,
        )
        self._step += 1
        return stats


class StepHistory:
    """The statistics of the latest backwards, oldest first: a subscriber of ``GradSync`` (``record``).

    Args:
        maxlen: Backwards kept.
    """

    def __init__(self, maxlen: int = 1000) -> None:
        self.last: StepStats | None = None
        """The latest backward's statistics (None before the first)."""
        self.steps: collections.deque[StepStats] = collections.deque(maxlen=maxlen)
        """Up to ``maxlen`` backwards' statistics, oldest first."""

    def record(self, stats: StepStats) -> None:
        """Keep ``stats``, the latest backward's."""
        self.last = stats
        self.steps.append(stats)
