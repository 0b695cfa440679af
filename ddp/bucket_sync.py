"""How a ready bucket is communicated: the one place that decides, launches and lands it.

``BucketSync.launch`` runs when a bucket's gradients are all in: it stages the
bucket (another dtype or device, if any), scales it (one pass over the bucket,
in the dtype it is communicated in), checks it for NaN and Inf when asked, and
starts its collective: an all-reduce of the bucket (the default, prepared once
per layout with ``IProcessGroup.prepare_all_reduce``), for a bucket of embedding
gradients the exchange of their touched rows (``ddp.touched_rows``), a
reduce-scatter (``gradient_sync="reduce_scatter"``, see ``ddp.bucket_shards``) or
the registered communication hook. ``BucketSync.finish`` waits for it, with a timeout and a
message naming the bucket, and lands the result in the gradients.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from commlib.errors import CommError, CommTimeoutError, error_prefix
from commlib.prepared import PreparedCollective
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from commlib.work import CompletedWork, Work
from ddp.bucket import GradientBucket
from ddp.bucket_shards import ReduceScatterBuckets
from ddp.config import GradientScaling
from ddp.devices import CommStreams, HostReadback, control_tensor
from ddp.errors import CommHookError
from ddp.nonfinite import NonFiniteCheck
from ddp.touched_rows import TouchedRows

__all__ = ["BucketSync", "CommHook", "PendingSync", "check_comm_hook"]

_T = TypeVar("_T")

CommHook = Callable[[Any, GradientBucket], "torch.futures.Future[Any]"]
"""``hook(state, bucket) -> torch.futures.Future``: torch's communication hook signature."""


def check_comm_hook(hook: object) -> None:
    """Raise ``TypeError`` unless ``hook`` is callable as ``hook(state, bucket)``."""
    if not callable(hook):
        raise TypeError(f"register_comm_hook: the hook must be callable, got {type(hook).__name__}")
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # a builtin or C function: trust it
    try:
        signature.bind(None, None)
    except TypeError as e:
        raise TypeError(
            f"register_comm_hook: the hook must take two arguments, (state, bucket), as torch's hooks "
            f"do; {getattr(hook, '__qualname__', hook)!r} has signature {signature}: {e}"
        ) from None


class PendingSync:
    """One bucket's communication in flight: a ``Work`` (default path) or a hook's future.

    For a touched-rows exchange (``rows``), ``work`` is its first collective (the
    flags); the second runs in ``BucketSync.finish``, so it is not complete before.
    ``error``: the communication hook failed at launch; ``work`` is then the
    stand-in collective issued in its place (or None), and ``BucketSync.finish``
    waits for it, then raises the error.
    """

    __slots__ = ("work", "future", "settled", "rows", "error")

    def __init__(
        self,
        work: Work | None = None,
        future: torch.futures.Future[Any] | None = None,
        rows: TouchedRows | None = None,
        error: CommHookError | None = None,
    ) -> None:
        self.work = work
        self.future = future
        self.rows = rows
        self.error = error
        self.settled: threading.Event | None = None
        if future is not None:
            event = self.settled = threading.Event()
            future.add_done_callback(lambda _f: event.set())

    def is_completed(self) -> bool:
        """True once the collective (or the hook's future) has finished, without blocking."""
        if self.rows is not None:
            return False
        if self.work is not None:
            return self.work.is_completed()
        if self.error is not None:
            return True
        return self.future is not None and self.future.done()


class BucketSync:
    """Launches and finishes the communication of buckets (see the module docstring).

    Args:
        group: The group to reduce over.
        op: The collective's reduction (``SUM`` for averages and scaled sums).
        scaling: What gradients are scaled by before communication: each as it
            is taken into a CPU bucket, or once per bucket at launch
            (``scales_each_gradient``); not with a communication hook (it scales itself).
        check: The NaN/Inf check, or None (off).
        shards: Reduce-scatter the buckets with this instead of all-reducing
            them (``gradient_sync="reduce_scatter"``), or None.
    """

    def __init__(
        self,
        group: IProcessGroup,
        *,
        op: ReduceOp,
        scaling: GradientScaling,
        check: NonFiniteCheck | None = None,
        shards: ReduceScatterBuckets | None = None,
    ) -> None:
        self.group = group
        self.shards = shards
        self.op = op
        self.scaling = scaling
        """What this iteration's buckets are scaled by (``average_over`` re-weights it for ``Join``)."""
        self._configured = scaling
        self.check = check
        self.streams = CommStreams()
        self.hook: CommHook | None = None
        self.hook_state: Any = None
        self._prepared: list[PreparedCollective | None] = []
        """Per bucket: its all-reduce, prepared for the current layout (None: nothing to reduce)."""
        self._cuda: list[bool] = []
        """Per bucket: communicated from a CUDA device (waits are stream dependencies there)."""
        self._side_stream: list[bool] = []
        """Per bucket: launched on a communication stream (CUDA, where the group does not order streams)."""
        self._on_host: list[bool] = []
        """Per bucket: a CPU bucket communicated in its own dtype (see ``scales_each_gradient``)."""
        self._outcome: HostReadback | None = None
        """The outcome agreement's table and its read, allocated once."""
        self.bytes_launched = 0
        """Bytes this iteration's launches handed to the group (a hook's own collectives included):
        this model's alone, though another model's backward may issue on the group in between."""

    def _prefix(self) -> str:
        return error_prefix(self.group.rank, self.group.world_size, "ddp", "comm_hook")

    @property
    def _hook_name(self) -> object:
        return getattr(self.hook, "__qualname__", self.hook)

    # --------------------------------------------------------------- decisions
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Communicate every bucket with ``hook(state, bucket)`` from now on (it scales itself)."""
        self.hook, self.hook_state = hook, state

    def begin(self, average_over: int | None = None) -> None:
        """An iteration starts: its buckets average over ``average_over`` ranks (None: as configured).

        The NaN check, if on, forgets what it found in the last iteration.
        """
        self.scaling = self.average_over(average_over)
        self.bytes_launched = 0
        if self.check is not None:
            self.check.reset()

    def average_over(self, ranks: int | None) -> GradientScaling:
        """The scaling that averages over ``ranks`` ranks (None: the configured one).

        Only the average (a divisor, no factor of the user's) is re-weighted.
        """
        configured = self._configured
        if ranks is None or configured.divisor == 1 or configured.factor != 1.0:
            return configured
        return GradientScaling(divisor=ranks)

    def prepare(self, buckets: Sequence[GradientBucket]) -> None:
        """A new layout: prepare each bucket's all-reduce once, and where it is launched from."""
        group, op = self.group, self.op
        self._prepared = [
            group.prepare_all_reduce(bucket.comm_data, op) if bucket.numel else None for bucket in buckets
        ]
        self._cuda = [CommStreams.applies(bucket.comm_device) for bucket in buckets]
        self._side_stream = [cuda and not group.orders_cuda_streams for cuda in self._cuda]
        self._on_host = [bucket.device.type == "cpu" and not bucket.staged for bucket in buckets]

    def scales_each_gradient(self, index: int) -> bool:
        """True if bucket ``index``'s gradients are scaled one by one as they are taken in, not at launch.

        On the CPU memory bandwidth is the cost: a fresh gradient is copied into its
        view with the scaling in the same pass (``torch.div(grad, world, out=view)``
        costs what the copy costs), which beats zeroing the bucket for autograd to add
        into and then scaling it. Elsewhere (CUDA) the gradients land in their views
        and the bucket is scaled once at launch, one kernel. A bucket communicated in
        another dtype is scaled at launch in that dtype; with a hook nothing is scaled.
        """
        return self.hook is None and self._on_host[index]

    @property
    def reduce_scatters(self) -> bool:
        """True if the buckets are reduce-scattered (``gradient_sync="reduce_scatter"``)."""
        return self.shards is not None

    def gather_shards(self, buckets: Sequence[GradientBucket]) -> None:
        """All-gather every rank's reduced shard of ``buckets`` (collective): every gradient becomes exact.

        Reduce-scatter mode only, before the buckets are laid out again: the new
        layout's shards cut elsewhere (``ReduceScatterBuckets.gather``).
        """
        assert self.shards is not None, "gather_shards: the buckets are all-reduced, not reduce-scattered"
        self.shards.gather(buckets)

    # ------------------------------------------------------------------ launch
    def launch(
        self, index: int, bucket: GradientBucket, rows: TouchedRows | None = None, *, on_stream: bool = False
    ) -> PendingSync:
        """Start communicating bucket ``index`` (all its gradients are in its views).

        A bucket of zero elements (empty parameters) communicates nothing, unless
        a hook is registered (it is called for every bucket, as torch calls it).
        ``rows``: the bucket holds row-sparse gradients only; unless a hook is
        registered or the gradients are reduce-scattered, exchange only the rows
        some rank touched. ``on_stream``: already on the bucket's communication stream.
        """
        if bucket.numel == 0 and self.hook is None:
            return PendingSync(work=CompletedWork())
        if self._side_stream[index] and not on_stream:
            with self.streams.launching(bucket.comm_device):
                return self.launch(index, bucket, rows, on_stream=True)
        data = bucket.comm_data
        if bucket.staged:
            data.copy_(bucket.grad_data)
        if self.hook is not None:
            if self.check is not None:
                self.check.inspect(bucket, data)
            return self._counting(self._launch_hook, bucket)
        if not self._on_host[index]:
            self.scaling.apply_(data)
        if self.check is not None:
            self.check.inspect(bucket, data)
        if self.shards is not None:
            work = self._counting(self.shards.launch, bucket, data, self.op)
        elif rows is not None:
            return PendingSync(work=self._counting(rows.launch), rows=rows)
        else:
            prepared = self._prepared[index]
            assert prepared is not None  # numel > 0: prepared
            self.bytes_launched += prepared.nbytes  # no counter read on the default path
            work = prepared.start()
        return PendingSync(
            work=work.annotate(  # the bucket, named in stall warnings and flight-recorder dumps
                lambda: (
                    f"DDP bucket {bucket.index()}, {len(bucket.names)} parameters, "
                    f"first: {', '.join(bucket.names[:3])}"
                )
            )
        )

    def _counting(self, launch: Callable[..., _T], *args: Any) -> _T:
        """``launch(*args)``, its bytes added to ``bytes_launched`` from the group's counter."""
        issued = self.group.bytes_issued
        try:
            return launch(*args)
        finally:
            self.bytes_launched += self.group.bytes_issued - issued

    def _launch_hook(self, bucket: GradientBucket) -> PendingSync:
        """Call the hook; if it fails before communicating, issue a stand-in all-reduce of zeros.

        The other ranks' hooks issued their collectives for this bucket, so a rank
        whose hook raised (or returned a failed future, or no future) without
        issuing any on the group takes part with zeros in an all-reduce of the
        bucket: what ``allreduce_hook`` and DDP's own path issue. The failure is
        then raised on every rank by the step's outcome agreement (``agree``),
        and the later buckets stay paired.
        """
        group = self.group
        issued = group.bytes_issued
        try:
            future = self._call_hook(bucket)
            error = self._failed_already(bucket, future)
        except CommHookError as e:
            error = e
        if error is None:
            return PendingSync(future=future)
        stand_in = None
        if group.bytes_issued == issued and bucket.numel:
            data = bucket.comm_data
            data.zero_()
            stand_in = group.all_reduce(data, ReduceOp.SUM, async_op=True)
        return PendingSync(work=stand_in, error=error)

    def _failed_already(
        self, bucket: GradientBucket, future: torch.futures.Future[Any]
    ) -> CommHookError | None:
        """The hook's failure if its future has already failed (not in a collective), else None."""
        if not future.done():
            return None
        try:
            future.value()
        except CommError:
            return None  # a collective failed: finish raises it, and the group is broken
        except Exception as e:  # noqa: BLE001 - a hook's failure, named
            error = CommHookError(
                f"{self._prefix()}the communication hook's future for bucket {bucket.index()} failed: "
                f"{type(e).__name__}: {e}"
            )
            error.__cause__ = e
            return error
        return None

    def _call_hook(self, bucket: GradientBucket) -> torch.futures.Future[Any]:
        assert self.hook is not None
        issued = self.group.bytes_issued
        try:
            future = self.hook(self.hook_state, bucket)
        except Exception as e:  # noqa: BLE001 - a hook's failure, named
            if isinstance(e, CommError) and self.group.bytes_issued != issued:
                raise  # a collective of the hook failed: the group is broken
            raise CommHookError(
                f"{self._prefix()}the communication hook {self._hook_name!r} "
                f"raised for bucket {bucket.index()}: {type(e).__name__}: {e}"
            ) from e
        if not _is_torch_future(future):
            hint = (
                "; it returned a commlib Work: return work.get_future() (a torch future) instead"
                if isinstance(future, Work)
                else ""
            )
            raise CommHookError(
                f"{self._prefix()}the communication hook "
                f"{self._hook_name!r} returned {type(future).__name__} for "
                f"bucket {bucket.index()}; a hook must return a torch.futures.Future whose value is the "
                f"reduced flat buffer{hint}"
            )
        return future

    # ----------------------------------------------------------------- outcome
    @property
    def agrees_on_outcome(self) -> bool:
        """Whether ``agree`` communicates: a hook is registered or the NaN check is on."""
        return self.hook is not None or self.check is not None

    def agree(self, buckets: Sequence[GradientBucket], failed: tuple[int, CommHookError] | None) -> None:
        """The step's outcome agreement: raise on every rank what some rank found in this backward.

        Call it on every rank at the end of backward, after every bucket's
        collective. With a communication hook or the NaN check, one all-reduce of
        an integer per rank for each (the non-finite slices it found; the first
        bucket whose hook failed there, plus one); if some rank found non-finite
        gradients, a second one names them (``NonFiniteCheck.explain``). Without
        either, nothing is communicated.

        Args:
            buckets: The buckets, in order.
            failed: ``(bucket index, error)`` of the first bucket whose hook failed on this rank.

        Raises:
            CommHookError: The hook failed on some rank (every rank raises it).
            NonFiniteGradientError: Some rank's gradients held NaN or Inf.
        """
        if not self.agrees_on_outcome:
            if failed is not None:
                raise failed[1]
            return
        group, check = self.group, self.check
        world, rank = group.world_size, group.rank
        # One row of world integers for each question asked: NaN counts, then failed hook buckets.
        rows = (check is not None) + (self.hook is not None)
        values = [0] * (rows * world)
        if check is not None:
            values[rank] = check.found
        if self.hook is not None and failed is not None:
            values[(rows - 1) * world + rank] = failed[0] + 1
        tensor = control_tensor(group, values, torch.int64)
        work = group.all_reduce(tensor, ReduceOp.SUM, async_op=True)
        assert work is not None  # async_op=True always returns a handle
        outcome = self._outcome
        if outcome is None or outcome.tensor.shape != tensor.shape:
            outcome = self._outcome = HostReadback(tensor)
        outcome.start(work, source=tensor)
        got = outcome.result()
        nonfinite = check.explain(got[:world], buckets) if check is not None else None
        hook_failed = {r: b - 1 for r, b in enumerate(got[(rows - 1) * world :]) if b} if self.hook else {}
        if hook_failed:
            raise self._hook_failed_error(hook_failed, failed[1] if failed is not None else None)
        if nonfinite is not None:
            raise nonfinite

    def _hook_failed_error(self, where: dict[int, int], mine: CommHookError | None) -> CommHookError:
        group = self.group
        ranks = sorted(where)
        on = ", ".join(f"rank {r} (bucket {where[r]})" for r in ranks)
        own = "" if mine is None else f"{str(mine).removeprefix(self._prefix())}. "
        others = len([r for r in ranks if r != group.rank])
        cause = {0: "", 1: " (its error names the cause)"}.get(others, " (their errors name the cause)")
        error = CommHookError(
            f"{error_prefix(group.rank, group.world_size, 'ddp', 'backward')}{own}{'T' if own else 't'}he "
            f"communication hook failed in this backward on {on} of {group.world_size}{cause} "
            f"({group.backend} backend). "
            "Every rank raises this in the same backward, after issuing every collective of the step (a "
            "rank whose hook failed before communicating took part with zeros), so the ranks stay paired, "
            "but no rank holds the average: do not step the optimizer on these gradients. Fix the hook, "
            "or skip the step on every rank (catch CommHookError, call optimizer.zero_grad())",
            ranks=tuple(ranks),
            buckets=where,
        )
        error.__cause__ = mine
        return error

    # ------------------------------------------------------------------ finish
    def finish(self, index: int, bucket: GradientBucket, pending: PendingSync, timeout: float | None) -> None:
        """Wait for bucket ``index``'s communication and land the result in its gradients.

        On CUDA the wait of the default path is a stream dependency (no host
        block; the group's own timeout, NCCL's watchdog, bounds it).

        Raises:
            CommTimeoutError: Not finished within ``timeout`` seconds.
            CommError: The collective or the hook failed (the message names the bucket).
        """
        cuda = self._cuda[index]
        if pending.error is not None:
            if pending.work is not None:
                pending.work.wait(None if cuda else timeout)
            raise pending.error
        side = self._side_stream[index]
        if pending.rows is not None:
            assert pending.work is not None
            if side:  # the flags land on the communication stream: read them after it
                pending.work.wait(None)
                self.streams.join_device(bucket.comm_device)
            pending.rows.finish(pending.work, self.op, timeout)
            pending.rows = None  # complete
            result = bucket.comm_data
        elif pending.work is not None:
            pending.work.wait(None if cuda else timeout)
            if side:  # a staged result is copied back on the communication stream
                self.streams.join_device(bucket.comm_device)
            if self.shards is not None:
                if bucket.numel:
                    self.shards.land(bucket)
                return
            result = bucket.comm_data
        else:
            result = self._hook_result(bucket, pending, timeout)
            if side:
                self.streams.join_device(bucket.comm_device)
        if not _same_memory(result, bucket.grad_data):
            bucket.grad_data.copy_(result)

    def _hook_result(
        self, bucket: GradientBucket, pending: PendingSync, timeout: float | None
    ) -> torch.Tensor:
        assert pending.future is not None and pending.settled is not None
        limit = self.group.timeout if timeout is None else timeout
        if not pending.settled.wait(limit):
            raise CommTimeoutError(
                f"{self._prefix()}the future the communication hook returned for bucket "
                f"{bucket.index()} ({len(bucket.params)} params, first {bucket.names[0]!r}) did not complete "
                f"within {limit:g} s; look for a rank that did not run the same hook, or a callback that "
                "never completes the future"
            )
        try:
            value = pending.future.wait()  # done: returns at once (on CUDA it orders the current stream)
        except CommError:
            raise
        except Exception as e:  # noqa: BLE001 - a hook's failure, named
            raise CommHookError(
                f"{self._prefix()}the communication hook's future for bucket "
                f"{bucket.index()} failed: {type(e).__name__}: {e}"
            ) from e
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if not isinstance(value, torch.Tensor) or value.numel() != bucket.numel:
            got = (
                f"a tensor of {value.numel()} elements"
                if isinstance(value, torch.Tensor)
                else type(value).__name__
            )
            raise CommHookError(
                f"{self._prefix()}the communication hook's future for bucket "
                f"{bucket.index()} completed with {got}; its value must be the reduced flat buffer "
                f"({bucket.numel} elements, as bucket.buffer())"
            )
        return value.reshape(-1)


def _is_torch_future(value: object) -> bool:
    """True for a ``torch.futures.Future``, including those ``then()`` returns (torch's C++ class)."""
    return all(callable(getattr(value, m, None)) for m in ("add_done_callback", "wait", "done", "value"))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if ``a`` and ``b`` are the same flat memory (nothing to copy)."""
    if a is b:
        return True
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.numel() == b.numel()
        and a.data_ptr() == b.data_ptr()
    )
