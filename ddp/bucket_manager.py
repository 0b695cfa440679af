"""``GradientBucketManager``: lays parameters out in buckets, tracks readiness, launches in order."""

from __future__ import annotations

import math
import time
import types
from collections.abc import Mapping, Sequence

import torch

from commlib.errors import CommError, error_prefix
from commlib.process_group import IProcessGroup
from commlib.types import ReduceOp
from ddp.bucket import GradientBucket
from ddp.config import DEFAULT_BUCKET_SIZE_MB, MB
from ddp.stats import StepRecorder

__all__ = ["GradientBucketManager", "plan_buckets"]


def plan_buckets(
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    bucket_bytes: int,
    first_bucket_bytes: int | None = None,
) -> list[list[int]]:
    """Group parameter indices into buckets, walking ``order`` (the order gradients arrive).

    Parameters of one dtype and device fill one open bucket until the next one would
    take it past the cap; then the bucket closes and a new one opens. A parameter is
    never split, so one larger than the cap gets a bucket of its own, and a cap of 0
    gives one parameter per bucket. The first bucket of each dtype and device uses
    ``first_bucket_bytes``. Buckets are returned in the order they complete when
    gradients arrive in ``order``: by the position of their last parameter.

    Args:
        params: The parameters, indexed by the numbers in ``order``.
        order: A permutation of (a subset of) ``range(len(params))``.
        bucket_bytes: Cap of a bucket, in bytes.
        first_bucket_bytes: Cap of the first bucket of each dtype and device
            (default ``bucket_bytes``).

    Returns:
        Lists of parameter indices, one per bucket.
    """
    first_cap = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    seen_keys: set[tuple[torch.dtype, torch.device]] = set()
    closed: list[tuple[int, list[int]]] = []  # (position of the last member, members)
    position = {index: pos for pos, index in enumerate(order)}
    for index in order:
        p = params[index]
        key = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        members = open_buckets.get(key)
        if members:
            cap = bucket_bytes if key in seen_keys else first_cap
            if open_bytes[key] + nbytes > cap:
                closed.append((position[members[-1]], members))
                seen_keys.add(key)
                members = None
        if not members:
            members = open_buckets[key] = []
            open_bytes[key] = 0
        members.append(index)
        open_bytes[key] += nbytes
    for members in open_buckets.values():
        if members:
            closed.append((position[members[-1]], members))
    closed.sort(key=lambda item: item[0])
    return [members for _, members in closed]


class GradientBucketManager:
    """The buckets of a set of parameters, their readiness, and their all-reduces.

    Buckets are launched strictly in bucket order on every rank: a bucket that
    completes early waits until every bucket before it has been launched, so all
    ranks issue the same collectives in the same order (MPI and NCCL require it).

    Args:
        params: Parameters that receive gradients, in registration order (duplicates
            not allowed).
        group: The process group that reduces them.
        names: Their names, for messages (default ``param0``, ``param1``, ...).
        bucket_size_mb: Cap of a bucket in MiB; 0 gives one parameter per bucket.
        first_bucket_size_mb: Cap of the first bucket (default ``bucket_size_mb``).
        reduce_op: How the ranks' gradients are combined (``AVG``: the mean).
        order: Order in which gradients are expected (indices into ``params``);
            default: reverse registration order, the order backward produces them.

    Example::

        >>> manager = GradientBucketManager(list(model.parameters()), group, bucket_size_mb=1)
        >>> loss.backward()
        >>> manager.reduce_all_async()     # eager path; DDP instead calls mark_ready per gradient
        >>> manager.wait_all()             # .grad of every parameter now holds the mean
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        group: IProcessGroup,
        *,
        names: Sequence[str] | None = None,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        first_bucket_size_mb: float | None = None,
        reduce_op: ReduceOp = ReduceOp.AVG,
        order: Sequence[int] | None = None,
    ) -> None:
        self._params = list(params)
        self._names = list(names) if names is not None else [f"param{i}" for i in range(len(self._params))]
        if len(self._names) != len(self._params):
            raise ValueError(
                f"GradientBucketManager: {len(self._params)} parameters but {len(self._names)} names"
            )
        self._index: dict[int, int] = {}
        for i, p in enumerate(self._params):
            if id(p) in self._index:
                raise ValueError(
                    f"GradientBucketManager: parameter {self._names[i]!r} is the same tensor as "
                    f"{self._names[self._index[id(p)]]!r}; pass each parameter once"
                )
            self._index[id(p)] = i
        self.group = group
        self.reduce_op = reduce_op
        self.bucket_bytes = int(bucket_size_mb * MB)
        self.first_bucket_bytes = None if first_bucket_size_mb is None else int(first_bucket_size_mb * MB)
        n = len(self._params)
        self.arrived = bytearray(n)
        """1 for each parameter whose gradient arrived since ``end_window`` (the last sync)."""
        self.arrival_order: list[int] = []
        """Parameter indices in the order their gradients arrived in this iteration."""
        self.arrival_times: list[float] = []
        """``time.perf_counter()`` at each arrival of ``arrival_order`` (same positions)."""
        self.recorder = StepRecorder()
        self._buckets: list[GradientBucket] = []
        self._slot: list[tuple[int, int]] = []
        self._active = False
        self._next_launch = self._next_done = self._next_waited = 0
        self._layout(list(order) if order is not None else list(reversed(range(n))))

    # ---------------------------------------------------------------- layout
    def _layout(self, order: list[int]) -> None:
        plan = plan_buckets(self._params, order, self.bucket_bytes, self.first_bucket_bytes)
        buckets = [
            GradientBucket(b, [self._params[i] for i in members], [self._names[i] for i in members])
            for b, members in enumerate(plan)
        ]
        slot = [(-1, -1)] * len(self._params)
        for b, members in enumerate(plan):
            for s, i in enumerate(members):
                slot[i] = (b, s)
        missing = [self._names[i] for i, where in enumerate(slot) if where[0] < 0]
        if missing:
            raise ValueError(f"GradientBucketManager: order leaves out parameters {missing}")
        old = self._buckets
        self._buckets, self._slot, self._plan, self._order = buckets, slot, plan, order
        # Keep every gradient's value: point .grad at the new views.
        for i, p in enumerate(self._params):
            if p.grad is not None:
                b, s = slot[i]
                new_view = buckets[b].views[s]
                new_view.copy_(p.grad)
                p.grad = new_view
        del old
        self._next_launch = self._next_done = self._next_waited = 0

    def rebuild(self, order: Sequence[int]) -> bool:
        """Lay the buckets out again for gradients arriving in ``order``.

        Gradients keep their values (copied into the new buffers). Must not be called
        while collectives are in flight.

        Returns:
            False if the new layout equals the current one (nothing was rebuilt).
        """
        order = list(order)
        if sorted(order) != list(range(len(self._params))):
            raise ValueError(
                f"GradientBucketManager.rebuild: order must be a permutation of 0..{len(self._params) - 1}, "
                f"got {len(order)} indices"
            )
        if plan_buckets(self._params, order, self.bucket_bytes, self.first_bucket_bytes) == self._plan:
            self._order = order
            return False
        self._layout(order)
        return True

    def set_bucket_size(self, bucket_size_mb: float, first_bucket_size_mb: float | None = None) -> bool:
        """Change the bucket caps and lay the buckets out again in the current ``order``.

        Must not be called while collectives are in flight.

        Returns:
            False if the layout did not change.
        """
        if not (math.isfinite(bucket_size_mb) and bucket_size_mb >= 0):
            raise ValueError(
                f"GradientBucketManager.set_bucket_size: bucket_size_mb must be >= 0, got {bucket_size_mb!r}"
            )
        self.bucket_bytes = int(bucket_size_mb * MB)
        self.first_bucket_bytes = None if first_bucket_size_mb is None else int(first_bucket_size_mb * MB)
        return self.rebuild(self._order)

    @property
    def order(self) -> list[int]:
        """The gradient order the current layout was planned for (parameter indices)."""
        return list(self._order)

    @property
    def buckets(self) -> tuple[GradientBucket, ...]:
        """The buckets, in launch order."""
        return tuple(self._buckets)

    @property
    def num_buckets(self) -> int:
        """Number of buckets (0 for no parameters)."""
        return len(self._buckets)

    @property
    def layout(self) -> list[list[str]]:
        """Parameter names of each bucket, in launch order."""
        return [list(b.names) for b in self._buckets]

    @property
    def params(self) -> list[torch.Tensor]:
        """The managed parameters, in registration order."""
        return list(self._params)

    @property
    def names(self) -> list[str]:
        """Their names."""
        return list(self._names)

    @property
    def param_indices(self) -> Mapping[int, int]:
        """``id(parameter) -> index`` in registration order (read-only)."""
        return types.MappingProxyType(self._index)

    def index_of(self, param: torch.Tensor) -> int:
        """Index of ``param`` in registration order.

        Raises:
            KeyError: ``param`` is not managed here.
        """
        try:
            return self._index[id(param)]
        except KeyError:
            raise KeyError(
                f"GradientBucketManager: tensor of shape {tuple(param.shape)} is not one of its "
                f"{len(self._params)} parameters"
            ) from None

    def get_bucket_index(self, param: torch.Tensor) -> int:
        """Index of the bucket that holds ``param``'s gradient."""
        return self._slot[self.index_of(param)][0]

    # ------------------------------------------------------------ gradients
    def accumulate(self, index: int) -> None:
        """Record the gradient of parameter ``index`` without marking it ready (inside ``no_sync``)."""
        b, s = self._slot[index]
        if self._buckets[b].adopt_grad(s):
            self.recorder.grads_copied += 1
        self.arrived[index] = 1

    def mark_ready(self, param: torch.Tensor | int) -> None:
        """Record that a parameter's gradient is final for this iteration, launching what became launchable.

        Args:
            param: The parameter, or its index in registration order.
        """
        if not self._active:
            self.begin()
        index = param if isinstance(param, int) else self.index_of(param)
        b, s = self._slot[index]
        bucket = self._buckets[b]
        if bucket.adopt_grad(s):
            self.recorder.grads_copied += 1
        self.arrived[index] = 1
        self.arrival_order.append(index)
        self.arrival_times.append(time.perf_counter())
        if bucket.mark_ready(s):
            self.recorder.ready(b)
            self._launch_in_order()
        self._poll_done()

    def mark_unused(self, index: int) -> None:
        """Mark parameter ``index`` ready although backward will not produce its gradient.

        Its slice keeps what it holds (an accumulated gradient from ``no_sync`` steps),
        or zeros if its ``.grad`` is None; it contributes that to the reduction.
        """
        b, s = self._slot[index]
        bucket = self._buckets[b]
        if bucket.adopt_grad(s):
            self.recorder.grads_copied += 1
        if bucket.mark_ready(s):
            self.recorder.ready(b)
            self._launch_in_order()

    def missing(self) -> list[tuple[int, int]]:
        """``(parameter index, bucket index)`` of every gradient not yet marked ready."""
        return [(i, b) for i, (b, s) in enumerate(self._slot) if not self._buckets[b].is_ready(s)]

    def local_grad_flags(self, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out[i]`` with 1 where parameter ``i`` has a gradient in this window, else 0.

        A gradient counts if it arrived since the last sync, or if ``.grad`` is not
        None (a gradient the user kept, zeroed or not, as one process would).
        """
        flags = [1 if self.arrived[i] or p.grad is not None else 0 for i, p in enumerate(self._params)]
        out.copy_(torch.tensor(flags, dtype=out.dtype))
        return out

    def release_grads(self, indices: Sequence[int]) -> None:
        """Set ``.grad`` back to None for ``indices`` (parameters that got no gradient on any rank)."""
        for i in indices:
            self._params[i].grad = None

    def end_window(self) -> None:
        """Forget which gradients arrived: the accumulation window closed with a sync."""
        self.arrived[:] = bytes(len(self.arrived))

    # ---------------------------------------------------------- collectives
    def begin(self) -> None:
        """Start an iteration: clear readiness and start recording.

        ``mark_ready`` and ``reduce_all_async`` call it themselves when the previous
        iteration has been waited for.
        """
        self._active = True
        for bucket in self._buckets:
            bucket.reset()
        self._next_launch = self._next_done = self._next_waited = 0
        self.arrival_order.clear()
        self.arrival_times.clear()
        self.recorder.begin(len(self._buckets))

    def _launch_in_order(self) -> None:
        buckets = self._buckets
        while self._next_launch < len(buckets) and buckets[self._next_launch].is_complete:
            self.reduce_bucket_async(self._next_launch)

    def _poll_done(self) -> None:
        buckets = self._buckets
        while self._next_done < self._next_launch and buckets[self._next_done].work.is_completed():  # type: ignore[union-attr]
            self.recorder.done(self._next_done)
            self._next_done += 1

    def reduce_bucket_async(self, index: int) -> None:
        """Launch bucket ``index`` now (the next in order; see the class docstring).

        Raises:
            RuntimeError: An earlier bucket has not been launched yet, or this one was.
        """
        if index != self._next_launch:
            raise RuntimeError(
                f"{self._prefix('reduce_bucket_async')}bucket {index} cannot be launched before bucket "
                f"{self._next_launch}: "
                "buckets launch strictly in order so that every rank issues the same collectives"
            )
        bucket = self._buckets[index]
        start = time.perf_counter()
        bucket.reduce_async(self.group, self.reduce_op).annotate(
            lambda: (
                f"DDP bucket {index}, {len(bucket.names)} parameters, first: {', '.join(bucket.names[:3])}"
            )
        )
        self.recorder.launched(index, bucket.nbytes, len(bucket.params), start)
        self._next_launch += 1

    def reduce_all_async(self) -> None:
        """Mark every gradient ready and launch every bucket not yet launched, in order.

        The eager path (no hooks): call after backward, then ``wait_all``. Parameters
        whose ``.grad`` is None contribute zeros.
        """
        if not self._active:
            self.begin()
        for b, bucket in enumerate(self._buckets):
            for s in range(len(bucket.params)):
                if bucket.adopt_grad(s):
                    self.recorder.grads_copied += 1
                if bucket.mark_ready(s):
                    self.recorder.ready(b)
        self._launch_in_order()

    def wait_all(self, timeout: float | None = None) -> float:
        """Wait, in order, for every launched bucket; then make every ``.grad`` its view.

        Args:
            timeout: Seconds for the whole wait (default: the group's timeout).

        Returns:
            Seconds spent blocked.

        Raises:
            CommTimeoutError: The collectives did not finish in time.
            CommError: A collective failed (the message names the bucket).
        """
        budget = self.group.timeout if timeout is None else timeout
        start = time.perf_counter()
        deadline = start + budget
        # Every launched bucket is waited on, even one already seen complete: the
        # result is only valid once wait() has returned (a backend may finish there).
        for b in range(self._next_waited, self._next_launch):
            bucket = self._buckets[b]
            try:
                bucket.wait(max(deadline - time.perf_counter(), 0.001))
            except CommError as e:
                raise _with_context(
                    e,
                    f"{self._prefix('wait_all')}waiting for bucket {b} of {self._next_launch} launched "
                    f"({len(bucket.params)} params, {bucket.nbytes / 2**20:.2f} MiB, {self.group.backend} "
                    f"backend, waited {time.perf_counter() - start:.1f}s of {budget:.0f}s)",
                ) from e
            self.recorder.done(b)
            self._next_waited = b + 1
        self._next_done = self._next_launch
        self._active = False
        waited = time.perf_counter() - start
        for bucket in self._buckets[: self._next_launch]:
            bucket.copy_back()
        return waited

    def copy_back_all(self) -> None:
        """Make every parameter's ``.grad`` its view (see ``GradientBucket.copy_back``)."""
        for bucket in self._buckets:
            bucket.copy_back()

    @property
    def launched(self) -> int:
        """Buckets launched in this iteration."""
        return self._next_launch

    def _prefix(self, op: str) -> str:
        return error_prefix(self.group.rank, self.group.world_size, "ddp", op)


def _with_context(error: CommError, context: str) -> CommError:
    """Return an error of the same kind as ``error``, its message prefixed by ``context``."""
    try:
        return type(error)(f"{context}: {error}")
    except TypeError:
        return CommError(f"{context}: {error}")
